"""Decode attention for one token (batch 1, FP16 cache) in Triton: cache write + attention, graph-safe.

Letters: S cache length, L attended length (the bucket), Hq query heads, Hk KV heads,
R = Hq // Hk query heads per KV head (RP: R padded to a power of two >= 16 for the dot), D head dim,
C rows per split (chunk), NS = ceil(L / C) splits, BN rows per block inside a split.

One program per (KV head, split): it reads its chunk of K/V once for all R query heads of that KV
head (flash-decoding, online softmax in fp32). The token's position `pos` (attends rows 0..pos) is
read from a device tensor, and the grid depends only on L, so a CUDA graph captured for a bucket
replays at every position in it: programs whose chunk starts after `pos` do nothing.
The new k/v row is written into the cache at `pos` by the program whose chunk holds it; every
program takes row `pos` from the new k/v (not from the cache), so no program reads a row another
one is writing. With one split the kernel writes the output itself (one launch); with more, a
small second kernel merges the splits by their log-sum-exp.

    python -m runtime.backends.attention --check      # GPU: compare with the bmm path, time both
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

TARGET_PROGRAMS = 264        # programs to aim for (about 2 per multiprocessor of an H200)


@triton.jit
def _decode_attn(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, o_ptr, part_ptr, lse_ptr, scale,
                 HK: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, D: tl.constexpr,
                 C: tl.constexpr, BN: tl.constexpr, DIRECT: tl.constexpr):
    h = tl.program_id(0)
    s = tl.program_id(1)
    pos = tl.load(pos_ptr).to(tl.int32)
    start = s * C
    if start <= pos:
        offs_r = tl.arange(0, RP)
        offs_d = tl.arange(0, D)
        mask_r = offs_r < R
        heads = h * R + offs_r                                                  # [RP] query heads
        q = tl.load(q_ptr + heads[:, None] * D + offs_d[None, :], mask=mask_r[:, None], other=0.0)
        k_new = tl.load(k_ptr + h * D + offs_d)                                 # [D]
        v_new = tl.load(v_ptr + h * D + offs_d)
        if pos < start + C:
            tl.store(kc_ptr + pos * (HK * D) + h * D + offs_d, k_new)
            tl.store(vc_ptr + pos * (HK * D) + h * D + offs_d, v_new)
        m = tl.full([RP], float("-inf"), dtype=tl.float32)
        l = tl.zeros([RP], dtype=tl.float32)
        acc = tl.zeros([RP, D], dtype=tl.float32)
        for i in range(0, C // BN):                  # a static trip count: blocks after pos are skipped
            n0 = start + i * BN
            if n0 <= pos:
                rows = n0 + tl.arange(0, BN)                                        # [BN]
                old = (rows < pos)[:, None]
                new = (rows == pos)[:, None]
                at = rows[:, None] * (HK * D) + h * D + offs_d[None, :]             # [BN, D]
                kb = tl.where(new, k_new[None, :], tl.load(kc_ptr + at, mask=old, other=0.0))
                sc = tl.dot(q, tl.trans(kb)) * scale                                # [RP, BN] fp32
                sc = tl.where((rows <= pos)[None, :], sc, float("-inf"))
                m_new = tl.maximum(m, tl.max(sc, axis=1))
                p = tl.exp(sc - m_new[:, None])
                alpha = tl.exp(m - m_new)
                l = l * alpha + tl.sum(p, axis=1)
                vb = tl.where(new, v_new[None, :], tl.load(vc_ptr + at, mask=old, other=0.0))
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), vb)           # [RP, D]
                m = m_new
        out = acc / l[:, None]
        if DIRECT:
            tl.store(o_ptr + heads[:, None] * D + offs_d[None, :], out.to(tl.float16), mask=mask_r[:, None])
        else:
            row = s * (HK * R) + heads                                          # [RP] in [NS, Hq]
            tl.store(part_ptr + row[:, None] * D + offs_d[None, :], out, mask=mask_r[:, None])
            tl.store(lse_ptr + row, m + tl.log(l), mask=mask_r)


@triton.jit
def _combine(part_ptr, lse_ptr, pos_ptr, o_ptr, HQ, D: tl.constexpr, C: tl.constexpr,
             NSP: tl.constexpr):
    """o[j] = sum_s w_s part[s, j] / sum_s w_s, w_s = exp(lse[s, j] - max); splits after pos skipped."""
    j = tl.program_id(0)
    pos = tl.load(pos_ptr).to(tl.int32)
    offs_s = tl.arange(0, NSP)
    offs_d = tl.arange(0, D)
    valid = offs_s <= pos // C
    lse = tl.load(lse_ptr + offs_s * HQ + j, mask=valid, other=float("-inf"))   # [NSP]
    w = tl.where(valid, tl.exp(lse - tl.max(lse, axis=0)), 0.0)
    part = tl.load(part_ptr + (offs_s[:, None] * HQ + j) * D + offs_d[None, :], mask=valid[:, None],
                   other=0.0)                                                   # [NSP, D]
    o = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(o_ptr + j * D + offs_d, o.to(tl.float16))


def chunk_rows(L: int, Hk: int, block_n: int) -> int:
    """Rows per split: the smallest power-of-two multiple of block_n keeping Hk * NS near TARGET_PROGRAMS."""
    c = block_n
    while Hk * triton.cdiv(L, c) > TARGET_PROGRAMS:
        c *= 2
    return c


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                     pos: torch.Tensor, L: int, scale: float, block_n: int = 64,
                     chunk: int | None = None) -> torch.Tensor:
    """Write k/v into the cache at row pos, then attend q over rows 0..pos; 1 or 2 launches.

    q fp16 [1, 1, Hq*D]; k, v fp16 [1, 1, Hk*D]; K, V fp16 [1, S, Hk, D] (modified); pos int [1] on the
    device, 0 <= pos < L <= S (not checked: that would read the device). Returns fp16 [1, 1, Hq*D]."""
    _, S, Hk, D = K.shape
    Hq = q.numel() // D
    if V.shape != K.shape or K.dtype != torch.float16 or V.dtype != torch.float16:
        raise ValueError(f"decode attention: K/V caches must be fp16 [1, S, Hk, D]; got {K.dtype} "
                         f"{list(K.shape)} and {V.dtype} {list(V.shape)}")
    if not (K.is_contiguous() and V.is_contiguous()):
        raise ValueError("decode attention: K/V caches must be contiguous [1, S, Hk, D]")
    if q.numel() != Hq * D or Hq % Hk or k.numel() != Hk * D or v.numel() != Hk * D:
        raise ValueError(f"decode attention: q has {q.numel()} values, k {k.numel()}, v {v.numel()}; "
                         f"expected Hq*D with Hq a multiple of Hk={Hk}, and Hk*D={Hk * D} (D={D})")
    if not 0 < L <= S:
        raise ValueError(f"decode attention: attended length L={L} outside 1..{S} (the cache length)")
    if D & (D - 1) or block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"decode attention: head dim {D} and block {block_n} must be powers of two, block >= 16")
    R = Hq // Hk
    C = chunk or chunk_rows(L, Hk, block_n)
    if C % block_n:
        raise ValueError(f"decode attention: chunk {C} is not a multiple of the block {block_n}")
    NS = triton.cdiv(L, C)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty((1, 1, Hq * D), dtype=torch.float16, device=q.device)
    if NS == 1:
        part, lse = o, o                                       # unused
    else:
        part = torch.empty((NS, Hq, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((NS, Hq), dtype=torch.float32, device=q.device)
    _decode_attn[(Hk, NS)](q, k, v, K, V, pos, o, part, lse, scale, HK=Hk, R=R,
                           RP=max(16, triton.next_power_of_2(R)), D=D, C=C, BN=block_n,
                           DIRECT=NS == 1, num_warps=4)
    if NS > 1:
        _combine[(Hq,)](part, lse, pos, o, HQ=Hq, D=D, C=C, NSP=triton.next_power_of_2(NS), num_warps=4)
    return o


# -- GPU check ---------------------------------------------------------------------------------------

def _bmm_path(q, k, v, K, V, pos64, mask, L, Hq, Hk, D, scale):
    """What the graph ran before: two index_copy_ and the bmm attention over a precomputed mask."""
    from runtime.backends.exl2_graph import DecodeGraphs
    K.index_copy_(1, pos64, k.view(1, 1, Hk, D))
    V.index_copy_(1, pos64, v.view(1, 1, Hk, D))
    return DecodeGraphs._attn_bmm(q, K, V, L, mask, Hq, Hk, D, scale)


def check(S: int = 4096) -> bool:
    from triton.testing import do_bench_cudagraph
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    ok = True
    print(f"decode attention vs bmm path (GPU time per call inside a CUDA graph), {torch.cuda.get_device_name()}")
    for Hq, Hk, D in [(32, 4, 128), (64, 4, 128)]:
        scale = D ** -0.5
        K = torch.randn((1, S, Hk, D), generator=g, device=dev).half()
        V = torch.randn((1, S, Hk, D), generator=g, device=dev).half()
        q, k, v = (torch.randn((1, 1, n * D), generator=g, device=dev).half() for n in (Hq, Hk, Hk))
        for p, L in [(100, 512), (511, 512), (4000, 4096)]:
            pos32 = torch.tensor([p], dtype=torch.int32, device=dev)
            pos64 = pos32.long()
            mask = torch.where(torch.arange(L, device=dev) <= pos64, 0.0, float("-inf"))
            K1, V1, K2, V2 = K.clone(), V.clone(), K.clone(), V.clone()
            ref = _bmm_path(q, k, v, K1, V1, pos64, mask, L, Hq, Hk, D, scale).float()
            got = decode_attention(q, k, v, K2, V2, pos32, L, scale).float()
            err = ((got - ref).norm() / ref.norm()).item()
            same_cache = torch.equal(K1, K2) and torch.equal(V1, V2)
            good = err < 2e-3 and same_cache
            ok &= good
            t_kern = do_bench_cudagraph(lambda: decode_attention(q, k, v, K2, V2, pos32, L, scale)) * 1e3
            t_one = do_bench_cudagraph(lambda: decode_attention(q, k, v, K2, V2, pos32, L, scale, chunk=L)) * 1e3
            t_bmm = do_bench_cudagraph(lambda: _bmm_path(q, k, v, K1, V1, pos64, mask, L, Hq, Hk, D, scale)) * 1e3
            ns = triton.cdiv(L, chunk_rows(L, Hk, 64))
            print(f"Hq {Hq:2d} Hk {Hk} D {D} pos {p:4d} L {L:4d}: rel err {err:.1e} cache "
                  f"{'same' if same_cache else 'DIFFERS'} {'ok' if good else 'FAIL'} | kernel {t_kern:5.2f} us "
                  f"({ns} splits), 1 split {t_one:5.2f} us | bmm+index_copy {t_bmm:5.2f} us")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.backends.attention", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the bmm path on the GPU and time both")
    args = ap.parse_args(argv)
    if not args.check:
        ap.print_help()
        return 2
    if not torch.cuda.is_available():
        print("--check needs CUDA (the CPU tests run the kernel under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    return 0 if check() else 1


if __name__ == "__main__":
    sys.exit(main())
