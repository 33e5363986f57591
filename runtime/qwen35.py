"""Qwen3.5-MoE model folders (no torch): config, tensor layout, parameter counts, per-sequence state.

Qwen3.5-MoE is a hybrid: most layers are Gated DeltaNet (linear attention with a short causal
convolution and a recurrent state per sequence), every `full_attention_interval`-th layer is gated
full attention (output gate, QK norm, partial RoPE), and every layer is an MoE of routed experts plus a
gated shared expert. The Hub's checkpoints are multimodal (`Qwen3_5MoeForConditionalGeneration`: the
sizes under `text_config`, the language model's tensors under `model.language_model.`, a vision tower
under `model.visual.` (unused here) and a multi-token-prediction head under `mtp.` (`mtp_layout`: the
speculative draft of the reference engine); a text-only export (`Qwen3_5MoeForCausalLM`) keeps the
language model under `model.`.

Experts are read either per expert (`mlp.experts.N.gate_proj`, as transformers saves them and as EXL2
folders store them) or stacked (`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj`
[E, H, I], as the released bf16 checkpoints store them).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from runtime.errors import UnsupportedArchitecture
from runtime.folder_check import Layout, _check_number, _invalid, check_rope

CONDITIONAL = "Qwen3_5MoeForConditionalGeneration"
ARCHITECTURES = (CONDITIONAL, "Qwen3_5MoeForCausalLM")
LINEAR, FULL = "linear_attention", "full_attention"

# transformers' defaults (Qwen3_5MoeTextConfig) for the sizes a config may leave out
DEFAULTS = {"num_key_value_heads": 2, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
            "num_experts_per_tok": 8, "max_position_embeddings": 32768}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Ceilings far above any released model (a hostile config must fail before anything is built from it)
BOUNDS = {"hidden_size": 1 << 17, "num_hidden_layers": 1024, "num_attention_heads": 1024, "vocab_size": 1 << 22,
          "num_key_value_heads": 1024, "head_dim": 1 << 12, "linear_conv_kernel_dim": 64,
          "linear_key_head_dim": 1 << 12, "linear_value_head_dim": 1 << 12, "linear_num_key_heads": 1024,
          "linear_num_value_heads": 1024, "moe_intermediate_size": 1 << 20,
          "shared_expert_intermediate_size": 1 << 20, "num_experts": 4096, "num_experts_per_tok": 4096,
          "max_position_embeddings": 1 << 24, "full_attention_interval": 1024}


def prefix(config: dict) -> str:
    """Where the language model's tensors live."""
    return "model.language_model" if config["architectures"][0] == CONDITIONAL else "model"


def _int(config: dict, key: str, path: Path | str) -> int:
    value, top = config.get(key), BOUNDS[key]
    if type(value) is not int or not 0 < value <= top:
        raise _invalid(path, f"'{key}' must be a positive integer of at most {top}, got {value!r}")
    return value


def read_config(config: dict, path: Path | str) -> dict:
    """The language model's config, flattened (a multimodal config's text_config hoisted to the top level),
    defaults filled in as transformers fills them, every size bounded and consistent."""
    arch = config["architectures"][0]
    if arch == CONDITIONAL:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise _invalid(path, f"'text_config' must be an object for {arch}, got {text!r}")
        flat = {k: v for k, v in config.items() if k != "text_config"}
        flat.update(text)
        flat["architectures"] = [arch]
        flat["tie_word_embeddings"] = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        if "quantization_config" in config:
            flat["quantization_config"] = config["quantization_config"]
    else:
        flat = dict(config)
    for key, value in DEFAULTS.items():
        if flat.get(key) is None:
            flat[key] = value
    for key in REQUIRED + tuple(DEFAULTS):
        _int(flat, key, path)
    if flat.get("full_attention_interval") is not None:
        _int(flat, "full_attention_interval", path)
    if flat.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitecture(path, f"activation {flat['hidden_act']!r} is not supported (only silu)")
    if flat["num_experts_per_tok"] > flat["num_experts"]:
        raise _invalid(path, f"'num_experts_per_tok' ({flat['num_experts_per_tok']}) is more than "
                             f"'num_experts' ({flat['num_experts']})")
    if flat["num_attention_heads"] % flat["num_key_value_heads"]:
        raise _invalid(path, "'num_attention_heads' is not a multiple of 'num_key_value_heads'")
    if flat["linear_num_value_heads"] % flat["linear_num_key_heads"]:
        raise _invalid(path, "'linear_num_value_heads' is not a multiple of 'linear_num_key_heads'")
    _check_number(flat, "rms_norm_eps", path, 0.0, 1.0)
    _check_number(flat, "rope_theta", path, 0.0, 1e12)
    params = check_rope(flat, path)
    factor = params.get("partial_rotary_factor", flat.get("partial_rotary_factor", 0.25))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise _invalid(path, f"'partial_rotary_factor' must be a number above 0 and at most 1, got {factor!r}")
    if int(flat["head_dim"] * factor) % 2:
        raise _invalid(path, f"partial_rotary_factor {factor} of head_dim {flat['head_dim']} rotates an odd "
                             f"number of dimensions")
    flat["partial_rotary_factor"] = float(factor)
    flat["layer_types"] = layer_types(flat, path)
    return flat


