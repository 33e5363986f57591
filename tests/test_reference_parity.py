"""The CPU reference engine against transformers' own implementations, on tiny random models.

Every step of the engine's life is compared with a cache-free transformers forward over the same
tokens: prefill, single-token decode steps, verify 4 tokens at once, and recompute after truncate.
Tolerance: max |logit difference| <= 1e-4 in float32 (logits of order 1-10 here).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from runtime.reference import load  # noqa: E402

TOL_FP32 = 1e-4
COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-5)


def _configs():
    t = transformers
    return {
        # untied head, GQA, Llama 3.1 rope scaling (low and high frequencies both rescaled at this size)
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**COMMON, rope_theta=50000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})),
        # QK-norm, tied embeddings, head_dim not hidden/heads
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True,
                                                    rope_theta=1000000.0)),
        # experts renormalised, one dense layer among MoE layers
        "qwen3_moe": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32,
                                                               num_experts=8, num_experts_per_tok=3,
                                                               norm_topk_prob=True, mlp_only_layers=[1])),
        # YaRN rope scaling (Qwen3's long-context setting, at a size where the ramp falls inside the head)
        "qwen3_moe_yarn": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(
            **COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
        # raw top-k probabilities
        "qwen3_moe_unnormalised": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(
            **COMMON, head_dim=16, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
            norm_topk_prob=False)),
        # softmax over the top-2 router logits, every layer MoE, untied head
        "mixtral": (t.MixtralForCausalLM, t.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                          rope_theta=1000000.0)),
        # a sliding window shorter than the test sequences: prefill, decode and verify past it
        "mixtral_window": (t.MixtralForCausalLM, t.MixtralConfig(**COMMON, num_local_experts=5,
                                                                 num_experts_per_tok=2, sliding_window=6)),
        # LayerNorm without bias, clip_qkv that bites, top-3 of 6 divided by their 2-norm, its own rope theta
        "dbrx": (t.DbrxForCausalLM, t.DbrxConfig(
            d_model=64, n_heads=4, n_layers=3, vocab_size=128, max_seq_len=512,
            attn_config=dict(kv_n_heads=2, clip_qkv=2.0, rope_theta=500000.0),
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=6, moe_top_k=3, moe_normalize_expert_weights=2.0))),
    }


def make_model(name: str, folder, seed: int = 0):
    """A transformers model with weights large enough that routing and attention matter; saved as safetensors."""
    cls, config = _configs()[name]
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:                              # norms (DBRX's Wqkv has "norm" in its name)
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    if name == "dbrx":
        _dbrx_as_exllamav2_names(folder, model.config)
    return model


def _dbrx_as_exllamav2_names(folder, config) -> None:
    """DBRX saved by transformers (transformer.blocks.N.*, fused Wqkv, stacked experts) rewritten as exllamav2
    names and its converter writes EXL2 folders: model.layers.N.*, q/k/v_proj, one w1/v1/w2 per expert."""
    from safetensors.torch import load_file, save_file
    sd = load_file(str(folder / "model.safetensors"))
    h, i, e = config.d_model, config.ffn_config.ffn_hidden_size, config.ffn_config.moe_num_experts
    q, kv = h, config.attn_config.kv_n_heads * h // config.n_heads
    out = {"model.embed_tokens.weight": sd["transformer.wte.weight"], "lm_head.weight": sd["lm_head.weight"],
           "model.norm.weight": sd["transformer.norm_f.weight"]}
    for n in range(config.n_layers):
        b, p = f"transformer.blocks.{n}", f"model.layers.{n}"
        wq, wk, wv = sd[f"{b}.norm_attn_norm.attn.Wqkv.weight"].split([q, kv, kv])
        out.update({f"{p}.self_attn.q_proj.weight": wq, f"{p}.self_attn.k_proj.weight": wk,
                    f"{p}.self_attn.v_proj.weight": wv,
                    f"{p}.self_attn.o_proj.weight": sd[f"{b}.norm_attn_norm.attn.out_proj.weight"],
                    f"{p}.input_layernorm.weight": sd[f"{b}.norm_attn_norm.norm_1.weight"],
                    f"{p}.post_attention_layernorm.weight": sd[f"{b}.norm_attn_norm.norm_2.weight"],
                    f"{p}.block_sparse_moe.gate.weight": sd[f"{b}.ffn.router.layer.weight"]})
        for proj in ("w1", "v1", "w2"):
            stacked = sd[f"{b}.ffn.experts.mlp.{proj}"].view(e, i, h)
            for j in range(e):                    # w2 is stored [width, hidden] and used as x @ w2
                w = stacked[j].T if proj == "w2" else stacked[j]
                out[f"{p}.block_sparse_moe.experts.{j}.{proj}.weight"] = w.contiguous()
    save_file(out, str(folder / "model.safetensors"))


def oracle(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()                       # [T, V]


@pytest.fixture(scope="module", params=list(_configs()))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = make_model(request.param, folder)
    engine, _ = load(folder, precision="float32")
    return request.param, model, engine


def test_prefill_decode_verify_truncate_match_transformers(pair):
    name, model, engine = pair
    engine.reset()
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 128, (20,), generator=g).tolist()
    ref = oracle(model, seq)
    assert ref.abs().max() > 1.0, "logits too small for the comparison to mean anything"

    def check(got, lo, hi, what):
        diff = (got - ref[lo:hi]).abs().max().item()
        assert got.shape == (hi - lo, 128)
        assert diff <= TOL_FP32, f"{name} {what}: max |logit diff| {diff:.2e} > {TOL_FP32}"

    check(engine.forward(seq[:9]), 0, 9, "prefill")
    for i in range(9, 12):
        check(engine.forward([seq[i]]), i, i + 1, f"decode at {i}")
    check(engine.forward(seq[12:16]), 12, 16, "verify 4")
    assert engine.position == 16

    engine.truncate(13)                                   # reject the last 3 verified tokens
    other = seq[:13] + torch.randint(0, 128, (5,), generator=g).tolist()
    ref = oracle(model, other)
    check(engine.forward(other[13:17]), 13, 17, "verify after truncate")
    check(engine.forward([other[17]]), 17, 18, "decode after truncate")

    engine.reset()
    check(engine.forward(seq[:4]), 0, 4, "prefill after reset")


def test_long_prefill_then_decode(pair):
    """Past the llama3 original context and across many positions."""
    name, model, engine = pair
    engine.reset()
    seq = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = oracle(model, seq)
    got = torch.cat([engine.forward(seq[:66])] + [engine.forward([t]) for t in seq[66:]])
    assert (got - ref).abs().max().item() <= TOL_FP32


@pytest.mark.parametrize("precision, tol", [("bfloat16", 0.15), ("int8", 0.25)])
def test_reduced_precisions_stay_close(tmp_path, precision, tol):
    """bf16 and int8 weights: logits close to float32's relative to their scale, same top tokens mostly."""
    model = make_model("qwen3", tmp_path)
    seq = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = oracle(model, seq)
    engine, _ = load(tmp_path, precision=precision)
    # a long prefill (int8: the dequantized bf16 path), a short verify and decodes (the int8 kernel)
    got = torch.cat([engine.forward(seq[:40]), engine.forward(seq[40:46]), engine.forward([seq[46]]),
                     engine.forward([seq[47]])])
    assert got.dtype == torch.float32
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < tol, f"{precision}: max diff {rel:.3f} of the logit scale"
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_exl2_folder_loads_and_matches_its_dequantized_weights(tmp_path):
    """Every linear stored as EXL2 tensors: the engine equals transformers holding the dequantized weights."""
    from safetensors.torch import load_file, save_file

    from runtime.exl2.format import dequantize, quantize
    model = make_model("qwen3_moe", tmp_path / "plain")
    plain = load_file(str(tmp_path / "plain" / "model.safetensors"))
    quantized, folder = {}, tmp_path / "exl2"
    folder.mkdir()
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, w in plain.items():
            if w.dim() == 2 and name != "model.embed_tokens.weight":
                prefix = name.removesuffix(".weight")
                parts = quantize(w, bits=6 if "experts" in name else 8, group_size=32, name=prefix)
                quantized.update({f"{prefix}.{k}": v for k, v in parts.items()})
                deq = dequantize(parts, out_features=w.shape[0])
                if name in params:
                    params[name].copy_(deq)
                else:                                     # transformers holds experts fused in 3-D tensors
                    _set_expert(model, name, deq)
            else:
                quantized[name] = w
    save_file(quantized, str(folder / "model.safetensors"))
    (folder / "config.json").write_text((tmp_path / "plain" / "config.json").read_text())
    engine, _ = load(folder, precision="float32")
    assert engine.info.extra["is_exl2"]
    seq = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = oracle(model, seq)
    got = torch.cat([engine.forward(seq[:8]), engine.forward(seq[8:9]), engine.forward(seq[9:])])
    assert (got - ref).abs().max().item() <= TOL_FP32


