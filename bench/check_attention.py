"""GPU check of the decode/verify attention kernel against the bmm path, both timed in a CUDA graph.

The kernel is runtime/backends/attention.py; the bmm path is what the decode graphs ran before it (two
index_copy_ and two batched matmuls over a mask), kept here as the reference.

    python -m bench.check_attention --check
"""
from __future__ import annotations

import sys

import torch
import triton

from bench.checks import check_main
from runtime.backends.attention import chunk_rows, decode_attention


def _attn_bmm(q, K, V, L, mask, Hq, Hk, D, scale):
    """Two batched matmuls over the KV heads; q [1, T, Hq*D], mask: fp32 additive [T, L]."""
    T, R = q.shape[1], Hq // Hk
    Kl = K[0, :L].permute(1, 2, 0)                                 # [Hk, D, L] (a view)
    Vl = V[0, :L].permute(1, 0, 2)                                 # [Hk, L, D]
    qh = q.view(T, Hk, R, D).transpose(0, 1).reshape(Hk, T * R, D)    # rows (t, r)
    s = torch.bmm(qh, Kl).float().view(Hk, T, R, L)                # [Hk, T, R, L]
    p = torch.softmax(s * scale + mask.view(1, T, 1, L), dim=-1).half().view(Hk, T * R, L)
    o = torch.bmm(p, Vl)                                           # [Hk, T*R, D]
    return o.view(Hk, T, R, D).transpose(0, 1).reshape(1, T, Hq * D)


def _bmm_path(q, k, v, K, V, pos64, mask, L, Hq, Hk, D, scale):
    """The bmm path: two index_copy_ and the bmm attention over a precomputed mask; pos64 [T] the rows'
    positions, mask fp32 [T, L]."""
    T = q.shape[1]
    K.index_copy_(1, pos64, k.view(1, T, Hk, D))
    V.index_copy_(1, pos64, v.view(1, T, Hk, D))
    return _attn_bmm(q, K, V, L, mask, Hq, Hk, D, scale)


def check(S: int = 4096) -> bool:
    from triton.testing import do_bench_cudagraph
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    ok = True
    print(f"decode/verify attention vs bmm path (GPU time per call inside a CUDA graph), {torch.cuda.get_device_name()}")
    for Hq, Hk, D in [(32, 4, 128), (64, 4, 128)]:
        scale = D ** -0.5
        K = torch.randn((1, S, Hk, D), generator=g, device=dev).half()
        V = torch.randn((1, S, Hk, D), generator=g, device=dev).half()
        for p, L, T in [(100, 512, 1), (511, 512, 1), (4000, 4096, 1), (508, 1024, 5), (4000, 4096, 5)]:
            q, k, v = (torch.randn((1, T, n * D), generator=g, device=dev).half() for n in (Hq, Hk, Hk))
            pos32 = torch.tensor([p], dtype=torch.int32, device=dev)
            pos64 = p + torch.arange(T, device=dev)
            mask = torch.where(torch.arange(L, device=dev)[None, :] <= pos64[:, None], 0.0, float("-inf"))
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
            print(f"Hq {Hq:2d} Hk {Hk} D {D} T {T} pos {p:4d} L {L:4d}: rel err {err:.1e} cache "
                  f"{'same' if same_cache else 'DIFFERS'} {'ok' if good else 'FAIL'} | kernel {t_kern:5.2f} us "
                  f"({ns} splits), 1 split {t_one:5.2f} us | bmm+index_copy {t_bmm:5.2f} us")
    return ok


def main(argv: list[str] | None = None) -> int:
    return check_main(argv, "python -m bench.check_attention", __doc__.split("\n")[0],
                      lambda ap: ap.add_argument("--check", action="store_true",
                                                 help="compare with the bmm path on the GPU and time both"),
                      lambda _: check(), "the CPU tests run the kernel under TRITON_INTERPRET=1")


if __name__ == "__main__":
    sys.exit(main())
