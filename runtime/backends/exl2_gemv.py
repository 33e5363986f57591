"""The decode graphs' attention projections through the split-K GEMV (tuning switch MOEDESK_DENSE_GEMV).

In the exllamav2 engine's decode graphs (runtime/backends/exl2_graph.py) each attention's prologue is
exllamav2's fused `q_attn_forward_1` (norm, q/k/v GEMMs, head norms, RoPE) and its epilogue
`q_attn_forward_2` (o GEMM added into the residual). With the switch on, `install` gives every plain
attention (pre-norm, residual, no bias, no post-norm, no prologue of its architecture's own) two hooks
that the graph calls instead: `moedesk_qkv` (exllamav2's norm, our GEMV for q, k and v, each part stored
straight into the graph's q, k and v, its head norms and RoPE) and `moedesk_o` (our GEMV of o added into x
by the kernel). The GEMVs are `TritonExl2Linear`s packed from the
model folder's EXL2 tensors (exllamav2's own copies have their codes reordered by its Q matrices): the
attention weights are held twice in VRAM, so only loads without offload take them.

With the switch MOEDESK_QKV_FUSED the prologue is one launch where the attention allows it (`fused_qkv`: an
RMSNorm before, RMS head norms without bias or none, NEOX RoPE over whole heads or none;
runtime/experts/qkv_prologue.py), else the hooks above.
"""
from __future__ import annotations

import functools

import torch

from runtime import tuning
from runtime.errors import InvalidModel


def settle_kernels(model, offload: bool) -> None:
    """exllamav2's GEMM past its autotuning (exl2_kernels.settle_gemm_autotune), then, for a load
    without offload, `install`."""
    from runtime.backends.exl2_kernels import settle_gemm_autotune
    settle_gemm_autotune(model)
    if not offload:
        install(model)


def install(model, folder=None) -> int:
    """Hooks on every attention it applies to (see the module docstring), their launch shapes chosen
    (before any capture); returns how many attentions have them. Nothing with the switch off.
    folder: the model's tensors (a ModelFolder, closed here; default: the model's own folder)."""
    t = tuning.current()
    if not (t.dense_gemv or t.qkv_fused):
        return 0
    from exllamav2.attn import ExLlamaV2Attention
    from runtime.backends.quant_linear import TritonExl2Linear, exl2_parts, is_exl2, settle_gemv
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
            if not _plain(a):
                continue
            projs = (a.q_proj, a.k_proj, a.v_proj)
            if not all(is_exl2(folder, lin.key) for lin in projs + (a.o_proj,)):
                continue
            dev = a.o_proj.device()
            try:
                qkv = TritonExl2Linear([exl2_parts(folder, lin.key) for lin in projs],
                                       [lin.out_features for lin in projs], [lin.key for lin in projs], dev, None)
                o = TritonExl2Linear([exl2_parts(folder, a.o_proj.key)], [a.o_proj.out_features], [a.o_proj.key],
                                     dev, None)
            except InvalidModel:
                continue                                  # a layout the GEMV does not take: exllamav2's
            settle_gemv(qkv)
            settle_gemv(o)
            fused = t.qkv_fused and _fusable(a)
            if fused:
                settle_fused(a, qkv)
            a.moedesk_qkv = functools.partial(fused_qkv if fused else gemv_qkv, a, qkv)
            a.moedesk_o = functools.partial(gemv_o, a, o)
            n += 1
    finally:
        folder.close()
    if n and torch.cuda.is_available():
        torch.cuda.synchronize()
    return n


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


def settle_fused(a, lin) -> None:
    """The one-launch prologue's shapes chosen at every row count it takes (timed, with host synchronisations),
    before any graph capture; tables of zeros stand in for the RoPE's (the timing does not read them). On a GPU
    only: elsewhere nothing is timed."""
    dev = lin.packs[0].scales.device
    if dev.type != "cuda":
        return
    Hq, Hk, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    table = torch.zeros((1, D), dtype=torch.float16, device=dev)      # rows of D: the rotation of whole heads
    pos = torch.zeros(1, dtype=torch.int32, device=dev)
    for T in range(1, lin.max_rows + 1):
        x = torch.zeros((1, T, lin.in_features), dtype=torch.float16, device=dev)
        q, k, v = (torch.empty((1, T, h * D), dtype=torch.float16, device=dev) for h in (Hq, Hk, Hk))
        fused_qkv(a, lin, x, T, pos, q, k, v, table, table)


