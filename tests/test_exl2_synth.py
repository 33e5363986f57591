"""Synthetic models: tiny shapes written, readable, dequantizable, config and tokenizer consistent;
parameter counts of the big shapes computed without writing them; CLI errors."""
from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
from safetensors import safe_open

from runtime.exl2 import format as fmt
from runtime.exl2 import synth
from runtime.exl2.shapes import SHAPES, get_shape, hf_config, param_counts, tensors


def _load(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / shard), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    return {name: (root / name, synth.write_synthetic(name, bpw, root / name, seed=1))
            for name, bpw in (("tiny-moe", 4.0), ("tiny-dense", 2.5))}


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense"])
def test_tiny_models_are_complete_and_dequantize(written, name):
    path, res = written[name]
    shape = get_shape(name)
    tensors_on_disk = _load(path)
    config = json.loads((path / "config.json").read_text())
    expect_config = hf_config(shape)
    assert {k: config[k] for k in expect_config if k != "torch_dtype"} == \
           {k: v for k, v in expect_config.items() if k != "torch_dtype"}
    assert config["quantization_config"]["quant_method"] == "exl2"
    assert "synthetic, random weights" in config["synthetic"]
    assert "synthetic, random weights" in (path / "README.md").read_text()

    expected_names = set()
    for spec in tensors(shape):
        if spec.kind in ("linear", "head"):
            q = {k: tensors_on_disk[f"{spec.name}.{k}"] for k in fmt.REQUIRED_KEYS}
            expected_names |= {f"{spec.name}.{k}" for k in fmt.REQUIRED_KEYS}
            w = fmt.dequantize(q, out_features=spec.shape[0], name=spec.name)
            assert w.shape == spec.shape
            assert 0.01 < w.std().item() < 0.04, spec.name
            widths = set(q["q_groups"].view(-1, 2)[:, 0].tolist())
            assert widths == ({6} if spec.kind == "head" else set(fmt.resolve_bits(config["quantization_config"]["bits"])[0]))
        else:
            t = tensors_on_disk[spec.name]
            assert t.shape == spec.shape and t.dtype == torch.float16
            expected_names.add(spec.name)
    assert set(tensors_on_disk) == expected_names
    assert res.num_tensors == len(expected_names)
    assert ("lm_head.q_weight" in tensors_on_disk) == (not shape.tie_embeddings)


def test_small_models_get_distinct_experts(written):
    path, _ = written["tiny-moe"]
    t = _load(path)
    a = t["model.layers.0.mlp.experts.0.up_proj.q_weight"]
    b = t["model.layers.0.mlp.experts.1.up_proj.q_weight"]
    c = t["model.layers.1.mlp.experts.0.up_proj.q_weight"]
    assert not torch.equal(a, b) and not torch.equal(a, c)


def test_large_models_reuse_a_pool_of_linears(tmp_path, monkeypatch):
    monkeypatch.setattr(synth, "REUSE_ABOVE_PARAMS", 0)
    monkeypatch.setattr(synth, "POOL_PER_ROLE", 2)
    synth.write_synthetic("tiny-moe", 3.0, tmp_path / "m")
    t = _load(tmp_path / "m")
    ups = {t[f"model.layers.{i}.mlp.experts.{e}.up_proj.q_weight"].numpy().tobytes()
           for i in range(2) for e in range(16)}
    assert len(ups) == 2


