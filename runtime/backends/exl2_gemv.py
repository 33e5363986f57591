"""The decode graphs' attention in two of our launches where it allows them: the prologue in one, o in one.

In the exllamav2 engine's decode graphs (runtime/backends/exl2_graph.py) an attention's prologue is
exllamav2's fused `q_attn_forward_1` (the input norm, three GEMMs, two head norms, RoPE: seven launches)
and its epilogue `q_attn_forward_2` (the o GEMM added into the residual). For a load without offload,
`install` gives every attention that allows it two hooks the graph calls instead:
- `moedesk_qkv`: the prologue in one launch (runtime/experts/qkv_prologue.py), where the attention is plain
  (pre-norm, residual, no bias, no post-norm, no prologue of its architecture's own) and the one launch takes
  it (`_fusable`: an RMSNorm before, RMS head norms without bias or none, NEOX RoPE over whole heads or none);
  a call it cannot take (more rows than the GEMV's, a partial rotation) runs exllamav2's prologue;
- `moedesk_o`: o through the split-K GEMV (runtime/experts/linear_gemv.py), added into x by the kernel.
With the experts' norm, routing and sums in three launches (runtime/experts/layer.py) this is the measured
one-launch set: 290.8 against 239.1 tok/s decode on the H100 at 524eb12 (qwen3-30b-a3b 4.0 bpw,
docs/engine-notes.md). The projections are packed from the model folder's EXL2 tensors (exllamav2's own
copies have their codes reordered by its Q matrices): the attention weights are held twice in VRAM, which
loads with offload leave to the experts. Attentions the one launch does not take keep exllamav2's path.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from runtime.errors import InvalidModel


def settle_kernels(model, offload: bool, splitk: Optional[tuple[int, int]] = None) -> None:
    """exllamav2's GEMM past its autotuning (exl2_kernels.settle_gemm_autotune), then, for a load
    without offload, `install`."""
    from runtime.backends.exl2_kernels import settle_gemm_autotune
    settle_gemm_autotune(model)
    if not offload:
        install(model, splitk=splitk)


def install(model, folder=None, splitk: Optional[tuple[int, int]] = None) -> int:
    """Hooks on every attention they apply to (see the module docstring), their launch shapes chosen (before
    any capture); returns how many attentions have them. folder: the model's tensors (a ModelFolder, closed
    here; default: the model's own folder); splitk: one forced launch shape of o's GEMV (Tuning.splitk)."""
    from exllamav2.attn import ExLlamaV2Attention
    from runtime.backends.quant_linear import is_exl2
    if folder is None:
        from runtime.modelfolder import ModelFolder
        folder = ModelFolder(model.config.model_dir)
    n = 0
    try:
        for a in model.modules:
            if not isinstance(a, ExLlamaV2Attention):
                continue
            if getattr(a, "moedesk_o", None) is not None:      # installed before (a second graph build)
                n += 1
                continue
            lins = (a.q_proj, a.k_proj, a.v_proj, a.o_proj)
            if not (_plain(a) and _fusable(a) and all(is_exl2(folder, lin.key) for lin in lins)):
                continue
            try:
                qkv, o = (_packs(folder, lins[:3], a.o_proj.device()), _packs(folder, lins[3:], a.o_proj.device()))
            except InvalidModel:
                continue                                  # a layout the GEMV does not take: exllamav2's
            settle(a, qkv, o, splitk)
            a.moedesk_qkv = functools.partial(fused_qkv, a, qkv)
            a.moedesk_o = functools.partial(gemv_o, a, o, splitk)
            n += 1
    finally:
        folder.close()
    if n and torch.cuda.is_available():
        torch.cuda.synchronize()
    return n


def _packs(folder, lins: Sequence, device) -> list:
    """Each linear packed as a single expert for the split-K GEMV; InvalidModel naming the one whose layout
    the GEMV's K tile cannot take."""
    from runtime.backends.quant_linear import exl2_parts
    from runtime.experts.linear_gemv import linear_tile
    from runtime.experts.pack import PackError, pack_experts
    out = []
    for lin in lins:
        try:
            p = pack_experts([exl2_parts(folder, lin.key)], lin.key, device=device)
            linear_tile(p)
        except (PackError, ValueError) as e:
            raise InvalidModel(lin.key, f"no split-K GEMV for this layout: {e}") from None
        if not 0 < lin.out_features <= p.out_features:
            raise InvalidModel(lin.key, f"{lin.out_features} output features but {p.out_features} stored columns")
        out.append(p)
    return out


def _plain(a) -> bool:
    """Pre-norm and residual, no post-norm, no bias, q/k/v stored apart, and no prologue of the
    architecture's own (exl2_arch.install: DBRX's clip_qkv)."""
    if getattr(a, "moedesk_qkv", None) is not None or a.q_handle is None:
        return False
    if not a.has_norm or not a.has_residual or a.post_layernorm:
        return False
    return not any(lin.has_bias or lin.f_key for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))


