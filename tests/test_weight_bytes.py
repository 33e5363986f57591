"""Bytes of weights a decode step of the CUDA engine reads, from a synthetic EXL2 folder's tensor
sizes (no GPU): the roofline's divisor."""
from __future__ import annotations

import json
import re
import torch

import pytest


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from runtime.exl2 import synth
    out = tmp_path_factory.mktemp("m") / "tiny-moe"
    synth.write_synthetic("tiny-moe", 3.0, out, layers=2)
    return out


def _stored(folder) -> dict[str, int]:
    """Bytes of every tensor as safetensors itself reads them."""
    from safetensors.torch import load_file
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update({k: t.numel() * t.element_size() for k, t in load_file(f).items()})
    return out


def test_a_decode_step_reads_the_dense_weights_one_embedding_row_and_top_k_experts(tiny_moe):
    from bench.weight_bytes import weight_bytes_per_token
    config = json.loads((tiny_moe / "config.json").read_text())
    E, k, L = config["num_experts"], config["num_experts_per_tok"], config["num_hidden_layers"]
    h, vocab = config["hidden_size"], config["vocab_size"]
    stored = _stored(tiny_moe)
    one_expert = sum(n for name, n in stored.items() if name.startswith("model.layers.0.mlp.experts.0."))
    assert one_expert > 0
    r = weight_bytes_per_token(tiny_moe)
    assert r["top_k"] == k and r["expert_bytes_per_layer"] == [one_expert] * L
    assert r["experts"] == L * k * one_expert
    assert r["embeddings"] == h * 2                                # one fp16 row of the table
    # everything stored, less the experts no token picks and all embedding rows but one
    assert r["total"] == sum(stored.values()) - L * (E - k) * one_expert - (vocab - 1) * h * 2
    assert r["total"] == sum(r[p] for p in ("attention", "norms", "router", "dense_mlp", "shared_experts",
                                            "experts", "embeddings", "head", "other"))
    attention = sum(n for name, n in stored.items() if ".self_attn." in name and not re.search(r"_norm\.", name))
    assert r["attention"] == attention and r["other"] == 0 and r["dense_mlp"] == 0
    assert r["head"] == sum(n for name, n in stored.items() if name.startswith("lm_head."))
    assert r["router"] == L * E * h * 2


def test_the_benchmark_adds_it_only_where_the_engine_reports_none(tiny_moe, tmp_path):
    """bench-worker adds the folder's bytes to the load's telemetry of an engine that reports none (the
    exllamav2-based engine); an engine's own figure, or a folder of plain weights, adds nothing."""
    from safetensors.torch import save_file
    from bench.weight_bytes import decode_weight_bytes, weight_bytes_per_token
    got = decode_weight_bytes(tiny_moe, {"vram_allocated_bytes": 1})
    assert got["weight_bytes_per_token"] == weight_bytes_per_token(tiny_moe)["total"] > 0
    assert got["weight_bytes_per_token_parts"]["experts"] > 0
    assert decode_weight_bytes(tiny_moe, {"weight_bytes_per_token": 5}) is None
    (tmp_path / "config.json").write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    assert decode_weight_bytes(tmp_path, {}) is None


def test_a_folder_without_weights_is_named(tmp_path):
    from bench.weight_bytes import weight_bytes_per_token
    from runtime.errors import InvalidModel
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidModel, match="no .safetensors files"):
        weight_bytes_per_token(tmp_path)


def test_a_qwen35_folder_counts_its_language_models_layers_and_not_its_mtp_head(tiny_qwen35):
    """Qwen3.5-MoE keeps its layers under model.language_model. (a multimodal checkpoint): its experts are
    counted top-k a layer, not whole as dense weights; the MTP head is a draft, not read by a plain step.
    The hybrid engine's own telemetry says about the same experts' share (its packed stacks, padded for
    the kernels: 6% more at this tiny width)."""
    from bench.weight_bytes import weight_bytes_per_token
    from runtime.backends import hybrid
    from runtime.options import LoadOptions, OffloadOptions
    config = json.loads((tiny_qwen35 / "config.json").read_text())
    text = config.get("text_config", config)
    k, L = text["num_experts_per_tok"], text["num_hidden_layers"]
    stored = _stored(tiny_qwen35)
    p0 = "model.language_model.layers.0.mlp.experts.0."
    one_expert = sum(n for name, n in stored.items() if name.startswith(p0))
    assert one_expert > 0 and any(name.startswith("mtp.") for name in stored)
    r = weight_bytes_per_token(tiny_qwen35)
    assert r["top_k"] == k and r["experts"] == L * k * one_expert
    assert r["embeddings"] == text["hidden_size"] * 2 and r["other"] == 0 and r["dense_mlp"] == 0
    mtp = sum(n for name, n in stored.items() if name.startswith("mtp."))
    experts_stored = sum(n for name, n in stored.items() if ".mlp.experts." in name and not name.startswith("mtp."))
    embed = stored["model.language_model.embed_tokens.weight"]
    assert r["total"] == sum(stored.values()) - mtp - experts_stored + r["experts"] - embed + r["embeddings"]
    eng, _ = hybrid.load(tiny_qwen35, LoadOptions(offload=OffloadOptions(context_length=256)), device="cpu")
    try:
        parts = eng.telemetry()["weight_bytes_per_token_parts"]
    finally:
        eng.close()
    assert parts["experts"] == pytest.approx(r["experts"], rel=0.1) and parts["total"] > parts["experts"]
