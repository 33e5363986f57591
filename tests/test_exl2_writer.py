"""Streaming model writer: shards of bounded size readable by safetensors, index, config, bounded memory;
quantize_model on real transformers state dicts (Llama tied, Qwen3-MoE with fused experts)."""
from __future__ import annotations

import json

import psutil
import pytest
import torch
from safetensors import safe_open

from runtime.exl2 import format as fmt
from runtime.exl2.writer import ModelWriter, quantize_model


def _read_folder(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / shard), "pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == shard
                tensors[k] = f.get_tensor(k)
    assert set(tensors) == set(index["weight_map"])
    return index, tensors


def test_shards_are_bounded_and_readable(tmp_path):
    g = torch.Generator().manual_seed(0)
    written = {}
    with ModelWriter(tmp_path / "m", max_shard_bytes=1000, header_reserve=4096) as w:
        for i in range(40):
            t = torch.randn(37 + i, generator=g).to([torch.float16, torch.float32, torch.bfloat16][i % 3])
            w.add(f"t.{i}", t)
            written[f"t.{i}"] = t
        w.add("ints", torch.arange(10, dtype=torch.int32))
        written["ints"] = torch.arange(10, dtype=torch.int32)
        res = w.finish({"architectures": ["LlamaForCausalLM"]})
    assert len(res.shards) > 1 and res.num_tensors == 41
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert not [f for f in files if f.endswith(".partial")]
    n = len(res.shards)
    assert res.shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for shard in res.shards:
        with safe_open(str(tmp_path / "m" / shard), "pt") as f:
            data = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
        assert data <= 1000
    index, tensors = _read_folder(tmp_path / "m")
    assert index["metadata"]["total_size"] == res.total_bytes
    for k, t in written.items():
        assert tensors[k].dtype == t.dtype and torch.equal(tensors[k], t)
    assert json.loads((tmp_path / "m" / "config.json").read_text()) == {"architectures": ["LlamaForCausalLM"]}


def test_bad_adds_and_abort_cleans_up(tmp_path):
    with pytest.raises(ValueError, match=r"x: dtype torch.int64 is not one exllamav2 reads"):
        with ModelWriter(tmp_path / "m") as w:
            w.add("a", torch.zeros(4, dtype=torch.float16))
            w.add("x", torch.zeros(4, dtype=torch.int64))
    assert not list((tmp_path / "m").glob("*.safetensors*"))
    with ModelWriter(tmp_path / "n") as w:
        w.add("a", torch.zeros(4, dtype=torch.float16))
        with pytest.raises(ValueError, match=r"a: tensor written twice"):
            w.add("a", torch.zeros(4, dtype=torch.float16))
        w.finish({})


def test_memory_stays_bounded_while_streaming(tmp_path):
    proc = psutil.Process()
    chunk = 8 * 2**20                                   # 8 MiB tensors, 320 MiB in all
    start = proc.memory_info().rss
    peak = start
    with ModelWriter(tmp_path / "big", max_shard_bytes=100 * 2**20) as w:
        for i in range(40):
            w.add(f"t{i}", torch.full((chunk // 2,), float(i), dtype=torch.float16))
            peak = max(peak, proc.memory_info().rss)
        res = w.finish({})
    assert res.total_bytes == 40 * chunk and len(res.shards) == 4
    assert peak - start < 64 * 2**20, f"RSS grew by {(peak - start) / 2**20:.0f} MiB"


def _llama_state_dict(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    return model.state_dict(), {**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}


@pytest.mark.parametrize("tied", [True, False])
def test_quantize_model_llama(tmp_path, tied):
    sd, cfg = _llama_state_dict(tied)
    calls = []
    res = quantize_model(sd, cfg, bits=8, head_bits=6, out_dir=tmp_path / "q", progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (len(sd), len(sd)) and [d for d, _ in calls] == list(range(1, len(sd) + 1))
    _, tensors = _read_folder(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "exl2", "version": "0.3.2", "bits": 8.0, "head_bits": 6}
    assert config["rope_theta"] == 10000.0 and config["torch_dtype"] == "float16"     # keys exllamav2 reads
    for layer in range(2):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            prefix = f"model.layers.{layer}.{proj}"
            assert f"{prefix}.weight" not in tensors
            q = {k: tensors[f"{prefix}.{k}"] for k in fmt.REQUIRED_KEYS}
            w = sd[f"{prefix}.weight"]
            deq = fmt.dequantize(q, out_features=w.shape[0])
            assert (deq - w).abs().max() <= fmt.step_sizes(q)[: w.shape[0]].max()
        assert tensors[f"model.layers.{layer}.input_layernorm.weight"].dtype == torch.float16
    assert tensors["model.embed_tokens.weight"].dtype == torch.float16
    if tied:
        assert not [k for k in tensors if k.startswith("lm_head")]
    else:
        widths = tensors["lm_head.q_groups"].view(-1, 2)[:, 0].tolist()
        assert set(widths) == {6}
    assert res.num_tensors == len(tensors)


def test_quantize_model_qwen3_moe_fused_experts(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    sd = Qwen3MoeForCausalLM(cfg).state_dict()
    quantize_model(sd, {**cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}, bits=4.0, head_bits=8, out_dir=tmp_path / "q", group_size=32)
    _, tensors = _read_folder(tmp_path / "q")
    fused = sd["model.layers.0.mlp.experts.gate_up_proj"]
    down = sd["model.layers.0.mlp.experts.down_proj"]
    for e in range(4):
        for proj, w in (("gate_proj", fused[e, :32]), ("up_proj", fused[e, 32:]), ("down_proj", down[e])):
            prefix = f"model.layers.0.mlp.experts.{e}.{proj}"
            q = {k: tensors[f"{prefix}.{k}"] for k in fmt.REQUIRED_KEYS}
            deq = fmt.dequantize(q, out_features=w.shape[0])
            assert (deq - w).abs().max() <= fmt.step_sizes(q)[: w.shape[0]].max()
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float16          # router stays fp16
    assert tensors["model.layers.0.self_attn.q_norm.weight"].dtype == torch.float16
    assert "lm_head.q_weight" in tensors


def test_full_header_area_starts_a_new_shard(tmp_path):
    with ModelWriter(tmp_path / "m", header_reserve=512) as w:
        for i in range(30):
            w.add(f"model.layers.{i}.input_layernorm.weight", torch.ones(8, dtype=torch.float16))
        res = w.finish({})
    assert len(res.shards) > 1
    _, tensors = _read_folder(tmp_path / "m")
    assert len(tensors) == 30


def test_quantize_model_needs_architectures(tmp_path):
    with pytest.raises(ValueError, match=r"'architectures' must name the model class"):
        quantize_model({}, {"architectures": None}, 8, 8, tmp_path / "q")
    with pytest.raises(ValueError, match=r"head_bits: bit mix \[7\] has no exllamav2 kernel"):
        quantize_model({}, {"architectures": ["LlamaForCausalLM"]}, 8, 7, tmp_path / "q")