def _fusable(a) -> bool:
    """The one-launch prologue's cases (qkv_prologue.py): an RMSNorm before, RMS head norms without bias or
    none, heads of a power of two from 16, a hidden size its norm's steps divide, NEOX RoPE or none (a partial
    rotation is found per call, from the tables' width)."""
    from exllamav2.architecture import RopeStyle
    from exllamav2.rmsnorm import ExLlamaV2RMSNorm
    from runtime.experts.qkv_prologue import XB
    D = a.head_dim
    if not isinstance(a.pre_layernorm, ExLlamaV2RMSNorm) or D < 16 or D & (D - 1) or a.q_proj.in_features % XB \
            or a.archparams.rope_style not in (RopeStyle.NONE, RopeStyle.NEOX):
        return False
    if a.q_norm is None and getattr(a, "k_norm", None) is None:
        return True
    return a.archparams.headnorm == "rmsnorm" and all(
        n is not None and n.bias is None and n.weight.shape[-1] == D and n.weight.is_contiguous()
        for n in (a.q_norm, a.k_norm))


def settle(a, qkv: list, o: list, splitk: Optional[tuple[int, int]] = None) -> None:
    """The prologue's and o's launch shapes chosen at every row count they take (timed, with host
    synchronisations), before any graph capture; tables of zeros stand in for the RoPE's (the timing does not
    read them). On a GPU only: elsewhere nothing is timed."""
    from runtime.experts.linear_gemv import LINEAR_MAX_ROWS, linear_into
    dev = o[0].scales.device
    if dev.type != "cuda":
        return
    Hq, Hk, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    K, N = o[0].in_features, a.o_proj.out_features
    table = torch.zeros((1, D), dtype=torch.float16, device=dev)      # rows of D: the rotation of whole heads
    pos = torch.zeros(1, dtype=torch.int32, device=dev)
    for T in range(1, LINEAR_MAX_ROWS + 1):
        x = torch.zeros((1, T, qkv[0].in_features), dtype=torch.float16, device=dev)
        q, k, v = (torch.empty((1, T, h * D), dtype=torch.float16, device=dev) for h in (Hq, Hk, Hk))
        fused_qkv(a, qkv, x, T, pos, q, k, v, table, table)
        linear_into(torch.zeros((T, K), dtype=torch.float16, device=dev), o,
                    [torch.empty((T, N), dtype=torch.float16, device=dev)], splitk=splitk)


def fused_qkv(a, packs: list, x, T: int, pos32, q, k, v, sin, cos) -> None:
    """The graph's attention prologue: x fp16 [1, T, H] (the residual, unchanged) -> q [1, T, Hq*D],
    k, v [1, T, Hk*D] at positions pos32[0] + t, in one launch (runtime/experts/qkv_prologue.py) where the RoPE
    is NEOX over whole heads or none and the GEMV takes T rows; else exllamav2's prologue."""
    from exllamav2.architecture import RopeStyle
    from runtime.experts.linear_gemv import LINEAR_MAX_ROWS
    from runtime.experts.qkv_prologue import qkv_prologue
    style, D = a.archparams.rope_style, a.head_dim
    if T > LINEAR_MAX_ROWS or style not in (RopeStyle.NONE, RopeStyle.NEOX) \
            or style == RopeStyle.NEOX and sin.shape[-1] != D:
        from exllamav2.ext import exllamav2_ext as ext, none_tensor
        ext.q_attn_forward_1(a.q_handle, x, 1, T, -1, pos32, q, k, v, sin, cos, [], none_tensor)
        return
    ln = a.pre_layernorm
    norms = None if a.q_norm is None else (a.q_norm, a.k_norm)
    qkv_prologue(x.view(T, -1), ln.weight, ln.variance_epsilon, packs,
                 (a.num_attention_heads, a.num_key_value_heads, D), q.view(T, -1), k.view(T, -1), v.view(T, -1),
                 None if norms is None else tuple(n.weight.data for n in norms),
                 (0.0, 0.0) if norms is None else tuple(n.variance_epsilon for n in norms),
                 (sin, cos, pos32) if style == RopeStyle.NEOX else None)


def gemv_o(a, packs: list, splitk: Optional[tuple[int, int]], x, o, T: int) -> None:
    """The graph's attention epilogue: x fp16 [1, T, H] += o [1, T, Hq*D] @ W_o.T (in place, one launch;
    exllamav2's above the GEMV's rows)."""
    from runtime.experts.linear_gemv import LINEAR_MAX_ROWS, linear_into
    if T <= LINEAR_MAX_ROWS:
        linear_into(o.view(T, -1), packs, [x.view(T, -1)], add=True, splitk=splitk)
    else:
        from exllamav2.ext import exllamav2_ext as ext, none_tensor
        ext.q_attn_forward_2(a.q_handle, x, o, 1, T, [], none_tensor)