def fused_qkv(a, lin, x, T: int, pos32, q, k, v, sin, cos) -> None:
    """`gemv_qkv` in one launch (runtime/experts/qkv_prologue.py) where the RoPE is NEOX over whole heads or
    none; else, and above the GEMV's rows, `gemv_qkv`."""
    from exllamav2.architecture import RopeStyle
    from runtime.experts.qkv_prologue import qkv_prologue
    style, D = a.archparams.rope_style, a.head_dim
    if T > lin.max_rows or style not in (RopeStyle.NONE, RopeStyle.NEOX) \
            or style == RopeStyle.NEOX and sin.shape[-1] != D:
        gemv_qkv(a, lin, x, T, pos32, q, k, v, sin, cos)
        return
    ln = a.pre_layernorm
    norms = None if a.q_norm is None else (a.q_norm, a.k_norm)
    qkv_prologue(x.view(T, -1), ln.weight, ln.variance_epsilon, lin.packs,
                 (a.num_attention_heads, a.num_key_value_heads, D), q.view(T, -1), k.view(T, -1), v.view(T, -1),
                 None if norms is None else tuple(n.weight.data for n in norms),
                 (0.0, 0.0) if norms is None else tuple(n.variance_epsilon for n in norms),
                 (sin, cos, pos32) if style == RopeStyle.NEOX else None)


def gemv_qkv(a, lin, x, T: int, pos32, q, k, v, sin, cos) -> None:
    """The graph's attention prologue: x fp16 [1, T, H] (the residual, unchanged) -> q [1, T, Hq*D],
    k, v [1, T, Hk*D]: norm, q/k/v through the GEMV, head norms, RoPE at positions pos32[0] + t
    (exllamav2's fused prologue above the GEMV's rows)."""
    from exllamav2.architecture import RopeStyle
    from exllamav2.ext import exllamav2_ext as ext, none_tensor
    from runtime.backends.exl2_arch import pre_norm
    if T > lin.max_rows:                                  # exllamav2's prologue, as without the hook
        ext.q_attn_forward_1(a.q_handle, x, 1, T, -1, pos32, q, k, v, sin, cos, [], none_tensor)
        return
    lin.into(pre_norm(a, x.view(T, -1)), [q.view(T, -1), k.view(T, -1), v.view(T, -1)])
    Hq, Hk, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    if a.q_norm is not None:
        rms = a.archparams.headnorm == "rmsnorm"
        for norm, t, heads in ((a.q_norm, q, Hq), (a.k_norm, k, Hk)):
            t4 = t.view(1, T, heads, D)
            ext.head_norm(t4, norm.weight.data, norm.bias.data if norm.bias is not None else none_tensor, t4,
                          norm.variance_epsilon, rms)
    style = a.archparams.rope_style
    if style != RopeStyle.NONE:
        neox = style == RopeStyle.NEOX
        ext.rope_(q, sin, cos, -1, Hq, D, pos32, neox)
        ext.rope_(k, sin, cos, -1, Hk, D, pos32, neox)


def gemv_o(a, lin, x, o, T: int) -> None:
    """The graph's attention epilogue: x fp16 [1, T, H] += o [1, T, Hq*D] @ W_o.T (in place)."""
    if T <= lin.max_rows:
        lin.into(o.view(T, -1), [x.view(T, -1)], add=True)
    else:                                                 # exllamav2's epilogue, as without the hook
        from exllamav2.ext import exllamav2_ext as ext, none_tensor
        ext.q_attn_forward_2(a.q_handle, x, o, 1, T, [], none_tensor)
