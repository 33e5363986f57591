"""The forward pass of Llama, Qwen3 (QK-norm), Qwen3-MoE and Mixtral (sliding window) on one sequence, with a KV cache.

One function serves prefill, single-token decode and verify-K: it appends T tokens at the cache's
current length and returns logits for all of them. Attention keeps the cache's kv heads unrepeated:
each kv head attends for its group of G query heads at once (queries folded to [KVH, G*T, D]).

T new tokens, S = cached + new positions, H hidden, V vocab, D head dim, NH query heads,
KVH kv heads, G = NH / KVH, E experts, A active experts per token, I intermediate.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from runtime.reference import rope
from runtime.reference.weights import Layer, Linear, Spec, Weights


class KVCache:
    """Keys and values for every layer, allocated once: [L, KVH, S_max, D] each."""

    def __init__(self, spec: Spec, length: int, dtype: torch.dtype, device="cpu"):
        shape = (spec.layers, spec.kv_heads, length, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = length
        self.length = 0


def forward(w: Weights, spec: Spec, cache: KVCache, cos: torch.Tensor, sin: torch.Tensor,
            tokens: torch.Tensor, trace: Optional[list] = None) -> torch.Tensor:
    """tokens [T] (int64) -> logits [T, V] float32; the cache grows by T. With `trace`, the residual
    stream [T, H] after every attention and every MLP/MoE block is appended to it (for diagnostics)."""
    t, start = tokens.shape[0], cache.length
    end = start + t
    groups = spec.heads // spec.kv_heads
    x = F.embedding(tokens, w.embed)                                          # [T, H]
    rot = cos[start:end, None], sin[start:end, None]                          # [T, 1, D] each
    mask = _mask(start, end, spec.sliding_window, groups, x.device)
    for i, layer in enumerate(w.layers):
        x = layer.o.add_to(x, _attention(layer, spec, cache, i, x, rot, mask, start, end))
        if trace is not None:
            trace.append(x.clone())
        if layer.gate_up is not None:
            x = layer.down.add_to(x, _normed(layer.gate_up, x, layer.mlp_norm, spec), silu_mul=True)
        else:
            x = x + _moe(layer, spec, _norm(x, layer.mlp_norm, spec))
        if trace is not None:
            trace.append(x.clone())
    cache.length = end
    return _normed(w.lm_head, x, w.norm, spec).float()                          # [T, V]


def _norm(x: torch.Tensor, weight: torch.Tensor, spec: Spec) -> torch.Tensor:
    if spec.layer_norm:                                                       # DBRX: LayerNorm without bias
        return F.layer_norm(x, (spec.hidden,), weight, None, spec.eps)
    return F.rms_norm(x, (spec.hidden,), weight, spec.eps)


def _normed(linear: Linear, x: torch.Tensor, weight: torch.Tensor, spec: Spec) -> torch.Tensor:
    """linear(_norm(x)): RMS norms in the CPU kernel's call where the linear has one."""
    return linear(_norm(x, weight, spec)) if spec.layer_norm else linear.normed(x, weight, spec.eps)


def _mask(start: int, end: int, window: int, groups: int, device=None) -> Optional[torch.Tensor]:
    """[G*T, S] boolean: row i (position start+i) sees keys <= start+i, and with a sliding window only the
    last `window` of them; None where every new token sees every key (a decode step within the window)."""
    if end - start == 1 and not (window and end > window):
        return None
    key, query = torch.arange(end, device=device)[None, :], torch.arange(start, end, device=device)[:, None]
    mask = key <= query                                                       # [T, S]
    if window:
        mask &= key > query - window
    return mask.repeat(groups, 1)


# Up to this many new rows (decode, verify) attention runs in the CPU kernel's loop (csrc/attention.cpp,
# where the int8 precision has the kernel), with the q/k norms, RoPE and the cache's writes: torch's fused
# kernel costs ~190 us a layer on the demo model's 3 query rows at 512 cached tokens and the rest ~10
# torch operations; prefill keeps torch's.
ATTEND_MAX_ROWS = 8