def test_tokenizer_has_the_vocab_size_and_chatml(written):
    from transformers import AutoTokenizer
    for name in ("tiny-moe", "tiny-dense"):
        path, _ = written[name]
        shape = get_shape(name)
        tok = AutoTokenizer.from_pretrained(str(path))
        assert len(tok) == shape.vocab
        ids = tok.apply_chat_template([{"role": "user", "content": "Hi there, héllo"}], add_generation_prompt=True,
                                      tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ids[0] == shape.first_special + 1                       # <|im_start|>
        text = tok.decode(ids)
        assert text == "<|im_start|>user\nHi there, héllo<|im_end|>\n<|im_start|>assistant\n"
        assert tok.convert_tokens_to_ids("<|im_end|>") == json.loads((path / "config.json").read_text())["eos_token_id"]
        assert max(tok.get_vocab().values()) == shape.vocab - 1


def test_parameter_counts_of_the_big_shapes():
    total, active = param_counts(SHAPES["q125-a11"])
    assert 120.0e9 < total < 122.0e9 and 11.0e9 < active < 12.5e9
    total, active = param_counts(SHAPES["qwen3-30b-a3b"])
    assert abs(total - 30.5e9) < 0.1e9 and abs(active - 3.3e9) < 0.1e9        # the model card's figures
    total, active = param_counts(SHAPES["qwen3-0.6b"])
    assert abs(total - 0.6e9) < 0.01e9 and total == active
    est = synth.estimate_bytes(SHAPES["q125-a11"], 3.0, 6)
    assert 44e9 < est < 50e9                                                 # "~46 GB at 3.0 bpw"


def test_real_configs_match_the_released_models():
    c = hf_config(SHAPES["qwen3-30b-a3b"])
    assert (c["architectures"], c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"],
            c["moe_intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
            c["vocab_size"], c["rope_theta"], c["rms_norm_eps"], c["norm_topk_prob"], c["tie_word_embeddings"],
            c["bos_token_id"], c["eos_token_id"]) == \
           (["Qwen3MoeForCausalLM"], 2048, 48, 128, 8, 768, 32, 4, 128, 151936, 1000000.0, 1e-06, True, False,
            151643, 151645)
    d = hf_config(SHAPES["qwen3-0.6b"])
    assert (d["architectures"], d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"],
            d["num_attention_heads"], d["num_key_value_heads"], d["tie_word_embeddings"]) == \
           (["Qwen3ForCausalLM"], 1024, 3072, 28, 16, 8, True)
    q = hf_config(SHAPES["q125-a11"])
    assert (q["hidden_size"], q["num_attention_heads"], q["num_key_value_heads"], q["moe_intermediate_size"]) == \
           (4096, 64, 4, 1536)


def _cli(*argv):
    p = argparse.ArgumentParser()
    synth.add_arguments(p)
    return synth.run(p.parse_args(list(argv)))


def test_cli_writes_and_reports(tmp_path, capsys):
    assert _cli("--shape", "tiny-dense", "--bpw", "8", "--out", str(tmp_path / "d"), "--layers", "1") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensors"] > 0 and (tmp_path / "d" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "d" / "config.json").read_text())["num_hidden_layers"] == 1


@pytest.mark.parametrize("argv,match", [
    (["--bpw", "9"], "outside EXL2's range"),
    (["--bpw", "4", "--layers", "0"], "--layers must be at least 1"),
    (["--bpw", "4", "--head-bits", "7"], r"bit mix \[7\] has no exllamav2 kernel"),
])
def test_cli_errors(tmp_path, capsys, argv, match):
    assert _cli("--shape", "tiny-moe", "--out", str(tmp_path / "x"), *argv) == 2
    assert re.search(match, capsys.readouterr().err)


def test_cli_refuses_a_non_empty_folder(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    assert _cli("--shape", "tiny-moe", "--bpw", "4", "--out", str(tmp_path / "x")) == 2
    assert "is not empty" in capsys.readouterr().err


@pytest.mark.parametrize("bits", [2.5, 3.0, 4.0, 6.0])
def test_synthetic_weights_are_centred_so_wide_layers_keep_their_scale(bits):
    """Random codes symmetric about 0: uniformly random bits had a mean of -0.5 steps (0.22 of a standard
    deviation at 3 bits), and a real-width Mixtral's activations grew past fp16's range in two layers.
    A Mixtral-width expert (6144 -> 16384 -> 6144, 3 bits) keeps the scale of a random one: the output's
    RMS is within 20% of std * sqrt(K) * RMS(h) layer after layer."""
    import math

    import torch
    import torch.nn.functional as F

    from runtime.exl2 import format as fmt
    from runtime.exl2.synth import WEIGHT_STD, _random_linear
    g = torch.Generator().manual_seed(0)
    w = fmt.dequantize(_random_linear(256, 1024, bits, g))
    assert abs(w.mean().item()) < 0.01 * w.std().item()
    assert abs(w.std().item() - WEIGHT_STD) < 0.1 * WEIGHT_STD
    if bits == 3.0:
        w1, w3 = (fmt.dequantize(_random_linear(16384, 6144, bits, g)) for _ in range(2))
        w2 = fmt.dequantize(_random_linear(6144, 16384, bits, g))
        x = torch.randn(4, 6144, generator=g)
        for _ in range(2):                          # the output, normalised, is the next input
            x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
            h = F.silu(x @ w1.T) * (x @ w3.T)
            y = h @ w2.T
            want = WEIGHT_STD * math.sqrt(16384) * h.pow(2).mean(-1).sqrt()
            assert ((y.pow(2).mean(-1).sqrt() / want - 1).abs() < 0.2).all(), (y.pow(2).mean(-1).sqrt(), want)
            x = y
