"""Expert-offload benchmark: decode speed, time to first token and PCIe traffic per VRAM budget, against
the naive baseline in the same run. Either GPU engine: the exllamav2 engine, or Qwen3.5-MoE's own
(runtime/backends/hybrid.py).

    python -m bench.offload --model DIR --budgets 24,12,48 --context 8192 \
        --prompt 2048 --decode 128 [--naive-decode 32] [--no-naive] [--reload] [--calibrate 256] \
        [--label q125-a11] [--bpw 3.0] [--out bench/results]

The model loads once, at the first budget; the others are applied with `set_vram_budget` (the same
planner as at load, allocator cap moved) unless --reload. After each load, --calibrate N tokens of a
random stream are decoded and the placement is planned again from the routing statistics they left
(without it the first budget runs on uniform statistics and later ones on what earlier budgets
learned, so budgets are not comparable). Per budget (batch 1, greedy argmax on the GPU, every shape
warmed up first):
- time to first token for a --prompt prompt (prefill with double-buffered staging of cold experts);
- decode tokens/s over --decode tokens (graph-captured step; cold experts read in place over PCIe);
- expert hit rate and bytes per decoded token: expert codes over PCIe, weights from HBM;
- the roofline for that placement: HBM bytes / HBM bandwidth + PCIe bytes / host->device bandwidth,
  serial and perfectly overlapped (ceilings measured on the rig, and measured again in this run);
- how concentrated the routing is (share of picks taken by each layer's most-picked experts), and the
  roofline if routing were uniform over the experts (the resident share as the hit rate);
- the naive baseline on the same placement: layer loop, a host synchronisation per layer, every cold
  expert a step chose copied into VRAM on demand, nothing overlapped.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from bench.cuda import weight_bytes_per_token
from bench.engine import git_commit, machine
from bench.roofline import hbm_bandwidth, pinned_h2d_bandwidth, sync_time
from bench.verify import layer_loop
from runtime import tuning
from runtime.engine import offered, random_tokens
from runtime.offload import manager as expert_manager
from runtime.offload.cpu_share import CPU_BALANCE
from runtime.options import LoadOptions, OffloadOptions

GiB = 1024 ** 3
RIG = {"hbm_copy_gib_s": 4000.0, "pinned_h2d_gib_s": 51.4, "host_ram_read_gib_s": 57.6}   # H200 rig ceilings


def _counts(engine) -> dict[str, float]:
    """Expert traffic so far: pairs, hits, code bytes read from VRAM and over PCIe (all layers)."""
    m = engine.offload
    torch.cuda.synchronize()                             # the CPU path's counters are host memory
    hits = pairs = vram_b = pcie_b = cpu_pairs = cpu_b = cpu_ns = 0
    tl = {"wake": 0, "gpu": 0, "stall": 0}
    pf = [0, 0, 0, 0]                                    # prefetch: candidates, picked; copies, picked
    score = m.prefetch.score.tolist() if m.prefetch is not None else [[0] * 4] * len(m.layers)
    for lo, sc in zip(m.layers, score):
        pf = [a + b for a, b in zip(pf, sc)]
        pcie_b += (sc[2] - sc[3]) * lo.code_bytes       # copies not picked (those picked are misses below)
        h, n = lo.hit_counts()
        ns, _, c, _ = lo.cpu.counters() if lo.cpu is not None else (0, 0, 0, 0)   # c: misses the CPU computed
        hits, pairs, cpu_pairs, cpu_ns = hits + h, pairs + n, cpu_pairs + c, cpu_ns + ns
        vram_b += h * lo.code_bytes
        part = lo.cpu.cpu_part() if lo.cpu is not None else 1.0         # cut experts: the GPU reads the rest
        pcie_b += (n - h - c * part) * lo.code_bytes
        if lo.cpu is not None:
            cpu_b += c * lo.cpu.pick_bytes()
            for k, v in lo.cpu.timeline().items():
                tl[k] += v
    moved = m.counters.bytes
    return {"hits": hits, "pairs": pairs, "vram_code_bytes": vram_b, "zero_copy_bytes": pcie_b,
            "cpu_pairs": cpu_pairs, "cpu_bytes": cpu_b, "cpu_ns": cpu_ns,
            "cpu_wake_ns": tl["wake"], "cpu_gpu_ns": tl["gpu"], "cpu_stall_ns": tl["stall"],
            "staged": moved["staged"], "promoted": moved["promoted"], "naive": moved["naive"],
            "pf_candidates": pf[0], "pf_candidates_picked": pf[1], "pf_copies": pf[2], "pf_copies_picked": pf[3]}


def _delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def _prompt(engine, n: int, seed: int) -> list[int]:
    return random_tokens(engine, n, torch.Generator().manual_seed(seed))


def ttft(engine, ids: list[int]) -> tuple[float, int]:
    engine.reset()
    box = {}
    dt = sync_time(lambda: box.update(tok=int(offered(engine, engine.prefill(ids))[-1].argmax())))
    return dt, box["tok"]


def decode(engine, tok: int, n: int, seed: int = 5) -> tuple[float, int]:
    """n decode steps, each ending in the argmax read on the host as sampling would. The tokens fed are
    a fixed random stream, not the argmax: greedy decoding of a random-weight model falls into a loop
    that reuses the same experts every step, which the re-placement then learns, so hit rates
    measured on it say nothing about text. Random tokens keep the routing near-uniform (pessimistic)."""
    stream = _prompt(engine, n, seed)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        tok = int(offered(engine, engine.forward([stream[i]]))[-1].argmax())
    return n / (time.perf_counter() - t), tok


def decode_counted(engine, tok: int, n: int, warm: int) -> tuple[float, int, dict]:
    """`warm` untimed steps from `tok`, then `decode` of n: (tokens/s, last token, expert traffic of the n)."""
    for _ in range(warm):
        tok = int(offered(engine, engine.forward([tok]))[-1].argmax())
    c0 = _counts(engine)
    tps, tok = decode(engine, tok, n)
    return tps, tok, _delta(c0, _counts(engine))


def force_uniform_routing(engine) -> None:
    """Every MoE layer picks its experts uniformly at random from now on, after its router has run as
    always (graphs captured again). The pick sets (2 MB for 128 experts, top-8) are outside the ledger."""
    from runtime.experts.routing import UniformPicks
    first = engine.moe[0].experts
    picks = UniformPicks.draw(first.num_experts, first.top_k, first.gate_w.device)
    engine.set_experiment(engine.experiment.replace(
        forced_routing=tuple(picks.for_layer(i) for i in range(len(engine.moe))), routing_label="uniform"))


def uniform_statistics(stats, top_k: int, tokens: float | None = None) -> None:
    """Routing statistics as uniform routing leaves them: each expert of each layer picked
    `tokens * top_k / E` times (tokens: one half-life of the statistics by default)."""
    E = stats.counts.shape[1]
    t = float(stats.half_life_tokens if tokens is None else tokens)
    if t <= 0 or top_k < 1:
        raise ValueError(f"uniform statistics of {t} tokens, top-{top_k}: both must be positive")
    stats.counts[...] = t * top_k / E
    stats.tokens = t


def place_for_uniform_routing(engine, budget_gb: float) -> None:
    """Under forced uniform routing: the statistics made uniform, the experts placed again at the same
    budget, and no statistics saved at close. Every load of a run then places alike, whatever the
    saved statistics, a routing prior or an earlier load's traffic (saved at its close) left: placed
    by those, which experts are hot, the staging capacity, the pages lent after a prefill and the
    promotions under uniform picks all changed from load to load (hit rates 46% and 52% on two loads
    of q125-a11 at 24 GB on the H200, decode 28.9 and 32.7 tokens/s)."""
    m = engine.offload
    m.stats_file = None
    uniform_statistics(m.stats, m.top_k)
    m.residency.rebase(m.routing_counts(), m.counters.tokens)     # traffic before this stays out
    engine.set_vram_budget(budget_gb)


def force_trace_routing(engine, profile: str, tokens: int = 8192) -> None:
    """Every MoE layer takes its picks from a routing trace with the statistics published for real
    Qwen-family models (bench/routing_traces.py: popularity skew per layer, reuse between nearby
    tokens), after its router has run as always (graphs captured again)."""
    from bench.routing_traces import forced_picks
    first = engine.moe[0].experts
    picks = forced_picks(len(engine.moe), first.num_experts, first.top_k, first.gate_w.device, tokens, profile)
    engine.set_experiment(engine.experiment.replace(forced_routing=tuple(picks), routing_label=f"trace {profile}"))


def calibrate(engine, n: int, budget_gb: float) -> None:
    """Decode n tokens of a random stream (routing statistics of this model), then plan the placement
    again from them at the same budget."""
    engine.reset()
    engine.forward(_prompt(engine, 16, 7))
    decode(engine, 0, n, seed=11)
    engine.set_vram_budget(budget_gb)


def routing_concentration(freq, tops: tuple[int, ...] = (8, 16, 32, 64)) -> dict[str, float]:
    """freq [L, E] routing shares -> mean over layers of the share the `top` most-picked experts take
    (uniform routing over E experts gives top / E)."""
    import numpy as np
    f = -np.sort(-np.asarray(freq, dtype=np.float64), axis=1)
    return {f"top{t}": float(f[:, :t].sum(axis=1).mean()) for t in tops if t <= f.shape[1]}


def uniform_roofline(engine, hbm_other: float, hbm: float, h2d: float, ram: float) -> dict[str, float]:
    """Tokens/s bound of this placement if every expert were picked equally often: per layer,
    top_k * (1 - residents / E) cold expert codes, the rest from HBM. hbm_other: the HBM bytes per
    token that are not expert codes (dense weights, expert scales and permutations). Two bounds: cold
    codes all over PCIe, and cold codes split between PCIe and the CPU reading RAM (at `ram` bytes/s)
    in the proportion that makes both take the same time (the issue's "perfectly overlapped")."""
    top_k, cold, vram = engine.info.experts_per_token, 0.0, 0.0
    for lo in engine.offload.layers:
        hot = (len(lo.expert_slot) + len(lo.lent)) / lo.layer.num_experts      # slots and lent staging pages
        cold += top_k * (1 - hot) * lo.code_bytes
        vram += top_k * hot * lo.code_bytes
    t_gpu, t_pcie, t_split = (hbm_other + vram) / hbm, cold / h2d, cold / (h2d + ram)
    return {"pcie_bytes_per_token": cold, "serial_tps": 1 / (t_gpu + t_pcie), "overlapped_tps": 1 / max(t_gpu, t_pcie),
            "pcie_and_cpu_overlapped_tps": 1 / max(t_gpu, t_split),
            "pcie_and_cpu_serial_tps": 1 / (t_gpu + t_split)}


def warm_up(engine, ids: list[int], n_decode: int) -> None:
    """Every kernel shape compiled, the graph buckets of a decode of n_decode after the prompt `ids` captured."""
    engine.reset()
    engine.forward(_prompt(engine, 64, 2))
    for _ in range(4):
        engine.forward([1])
    _, tok = ttft(engine, ids)
    decode(engine, tok, n_decode + 8, seed=3)


def measure_budget(engine, prompt: int, n_decode: int, n_naive: int, hbm: float, h2d: float,
                   ram: float) -> dict[str, Any]:
    ids = _prompt(engine, prompt, 1)
    warm_up(engine, ids, n_decode)
    # time to first token, then decode after it
    before = _counts(engine)
    t_first, tok = ttft(engine, ids)
    after_prefill = _counts(engine)
    tps, tok, d = decode_counted(engine, tok, n_decode, warm=4)
    tel = engine.telemetry()
    # the hybrid engine (Qwen3.5) says its own; the exllamav2 engine's modules are read here
    parts = tel.get("weight_bytes_per_token_parts") or weight_bytes_per_token(engine)
    pairs = max(1, d["pairs"])
    pcie = (d["zero_copy_bytes"] + d["promoted"]) / n_decode
    cpu_bytes = d["cpu_bytes"] / n_decode
    vram_codes = d["vram_code_bytes"] / n_decode
    code_all = sum(lo.code_bytes for lo in engine.offload.layers) / len(engine.offload.layers)
    expert_parts = parts["experts"]                       # top-k experts incl. scales and permutation
    top_k = engine.info.experts_per_token
    n_layers = len(engine.offload.layers)
    scales_perm = expert_parts - top_k * n_layers * code_all  # per token, always from VRAM
    hbm_bytes = parts["total"] - expert_parts + scales_perm + vram_codes
    t_gpu, t_pcie, t_cpu = hbm_bytes / hbm, pcie / h2d, cpu_bytes / ram
    staged = after_prefill["staged"] - before["staged"]
    out = {
        "vram_budget_gb": tel["vram_budget_bytes"] / GiB,
        "vram_budget_used_gb": tel["vram_budget_used_bytes"] / GiB,
        "vram_budget_items_gb": {k: v / GiB for k, v in tel["vram_budget_items"].items()},
        "peak_vram_reserved_gb": torch.cuda.max_memory_reserved() / GiB,
        "residents_per_layer": tel["expert_residents"], "paths": tel["expert_path_counts"],
        "lent_experts": tel["expert_lent"],                # in staging pages between prefills, beside the slots
        "staging_capacity": tel["expert_staging_capacity"],
        "ttft_s": t_first, "prefill_tps": prompt / t_first,
        "prefill_staged_gb": staged / GiB,
        "prefill_pcie_bound_s": staged / h2d,
        "decode_tps": tps, "decode_ms_per_token": 1e3 / tps,
        "hit_rate": d["hits"] / pairs,
        "pcie_bytes_per_token": pcie, "hbm_bytes_per_token": hbm_bytes,
        "cpu_bytes_per_token": cpu_bytes, "cpu_pairs_per_token": d["cpu_pairs"] / n_decode,
        "cpu_ms_per_token": d["cpu_ns"] / 1e6 / n_decode,
        "cpu_gb_per_s": d["cpu_bytes"] / max(d["cpu_ns"], 1),
        # per token, summed over layers: submit -> worker start; submit -> wait called (the GPU's kernels
        # meanwhile); the stream held in wait for the CPU. Overlap is good when stall is small.
        "cpu_timeline_ms_per_token": {k: d[f"cpu_{k}_ns"] / 1e6 / n_decode for k in ("wake", "gpu", "stall")},
        "cpu_signal": tel.get("cpu_expert_signal"),      # memops: no host code at submit/wait, no timeline
        "cpu_threads": engine.offload.cpu.team,
        # every thread of the process (OpenMP teams included): more than the CPUs slows every team's barriers
        "process_threads": psutil.Process().num_threads(),
        "promotions_during_decode": d["promoted"] / max(1, engine.offload.layers[0].code_bytes),
        "roofline": {"serial_tps": 1 / (t_gpu + t_pcie + t_cpu), "overlapped_tps": 1 / max(t_gpu, t_pcie, t_cpu),
                     "gpu_s": t_gpu, "pcie_s": t_pcie, "cpu_s": t_cpu},
        "roofline_fraction_overlapped": tps * max(t_gpu, t_pcie, t_cpu),
        "routing_concentration": routing_concentration(engine.offload.stats.frequencies()),
        "roofline_uniform_routing": uniform_roofline(engine, hbm_bytes - vram_codes, hbm, h2d, ram),
        "telemetry": {k: v for k, v in tel.items() if k not in ("vram_budget_items",)},
        "prefetch": ({"mode": engine.offload.prefetch.mode, "copying_at_end": engine.offload.prefetch.copying,
                      "oracle": engine.experiment.prefetch_oracle, **prefetch_figures(d, n_decode)}
                     if engine.offload.prefetch is not None else None),
    }
    if n_naive:
        out["naive"] = measure_naive(engine, ids, n_naive)
    return out


def vram_breakdown(engine) -> dict[str, float]:
    """GiB of VRAM in use after load, by what holds it (the ledger's first item, taken apart; the
    exllamav2 engine's parts: the hybrid engine's cache and scratch are not taken apart)."""
    model, cache = engine.model, engine.cache
    if not hasattr(cache, "key_states"):
        return {"allocated": torch.cuda.memory_allocated() / GiB, "cache": cache.nbytes() / GiB}
    kv = sum(t.numel() * t.element_size() for ts in (cache.key_states, cache.value_states) for t in ts if t is not None)
    scratch = sum(getattr(c, "scratch_bytes", 0) for c in (model.device_context or []) if c is not None)
    experts = codes = 0
    for m in engine.moe:
        x = m.experts
        for p in (x.w1, x.w3, x.w2):
            experts += p.scales.numel() * p.scales.element_size() + p.perm.numel() * p.perm.element_size()
            if p.qweight.is_cuda:
                codes += p.qweight.numel() * 4
        experts += x.router_bytes()
    total = torch.cuda.memory_allocated()
    return {"allocated": total / GiB, "kv_cache": kv / GiB, "exllamav2_scratch": scratch / GiB,
            "expert_scales_perm_router": experts / GiB, "expert_codes_in_vram": codes / GiB,
            "other_weights_and_buffers": (total - kv - scratch - experts - codes) / GiB}


def context_peak(engine) -> dict[str, Any]:
    """Fill the whole context with prefill chunks, then decode a step: the peak VRAM the allocator
    reserved against the budget (the prefill-scratch estimate is for the last chunk, which attends
    to the most rows)."""
    n = engine.info.context_length - 8
    ids = _prompt(engine, n, 9)
    chunk = 2048
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine.reset()
    for i in range(0, n, chunk):
        engine.prefill(ids[i:i + chunk])
    engine.forward([1])
    torch.cuda.synchronize()
    tel = engine.telemetry()
    out = {"tokens": n + 1, "peak_reserved_gb": torch.cuda.max_memory_reserved() / GiB,
           "peak_allocated_gb": torch.cuda.max_memory_allocated() / GiB,
           "budget_gb": tel["vram_budget_bytes"] / GiB,
           "ledger_prefill_scratch_gb": tel["vram_budget_items"].get("prefill scratch", 0) / GiB}
    engine.reset()
    return out


def decode_after_prompt(engine, prompt: int, n_decode: int) -> tuple[float, dict]:
    """Prefill the main measurement's prompt (same length, same tokens: the decode then attends to
    as many rows), 8 untimed steps, then n_decode timed: (tokens/s, expert traffic)."""
    engine.reset()
    engine.prefill(_prompt(engine, prompt, 1))
    tps, _, d = decode_counted(engine, 1, n_decode, warm=8)
    return tps, d


def set_routing(engine, mode: str, profile: str) -> None:
    """The run's routing: the model's own router ("router"), "uniform" or "trace" forced picks."""
    if mode == "uniform":
        force_uniform_routing(engine)
    elif mode == "trace":
        force_trace_routing(engine, profile)
    else:
        engine.set_experiment(engine.experiment.replace(forced_routing=None, routing_label=""))


def measure_routing(engine, mode: str, profile: str, prompt: int, n_decode: int, run_mode: str) -> dict[str, Any]:
    """Decode again under another routing mode (the CPU path decided again for it where "auto"),
    then back to the run's: the three modes side by side on one load."""
    try:
        set_routing(engine, mode, profile)
        if engine.path_judge is not None and engine.path_judge.policy == "auto":
            engine.recheck_placement()
        tps, d = decode_after_prompt(engine, prompt, n_decode)
        decision = engine.path_judge.telemetry() if engine.path_judge is not None else None
    finally:
        set_routing(engine, run_mode, profile)
    return {"routing": mode, "decode_tps": tps, "hit_rate": d["hits"] / max(1, d["pairs"]),
            "placement_decision": decision}


def measure_threads(engine, threads: int, prompt: int, n_decode: int) -> dict[str, Any]:
    """Decode again on the same placement and CPU copies with the CPU path's team at `threads`
    (each layer's context says how many; read by the worker per call), then back."""
    m = engine.offload
    kept = [lo.cpu.ctx.threads for lo in m.layers if lo.cpu is not None]
    for lo in m.layers:
        if lo.cpu is not None:
            lo.cpu.ctx.threads = threads
    try:
        tps, d = decode_after_prompt(engine, prompt, n_decode)
    finally:
        for lo, t in zip([lo for lo in m.layers if lo.cpu is not None], kept):
            lo.cpu.ctx.threads = t
    return {"threads": threads, "decode_tps": tps, "cpu_ms_per_token": d["cpu_ns"] / 1e6 / n_decode,
            "cpu_gb_per_s": d["cpu_bytes"] / max(d["cpu_ns"], 1)}


def measure_cut(engine, rows: int, prompt: int, n_decode: int) -> dict[str, Any]:
    """Decode again with every layer's CPU part held at `rows` intermediate rows (re-balancing off),
    then back to the cut the run had: the speed against the cut, side by side in one process."""
    m = engine.offload
    kept, run = m.cpu.cut, engine.experiment
    engine.set_experiment(run.replace(fixed_cut=True))
    try:
        m.cpu.set_cut(rows)
        before = m.cpu.balance_totals()
        tps, d = decode_after_prompt(engine, prompt, n_decode)
        after = m.cpu.balance_totals()
    finally:
        m.cpu.set_cut(kept)
        engine.set_experiment(run)
    first = after[0] - before[0]
    return {"cut_rows": rows, "decode_tps": tps, "cpu_ms_per_token": d["cpu_ns"] / 1e6 / n_decode,
            "cpu_gb_per_s": d["cpu_bytes"] / max(d["cpu_ns"], 1),
            "cpu_first_share": first / max(1, first + after[1] - before[1])}


def measure_without_lending(engine, prompt: int, n_decode: int) -> dict[str, Any]:
    """Decode again with the staging pages left empty between prefills (a prefill takes back what
    was lent), then lending on again: what lending gains, side by side in one process."""
    m, run = engine.offload, engine.experiment
    engine.set_experiment(run.replace(lend_staging=False))
    try:
        tps, d = decode_after_prompt(engine, prompt, n_decode)
        if any(lo.lent for lo in m.layers):
            raise RuntimeError("the prefill did not take the lent staging pages back")
    finally:
        engine.set_experiment(run)
    return {"decode_tps": tps, "hit_rate": d["hits"] / max(1, d["pairs"]), "cut_rows": m.cpu.cut,
            "cpu_ms_per_token": d["cpu_ns"] / 1e6 / n_decode}


def prefetch_figures(d: dict, n_decode: int) -> dict[str, Any]:
    """The decode prefetch over a measured stretch (a `_counts` delta)."""
    return {"accuracy": d["pf_candidates_picked"] / d["pf_candidates"] if d["pf_candidates"] else None,
            "copies_per_token": d["pf_copies"] / n_decode, "copies_picked_per_token": d["pf_copies_picked"] / n_decode}


def measure_prefetch(engine, mode: str, prompt: int, n_decode: int) -> dict[str, Any]:
    """Decode again with the prefetch held in `mode` ("on": copying whatever the score; "off": the
    prediction runs, nothing is copied; "none": not in the decode step at all, graphs captured again),
    then back to the run's mode: its effect side by side."""
    pf, run = engine.offload.prefetch, engine.experiment
    kept = pf.mode
    if mode == "none":
        engine.set_experiment(run.replace(prefetch=False))      # graphs captured again without it
    else:
        pf.set_mode(mode)
    try:
        tps, d = decode_after_prompt(engine, prompt, n_decode)
    finally:
        if mode == "none":
            engine.set_experiment(run)
        else:
            pf.set_mode(kept)
    return {"mode": mode, "decode_tps": tps, "hit_rate": d["hits"] / max(1, d["pairs"]),
            "pcie_bytes_per_token": d["zero_copy_bytes"] / n_decode, **prefetch_figures(d, n_decode)}


def measure_without_cpu_path(engine, prompt: int, n_decode: int, hbm: float, h2d: float, ram: float) -> dict[str, Any]:
    """The same placement with every cold expert read over PCIe (the CPU paths set aside, graphs
    captured again): the CPU path's gain measured side by side, in one process."""
    m = engine.offload
    kept = [lo.cpu for lo in m.layers]
    for lo in m.layers:
        lo.cpu = None
    engine.reset_graphs()
    try:
        r = measure_budget(engine, prompt, n_decode, 0, hbm, h2d, ram)
    finally:
        engine.reset_graphs()
        for lo, cpu in zip(m.layers, kept):
            lo.cpu = cpu
    keep = ("decode_tps", "decode_ms_per_token", "hit_rate", "pcie_bytes_per_token", "roofline",
            "roofline_fraction_overlapped", "ttft_s")
    return {k: r[k] for k in keep}


def measure_naive(engine, ids: list[int], n: int) -> dict[str, Any]:
    """The baseline on the same placement: layer loop, host sync per layer, on-demand copies."""
    with layer_loop(engine):              # set aside before the experiment changes: kept as captured
        run = engine.experiment
        engine.set_experiment(run.replace(naive=True))
        try:
            engine.forward([1])                              # warm the layer loop's shapes
            t_first, tok = ttft(engine, ids)
            tps, tok, d = decode_counted(engine, tok, n, warm=2)
        finally:
            engine.set_experiment(run)
    return {"ttft_s": t_first, "decode_tps": tps, "decode_tokens": n,
            "pcie_bytes_per_token": d["naive"] / n, "hit_rate": d["hits"] / max(1, d["pairs"])}


def profile_after_prompt(engine, prompt: int, path: Path) -> dict[str, Any]:
    """bench.cuda.profile_decode's decode steps after a fresh prefill of `prompt` tokens, its table into path."""
    from bench.cuda import profile_decode
    path.parent.mkdir(parents=True, exist_ok=True)
    engine.reset()
    engine.prefill(_prompt(engine, prompt, 1))
    return profile_decode(engine, path)


def measure_all_in_vram(backend, a: argparse.Namespace, hbm: float, hbm_run: float,
                        progress: Callable[[str], None]) -> dict[str, Any]:
    """Every expert in VRAM (a load without a budget, as the app loads a model that fits), in a load of its
    own: time to first token for --prompt, decode, the roofline (weight bytes per token over the HBM copy
    bandwidth: the rig's `hbm`, and this run's `hbm_run`), and the baseline in the same run: decode through
    the layer loop, without the decode graphs."""
    opts = LoadOptions(offload=OffloadOptions(context_length=a.context, placement=a.placement))
    progress("loading with every expert in VRAM")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    engine, _ = backend.load(a.model, opts, load_progress(lambda m: progress(f"  {m}")))
    try:
        if engine.offload is not None:
            raise SystemExit(f"{a.model}: its experts do not all fit in VRAM (--all-in-vram)")
        ids = _prompt(engine, a.prompt, 1)
        warm_up(engine, ids, a.decode)
        t_first, tok = ttft(engine, ids)
        tps, tok = decode(engine, tok, a.decode)
        tel = engine.telemetry()
        per_token = (tel.get("weight_bytes_per_token_parts") or weight_bytes_per_token(engine))["total"]
        out = {"ttft_s": t_first, "prefill_tps": a.prompt / t_first, "decode_tps": tps,
               "decode_ms_per_token": 1e3 / tps, "hbm_bytes_per_token": per_token,
               "roofline": {"tps": hbm / per_token}, "roofline_measured_ceilings": {"tps": hbm_run / per_token},
               "roofline_fraction": tps * per_token / hbm, "decode_graphs": getattr(engine, "graphs", None) is not None,
               "peak_vram_reserved_gb": torch.cuda.max_memory_reserved() / GiB if torch.cuda.is_available() else None}
        if getattr(a, "profile", None):                   # what the step's time goes to (kernels a token)
            out["profile"] = profile_after_prompt(engine, a.prompt,
                                                  Path(a.profile) / f"offload-{Path(a.model).name}-all.txt")
            progress(f"profiled: {out['profile']}")
        if not a.no_naive:
            with layer_loop(engine):
                decode(engine, tok, 2, seed=4)             # the layer loop's shapes
                naive_tps, _ = decode(engine, tok, a.naive_decode, seed=6)
            out["naive"] = {"name": "the layer loop, no decode graphs", "decode_tps": naive_tps,
                            "decode_tokens": a.naive_decode}
        return out
    finally:
        engine.close()
        gc.collect()


def _oracles(text: str) -> list:
    out = []
    for v in text.split(","):
        if v.strip() in ("none", ""):
            out.append(None)
            continue
        try:
            q = float(v)
        except ValueError:
            q = -1.0
        if not 0.0 <= q <= 1.0:
            raise argparse.ArgumentTypeError(f"{v!r}: want 'none' or a probability in 0..1")
        out.append(q)
    return out


def load_progress(say: Callable[[str], None], step: int = 10) -> Callable[[str, str, int, int], None]:
    """A load's progress callback that says each step as it starts, and a counted step (the weights,
    module by module) again every `step` percent: a load of minutes is never silent."""
    last = {"message": None, "pct": -1}

    def progress(stage: str, message: str, done: int, total: int) -> None:
        pct = 100 * done // total // step * step if total > 1 else -1
        if message != last["message"] or pct > last["pct"]:
            say(f"{stage}: {message}" + (f" ({done}/{total})" if total > 1 else ""))
            last.update(message=message, pct=pct)
    return progress


def engine_for(model: str) -> str:
    """The GPU engine for this folder, runtime.backends.NAME: Qwen3.5-MoE's own ("hybrid"), else the
    exllamav2 engine ("exl2")."""
    from runtime import modelfolder
    arch = modelfolder.validate(model, require_tokenizer=False).architecture
    return "hybrid" if arch in modelfolder.qwen35.ARCHITECTURES else "exl2"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Expert-offload benchmark (with the naive baseline)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--label", default=None, help="model name or shape for the results (default: folder name)")
    ap.add_argument("--bpw", type=float)
    ap.add_argument("--budgets", default="24,12,48", help="VRAM budgets in GB (GiB), first one loads; empty: "
                    "none (with --all-in-vram: that load alone)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--naive-decode", type=int, default=32, help="decode tokens for the (slow) naive baseline")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--reload", action="store_true", help="load the model again for every budget")
    ap.add_argument("--all-in-vram", action="store_true", help="first, in a load of its own without a budget: "
                    "every expert in VRAM (ttft, decode, roofline, decode without graphs as its baseline)")
    ap.add_argument("--placement", choices=("stream", "cpu", "auto"), default="stream",
                    help="cold experts: read over PCIe only, partly computed on the CPU, or the app's default "
                         "(the CPU path where the planner predicts a gain)")
    ap.add_argument("--cpu-threads", type=int, default=0, help="threads of the CPU path (0: automatic, the physical cores less two)")
    ap.add_argument("--routing", choices=("router", "uniform", "trace"), default="router",
                    help="uniform: every token picks top-k distinct experts at random (speed of the placement "
                         "under the routing the roofline assumes; the output is meaningless); trace: picks from a "
                         "trace with real models' published statistics (bench/routing_traces.py)")
    ap.add_argument("--other-routing", default="", help="comma-separated routing modes also measured on each "
                    "load (e.g. router,uniform,trace: all three side by side)")
    ap.add_argument("--trace-profile", default="qwen3-30b-a3b",
                    help="--routing trace: the profile of bench/routing_traces.PROFILES")
    ap.add_argument("--calibrate", type=int, default=256,
                    help="tokens decoded after each load before planning again from their routing (0: off)")
    ap.add_argument("--profile", help="folder for profiler tables of 16 decode steps per budget (and all in VRAM)")
    ap.add_argument("--try-threads", default="", help="CPU path team sizes to decode with again on the same "
                    "placement, e.g. 12,15 (the placement's split stays as planned)")
    ap.add_argument("--try-cuts", default="", help="experts cut between CPU and GPU: decode again with the "
                    "CPU's part held at these intermediate rows, e.g. 640,704,768 (within its copies)")
    ap.add_argument("--prefetch-modes", default="none,off,on", help="decode prefetch: decode again with it held "
                    "in these modes (none: left out of the step; off: predicted, nothing copied; on: always "
                    "copying), beside the run's (auto)")
    ap.add_argument("--prefetch-oracle", type=_oracles, default=[None], help="with --routing uniform, "
                    "comma-separated: the decode prefetch is handed each next layer's forced picks, each kept with "
                    "this probability (what a given prediction accuracy buys; real models' accuracy cannot be "
                    "measured here); 'none': the router's prediction. The first is the run's, the others are "
                    "measured after it in --prefetch-modes")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    budgets = [float(b) for b in a.budgets.split(",") if b.strip()]
    if not budgets and not a.all_in_vram:
        ap.error("--budgets is empty: name a budget, or measure --all-in-vram alone")
    import importlib
    backend = importlib.import_module(f"runtime.backends.{engine_for(a.model)}")
    label = a.label or Path(a.model).name
    hbm = hbm_bandwidth()
    h2d = pinned_h2d_bandwidth()
    print(f"measured: HBM copy {hbm / GiB:.0f} GiB/s, pinned H2D {h2d / GiB:.1f} GiB/s", flush=True)
    rig_hbm, rig_h2d = RIG["hbm_copy_gib_s"] * GiB, RIG["pinned_h2d_gib_s"] * GiB
    rig_ram = RIG["host_ram_read_gib_s"] * GiB
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)
    results: dict[str, Any] = {}
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}"

    def write() -> Path:
        head = results.get(f"{budgets[0]:g}" if budgets else "all", {})
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "machine": machine(), "device": torch.cuda.get_device_name(0),
            "engine": "cuda", "benchmark": "expert offload", "placement": a.placement, "model": label, "bpw": a.bpw, "context": a.context,
            "prompt_tokens": a.prompt, "decode_tokens": a.decode, "naive_decode_tokens": a.naive_decode,
            "ceilings": {"rig": RIG, "measured": {"hbm_copy_gib_s": hbm / GiB, "pinned_h2d_gib_s": h2d / GiB}},
            # the headline (first budget), in the fields every result file has
            "vram_budget_gb": budgets[0] if budgets else None, "decode_tps": head.get("decode_tps"),
            "ttft_s": head.get("ttft_s"), "prefill_tps": head.get("prefill_tps"),
            "roofline_tps": (head.get("roofline") or {}).get("overlapped_tps" if budgets else "tps"),
            "draft": None, "baseline": ({"name": "naive: on-demand copies, host sync per layer, no overlap",
                                         **head["naive"]} if head.get("naive") else None),
            "budgets": results,
            "calibration_tokens": a.calibrate, "routing": a.routing, "prefetch_oracles": a.prefetch_oracle,
            "prefetch_pages": expert_manager.PREFETCH_PAGES,
            "grouped_kernels": dataclasses.asdict(tuning.current().grouped),    # prefill launch shape
            "cpu_balance": CPU_BALANCE,                                       # whole experts' balanced split
            "cpu_split": "cut",                                               # where the layout allows it
            "notes": (("Budget 'all': every expert in VRAM, a load of its own without a budget, measured before "
                       "the budgets' load; its baseline decodes through the layer loop without the decode graphs. "
                       if a.all_in_vram else "")
                      + ("Routing forced uniform: each token's experts drawn at random (speed only). "
                       if a.routing == "uniform" else
                       f"Routing forced from a trace (profile {a.trace_profile}: popularity skew and reuse between "
                       "nearby tokens as published for real Qwen-family MoEs, bench/routing_traces.py). "
                       if a.routing == "trace" else "")
                      + ("Decode prefetch handed the forced picks where an oracle probability is given (an assumed "
                         "prediction accuracy, not a measured one): " + ", ".join(map(str, a.prefetch_oracle))
                         + " (the first is the run's). " if any(q is not None for q in a.prefetch_oracle) else "")
                      + "Synthetic random-weight EXL2 model; its routing is not uniform (see each budget's "
                      "routing_concentration), so each budget also gives the roofline under uniform routing. "
                      f"Placement planned from the routing of {a.calibrate} calibration tokens after the load"
                      + (" (none: the first budget ran on uniform statistics)" if not a.calibrate else "")
                      + ". Batch 1, greedy argmax on the GPU. Cold experts' codes live in page-locked host RAM "
                      "and are read in place by the decode kernels (zero-copy over PCIe); prefill stages each "
                      "layer's cold experts into VRAM, double-buffered. Roofline: HBM bytes (dense weights, expert "
                      "scales and permutations, resident expert codes) / HBM copy bandwidth and expert codes over "
                      "PCIe / pinned host->device bandwidth (rig ceilings; also with this run's). KV cache reads not "
                      "counted. Naive: same placement, layer loop, host sync per layer, on-demand copies. " + a.note),
        }
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"offload-{label}-{a.bpw or ''}bpw-{stamp}.json"
        (out / name).write_text(json.dumps(result, indent=1, default=str))
        return out / name

    if a.all_in_vram:
        r = results["all"] = measure_all_in_vram(backend, a, rig_hbm, hbm, progress)
        write()
        print(f"all in VRAM: decode {r['decode_tps']:.1f} tok/s (roofline {r['roofline']['tps']:.1f}, "
              f"{r['roofline_fraction']:.1%} of it), ttft {r['ttft_s']:.2f} s for {a.prompt} tokens; without "
              f"graphs: decode {(r.get('naive') or {}).get('decode_tps', float('nan')):.1f} tok/s", flush=True)
    engine = None
    try:
        for i, b in enumerate(budgets):
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            if engine is None or a.reload:
                if engine is not None:
                    engine.close()
                    gc.collect()
                opts = LoadOptions(offload=OffloadOptions(context_length=a.context, vram_budget_gb=b,
                                                          placement=a.placement, cpu_threads=a.cpu_threads))
                progress(f"loading at {b:g} GB")
                engine, applied = backend.load(a.model, opts, load_progress(lambda m: progress(f"  {m}")))
                progress("loaded")
                how = "load"
                # the expert-path decisions below time the random stream this benchmark decodes
                engine.set_experiment(engine.experiment.replace(trial_stream=True))
                if a.routing != "router":
                    set_routing(engine, a.routing, a.trace_profile)
                if a.calibrate:
                    calibrate(engine, a.calibrate, b)
                    progress("calibrated and planned again")
                    how = f"load, {a.calibrate} calibration tokens, planned again"
            else:
                # a new placement's prefetch starts without the oracle, as at load (set again below)
                engine.set_experiment(engine.experiment.replace(prefetch_oracle=None))
                engine.set_vram_budget(b)
                applied, how = None, "set_vram_budget"
            if a.placement == "auto" and engine.offload is not None:
                engine.recheck_placement()                 # under this run's routing and budget
                progress(f"expert path: {engine.path_judge.summary()}")
            setup_s = time.perf_counter() - t
            if engine.offload is None:
                raise SystemExit(f"{a.model} at {b} GB: experts were not offloaded")
            if any(q is not None for q in a.prefetch_oracle) and a.routing != "uniform":
                raise SystemExit("--prefetch-oracle needs --routing uniform (the forced picks it hands over)")
            if a.prefetch_oracle[0] is not None and engine.offload.prefetch is not None:
                # captured again with the oracle's plan
                engine.set_experiment(engine.experiment.replace(prefetch_oracle=a.prefetch_oracle[0]))
            r = measure_budget(engine, a.prompt, a.decode, 0 if a.no_naive else a.naive_decode, rig_hbm, rig_h2d,
                               rig_ram)
            progress(f"measured: decode {r['decode_tps']:.1f} tok/s, ttft {r['ttft_s']:.2f} s, hit rate "
                     f"{r['hit_rate']:.1%}" + (f", cut {r['telemetry'].get('cpu_expert_cut')}"
                                               if engine.offload.cpu.cut is not None else ""))
            if i == 0:
                r["vram_breakdown_gb"] = vram_breakdown(engine)
                r["context_peak"] = context_peak(engine)
                progress(f"whole context: peak reserved {r['context_peak']['peak_reserved_gb']:.2f} GiB of "
                         f"{r['context_peak']['budget_gb']:.2f}")
            if a.profile:
                r["profile"] = profile_after_prompt(engine, a.prompt,
                                                    Path(a.profile) / f"offload-{label}-{b:g}gb-{stamp}.txt")
                progress(f"profiled: {r['profile']}")
            if engine.offload.cpu.active and a.try_threads:
                r["other_threads"] = [measure_threads(engine, int(t), a.prompt, a.decode) for t in a.try_threads.split(",")]
                progress("other team sizes: " + ", ".join(f"{x['threads']}: {x['decode_tps']:.1f} tok/s"
                                                          for x in r["other_threads"]))
            if engine.offload.cpu.active and engine.offload.cpu.cut is not None and a.try_cuts:
                r["other_cuts"] = [measure_cut(engine, int(c), a.prompt, a.decode) for c in a.try_cuts.split(",")
                                   if int(c) <= engine.offload.cpu.cut_width]
                progress("other cuts: " + ", ".join(f"{x['cut_rows']}: {x['decode_tps']:.1f} tok/s "
                                                    f"(CPU first {x['cpu_first_share']:.0%})" for x in r["other_cuts"]))
            if engine.offload.staging.lend and engine.offload.staging.capacity:
                r["without_lending"] = measure_without_lending(engine, a.prompt, a.decode)
                progress(f"without lending staging pages: decode {r['without_lending']['decode_tps']:.1f} tok/s, "
                         f"hit rate {r['without_lending']['hit_rate']:.1%} (with: {r['lent_experts']} experts lent)")
            if engine.offload.prefetch is not None and a.prefetch_modes:
                r["prefetch_modes"] = [measure_prefetch(engine, mode, a.prompt, a.decode)
                                       for mode in a.prefetch_modes.split(",")]
                progress("prefetch: " + ", ".join(
                    f"{x['mode']}: {x['decode_tps']:.1f} tok/s (accuracy {x['accuracy'] or 0:.0%}, "
                    f"{x['copies_picked_per_token']:.1f} of {x['copies_per_token']:.1f} copies/token picked)"
                    for x in r["prefetch_modes"]) + f"; the run's: {r['prefetch']}")
                r["prefetch_oracles"] = []
                for q in a.prefetch_oracle[1:]:
                    engine.set_experiment(engine.experiment.replace(prefetch_oracle=q))
                    r["prefetch_oracles"].append({"oracle": q, "modes": [
                        measure_prefetch(engine, mode, a.prompt, a.decode) for mode in a.prefetch_modes.split(",")]})
                    progress(f"prefetch, oracle {q}: " + ", ".join(
                        f"{x['mode']}: {x['decode_tps']:.1f} tok/s (accuracy {x['accuracy'] or 0:.0%})"
                        for x in r["prefetch_oracles"][-1]["modes"]))
                if engine.experiment.prefetch_oracle != a.prefetch_oracle[0]:
                    engine.set_experiment(engine.experiment.replace(prefetch_oracle=a.prefetch_oracle[0]))
            if a.other_routing:
                r["other_routing"] = [measure_routing(engine, mode, a.trace_profile, a.prompt, a.decode, a.routing)
                                      for mode in a.other_routing.split(",") if mode != a.routing]
                if a.placement == "auto":
                    engine.recheck_placement()          # the run's routing again
                progress("other routing: " + ", ".join(f"{x['routing']}: {x['decode_tps']:.1f} tok/s, hit rate "
                                                       f"{x['hit_rate']:.1%}" for x in r["other_routing"]))
            if engine.offload.cpu.active:
                r["without_cpu_path"] = measure_without_cpu_path(engine, a.prompt, a.decode, rig_hbm, rig_h2d, rig_ram)
                progress(f"measured without the CPU path: decode {r['without_cpu_path']['decode_tps']:.1f} tok/s")
            r["setup"], r["setup_s"], r["applied"] = how, setup_s, applied
            # the same placement's roofline with this run's measured ceilings
            r["roofline_measured_ceilings"] = {
                "overlapped_tps": 1 / max(r["hbm_bytes_per_token"] / hbm, r["pcie_bytes_per_token"] / h2d,
                                          r["cpu_bytes_per_token"] / rig_ram),
                "serial_tps": 1 / (r["hbm_bytes_per_token"] / hbm + r["pcie_bytes_per_token"] / h2d
                                   + r["cpu_bytes_per_token"] / rig_ram)}
            results[f"{b:g}"] = r
            write()                                # each budget's figures survive a later failure
            nv = r.get("naive") or {}
            print(f"budget {b:g} GB: decode {r['decode_tps']:.1f} tok/s (roofline {r['roofline']['overlapped_tps']:.1f} "
                  f"overlapped, {r['roofline']['serial_tps']:.1f} serial), ttft {r['ttft_s']:.2f} s, hit rate "
                  f"{r['hit_rate']:.1%}, PCIe {r['pcie_bytes_per_token'] / 1e9:.2f} GB/token, uniform-routing roofline "
                  f"{r['roofline_uniform_routing']['overlapped_tps']:.1f}, top-8 experts take "
                  f"{r['routing_concentration'].get('top8', float('nan')):.0%} of picks"
                  + (f", cut {r['telemetry'].get('cpu_expert_cut')}" if engine.offload.cpu.cut is not None else "")
                  + (f" (with the CPU path {r['roofline_uniform_routing']['pcie_and_cpu_overlapped_tps']:.1f})"
                     f", CPU experts {r['cpu_ms_per_token']:.2f} ms/token, {r['cpu_bytes_per_token'] / 1e9:.2f} GB/token "
                     f"at {r['cpu_gb_per_s']:.1f} GB/s, signal {(r['cpu_signal'] or '?').split(':')[0]} (per token: worker wake-up "
                     f"{r['cpu_timeline_ms_per_token']['wake']:.2f} ms, GPU kernels beside it "
                     f"{r['cpu_timeline_ms_per_token']['gpu']:.2f} ms, stream held for the CPU "
                     f"{r['cpu_timeline_ms_per_token']['stall']:.2f} ms)" if engine.offload.cpu.active else "") + "; naive: decode "
                  f"{nv.get('decode_tps', float('nan')):.1f} tok/s, ttft {nv.get('ttft_s', float('nan')):.2f} s",
                  flush=True)
    finally:
        if engine is not None:
            engine.close()
    print("wrote", write())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
