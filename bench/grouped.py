"""Benchmark of the grouped (prefill) expert kernels over launch shapes, on one MoE layer of a real shape.

A prompt's rows through one layer's routed experts (uniform random routing, as a long prompt spreads over
all experts), timed for each launch shape `runtime.tuning.Grouped` (rows per block, columns per block, K tile,
warps, stages) and checked against the first shape's output. Speed depends on shapes and bytes, not on
the values: the layer holds a few synthetic EXL2 experts (runtime/exl2/synth.py) repeated to the shape's
expert count. Needs a CUDA device.

    python -m bench.grouped [--shape q125-a11] [--rows 2048] [--bits 3.0]
        [--configs 16,64,64,64,4,0 16,128,128,64,8,0 ...] [--json OUT]

Per shape: ms per layer, TFLOP/s (6 * H * I flops per (row, expert) pair), GB/s of expert weights (the codes
and scales of the experts the rows picked, each counted once: at a few rows, where the split-K GEMVs run, read
once per (row, expert) pair, the rate to hold against the HBM's), relative difference to the first shape.
`--rows 1` times the decode step's kernels (the launch shapes then do not apply: one line). The default shape
(MOEDESK_GROUPED unset) is always measured first.
`--orders` says how the kernels read their input (grouped.InputOrder), each timed over the shapes: "gathered"
through each projection's permutation per tile (as before the orders were used; the same layer as "layer"),
"layer" one order for every expert's gate and up (the Hub's EXL2 files), "expert" one per expert (our
converter's); down's permutation is the identity, as a load packs it. "gathered" and "layer" compute the same
sums: their difference is 0.

    python -m bench.grouped --shape mixtral-8x22b --orders gathered layer --configs 16,64,64,64,4,0
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence

import torch

from runtime.exl2.shapes import SHAPES
from runtime.exl2.synth import _random_linear
from runtime import tuning
from runtime.experts.decode import GEMV_MAX_PAIRS
from runtime.experts.grouped import InputOrder, input_order
from runtime.experts.layer import experts_forward
from runtime.experts.pack import PackedExperts, pack_experts

SWEEP = ["16,64,64,64,4,0", "16,64,64,128,4,0", "16,64,128,64,4,0", "16,64,128,64,8,0", "16,64,128,128,8,0",
         "16,128,64,64,4,0", "16,128,64,64,8,0", "16,128,128,64,8,0", "16,128,128,128,8,0",
         "16,128,128,64,8,3", "16,64,128,64,8,3", "16,64,64,64,4,3", "16,128,64,128,8,0", "16,64,128,128,4,0",
         "16,64,128,32,4,0", "16,32,128,64,4,0", "16,64,256,64,8,0", "32,64,128,64,4,0"]


def _repeat(p: PackedExperts, experts: int) -> PackedExperts:
    """The few packed experts of `p` repeated to `experts` (codes, scales, permutations)."""
    reps = -(-experts // p.num_experts)

    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:experts].contiguous()
    return dataclasses.replace(p, qweight=rep(p.qweight), scales=rep(p.scales), perm=rep(p.perm), woff=None)


def layer(shape: str, bits: float, templates: int = 4, seed: int = 0) -> tuple[PackedExperts, ...]:
    s = SHAPES[shape]
    if not s.is_moe:
        raise ValueError(f"shape {shape!r} is not an MoE shape")
    gen = torch.Generator().manual_seed(seed)
    h, i = s.hidden, s.expert_intermediate
    packs = []
    for name, (out, inp) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        few = pack_experts([_random_linear(out, inp, bits, gen) for _ in range(templates)], name, "cuda")
        packs.append(_repeat(few, s.experts))
    return tuple(packs)


ORDERS = ("gathered", "layer", "expert")


def with_order(w1: PackedExperts, w3: PackedExperts, w2: PackedExperts, order: str):
    """The layer's permutations made as `order` says (module docstring); returns (w1, w3, w2, InputOrder)."""
    if order not in ORDERS:
        raise ValueError(f"order: one of {', '.join(ORDERS)}, got {order!r}")
    perm = w1.perm[:1].expand_as(w1.perm).contiguous() if order != "expert" else w1.perm
    w1, w3 = dataclasses.replace(w1, perm=perm), dataclasses.replace(w3, perm=perm)
    ident = torch.arange(w2.in_features, dtype=w2.perm.dtype, device=w2.perm.device).expand_as(w2.perm)
    w2 = dataclasses.replace(w2, perm=ident.contiguous())
    # "gathered": the same layer as "layer", read the way the kernels read every layer before
    return w1, w3, w2, InputOrder() if order == "gathered" else input_order(w1, w3, w2)


