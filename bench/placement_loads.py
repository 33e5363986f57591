"""Is the "auto" expert-path decision stable? Loads of one model at one budget under forced uniform
routing, each deciding the CPU path from measured decode steps (runtime/offload/path_judge.py), then
decoding. GPU only.

    python -m bench.placement_loads --model DIR --vram-budget 24 --loads 5 [--measure-each-load] [--deadline-s 360]

Each load: the model's own routing decides at load (as the worker's load does); then uniform routing
is forced, the experts are placed again from uniform statistics (bench.offload.place_for_uniform_routing:
every load places alike) and the path is decided for that routing: timed on both paths where no decision
for it is saved; the first load of a run times both paths (keeping a saved path unless the other is
clearly faster), later loads reuse its decision untimed, as a later load of the app reuses the first
one's (--measure-each-load times both at every load). Then `--decode` one-row steps
after a `--prompt`-token prefill and `--warm` untimed steps, each step timed.

On the H200 with q125-a11 at 24 GB two loads decoded 28.9 and 32.7 tokens/s (12% apart) on the same
path: each placed by other statistics (the previous load's uniform traffic, saved at its close), so
their hit rates differed (46%, 52%), and 64 steps were timed. A load takes ~50-60 s there, most of it
reading 47 GB of weights; the decisions' timing (two paths, up to three rounds, and the CPU copies)
now runs once per run instead of three times per load.

One JSON in --out, written again after each load: each load's decisions (at load, under uniform
routing, and after the decode: the judge's check of the live steps against its timing), its stages'
wall time, its decode tokens/s (steps timed / their sum) and by the median step, its hit rate; and
the spread of both over the loads (`decode_spread`, `decode_spread_median`: max / min - 1).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence


def timed_decode(engine, prompt: int, warm: int, n: int, seed: int = 5) -> list[float]:
    """Prefill `prompt` random tokens, prepare the decode graphs the steps will reach (as the worker
    does before an answer), then `warm` untimed and `n` timed one-row decode steps, each fed a token
    of a fixed random stream and ending with its argmax read on the host (as sampling does): the wall
    time of each timed step, in seconds."""
    from bench.offload import _prompt
    if n < 1 or warm < 0 or prompt < 1:
        raise ValueError(f"decode {n} steps after {warm} untimed ones and a {prompt}-token prompt: "
                         "want at least 1 step, 0 untimed, 1 prompt token")
    engine.reset()
    engine.prefill(_prompt(engine, prompt, 1))
    prepare = getattr(engine, "prepare_decode", None)
    if prepare is not None:               # the graphs of every bucket the steps reach: no capture inside one
        prepare(warm + n + 1)
    stream = _prompt(engine, warm + n, seed)
    out: list[float] = []
    for i, tok in enumerate(stream):
        t0 = time.perf_counter()
        int(engine.forward([tok])[-1].argmax())
        if i >= warm:
            out.append(time.perf_counter() - t0)
    return out


def decode_rates(steps: Sequence[float]) -> tuple[float, float]:
    """(tokens/s over all the steps, tokens/s of the median step)."""
    if not steps:
        raise ValueError("no decode steps were timed")
    return len(steps) / sum(steps), 1.0 / statistics.median(steps)


def spread(values: Sequence[float]) -> Optional[float]:
    """max / min - 1 of positive figures (None for none)."""
    values = list(values)
    if not values:
        return None
    if min(values) <= 0:
        raise ValueError(f"decode rates {values}: all must be positive")
    return max(values) / min(values) - 1.0


def another_load_fits(elapsed_s: float, load_s: Sequence[float], deadline_s: float) -> bool:
    """Whether a load started now ends by the deadline (0: none), judged by the last load's wall time
    (later loads reuse the first one's decision and are the shorter ones)."""
    if not deadline_s:
        return True
    return elapsed_s + (load_s[-1] if load_s else 0.0) <= deadline_s


def saved_gpu_only(engine) -> str:
    """The reason of a GPU-only decision saved for the engine's model, budget and forced routing
    ("" when none is saved, or it is the CPU path)."""
    from runtime.offload.path_judge import decisions_file
    from runtime.backends.expert_path import decision_key
    from runtime.offload.path_judge import read_decision
    prior = read_decision(decisions_file(), decision_key(engine))
    if prior is None or prior.get("path") != "stream":
        return ""
    return f"as measured on an earlier load ({prior.get('reason', '')})"


def summary(loads: list[dict]) -> dict:
    paths = [x["decision"]["path"] for x in loads]
    tps = [x["decode_tps"] for x in loads]
    med = [x["decode_tps_median_step"] for x in loads]
    return {"paths": paths, "same_path": len(set(paths)) <= 1, "decode_spread": spread(tps),
            "decode_spread_median": spread(med), "decode_tps": sorted(tps)[len(tps) // 2] if tps else None}


def one_load(model: str, budget: float, context: int, prompt: int, warm: int, decode: int, measure: bool,
             trials: int) -> dict:
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
        if engine.offload is None:
            raise SystemExit(f"{model} at {budget:g} GB: experts were not offloaded")
        engine.offload.save_stats()            # the load's statistics (a routing prior) for the next load
        t1 = time.perf_counter()
        bo.force_uniform_routing(engine)
        if not measure:                        # a saved GPU-only decision: no CPU copies to drop again
            engine.offload.cpu.saved_off = saved_gpu_only(engine)
        bo.place_for_uniform_routing(engine, budget)
        engine.recheck_placement(measure=measure)             # saved under the forced routing's own key
        decide_s = time.perf_counter() - t1
        decision = engine.path_judge.telemetry()
        c0 = bo._counts(engine)
        steps = timed_decode(engine, prompt, warm, decode)
        d = bo._delta(c0, bo._counts(engine))
        tps, tps_median = decode_rates(steps)
        checked = engine.path_judge.telemetry()               # after the live steps: the judge's check
        again = []
        for _ in range(trials):                                # the same load deciding again, both timed
            engine.recheck_placement(measure=True)
            again.append(engine.path_judge.telemetry())
        cpu = [lo.cpu for lo in engine.offload.layers if lo.cpu is not None]
        return {"load_s": load_s, "load_stages": stages, "kernels_compiled_in_load": compiled,
                "decision_at_load_model_routing": at_load, "decision": decision, "decide_s": decide_s,
                "decision_after_decode": checked, "decode_tps": tps, "decode_tps_median_step": tps_median,
                "decode_steps": len(steps), "hit_rate": d["hits"] / max(1, d["pairs"]),
                "cpu_threads": cpu[0].ctx.threads if cpu else None, "cpu_cut": engine.offload.cpu.cut,
                "residents": [len(lo.expert_slot) for lo in engine.offload.layers],
                "lent_experts": sum(len(lo.lent) for lo in engine.offload.layers),
                "applied_placement": applied.get("offload.placement"), "redecisions": again,
                "wall_s": time.perf_counter() - t0}
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
    ap.add_argument("--measure-each-load", action="store_true",
                    help="time both paths at every load (default: the first load's decision is reused)")
    ap.add_argument("--trials", type=int, default=0, help="re-decisions on each load, both paths timed")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--warm", type=int, default=48,
                    help="untimed decode steps before the timed ones (the CPU path's cut settles meanwhile)")
    ap.add_argument("--decode", type=int, default=128, help="timed decode steps per load")
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="start no load that the last one's wall time says would end after this (0: none)")
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
        result = {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
            "machine": machine(), "device": torch.cuda.get_device_name(0), "model": label, "bpw": a.bpw,
            "vram_budget_gb": a.vram_budget, "context": a.context, "prompt_tokens": a.prompt, "prefill_tps": None,
            "ttft_s": None, "roofline_tps": None, "draft": None, "baseline": None,
            "decode_steps": a.decode, "warm_steps": a.warm, "measure_each_load": a.measure_each_load,
            "notes": ("Routing forced uniform and the experts placed from uniform statistics at each load; the "
                      "expert path decided from measured decode steps "
                      + ("at every load" if a.measure_each_load else "at the first load, reused by the later ones")
                      + "; loads one after another in one process."),
            "loads": loads, **summary(loads), "wall_s": time.perf_counter() - t0,
        }
        path.write_text(json.dumps(result, indent=1, default=str))

    for i in range(a.loads):
        if not another_load_fits(time.perf_counter() - t0, [x["wall_s"] for x in loads], a.deadline_s):
            print(f"load {i + 1}: not started, it would end after the {a.deadline_s:g} s deadline", flush=True)
            break
        loads.append(one_load(a.model, a.vram_budget, a.context, a.prompt, a.warm, a.decode,
                              a.measure_each_load or i == 0, a.trials))
        x = loads[-1]
        print(f"load {i + 1}: {x['decision']['summary']}; decode {x['decode_tps']:.1f} tok/s "
              f"(median step {x['decode_tps_median_step']:.1f}), hit rate {x['hit_rate']:.1%} "
              f"(load {x['load_s']:.0f} s, decision {x['decide_s']:.0f} s, all {x['wall_s']:.0f} s)"
              + (f"; again: {[r['path'] for r in x['redecisions']]}" if x["redecisions"] else ""), flush=True)
        write()
    s = summary(loads)
    if loads:
        print(f"paths {s['paths']} (same: {s['same_path']}); decode spread {s['decode_spread']:.1%} "
              f"(median step: {s['decode_spread_median']:.1%}); {time.perf_counter() - t0:.0f} s")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
