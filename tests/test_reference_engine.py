"""The reference engine's contract: options report, progress, and clear errors for bad calls and folders."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.engine import Engine
from runtime.errors import ContextOverflow, EngineError, InvalidModel, UnsupportedArchitecture
from runtime.modelfolder import ModelFolderError
from runtime.options import LoadOptions, OffloadOptions
from runtime.reference import load
from test_modelfolder import LLAMA, QWEN3_MOE, make_folder


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_load_reports_options_and_progress(tmp_path, threads):
    folder = make_folder(tmp_path / "m", {**LLAMA, "max_position_embeddings": 300})
    events = []
    opts = LoadOptions(offload=OffloadOptions(context_length=1024, cpu_threads=1, kv_cache="q4", backend="cpu"))
    engine, applied = load(folder, opts, lambda *e: events.append(e))
    assert isinstance(engine, Engine) and engine.backend == "cpu"
    assert engine.info.context_length == 300 and engine.info.architecture == "LlamaForCausalLM"
    assert applied["offload.context_length"].startswith("applied: capped at 300")
    assert applied["offload.cpu_threads"] == "applied" and torch.get_num_threads() == 1
    assert applied["offload.kv_cache"].startswith("ignored: CPU reference engine")
    assert applied["offload.vram_budget_gb"].startswith("ignored: CPU reference engine")
    loads = [e for e in events if e[0] == "load"]
    assert [e[2] for e in loads] == list(range(1, LLAMA["num_hidden_layers"] + 2))
    assert all(e[3] == LLAMA["num_hidden_layers"] + 1 for e in loads)
    assert engine.telemetry()["weight_bytes_per_token"] > 0


def test_context_length_within_model_limit_is_applied(tmp_path, threads):
    engine, applied = load(make_folder(tmp_path / "m", {**LLAMA, "max_position_embeddings": 8192}),
                           LoadOptions(offload=OffloadOptions(context_length=512)))
    assert engine.info.context_length == 512 and applied["offload.context_length"] == "applied"
    assert applied["offload.cpu_threads"].startswith("applied: ")


def test_context_overflow(tmp_path, threads):
    engine, _ = load(make_folder(tmp_path / "m", {**LLAMA, "max_position_embeddings": 256}), precision="float32")
    engine.forward(list(range(30)) * 8)                                     # 240 tokens
    with pytest.raises(EngineError) as e:
        engine.forward(list(range(17)))
    assert isinstance(e.value, ContextOverflow) and "256" in e.value.message
    assert engine.position == 240
    engine.forward(list(range(16)))
    assert engine.position == 256


def test_bad_calls(tmp_path, threads):
    engine, _ = load(make_folder(tmp_path / "m", QWEN3_MOE), precision="float32")
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.forward([1, 40])
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.forward([-1])
    with pytest.raises(EngineError, match="at least one token"):
        engine.forward([])
    engine.forward([1, 2, 3])
    with pytest.raises(EngineError, match="cache holds 3"):
        engine.truncate(4)
    engine.truncate(1)
    assert engine.position == 1
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.forward([1])


def test_bad_folder_raises_model_folder_error(tmp_path):
    with pytest.raises(ModelFolderError) as e:
        load(make_folder(tmp_path / "m", LLAMA, drop="model.layers.1.mlp.down_proj.weight"))
    assert isinstance(e.value, InvalidModel) and "model.layers.1.mlp.down_proj.weight" in e.value.message


def test_unsupported_rope_type(tmp_path):
    folder = make_folder(tmp_path / "m", {**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelFolderError) as e:
        load(folder)
    assert isinstance(e.value, UnsupportedArchitecture) and "yarn" in e.value.message
    assert "config.json" in e.value.message


def test_unsupported_activation(tmp_path):
    folder = make_folder(tmp_path / "m", {**LLAMA, "hidden_act": "gelu"})
    with pytest.raises(ModelFolderError, match="activation 'gelu'"):
        load(folder)


def test_engine_is_deterministic_and_batching_consistent(tmp_path, threads):
    folder = make_folder(tmp_path / "m", QWEN3_MOE)
    (folder / "config.json").write_text(json.dumps({**QWEN3_MOE, "norm_topk_prob": True}))
    a, _ = load(folder, precision="float32")
    b, _ = load(folder, precision="float32")
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    one = torch.cat([a.forward([t]) for t in seq])
    all_at_once = b.forward(seq)
    assert (one - all_at_once).abs().max().item() < 1e-4


def test_device_other_than_the_cpu_is_refused_where_the_engine_cannot_run_there(tmp_path, threads):
    """int8 weights use a CPU-only kernel and Qwen3.5's stack is CPU-only: a clear error before any weight is read."""
    from runtime.exl2 import synth
    with pytest.raises(ValueError, match="'int8' runs on the CPU only, not on cuda"):
        load(make_folder(tmp_path / "m", QWEN3_MOE), precision="int8", device="cuda")
    synth.write_synthetic("tiny-qwen3.5", 4.0, tmp_path / "q35", seed=3)
    with pytest.raises(ValueError, match="Qwen3.5-MoE on the CPU only, not on cuda"):
        load(tmp_path / "q35", precision="float32", device="cuda")


def test_cpu_device_is_the_default(tmp_path, threads):
    folder = make_folder(tmp_path / "m", QWEN3_MOE)
    a, _ = load(folder, precision="float32")
    b, _ = load(folder, precision="float32", device="cpu")
    assert a.device.type == b.device.type == "cpu"
    toks = list(range(3, 20))
    assert torch.equal(a.forward(toks), b.forward(toks))