def _expert_bytes(p: PackedExperts) -> int:
    """One expert's codes and scales of this projection, in bytes."""
    return p.words_per_expert * 4 + p.scales[0].numel() * p.scales.element_size()


def cuda_ms(fn, reps: int) -> float:
    """Milliseconds a call of fn, by CUDA events over reps calls after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def run(shape: str, rows: int, bits: float, configs: Sequence[str], reps: int = 10, say=print,
        orders: Sequence[str] = ("layer",)) -> list[dict]:
    if not torch.cuda.is_available():
        raise RuntimeError("the grouped kernels' benchmark needs a CUDA device")
    out: list[dict] = []
    base, refs = layer(shape, bits), {}
    for order in orders:
        say(f"# input order: {order}")
        out += _run(shape, rows, configs, reps, say, order, *with_order(*base, order), refs)
    return out


def _run(shape: str, rows: int, configs: Sequence[str], reps: int, say, order_name: str, w1, w3, w2, order,
         refs: dict) -> list[dict]:
    """One order over the shapes (split-K: the default alone); refs: the first output of each layer ("expert"
    has its own weights)."""
    s = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(rows, s.hidden, device="cuda", generator=gen) * 0.5).half()
    ids = torch.rand(rows, s.experts, device="cuda", generator=gen).topk(s.experts_per_token, dim=1).indices
    w = torch.full((rows, s.experts_per_token), 1.0 / s.experts_per_token, device="cuda")
    flops = rows * s.experts_per_token * 6 * s.hidden * s.expert_intermediate
    weight_bytes = ids.unique().numel() * sum(_expert_bytes(p) for p in (w1, w3, w2))
    before, out = tuning.current().grouped, []
    weights = "expert" if order_name == "expert" else "layer"
    ref = refs.get(weights)
    shapes = [dataclasses.astuple(before)] + [c for c in configs if tuning.Grouped.parse(c) != before]
    if rows * s.experts_per_token <= GEMV_MAX_PAIRS:
        shapes = shapes[:1]                            # the split-K GEMVs: no grouped launch shape applies
    for text in shapes:
        g = tuning.Grouped.parse(text if isinstance(text, str) else ",".join(map(str, text)))
        try:
            y = experts_forward(x, ids, w, w1, w3, w2, order=order, grouped=g)
            ms = cuda_ms(lambda: experts_forward(x, ids, w, w1, w3, w2, order=order, grouped=g), reps)
        except Exception as e:                         # a shape the compiler or the device refuses
            say(f"{g}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            out.append({"order": order_name, "config": dataclasses.asdict(g), "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        diff = 0.0 if ref is None else ((y - ref).abs().max() / ref.abs().max()).item()
        r = {"order": order_name, "config": dataclasses.asdict(g), "ms_per_layer": ms,
             "tflops": flops / ms / 1e9,
             "weights_gb_s": weight_bytes / ms / 1e6, "rel_diff": diff}
        if ref is None:
            ref = refs[weights] = y
        out.append(r)
        say(f"{','.join(map(str, dataclasses.astuple(g))):22s} {ms:8.3f} ms/layer  {r['tflops']:6.1f} TFLOP/s  "
            f"{r['weights_gb_s']:7.0f} GB/s of weights  diff {diff:.1e}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grouped", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="q125-a11")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--bits", type=float, default=3.0)
    p.add_argument("--configs", nargs="*", default=SWEEP, help="bm_small,bm_large,bn,bk,warps,stages each")
    p.add_argument("--orders", nargs="+", choices=ORDERS, default=["gathered", "layer"],
                   help="how the kernels read their input, each timed over the shapes (module docstring)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.shape not in SHAPES:
        p.error(f"unknown shape {a.shape!r}; choose from {sorted(SHAPES)}")
    for c in a.configs:
        try:
            tuning.Grouped.parse(c)
        except ValueError as e:
            p.error(str(e))
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    print(f"# {torch.cuda.get_device_name()}, {a.shape}, {a.rows} rows, {a.bits} bits", flush=True)
    res = run(a.shape, a.rows, a.bits, a.configs, a.reps, say=lambda s: print(s, flush=True), orders=a.orders)
    if a.json:
        with open(a.json, "w") as f:
            from bench.engine import git_commit
            json.dump({"git_commit": git_commit(), "shape": a.shape, "rows": a.rows, "bits": a.bits,
                       "device": torch.cuda.get_device_name(), "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
