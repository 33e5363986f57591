"""GPU check and timing of one attention layer's q/k/v/o: the split-K GEMV against exllamav2's GEMM.

The GEMV is `TritonExl2Linear` (runtime/backends/quant_linear.py, MOEDESK_DENSE_GEMV=1): q, k and v
fused in one call, o in another; exllamav2's GEMM runs the four projections one by one, as its
attention does. Random weights quantized at the given bits, the widths of a real model
(qwen3-30b-a3b by default: hidden 2048, 32 query heads and 4 KV heads of 128). Each is timed
inside a CUDA graph (after the launch shapes are chosen), and both must agree with x @ W.T of the
dequantized weights.

    python -m bench.check_dense_gemv --check [--bits 4,3,6] [--hidden 2048 --heads 32 --kv-heads 4 --head-dim 128]
        [--prologue]

--prologue adds attention's whole decode prologue (RMSNorm, q/k/v, RMS head norms, NEOX RoPE) three ways, each in
a CUDA graph: exllamav2's kernels one by one (its norm, three GEMMs, two head norms, RoPE for q and k), the same
with the GEMV's q/k/v (the hooks of MOEDESK_DENSE_GEMV), and one launch (runtime/experts/qkv_prologue.py,
MOEDESK_QKV_FUSED), the last checked against the first (tests/test_qkv_prologue.py holds it to the steps in torch).
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.checks import check_main

ROWS = (1, 2, 4, 9)


def _linear(n: int, k: int, bits: float, seed: int) -> dict:
    from runtime.exl2 import format as fmt
    g = torch.Generator().manual_seed(seed)
    return fmt.quantize(torch.randn(n, k, generator=g) * 0.02, bits, 128, perm=torch.randperm(k, generator=g))


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def check(bits_list: list[float], hidden: int, heads: int, kv_heads: int, head_dim: int) -> bool:
    from triton.testing import do_bench_cudagraph
    from runtime.backends.quant_linear import CudaExl2Linear, TritonExl2Linear, settle_autotune
    from runtime.exl2 import format as fmt
    from runtime.experts import kernels
    dev = torch.device("cuda")
    nq, nkv = heads * head_dim, kv_heads * head_dim
    ok = True
    print(f"one layer's q/k/v/o, hidden {hidden}, q {nq}, k/v {nkv}, o {nq}->{hidden}; {torch.cuda.get_device_name()}")
    for bits in bits_list:
        q, k, v = (_linear(n, hidden, bits, s) for n, s in ((nq, 1), (nkv, 2), (nkv, 3)))
        o = _linear(hidden, nq, bits, 4)
        w_qkv = torch.cat([fmt.dequantize(t) for t in (q, k, v)]).to(dev).float()
        w_o = fmt.dequantize(o).to(dev).float()
        gemv_qkv = TritonExl2Linear([q, k, v], [nq, nkv, nkv], ["q", "k", "v"], dev, fallback=None)
        gemv_o = TritonExl2Linear([o], [hidden], ["o"], dev, fallback=None)
        ex = [CudaExl2Linear([t], [n], [name], dev) for t, n, name in ((q, nq, "q"), (k, nkv, "k"), (v, nkv, "v"),
                                                                         (o, hidden, "o"))]
        settle_autotune(ex + [gemv_qkv, gemv_o])
        read = sum(p.nbytes() for lin in (gemv_qkv, gemv_o) for p in lin.packs)
        for T in ROWS:
            x = torch.randn((T, hidden), device=dev).half()
            h = torch.randn((T, nq), device=dev).half()
            want_qkv, want_o = x.float() @ w_qkv.T, h.float() @ w_o.T
            e_gemv = max(_err(gemv_qkv(x), want_qkv), _err(gemv_o(h), want_o))
            e_ex = max(_err(torch.cat([lin(x) for lin in ex[:3]], 1), want_qkv), _err(ex[3](h), want_o))
            good = e_gemv < 2e-3 and e_gemv <= 2 * e_ex + 1e-4
            ok &= good

            def run_gemv():
                gemv_qkv(x)
                gemv_o(h)

            def run_ex():
                for lin in ex[:3]:
                    lin(x)
                ex[3](h)
            t_gemv = do_bench_cudagraph(run_gemv) * 1e3
            t_ex = do_bench_cudagraph(run_ex) * 1e3
            mine = {(p.out_features, p.bits) for lin in (gemv_qkv, gemv_o) for p in lin.packs}
            shapes = ", ".join(f"{key[3]}:{c.bn}x{c.ksplit}{'' if c.dot or T == 1 else ' rows'}"
                               for key, c in kernels._CHOSEN.items() if key[4] == T and (key[2], key[5]) in mine)
            print(f"bits {bits} T {T}: rel err gemv {e_gemv:.1e} exllamav2 {e_ex:.1e} {'ok' if good else 'FAIL'} | "
                  f"gemv {t_gemv:6.2f} us ({read / t_gemv / 1e6:.2f} TB/s) | exllamav2 {t_ex:6.2f} us "
                  f"| x{t_ex / t_gemv:.2f} | shapes {shapes}")
    return ok


def prologue(bits: float, hidden: int, heads: int, kv_heads: int, D: int) -> bool:
    """Attention's decode prologue three ways (module docstring), timed in CUDA graphs at ROWS rows."""
    from triton.testing import do_bench_cudagraph
    from exllamav2.ext import exllamav2_ext as ext, none_tensor
    from runtime.backends.quant_linear import CudaExl2Linear, TritonExl2Linear, settle_autotune
    from runtime.experts.qkv_prologue import qkv_prologue
    dev = torch.device("cuda")
    nq, nkv = heads * D, kv_heads * D
    parts = [_linear(n, hidden, bits, s) for n, s in ((nq, 1), (nkv, 2), (nkv, 3))]
    gemv = TritonExl2Linear(parts, [nq, nkv, nkv], ["q", "k", "v"], dev, fallback=None)
    ex = [CudaExl2Linear([t], [n], [name], dev) for t, n, name in zip(parts, (nq, nkv, nkv), "qkv")]
    assert all(lin.widths == [n] for lin, n in zip(ex, (nq, nkv, nkv))), "exllamav2's GEMMs store unpadded"
    settle_autotune(ex + [gemv])
    g = torch.Generator(device=dev).manual_seed(0)
    norm_w = (torch.rand(hidden, generator=g, device=dev) + 0.5).half()
    hw = tuple((torch.rand(D, generator=g, device=dev) + 0.5).half() for _ in range(2))
    freqs = torch.outer(torch.arange(8192.0), 1e6 ** -(torch.arange(0, D, 2).float() / D))
    emb = torch.cat([freqs, freqs], -1).to(dev)                            # exllamav2's NEOX tables
    sin, cos = emb.sin().half()[None, None], emb.cos().half()[None, None]
    pos = torch.tensor([4000], dtype=torch.int32, device=dev)
    read = sum(p.nbytes() for p in gemv.packs)
    ok = True
    for T in ROWS:
        x = torch.randn((T, hidden), generator=g, device=dev).half()
        xn = torch.empty_like(x)
        q, k, v = (torch.empty((T, n), dtype=torch.float16, device=dev) for n in (nq, nkv, nkv))

        def tail():                               # head norms and RoPE, exllamav2's kernels
            for t, w, h in ((q, hw[0], heads), (k, hw[1], kv_heads)):
                ext.head_norm(t.view(1, T, h, D), w, none_tensor, t.view(1, T, h, D), 1e-6, True)
            ext.rope_(q.view(1, T, -1), sin, cos, -1, heads, D, pos, True)      # one batch: its position pos[0]
            ext.rope_(k.view(1, T, -1), sin, cos, -1, kv_heads, D, pos, True)

        def run_ex():
            ext.rms_norm(x, norm_w, xn, 1e-6)
            for lin, out in zip(ex, (q, k, v)):
                ext.gemm_half_q_half(xn, lin.handles[0], out, False)
            tail()

        def run_hooks():
            ext.rms_norm(x, norm_w, xn, 1e-6)
            gemv.into(xn, [q, k, v])
            tail()

        def run_fused():
            qkv_prologue(x, norm_w, 1e-6, gemv.packs, (heads, kv_heads, D), q, k, v, hw, (1e-6, 1e-6), (sin, cos, pos))
        run_ex()
        want = [t.float() for t in (q, k, v)]
        run_fused()
        err = max(_err(t, w) for t, w in zip((q, k, v), want))
        good = err < 3e-3                         # exllamav2 rotates in fp16, the one launch in fp32
        ok &= good
        times = [do_bench_cudagraph(f) * 1e3 for f in (run_ex, run_hooks, run_fused)]
        print(f"prologue bits {bits} T {T}: rel err one launch {err:.1e} {'ok' if good else 'FAIL'} | exllamav2 "
              f"{times[0]:6.2f} us | GEMV hooks {times[1]:6.2f} us | one launch {times[2]:6.2f} us "
              f"({read / times[2] / 1e6:.2f} TB/s) | x{times[0] / times[2]:.2f} exllamav2's")
    return ok


