"""Is the "auto" expert-path decision stable? Loads of one model at one budget, each deciding the CPU
path from measured decode steps (runtime/experts/path_judge.py) under forced uniform routing, then
decoding; plus re-decisions on the same load. GPU only.

    python -m bench.placement_loads --model DIR --vram-budget 24 --loads 5 [--trials 3] [--deadline-s 300]

One JSON in --out, written again after each load, with each load's decision (path, reason, measured
step times; `reused`: the decision saved by an earlier load of the model at this budget on this
machine), its stages' wall time (load_stages) and decode tokens/s, and the spread of the decode speeds.
Loads run in this one process (one after another, each closed first); the CPU kernel's rate is
measured once per process, PCIe's at every decision.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import sys
import time
from pathlib import Path


def one_load(model: str, budget: float, context: int, prompt: int, decode: int, trials: int) -> dict:
    from bench import offload as bo
    from runtime.backends import exl2
    from runtime.options import LoadOptions, OffloadOptions
    from runtime.worker import kernel_cache_entries, load_stages
    t0 = time.perf_counter()
    marks = [("load", "Starting the load", t0)]
    compiled = kernel_cache_entries()
    opts = LoadOptions(offload=OffloadOptions(context_length=context, vram_budget_gb=budget, placement="auto"))
    engine, applied = exl2.load(model, opts, lambda stage, msg, d, t: marks.append((stage, msg, time.perf_counter())))
    try:
        load_s = time.perf_counter() - t0
        stages = load_stages(marks, time.perf_counter())
        after = kernel_cache_entries()
        compiled = after - compiled if None not in (after, compiled) else None
        at_load = engine.path_judge.telemetry() if engine.path_judge else None
        bo.force_uniform_routing(engine)
        engine.recheck_placement()                             # under the routing measured below
        decision = engine.path_judge.telemetry()
        tps, d = bo.decode_after_prompt(engine, prompt, decode)
        again = []
        for _ in range(trials):                                # the same load deciding again, both timed
            engine.recheck_placement(measure=True)
            again.append(engine.path_judge.telemetry())
        return {"load_s": load_s, "load_stages": stages, "kernels_compiled_in_load": compiled,
                "decision_at_load_model_routing": at_load, "decision": decision,
                "decode_tps": tps, "hit_rate": d["hits"] / max(1, d["pairs"]),
                "applied_placement": applied.get("offload.placement"), "redecisions": again}
    finally:
        engine.close()
        gc.collect()


def main(argv=None) -> int:
    from bench.engine import git_commit, machine
    ap = argparse.ArgumentParser(prog="python -m bench.placement_loads", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--label", default=None)
    ap.add_argument("--bpw", type=float)
    ap.add_argument("--vram-budget", type=float, default=24.0)
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--trials", type=int, default=2, help="re-decisions on each load")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--deadline-s", type=float, default=0, help="start no load after this many seconds (0: none)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    import torch
    t0 = time.perf_counter()
    loads: list[dict] = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    label = a.label or Path(a.model).name
    path = out / f"placement-loads-{label}-{a.vram_budget:g}gb-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"

    def write() -> None:
        tps = [x["decode_tps"] for x in loads]
        paths = [x["decision"]["path"] for x in loads]
        result = {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
            "machine": machine(), "device": torch.cuda.get_device_name(0), "model": label, "bpw": a.bpw,
            "vram_budget_gb": a.vram_budget, "context": a.context, "prompt_tokens": a.prompt, "prefill_tps": None,
            "decode_tps": sorted(tps)[len(tps) // 2] if tps else None, "ttft_s": None, "roofline_tps": None,
            "draft": None, "baseline": None,
            "notes": ("Routing forced uniform; placement 'auto' decided from measured decode steps at each load "
                      "(and again on the same load); loads one after another in one process."),
            "loads": loads, "paths": paths, "same_path": len(set(paths)) <= 1,
            "decode_spread": (max(tps) / min(tps) - 1) if tps else None,
        }
        path.write_text(json.dumps(result, indent=1, default=str))

    for i in range(a.loads):
        if a.deadline_s and time.perf_counter() - t0 > a.deadline_s:
            break
        loads.append(one_load(a.model, a.vram_budget, a.context, a.prompt, a.decode, a.trials))
        x = loads[-1]
        print(f"load {i + 1}: {x['decision']['summary']}; decode {x['decode_tps']:.1f} tok/s "
              f"(load {x['load_s']:.0f} s); again: {[r['path'] for r in x['redecisions']]}", flush=True)
        write()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
