"""What the CUDA engine does differently per architecture: one small table, read from config.json.

exllamav2 0.3.2 runs all five architectures' layers, with three gaps that this module closes:

- **Expert weights.** Our MoE layer (runtime/experts/layer.py) takes the router's softmax over all
  experts, the top-k, and optionally divides the k weights by their sum. Mixtral's softmax over its
  top-2 logits is exactly that, renormalised (the softmax's denominator cancels); Qwen3-MoE
  renormalises when `norm_topk_prob` says so; DBRX divides by the p-norm of the k weights with
  p = `ffn_config.moe_normalize_expert_weights` (1 in the released models: the sum; none: no
  renormalisation). Other values of p are refused by name rather than computed wrongly.
- **clip_qkv (DBRX).** DBRX clamps q, k and v to [-clip, clip] after the projections and before
  RoPE; exllamav2 does not. The layer loop (prefill) runs exllamav2's unfused attention with the three
  projections clamped; the decode graphs (runtime/backends/exl2_graph.py) call `clipped_qkv` in place
  of exllamav2's fused norm + projections + RoPE: LayerNorm, the three quantized GEMMs, the clamp,
  then RoPE at the device-side position.
- **Sliding window (Mixtral).** exllamav2 registers no sliding window for Mixtral (attention sees the
  whole cache), and neither do our decode graphs; a config that sets one gets its context capped at
  the window, where both attentions are exact.

Everything here but `install` is plain Python (CPU-testable); `install`, `clipped_qkv` and `pre_norm` import
exllamav2, on CUDA machines only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import InvalidModel, UnsupportedArchitecture


@dataclass(frozen=True)
class Traits:
    """Per architecture: where its expert-weight normalisation is configured and what exllamav2 misses."""
    expert_norm: str = ""            # "" (no MoE), "always", a config key holding a flag, or "dbrx_p"
    clip_qkv: bool = False           # q, k, v clamped to [-clip_qkv, clip_qkv] (DBRX)
    window_caps_context: bool = False  # config.sliding_window, when set, caps the context (Mixtral)


TRAITS = {
    "LlamaForCausalLM": Traits(),
    "Qwen3ForCausalLM": Traits(),
    "Qwen3MoeForCausalLM": Traits(expert_norm="norm_topk_prob"),
    "MixtralForCausalLM": Traits(expert_norm="always", window_caps_context=True),
    "DbrxForCausalLM": Traits(expert_norm="dbrx_p", clip_qkv=True),
}
SUPPORTED = tuple(TRAITS)


@dataclass(frozen=True)
class ArchPlan:
    """What one model needs from the engine, decided before exllamav2 builds it."""
    architecture: str
    renormalize: bool = True         # top-k weights divided by their sum
    clip_qkv: float = 0.0            # 0: no clamp
    window: int = 0                  # the sliding window that caps the context (0: none)
    rope: object = None              # runtime.reference.rope.RopeConfig: the RoPE tables' one source
    head_dim: int = 0


def read_config(path: Path) -> dict:
    """config.json of a model folder as a dict (the caller has checked that it exists)."""
    from runtime.modelfolder import read_json
    config = read_json(Path(path) / "config.json")       # bounded; a named model_invalid when broken
    if not isinstance(config, dict):
        raise InvalidModel(Path(path) / "config.json", "expected a JSON object")
    return config


def plan(config: dict, where: str = "config.json") -> ArchPlan:
    """The ArchPlan of a config.json dict; UnsupportedArchitecture or InvalidModel for what the engine cannot run as the model says."""
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in TRAITS:
        raise UnsupportedArchitecture(where, f"architecture {arch} is not supported (supported: {', '.join(SUPPORTED)})")
    t = TRAITS[arch]
    renormalize = True
    if t.expert_norm == "dbrx_p":
        ffn = config.get("ffn_config") or {}
        p = ffn.get("moe_normalize_expert_weights", 1.0) if isinstance(ffn, dict) else 1.0
        if p is None:
            renormalize = False
        elif isinstance(p, bool) or not isinstance(p, (int, float)) or float(p) != 1.0:
            raise UnsupportedArchitecture(where,
                                          f"'ffn_config.moe_normalize_expert_weights' is {p!r}; the CUDA engine "
                              "renormalises expert weights by their sum only (p = 1, as the released DBRX "
                              "models set) or not at all (null)")
    elif t.expert_norm not in ("", "always"):
        renormalize = bool(config.get(t.expert_norm, False))
    clip = 0.0
    if t.clip_qkv:
        attn = config.get("attn_config") or {}
        value = attn.get("clip_qkv") if isinstance(attn, dict) else None
        value = config.get("clip_qkv") if value is None else value
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidModel(where, f"'attn_config.clip_qkv' must be a positive number, got {value!r}")
            clip = float(value)
    window = 0
    if t.window_caps_context:
        w = config.get("sliding_window")
        if w is not None:
            if type(w) is not int or w < 1:
                raise InvalidModel(where, f"'sliding_window' must be a positive integer or null, got {w!r}")
            window = w
    from runtime.modelfolder import flat_config, head_dim
    from runtime.reference.rope import rope_config
    flat = flat_config(config)
    if not isinstance(flat.get("num_attention_heads"), int) or not isinstance(flat.get("hidden_size"), int):
        raise InvalidModel(where, "'hidden_size' and 'num_attention_heads' must be integers")
    return ArchPlan(arch, renormalize, clip, window, rope_config(flat, where), head_dim(flat))


def cap_context(p: ArchPlan, off):
    """(OffloadOptions with the context capped where the architecture needs it, the note for
    `offload.context_length`)."""
    if p.window and off.context_length > p.window:
        return (dataclasses.replace(off, context_length=p.window),
                f"applied: capped at {p.window}, the model's sliding window (this engine attends the "
                "whole context, which is exact up to the window)")
    return off, "applied"


def rope_tables(p: ArchPlan, length: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(sin, cos) in exllamav2's layout, fp16 [1, 1, S, D] (NEOX: each half repeated), from
    runtime/reference/rope.py's `tables`: the frequencies and scaling every engine uses (exllamav2's own
    YaRN uses the context length where transformers uses original_max_position_embeddings, and only past it)."""
    from runtime.reference import rope
    cos, sin = rope.tables(p.rope, p.head_dim, length, torch.float32)
    return sin.half()[None, None].to(device), cos.half()[None, None].to(device)


