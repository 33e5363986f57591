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
    if not tuning.current().dense_gemv:
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
            a.moedesk_qkv = functools.partial(gemv_qkv, a, qkv)
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
