"""Benchmark of the prefill's sort into the grouped kernels' blocks (runtime/experts/grouped.align), alone.

Three forms of the same sort (outputs equal bit for bit, checked here), on random picks of a prefill chunk:
- `programs`: grouped.align as the engine runs it, two launches over up to SORT_PROGRAMS programs;
- `one`: the same kernels on one program (most=1), the work of the sort's first form (one program walking
  every chunk of pairs in turn);
- `torch`: the torch ops it replaced (bench.check_experts.align_by_torch: scatter-add, stable argsort,
  cumulative sums, searchsorted).
Per form and row count: ms per call over a loop of calls (CUDA events; a form bound by its launches from the
host shows that cost too), and ms on the GPU alone (the loop captured in a CUDA graph, where it can be). A
prefill of 4096 tokens runs exllamav2's chunks of up to 2048 rows through each of the model's MoE layers
(48 for Qwen3-30B-A3B): a sort that costs 0.3 ms more per call costs about 30 ms per prompt. Needs CUDA.

    python -m bench.align_sort [--rows 512,2048,4096] [--experts 128] [--top-k 8] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Sequence

import torch

from bench.check_experts import align_by_torch
from bench.grouped import cuda_ms
from runtime.experts.grouped import SORT_PROGRAMS, align, align_programs


def _graph_ms(fn: Callable[[], object], reps: int) -> float | None:
    """The loop replayed from a CUDA graph: GPU time without the host's launches (None: not capturable)."""
    try:
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            g.capture_begin()
            try:
                for _ in range(reps):
                    fn()
            finally:
                g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        return min(cuda_ms(g.replay, 1) for _ in range(3)) / reps
    except RuntimeError:
        torch.cuda.synchronize()
        return None


def run(rows: Sequence[int], experts: int, top_k: int, reps: int = 50) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for T in rows:
        P = T * top_k
        bm = 64 if P >= 4096 else 16                  # Tuning.grouped's bm_large / bm_small threshold
        ids = torch.rand((T, experts), generator=g).topk(top_k, dim=-1).indices.to(torch.int32).reshape(P).cuda()
        forms = {"programs": lambda: align(ids, experts, bm), "one": lambda: align(ids, experts, bm, most=1),
                 "torch": lambda: align_by_torch(ids, experts, bm)}
        want = align_by_torch(ids, experts, bm)
        for name, fn in forms.items():
            got = fn()
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                raise SystemExit(f"{name} at {T} rows differs from the torch sort")
            fn()
            torch.cuda.synchronize()
            programs = None if name == "torch" else align_programs(P, 1 if name == "one" else SORT_PROGRAMS)[0]
            r = {"rows": T, "pairs": P, "form": name, "programs": programs, "ms_per_call": cuda_ms(fn, reps), "gpu_ms_per_call": _graph_ms(fn, reps)}
            out.append(r)
            gpu = "-" if r["gpu_ms_per_call"] is None else f"{r['gpu_ms_per_call']:.4f}"
            print(f"{T:5d} rows {P:6d} pairs  {name:8s}  {r['ms_per_call']:.4f} ms/call  gpu {gpu} ms", flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="512,2048,4096")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    rows = [int(t) for t in a.rows.split(",")]
    if not all(0 < t <= 1 << 16 for t in rows) or not 1 <= a.top_k <= a.experts <= 4096:
        print("rows 1..65536, 1 <= top-k <= experts <= 4096", file=sys.stderr)
        return 2
    res = run(rows, a.experts, a.top_k, max(1, min(a.reps, 1000)))
    if a.json:
        from bench.engine import git_commit
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "git_commit": git_commit(),
                       "device": torch.cuda.get_device_name(), "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