def main(argv: list[str] | None = None) -> int:
    def add(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--check", action="store_true", help="compare both with the dequantized weights and time them")
        ap.add_argument("--bits", default="4", help="comma-separated bits per weight (e.g. 4,3,6,4.5)")
        ap.add_argument("--hidden", type=int, default=2048)
        ap.add_argument("--heads", type=int, default=32)
        ap.add_argument("--kv-heads", type=int, default=4)
        ap.add_argument("--head-dim", type=int, default=128)
        ap.add_argument("--prologue", action="store_true", help="also attention's whole prologue three ways")

    parsed = argparse.ArgumentParser(add_help=False)
    add(parsed)
    known, _ = parsed.parse_known_args(argv)
    bits_list = [float(b) if "." in b else int(b) for b in known.bits.split(",")]
    return check_main(argv, "python -m bench.check_dense_gemv", __doc__.split("\n")[0], add,
                      lambda _: all([check(bits_list, known.hidden, known.heads, known.kv_heads, known.head_dim)]
                                    + [prologue(b, known.hidden, known.heads, known.kv_heads, known.head_dim)
                                       for b in (bits_list if known.prologue else [])]),
                      "the CPU tests run the kernel under TRITON_INTERPRET=1 (tests/test_dense_gemv.py)")


if __name__ == "__main__":
    sys.exit(main())
