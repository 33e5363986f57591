"""Decode and verify attention (batch 1, T = 1..9 new rows, FP16 cache) in Triton: cache write +
causal attention, graph-safe.

Letters: S cache length, L attended length (the bucket), T new rows (the decode step: 1; a verify of
K draft tokens: K + 1), Hq query heads, Hk KV heads, R = Hq // Hk query heads per KV head,
M = R * T query rows per KV head (MP: M padded to a power of two >= 16 for the dot), D head dim,
C rows per split (chunk), NS = ceil(L / C) splits, BN rows per block inside a split.

One program per (KV head, split): it reads its chunk of K/V once for all R query heads of that KV
head and all T rows (flash-decoding, online softmax in fp32); query row m is token t = m // R, head
h * R + m % R. The first new row's position `pos` is read from a device tensor, and the grid depends
only on L, so a CUDA graph captured for a bucket replays at every position in it: programs whose
chunk starts after the last new row pos + T - 1 do nothing. Row t attends cache rows 0..pos + t.
The new k/v rows are written into the cache at pos..pos+T-1 by the programs whose chunks hold them;
every program takes rows pos.. from the new k/v (not from the cache), so no program reads a row
another one is writing. With one split the kernel writes the output itself (one launch); with more,
a small second kernel merges the splits by their log-sum-exp.

The GPU check (against the bmm path, timed): `python -m bench.check_attention --check`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TARGET_PROGRAMS = 264        # programs to aim for (about 2 per multiprocessor of an H200)
MAX_QUERY_ROWS = 256         # R * T per program: beyond, the [MP, D] fp32 accumulator no longer fits


@triton.jit
def _decode_attn(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, o_ptr, part_ptr, lse_ptr, scale,
                 HK: tl.constexpr, R: tl.constexpr, T: tl.constexpr, TP: tl.constexpr, MP: tl.constexpr,
                 D: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, DIRECT: tl.constexpr):
    h = tl.program_id(0)
    s = tl.program_id(1)
    pos = tl.load(pos_ptr).to(tl.int32)
    last = pos + (T - 1)                                                        # last new row
    start = s * C
    if start <= last:
        offs_m = tl.arange(0, MP)
        offs_d = tl.arange(0, D)
        mask_m = offs_m < R * T
        t_m = offs_m // R                                                       # [MP] token of the row
        qrow = t_m * (HK * R) + h * R + offs_m % R                              # [MP] in [T, Hq]
        q = tl.load(q_ptr + qrow[:, None] * D + offs_d[None, :], mask=mask_m[:, None], other=0.0)
        if T == 1:
            k_new = tl.load(k_ptr + h * D + offs_d)                             # [D]
            v_new = tl.load(v_ptr + h * D + offs_d)
            if pos < start + C:
                tl.store(kc_ptr + pos * (HK * D) + h * D + offs_d, k_new)
                tl.store(vc_ptr + pos * (HK * D) + h * D + offs_d, v_new)
        else:
            offs_t = tl.arange(0, TP)
            dst = pos + offs_t                                                  # [TP] cache rows
            mine = ((offs_t < T) & (dst >= start) & (dst < start + C))[:, None]
            src = offs_t[:, None] * (HK * D) + h * D + offs_d[None, :]          # [TP, D] in k, v
            at_w = dst[:, None] * (HK * D) + h * D + offs_d[None, :]
            tl.store(kc_ptr + at_w, tl.load(k_ptr + src, mask=mine, other=0.0), mask=mine)
            tl.store(vc_ptr + at_w, tl.load(v_ptr + src, mask=mine, other=0.0), mask=mine)
        lim = pos + t_m                                                         # [MP] last row attended
        m = tl.full([MP], float("-inf"), dtype=tl.float32)
        l = tl.zeros([MP], dtype=tl.float32)
        acc = tl.zeros([MP, D], dtype=tl.float32)
        for i in range(0, C // BN):                  # a static trip count: blocks after `last` are skipped
            n0 = start + i * BN
            if n0 <= last:
                rows = n0 + tl.arange(0, BN)                                        # [BN]
                old = (rows < pos)[:, None]
                at = rows[:, None] * (HK * D) + h * D + offs_d[None, :]             # [BN, D]
                if T == 1:
                    new = (rows == pos)[:, None]
                    kb = tl.where(new, k_new[None, :], tl.load(kc_ptr + at, mask=old, other=0.0))
                else:
                    new = ((rows >= pos) & (rows <= last))[:, None]
                    at_n = (rows - pos)[:, None] * (HK * D) + h * D + offs_d[None, :]   # [BN, D] in k, v
                    kb = tl.where(new, tl.load(k_ptr + at_n, mask=new, other=0.0),
                                  tl.load(kc_ptr + at, mask=old, other=0.0))
                sc = tl.dot(q, tl.trans(kb)) * scale                                # [MP, BN] fp32
                if T == 1:
                    sc = tl.where((rows <= pos)[None, :], sc, float("-inf"))
                else:
                    sc = tl.where(rows[None, :] <= lim[:, None], sc, float("-inf"))
                m_new = tl.maximum(m, tl.max(sc, axis=1))
                # a row with nothing to attend yet (this chunk starts after pos + t): keep it empty, not NaN
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(sc - m_use[:, None])
                alpha = tl.exp(m - m_use)
                l = l * alpha + tl.sum(p, axis=1)
                if T == 1:
                    vb = tl.where(new, v_new[None, :], tl.load(vc_ptr + at, mask=old, other=0.0))
                else:
                    vb = tl.where(new, tl.load(v_ptr + at_n, mask=new, other=0.0),
                                  tl.load(vc_ptr + at, mask=old, other=0.0))
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), vb)           # [MP, D]
                m = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        if DIRECT:
            tl.store(o_ptr + qrow[:, None] * D + offs_d[None, :], out.to(tl.float16), mask=mask_m[:, None])
        else:
            row = s * (T * HK * R) + qrow                                       # [MP] in [NS, T*Hq]
            tl.store(part_ptr + row[:, None] * D + offs_d[None, :], out, mask=mask_m[:, None])
            lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))     # -inf: row empty here
            tl.store(lse_ptr + row, lse, mask=mask_m)


@triton.jit
def _combine(part_ptr, lse_ptr, pos_ptr, o_ptr, HQ, T: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
             NSP: tl.constexpr):
    """o[j] = sum_s w_s part[s, j] / sum_s w_s, w_s = exp(lse[s, j] - max), j in [T*Hq] (token j // Hq);
    splits after the token's position skipped."""
    j = tl.program_id(0)
    pos = tl.load(pos_ptr).to(tl.int32) + j // HQ
    offs_s = tl.arange(0, NSP)
    offs_d = tl.arange(0, D)
    valid = offs_s <= pos // C
    lse = tl.load(lse_ptr + offs_s * (T * HQ) + j, mask=valid, other=float("-inf"))   # [NSP]
    w = tl.where(valid, tl.exp(lse - tl.max(lse, axis=0)), 0.0)
    part = tl.load(part_ptr + (offs_s[:, None] * (T * HQ) + j) * D + offs_d[None, :], mask=valid[:, None],
                   other=0.0)                                                   # [NSP, D]
    o = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(o_ptr + j * D + offs_d, o.to(tl.float16))


def chunk_rows(L: int, Hk: int, block_n: int) -> int:
    """Rows per split: the smallest power-of-two multiple of block_n keeping Hk * NS near TARGET_PROGRAMS."""
    c = block_n
    while Hk * triton.cdiv(L, c) > TARGET_PROGRAMS:
        c *= 2
    return c


def launch(L: int, T: int, Hq: int, Hk: int, D: int, block_n: int = 64, chunk: int | None = None) -> dict:
    """The compile-time parameters of decode_attention's launches for (L, T): "attn" those of
    `_decode_attn` (num_warps included), "combine" those of `_combine` (None: one split, no merge),
    "NS" the splits. Triton compiles a kernel variant per distinct set; the other arguments are the
    float scale, HQ (fixed per model) and pointers to fresh or cache tensors (all 16-byte aligned)."""
    R = Hq // Hk
    C = chunk or chunk_rows(L, Hk, block_n)
    if C % block_n:
        raise ValueError(f"decode attention: chunk {C} is not a multiple of the block {block_n}")
    NS = triton.cdiv(L, C)
    MP = max(16, triton.next_power_of_2(R * T))
    attn = dict(HK=Hk, R=R, T=T, TP=triton.next_power_of_2(T), MP=MP, D=D, C=C, BN=block_n, DIRECT=NS == 1,
                num_warps=4 if MP <= 64 else 8)
    combine = None if NS == 1 else dict(T=T, D=D, C=C, NSP=triton.next_power_of_2(NS), num_warps=4)
    return {"NS": NS, "attn": attn, "combine": combine}


def variant(L: int, T: int, Hq: int, Hk: int, D: int, block_n: int = 64) -> tuple:
    """What Triton compiles decode_attention's kernels apart by, for (L, T): equal tuples share them."""
    p = launch(L, T, Hq, Hk, D, block_n)
    return tuple(sorted(p["attn"].items())) + tuple(sorted((p["combine"] or {}).items()))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                     pos: torch.Tensor, L: int, scale: float, block_n: int = 64,
                     chunk: int | None = None) -> torch.Tensor:
    """Write the T new k/v rows into the cache at rows pos..pos+T-1, then attend each query row t over
    rows 0..pos+t; 1 or 2 launches.

    q fp16 [1, T, Hq*D]; k, v fp16 [1, T, Hk*D]; K, V fp16 [1, S, Hk, D] (modified); pos int [1] on the
    device, 0 <= pos and pos + T <= L <= S (not checked: that would read the device).
    Returns fp16 [1, T, Hq*D]."""
    _, S, Hk, D = K.shape
    if V.shape != K.shape or K.dtype != torch.float16 or V.dtype != torch.float16:
        raise ValueError(f"decode attention: K/V caches must be fp16 [1, S, Hk, D]; got {K.dtype} "
                         f"{list(K.shape)} and {V.dtype} {list(V.shape)}")
    if not (K.is_contiguous() and V.is_contiguous()):
        raise ValueError("decode attention: K/V caches must be contiguous [1, S, Hk, D]")
    if q.dim() != 3 or q.shape[0] != 1 or q.shape[1] < 1:
        raise ValueError(f"decode attention: q must be [1, T, Hq*D] with T >= 1; got {list(q.shape)}")
    T = q.shape[1]
    Hq = q.shape[2] // D
    if q.shape[2] != Hq * D or Hq % Hk or Hq == 0 or k.shape != (1, T, Hk * D) or v.shape != k.shape:
        raise ValueError(f"decode attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}; "
                         f"expected q [1, T, Hq*D] with Hq a multiple of Hk={Hk}, and k, v [1, T, Hk*D] "
                         f"= [1, {T}, {Hk * D}] (D={D})")
    if not T <= L <= S:
        raise ValueError(f"decode attention: attended length L={L} outside {T}..{S} (the new rows..the cache length)")
    if D & (D - 1) or block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"decode attention: head dim {D} and block {block_n} must be powers of two, block >= 16")
    R = Hq // Hk
    if R * T > MAX_QUERY_ROWS:
        raise ValueError(f"decode attention: {T} rows x {R} query heads per KV head = {R * T} query rows "
                         f"per program, more than {MAX_QUERY_ROWS}")
    p = launch(L, T, Hq, Hk, D, block_n, chunk)
    NS = p["NS"]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty((1, T, Hq * D), dtype=torch.float16, device=q.device)
    if NS == 1:
        part, lse = o, o                                       # unused
    else:
        part = torch.empty((NS, T * Hq, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((NS, T * Hq), dtype=torch.float32, device=q.device)
    _decode_attn[(Hk, NS)](q, k, v, K, V, pos, o, part, lse, scale, **p["attn"])
    if NS > 1:
        _combine[(T * Hq,)](part, lse, pos, o, HQ=Hq, **p["combine"])
    return o
