"""Gated DeltaNet, the linear attention of Qwen3.5's hybrid layers, on one sequence (pure PyTorch).

Per value head the layer keeps a state S [dk, dv] and, for each token t (decay g_t <= 0 in log space,
write strength beta_t in (0, 1), queries and keys L2-normalised, queries scaled by dk^-1/2):

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - k_t^T S))^T;   o_t = q_t^T S

`recurrent` runs that loop (decode and verify); `chunked` computes the same in blocks of C tokens
(prefill): inside a block the writes are resolved at once by a unit lower-triangular solve, and only
the state is carried from block to block. Both work in float32 whatever the activations are.
Before the rule, q, k and v pass through a short causal depthwise convolution (kernel K, SiLU) whose
state is the previous K-1 inputs; after it, each head's output is RMS-normalised and gated by SiLU(z).

T tokens, HV value heads, dk key dim, dv value dim, C convolution channels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64                 # tokens per block of the chunked form
RECURRENT_MAX_TOKENS = 8   # up to this many tokens (decode, verify) the plain loop is quicker


def conv(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] new inputs, prev [K-1, C] the inputs before them, weight [C, K] ->
    (SiLU of the causal depthwise convolution [T, C], the last K-1 inputs: the next `prev`)."""
    k = weight.shape[1]
    full = torch.cat([prev.to(x.dtype), x])                                        # [K-1+T, C]
    y = F.conv1d(full.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])  # [1, C, T]
    return F.silu(y[0].t()).to(x.dtype), full[full.shape[0] - (k - 1):]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, HV, dk] (normalised and scaled), v [T, HV, dv], g and beta [T, HV], state [HV, dk, dv]
    float32 -> (outputs [T, HV, dv] float32, the state after the last token). The state passed in is not
    modified (rollback keeps references to earlier states)."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if q.shape[0] <= RECURRENT_MAX_TOKENS:
        return recurrent(q, k, v, g, beta, state)
    return chunked(q, k, v, g, beta, state)


def recurrent(q, k, v, g, beta, state):
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        read = torch.einsum("hk,hkv->hv", k[t], state)                              # what S predicts for k_t
        write = (v[t] - read) * beta[t, :, None]
        state = state + k[t, :, :, None] * write[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(out), state


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same outputs block by block. In a block of c tokens with cumulative log decay G:
    D[i, j] = exp(G_i - G_j) for j <= i; the writes w solve (I + A) w = beta (v - exp(G) k S0) with
    A[i, j] = beta_i D[i, j] k_i.k_j (j < i); o = exp(G) q S0 + (q k^T * D) w; S = exp(G_c) S0 + sum of
    exp(G_c - G_j) k_j w_j^T."""
    outs = []
    for s in range(0, q.shape[0], chunk):
        qc, kc, vc = (x[s:s + chunk].transpose(0, 1) for x in (q, k, v))           # [HV, c, d]
        gc, bc = g[s:s + chunk].t(), beta[s:s + chunk].t()                          # [HV, c]
        c = qc.shape[1]
        cum = gc.cumsum(-1)                                                         # G [HV, c]
        upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(upper, float("-inf")).exp()   # D [HV, c, c]
        a = (kc @ kc.transpose(1, 2)) * decay * bc[:, :, None]
        system = a.tril(-1) + torch.eye(c, device=q.device)                         # I + A
        rhs = torch.cat([vc * bc[..., None], kc * (bc * cum.exp())[..., None]], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, w = solved[..., :vc.shape[-1]], solved[..., vc.shape[-1]:]
        writes = u - w @ state                                                      # [HV, c, dv]
        attn = (qc @ kc.transpose(1, 2)) * decay                                    # [HV, c, c]
        outs.append(((qc * cum.exp()[..., None]) @ state + attn @ writes).transpose(0, 1))
        last = cum[:, -1:]                                                          # [HV, 1]
        state = state * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(1, 2) @ writes
    return torch.cat(outs), state


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over each head's dv values, times weight, times SiLU(z) (o and z [T, HV, dv])."""
    dtype = z.dtype
    normed = F.rms_norm(o.float(), (o.shape[-1],), None, eps).to(dtype) * weight
    return (normed.float() * F.silu(z.float())).to(dtype)