def _attention(layer: Layer, spec: Spec, cache: KVCache, i: int, x: torch.Tensor,
               rot: tuple[torch.Tensor, torch.Tensor], mask, start: int, end: int) -> torch.Tensor:
    """The attention of the residual stream x [T, H] (normed here), before the output projection: [T, NH*D]."""
    t, d, nh, nkv = x.shape[0], spec.head_dim, spec.heads, spec.kv_heads
    qkv = _normed(layer.qkv, x, layer.attn_norm, spec)                        # [T, (NH+2*KVH)*D]
    if t <= ATTEND_MAX_ROWS and layer.o.q is not None and cache.k.dtype == qkv.dtype == torch.bfloat16 \
            and not spec.clip_qkv:                                            # all of it in the CPU kernel's call
        qk_norm = None if layer.qk_norm is None else layer.qk_norm_f32
        return layer.o.q.ext.attend_qkv(qkv, rot[0].view(t, d), rot[1].view(t, d), cache.k[i], cache.v[i], start,
                                        spec.sliding_window, qk_norm, spec.eps)
    if spec.clip_qkv:
        qkv = qkv.clamp(-spec.clip_qkv, spec.clip_qkv)
    qk = qkv[:, :(nh + nkv) * d].view(t, nh + nkv, d)                         # q and k heads together
    if layer.qk_norm is not None:
        qk = F.rms_norm(qk, (d,), None, spec.eps) * layer.qk_norm
    qk = rope.apply(qk, *rot)
    cache.k[i, :, start:end] = qk[:, nh:].transpose(0, 1)                     # [KVH, T, D]
    cache.v[i, :, start:end] = qkv[:, (nh + nkv) * d:].view(t, nkv, d).transpose(0, 1)
    if t <= ATTEND_MAX_ROWS and layer.o.q is not None and cache.k.dtype == torch.bfloat16:   # (DBRX's clip)
        return layer.o.q.ext.attend(qk[:, :nh].contiguous(), cache.k[i], cache.v[i], start, spec.sliding_window)
    q = qk[:, :nh].reshape(t, nkv, nh // nkv, d).permute(1, 2, 0, 3).reshape(1, nkv, -1, d)  # [1, KVH, G*T, D]
    # 4-D inputs take torch's fused CPU attention kernel (3-D ones fall back to the slower math path)
    o = F.scaled_dot_product_attention(q, cache.k[i:i + 1, :, :end], cache.v[i:i + 1, :, :end], attn_mask=mask)
    return o.view(nkv, nh // nkv, t, d).permute(2, 0, 1, 3).reshape(t, nh * d)  # [T, NH*D]


def _expert(layer: Layer, e: int, h: torch.Tensor) -> torch.Tensor:
    gate, up = layer.experts_gate_up[e](h).chunk(2, dim=-1)
    return layer.experts_down[e](F.silu(gate) * up)


def _route(layer: Layer, spec: Spec, h: torch.Tensor, expert: torch.Tensor | None = None):
    """Router softmax in float32, top-A (or the given picks `expert` [T, A]: comparisons that hand the
    reference an engine's picks), optional renormalisation -> (weight [T, A] in h's dtype, expert)."""
    probs = torch.softmax(F.linear(h.float(), layer.router), dim=-1)          # [T, E]
    if expert is None:
        weight, expert = torch.topk(probs, spec.top_k, dim=-1)                # [T, A]
    else:
        expert = expert.to(probs.device, torch.int64)
        weight = probs.gather(-1, expert)
    if spec.norm_topk_prob and spec.expert_norm_p == 1.0:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    elif spec.norm_topk_prob:                                                 # DBRX's p-norm
        weight = weight / torch.linalg.vector_norm(weight, ord=spec.expert_norm_p, dim=-1, keepdim=True)
    return weight.to(h.dtype), expert


def _moe(layer: Layer, spec: Spec, h: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum (_route), SiLU-gated experts."""
    weight, expert = _route(layer, spec, h)
    if h.shape[0] == 1:                                                       # decode: A experts, no gathers
        out = None
        for a, e in enumerate(expert[0].tolist()):
            y = _expert(layer, e, h) * weight[0, a]
            out = y if out is None else out + y
        return out
    out = torch.zeros_like(h)                                                 # [T, H]
    for e in expert.unique().tolist():
        token, slot = (expert == e).nonzero(as_tuple=True)                    # rows routed to e
        out.index_add_(0, token, _expert(layer, e, h[token]) * weight[token, slot, None])
    return out
