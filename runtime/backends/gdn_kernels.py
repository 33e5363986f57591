"""The gated delta rule of the hybrid engine's DeltaNet layers on CUDA through fla's Triton kernels
(`fla-core`, the `gpu` extra): `chunk_gated_delta_rule` for long forwards (prefill),
`fused_recurrent_gated_delta_rule` for short ones (decode, verify). Where fla is missing, or the
tensors are not on CUDA, `available` is False and the layer runs its PyTorch forms
(runtime/backends/hybrid_layers.py), which stay the oracle of the GPU tests.

fla's contract (fla-core 0.6.0, read in its source), per value head h, for each token t:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - k_t^T S))^T;   o_t = (scale q_t)^T S

the rule of runtime/reference/deltanet.py, with:
- layouts [B, T, H, K] for q and k, [B, T, HV, V] for v, [B, T, HV] for g and beta; states
  [N, HV, K, V] float32 (initial_state, and the final state returned with output_final_state);
- g the log decay (natural log, <= 0: -exp(A_log) * softplus(a + dt_bias)), beta after its sigmoid;
- grouped values (HV a multiple of H): value head h reads key head h // (HV // H), what
  repeat_interleave(HV // H) of the key heads gives the PyTorch forms;
- g and beta passed by keyword: the fused recurrent entry's parameters are (q, k, v, g, gk, gv, beta, ...),
  so a positional beta would be read as gk, a per-key decay (garbage and NaN);
- scale applied to q inside the kernels: q and k go in L2-normalised (our own l2norm, float32, the
  same x / sqrt(|x|^2 + 1e-6) as fla's use_qk_l2norm_in_kernel), unscaled and not repeated.

The recurrent kernel computes in float32 whatever its inputs; it is fed float32 and runs row by row
when the states after each row are kept (the rollback ring, HybridCache.hist_rec). It reads nothing
on the host and allocates only its outputs: what a CUDA graph captures (its first run, eager,
compiles it). The chunked kernel is fed the activation dtype (its tested inputs; g float32), and
autotunes on its first call for a model's widths: it runs eagerly only (prefill).

Letters: T rows, HK key heads, HV value heads, dk / dv head dims.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)

_UNSET = object()
_ops = _UNSET


def ops():
    """(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule), or None where fla cannot be imported
    (imported on first use: it queries the GPU at import)."""
    global _ops
    if _ops is _UNSET:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
            _ops = (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)
        except Exception as err:          # not installed, or an incompatible Triton: the PyTorch forms run
            log.info("fla's gated delta rule kernels are not used: %s: %s", type(err).__name__, err)
            _ops = None
    return _ops


def available(x: torch.Tensor) -> bool:
    """Whether the rule on `x`'s device runs through fla (CUDA and fla importable)."""
    return x.is_cuda and ops() is not None


def recurrent(q, k, v, g, beta, scale: float, state: torch.Tensor, hist: Optional[torch.Tensor] = None,
              slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q, k [T, HK, dk], v [T, HV, dv], g and beta [T, HV], state [HV, dk, dv] float32 updated in place;
    with `hist`, the state after row t is written to hist[slots[t]]. -> outputs [T, HV, dv] float32."""
    fused = ops()[1]
    q, k, v, g, beta = (x.float()[None] for x in (q, k, v, g, beta))
    s = state[None]
    if hist is None:
        o, s = fused(q, k, v, g=g, beta=beta, scale=scale, initial_state=s, output_final_state=True)
        state.copy_(s[0])
        return o[0]
    outs = []
    for t in range(q.shape[1]):
        r = slice(t, t + 1)
        o, s = fused(q[:, r], k[:, r], v[:, r], g=g[:, r], beta=beta[:, r], scale=scale, initial_state=s,
                     output_final_state=True)
        outs.append(o[0])
        hist.index_copy_(0, slots[r], s)
    state.copy_(s[0])
    return torch.cat(outs)


def chunked(q, k, v, g, beta, scale: float, state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As `recurrent` without snapshots, through the chunked kernel fed in `dtype` (float16 or
    bfloat16; g float32). -> outputs [T, HV, dv] float32."""
    chunk = ops()[0]
    q, k, v, beta = (x.to(dtype)[None] for x in (q, k, v, beta))
    o, s = chunk(q, k, v, g=g.float()[None], beta=beta, scale=scale, initial_state=state[None],
                 output_final_state=True)
    state.copy_(s[0])
    return o[0].float()


def warm(spec, device: torch.device, dtype: torch.dtype, rows: int = 128) -> bool:
    """At load (behind its progress), where fla runs: both kernels once on zeros of the model's
    DeltaNet widths, so that the chunked kernel's autotuning and both compiles happen there and not in
    the first answer's prefill or decode (their tuning keys are the head counts and widths, not the
    rows). `spec` is the hybrid engine's (runtime/reference/qwen35.Spec). False where fla does not run
    on `device`."""
    probe = torch.empty(0, device=device)
    if not available(probe):
        return False
    hk, hv, dk, dv = spec.lin_key_heads, spec.lin_value_heads, spec.lin_key_dim, spec.lin_value_dim
    q, k = (torch.zeros((rows, hk, dk), dtype=torch.float32, device=device) for _ in range(2))
    v = torch.zeros((rows, hv, dv), dtype=torch.float32, device=device)
    g, beta = (torch.zeros((rows, hv), dtype=torch.float32, device=device) for _ in range(2))
    state = torch.zeros((hv, dk, dv), dtype=torch.float32, device=device)
    chunked(q, k, v, g, beta, dk ** -0.5, state, dtype)
    recurrent(q[:1], k[:1], v[:1], g[:1], beta[:1], dk ** -0.5, state)
    torch.cuda.synchronize(device)
    return True
