"""Diagnosis: does a docked OpenMP team elsewhere in the process slow the CPU expert kernel's calls?

libgomp (torch's OpenMP, which the CPU expert kernel shares) keeps a grown team's threads docked with
the thread that grew it until that thread exits; while more OpenMP threads are alive than the process
has CPUs, every team spins 100 times instead of 300,000 at its barriers before sleeping in the kernel
(runtime/cpu_load.on_cores says why the engine's load runs its work on a helper thread). A decode step
calls the kernel once per layer on a little work, so barrier wake-ups are a large part of each call.

Each case runs in a fresh process: the kernel (EXL2 CPU format, one row, top-k experts of `--shape`
from a pool of `--pool-mb`) timed for `--calls` calls with a team of `--threads`, after
- clean: nothing else grown;
- docked: `--docked` other threads each grew a team of `--threads` with a matrix product and stay
  alive (as the engine thread and the load's copy threads did before on_cores);
- on_cores: the same product run through cpu_load.on_cores (its team ends with its helper thread).
Wall time per call (median of three runs of `--calls`); a diagnosis in-process, not a user's figure.

    python -m bench.omp_teams [--threads N] [--docked 1] [--shape q125-a11] [--calls 300] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

CASES = ("clean", "docked", "on_cores")


def _child(case: str, threads: int, docked: int, shape: str, pool_mb: int, calls: int) -> dict:
    import torch
    from bench.cpu_experts import _pool, bench_store
    from runtime.exl2.shapes import SHAPES
    from runtime.cpu import experts as ce
    if (why := ce.kernel_unavailable_reason()):
        raise SystemExit(f"the CPU expert kernel is unavailable: {why}")
    torch.set_num_threads(threads)
    store, _ = _pool(shape, "exl2", 3.0, pool_mb << 20, templates=2, seed=0)
    hold = threading.Event()
    a = torch.randn(1024, 1024)

    def grow() -> None:
        torch.set_num_threads(threads)
        (a @ a).sum()
        hold.wait()
    growers = [threading.Thread(target=grow, daemon=True) for _ in range(docked if case == "docked" else 0)]
    for t in growers:
        t.start()
    if case == "on_cores":
        from runtime.cpu_load import on_cores
        on_cores(threads, lambda: (a @ a).sum())
    time.sleep(0.5)
    runs = [statistics.median(bench_store(store, 1, SHAPES[shape].experts_per_token, calls)[0]) * 1e3
            for _ in range(3)]
    threads_now = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
    hold.set()
    for t in growers:                   # ended before the interpreter is: a team torn down at exit aborts
        t.join()
    return {"case": case, "ms_per_call": statistics.median(runs), "runs_ms": runs,
            "process_threads": threads_now}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=0, help="the kernel's team (default: the physical cores less 2, "
                                                           "as the CPU path's automatic count)")
    p.add_argument("--docked", type=int, default=1, help="other threads whose teams stay docked (case 'docked')")
    p.add_argument("--shape", default="q125-a11")
    p.add_argument("--pool-mb", type=int, default=64)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads <= 0:
        from runtime.cpu_load import physical_cores
        args.threads = max(1, physical_cores() - 2)
    if args.child:
        print(json.dumps(_child(args.child, args.threads, args.docked, args.shape, args.pool_mb, args.calls)))
        return 0
    rows = []
    for case in CASES:
        cmd = [sys.executable, "-m", "bench.omp_teams", "--child", case, "--threads", str(args.threads),
               "--docked", str(args.docked), "--shape", args.shape, "--pool-mb", str(args.pool_mb),
               "--calls", str(args.calls)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            print(f"omp_teams: case {case} failed: {run.stderr.strip()[-800:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{case:9s} {r['ms_per_call']:7.3f} ms a call (runs {', '.join(f'{x:.3f}' for x in r['runs_ms'])}), "
              f"{r['process_threads']} threads in the process", flush=True)
    clean = rows[0]["ms_per_call"]
    for r in rows[1:]:
        print(f"{r['case']} / clean: x{r['ms_per_call'] / clean:.3f}")
    if args.json:
        from bench.engine import git_commit, machine
        args.json.write_text(json.dumps({"git_commit": git_commit(), "machine": machine(), "threads": args.threads,
                                         "docked": args.docked, "shape": args.shape, "calls": args.calls,
                                         "cases": rows, "notes": __doc__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