def layer_types(config: dict, path: Path | str) -> list[str]:
    """Each layer's kind: `layer_types` as given, else every `full_attention_interval`-th layer (default 4th) full."""
    n = config["num_hidden_layers"]
    kinds = config.get("layer_types")
    if kinds is None:
        every = config.get("full_attention_interval") or 4
        return [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or any(k not in (LINEAR, FULL) for k in kinds):
        raise _invalid(path, f"'layer_types' must list {n} entries, each {LINEAR!r} or {FULL!r}")
    return list(kinds)


def rotary_dim(config: dict) -> int:
    return int(config["head_dim"] * config["partial_rotary_factor"])


def conv_dim(config: dict) -> int:
    """Channels of the short convolution: queries and keys of the key heads, values of the value heads."""
    return 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"] + value_dim(config)


def value_dim(config: dict) -> int:
    return config["linear_num_value_heads"] * config["linear_value_head_dim"]


def layout(config: dict, present: set[str] | None = None) -> Layout:
    """Every tensor the language model needs: plain ones with their shapes, linears as (out, in)."""
    h, v, p0 = config["hidden_size"], config["vocab_size"], prefix(config)
    hd, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    e, k, m, ms = (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
                   config["shared_expert_intermediate_size"])
    hv, cd, vd = config["linear_num_value_heads"], conv_dim(config), value_dim(config)
    plain: dict[str, tuple[int, ...]] = {f"{p0}.embed_tokens.weight": (v, h), f"{p0}.norm.weight": (h,)}
    linears: dict[str, tuple[int, int]] = {}
    present = present or set()
    if not config.get("tie_word_embeddings", False) or "lm_head.weight" in present or "lm_head.q_weight" in present:
        linears["lm_head"] = (v, h)
    for i, kind in enumerate(config["layer_types"]):
        p = f"{p0}.layers.{i}"
        plain[f"{p}.input_layernorm.weight"] = (h,)
        plain[f"{p}.post_attention_layernorm.weight"] = (h,)
        if kind == FULL:
            a = f"{p}.self_attn"
            linears[f"{a}.q_proj"] = (2 * nh * hd, h)          # queries and their output gates, per head
            linears[f"{a}.k_proj"] = (nkv * hd, h)
            linears[f"{a}.v_proj"] = (nkv * hd, h)
            linears[f"{a}.o_proj"] = (h, nh * hd)
            plain[f"{a}.q_norm.weight"] = (hd,)
            plain[f"{a}.k_norm.weight"] = (hd,)
        else:
            a = f"{p}.linear_attn"
            linears[f"{a}.in_proj_qkv"] = (cd, h)
            linears[f"{a}.in_proj_z"] = (vd, h)
            linears[f"{a}.in_proj_b"] = (hv, h)
            linears[f"{a}.in_proj_a"] = (hv, h)
            linears[f"{a}.out_proj"] = (h, vd)
            plain[f"{a}.conv1d.weight"] = (cd, 1, config["linear_conv_kernel_dim"])
            plain[f"{a}.A_log"] = (hv,)
            plain[f"{a}.dt_bias"] = (hv,)
            plain[f"{a}.norm.weight"] = (config["linear_value_head_dim"],)
        linears[f"{p}.mlp.gate"] = (e, h)
        linears[f"{p}.mlp.shared_expert_gate"] = (1, h)
        for name in ("gate_proj", "up_proj"):
            linears[f"{p}.mlp.shared_expert.{name}"] = (ms, h)
        linears[f"{p}.mlp.shared_expert.down_proj"] = (h, ms)
        if stacked_experts(config, present, i):
            plain[f"{p}.mlp.experts.gate_up_proj"] = (e, 2 * m, h)
            plain[f"{p}.mlp.experts.down_proj"] = (e, h, m)
        else:
            for j in range(e):
                linears[f"{p}.mlp.experts.{j}.gate_proj"] = (m, h)
                linears[f"{p}.mlp.experts.{j}.up_proj"] = (m, h)
                linears[f"{p}.mlp.experts.{j}.down_proj"] = (h, m)
    idle = config["num_hidden_layers"] * (e - k) * 3 * m * h
    return Layout(plain, linears, idle)


def stacked_experts(config: dict, present: set[str], layer: int) -> bool:
    return f"{prefix(config)}.layers.{layer}.mlp.experts.gate_up_proj" in present


MTP = "mtp"


def has_mtp(present: set[str]) -> bool:
    """The folder holds the multi-token-prediction head (its fc stored plain or quantized)."""
    return f"{MTP}.fc.weight" in present or f"{MTP}.fc.q_weight" in present


def mtp_layout(config: dict, present: set[str] | None = None) -> Layout:
    """The MTP head's tensors: two (1 + weight) norms of the next token's embedding and of the model's
    last hidden state, `fc` [H, 2H] joining them (embedding first), one gated full-attention decoder
    layer with the model's MoE, and a final norm; the embedding and lm_head are the model's own."""
    h, m, ms, e = (config["hidden_size"], config["moe_intermediate_size"], config["shared_expert_intermediate_size"],
                   config["num_experts"])
    hd, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    p, present = f"{MTP}.layers.0", present or set()
    plain = {f"{MTP}.{n}.weight": (h,) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    plain.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                  f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,)})
    linears = {f"{MTP}.fc": (h, 2 * h), f"{p}.self_attn.q_proj": (2 * nh * hd, h), f"{p}.self_attn.k_proj": (nkv * hd, h),
               f"{p}.self_attn.v_proj": (nkv * hd, h), f"{p}.self_attn.o_proj": (h, nh * hd), f"{p}.mlp.gate": (e, h),
               f"{p}.mlp.shared_expert_gate": (1, h), f"{p}.mlp.shared_expert.gate_proj": (ms, h),
               f"{p}.mlp.shared_expert.up_proj": (ms, h), f"{p}.mlp.shared_expert.down_proj": (h, ms)}
    if f"{p}.mlp.experts.gate_up_proj" in present:
        plain[f"{p}.mlp.experts.gate_up_proj"] = (e, 2 * m, h)
        plain[f"{p}.mlp.experts.down_proj"] = (e, h, m)
    else:
        for j in range(e):
            linears.update({f"{p}.mlp.experts.{j}.gate_proj": (m, h), f"{p}.mlp.experts.{j}.up_proj": (m, h),
                            f"{p}.mlp.experts.{j}.down_proj": (h, m)})
    return Layout(plain, linears, (e - config["num_experts_per_tok"]) * 3 * m * h)