def _set_expert(model, name: str, weight: torch.Tensor) -> None:
    """model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight into transformers' fused expert tensors."""
    parts = name.split(".")
    layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
    experts = model.model.layers[layer].mlp.experts
    m = weight.shape[0] if proj != "down_proj" else weight.shape[1]
    if proj == "down_proj":
        experts.down_proj[e].copy_(weight)
    elif proj == "gate_proj":
        experts.gate_up_proj[e, :m].copy_(weight)
    else:
        experts.gate_up_proj[e, m:].copy_(weight)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_folder_written_by_exl2_writer_loads_close_to_original(tmp_path, name):
    """The project's EXL2 writer at 8 bits: the engine's logits stay close to the unquantized model's."""
    import json

    from runtime.exl2.writer import quantize_model
    model = make_model(name, tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    from safetensors.torch import load_file
    quantize_model(load_file(str(tmp_path / "plain" / "model.safetensors")), config, bits=8, head_bits=8,
                   out_dir=tmp_path / "exl2", group_size=32)
    engine, _ = load(tmp_path / "exl2", precision="float32")
    assert engine.info.extra["is_exl2"]
    seq = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = oracle(model, seq)
    got = torch.cat([engine.forward(seq[:9]), engine.forward(seq[9:])])
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    # quantization noise can flip near-tied routing choices of a random MoE, hence the margin
    assert rel < 0.1, f"8-bit EXL2 logits differ by {rel:.3f} of the logit scale"
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