def own_rope_tables(context_cls) -> None:
    """exllamav2's device context (`context_cls`, ExLlamaV2DeviceContext) made to keep our tables: after its own
    prepare_sincos, the first table pair is replaced by `rope_tables` of the model's ArchPlan (set by
    `install`). Once per process; models without a plan keep exllamav2's."""
    original = context_cls.prepare_sincos
    if getattr(original, "moedesk_rope", False):
        return

    def prepare_sincos(self):
        original(self)
        p = getattr(self.model, "moedesk_arch", None)
        if p is not None and p.rope is not None and self.sin and self.sin[0].numel() > 1:
            self.sin[0], self.cos[0] = rope_tables(p, self.model.config.max_seq_len, self.sin[0].device)
    prepare_sincos.moedesk_rope = True
    context_cls.prepare_sincos = prepare_sincos


# -- CUDA side: exllamav2 imported inside ------------------------------------------------------------

def install(model, p: ArchPlan) -> int:
    """After `model` is built (before or after load): the attention changes `p` needs; returns how
    many attention modules were changed. DBRX's clip_qkv: every q/k/v projection's output is clamped
    in exllamav2's unfused attention, which the layer loop then runs; `moedesk_qkv` is what the
    decode graphs call instead of the fused norm + projections + RoPE."""
    if not p.clip_qkv:
        return 0
    import functools
    import types
    from exllamav2.attn import ExLlamaV2Attention
    n = 0
    for m in model.modules:
        if isinstance(m, ExLlamaV2Attention):
            for lin in (m.q_proj, m.k_proj, m.v_proj):
                lin.forward = _clamped(lin.forward, p.clip_qkv)
            m.forward = types.MethodType(ExLlamaV2Attention.forward_torch, m)
            m.moedesk_qkv = functools.partial(clipped_qkv, m, p.clip_qkv)
            n += 1
    return n


def install_rope(model, p: ArchPlan) -> None:
    """After `model` is built: its RoPE tables are ours (`own_rope_tables`), those of every device context
    prepared already made again."""
    from exllamav2.device import ExLlamaV2DeviceContext
    model.moedesk_arch = p
    own_rope_tables(ExLlamaV2DeviceContext)
    for ctx in getattr(model, "device_context", None) or []:
        if getattr(ctx, "ready", False):
            ctx.prepare_sincos()


def _clamped(forward, clip: float):
    def clamped_forward(hidden_states, *args, **kwargs):
        out = forward(hidden_states, *args, **kwargs)
        if isinstance(out, dict):                     # exllamav2's intermediates
            out["hidden_states"] = out["hidden_states"].clamp_(-clip, clip)
            return out
        return out.clamp_(-clip, clip)
    clamped_forward.clip_qkv = clip
    return clamped_forward


def clipped_qkv(a, clip: float, x, T: int, pos32, q, k, v, sin, cos) -> None:
    """The decode graphs' attention prologue for clip_qkv: x fp16 [1, T, H] (the residual, unchanged)
    -> q [1, T, Hq*D], k, v [1, T, Hk*D]: norm, quantized projections, clamp, RoPE at positions
    pos32[0] + t (read on the device, as exllamav2's fused prologue reads it)."""
    from exllamav2.architecture import RopeStyle
    from exllamav2.ext import exllamav2_ext as ext
    normed = pre_norm(a, x.view(T, -1))
    for lin, out in ((a.q_proj, q), (a.k_proj, k), (a.v_proj, v)):
        o = out.view(T, -1)
        ext.gemm_half_q_half(normed, lin.q_handle, o, False)
        o.clamp_(-clip, clip)
    style = a.archparams.rope_style
    if style != RopeStyle.NONE:
        neox = style == RopeStyle.NEOX
        ext.rope_(q, sin, cos, -1, a.num_attention_heads, a.head_dim, pos32, neox)
        ext.rope_(k, sin, cos, -1, a.num_key_value_heads, a.head_dim, pos32, neox)


def pre_norm(a, h: torch.Tensor) -> torch.Tensor:
    """Attention `a`'s input norm (RMSNorm or LayerNorm, exllamav2's kernels) of h fp16 [T, H], into a new tensor."""
    from exllamav2.ext import exllamav2_ext as ext, none_tensor
    from exllamav2.rmsnorm import ExLlamaV2RMSNorm
    normed = torch.empty_like(h)
    ln = a.pre_layernorm
    if isinstance(ln, ExLlamaV2RMSNorm):
        ext.rms_norm(h, ln.weight, normed, ln.variance_epsilon)
    else:
        ext.layer_norm(h, ln.weight.data, ln.bias.data if ln.bias is not None else none_tensor, normed,
                       ln.variance_epsilon)
    return normed


def graph_modules():
    """exllamav2 module types the decode graphs run by their own forward (besides attention and MoE)."""
    from exllamav2.layernorm import ExLlamaV2LayerNorm
    return (ExLlamaV2LayerNorm,)