def implied_tensors(config: dict, present: set[str]) -> int:
    """How many stored tensors `layout` implies, counted without building it (experts per expert, unless
    the folder stacks them)."""
    full = config["layer_types"].count(FULL)
    stacked = sum(stacked_experts(config, present, i) for i in range(len(config["layer_types"])))
    per_expert = len(config["layer_types"]) - stacked
    return (2 + full * 6 + (len(config["layer_types"]) - full) * 9 + len(config["layer_types"]) * 7
            + stacked * 2 + per_expert * 3 * config["num_experts"])


def param_counts(config: dict) -> tuple[int, int]:
    """(total, active per token) parameters of the language model (vision tower and MTP head left out)."""
    lay = layout(config)
    total = sum(math.prod(s) for s in lay.plain.values()) + sum(o * i for o, i in lay.linears.values())
    return total, total - lay.expert_params


def state_bytes(config: dict, state_dtype_bytes: int = 4, conv_dtype_bytes: int = 2) -> int:
    """Bytes of one sequence's linear-attention state: per DeltaNet layer a recurrent state of
    [value heads, key dim, value dim] (float32) and the convolution's last kernel-1 inputs. It does not
    grow with the context: it takes the place of those layers' KV cache."""
    n = config["layer_types"].count(LINEAR)
    recurrent = config["linear_num_value_heads"] * config["linear_key_head_dim"] * config["linear_value_head_dim"]
    conv = conv_dim(config) * (config["linear_conv_kernel_dim"] - 1)
    return n * (recurrent * state_dtype_bytes + conv * conv_dtype_bytes)


def kv_layers(config: dict) -> int:
    """Layers that keep a KV cache (the full-attention ones)."""
    return config["layer_types"].count(FULL)
