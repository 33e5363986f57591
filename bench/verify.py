"""The verify-cost benchmark (`moedesk-cli bench-spec --what verify`): what one target forward over K+1
rows costs next to the one-row step of plain decoding, K = 1..8, and the speedup that buys at a given
acceptance rate. Not a test.

Two one-row baselines, both recorded and named in the result:
    step   the one-row forward plain decoding runs: on the CUDA engine a replayed CUDA graph of the
           whole step ("cuda_graph"); on the CPU engine the layer loop ("layer_loop")
    loop   the one-row forward through the layer loop (on CUDA: the graph switched off for it)
On the CUDA engine verify forwards of 2..9 rows replay CUDA graphs too (runtime/backends/exl2_graph.py),
so `relative` (to step) is what speculation pays over plain decoding; `relative_to_loop` compares with
the layer loop that anything without a graph runs.

MoE targets: the routing of each timed forward is read from the experts' selection counters (their
change over the forward), giving per layer the number of distinct experts the rows selected: the
union, i.e. the experts a verify forward must read. Per K there are two row sets: K+1 random tokens,
and one random token repeated K+1 times (rows whose routing overlaps more). At equal rows, the
difference in time over the difference in union is the marginal cost of one more expert per layer.

Forced acceptance (`--forced-acceptance`) decodes with every draft kept regardless of the target
(random-weight models accept nothing useful) to time the verify path end to end; results say so.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

ACCEPTANCE_RATES = (0.5, 0.6, 0.7, 0.8, 0.9)
FORCED_K = (1, 2, 4, 8)


@dataclass
class VerifyCost:
    k: int
    rows: int
    seconds: float                           # median time of a forward over `rows` random tokens
    relative: float                          # seconds / the one-row step plain decoding runs
    relative_to_loop: float                  # seconds / a one-row forward through the layer loop
    experts: Optional[float] = None          # MoE: distinct experts per layer these rows selected
    relative_to_loop_per_union: Optional[float] = None   # relative_to_loop / (experts / one row's experts)
    repeat_seconds: Optional[float] = None   # MoE: the same row count, one token repeated
    repeat_experts: Optional[float] = None


@dataclass
class VerifyTiming:
    costs: list[VerifyCost]                  # K = 0..k_max (K = 0: one row, random token, as the step runs it)
    step_kind: str                           # "cuda_graph" | "layer_loop": how the one-row step ran
    step_s: float                            # median one-row step
    loop_s: float                            # median one-row forward through the layer loop
    graph_error: Optional[str] = None        # why the decode graph stopped, if it did during the run
    marginal_expert_s: Optional[float] = None  # MoE: seconds per extra distinct expert per layer


class RoutingProbe:
    """Distinct experts chosen per MoE layer by one forward, from the layers' selection counters
    (`ExpertLayer.counts`, counted on the device). Empty for dense models and engines without them."""

    def __init__(self, engine: Any):
        self.layers = [m.experts for m in getattr(engine, "moe", []) or []]
        self.before = None

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _counts(self):
        import torch
        c = torch.stack([layer.counts for layer in self.layers])          # [L, E]
        if c.is_cuda:
            torch.cuda.synchronize(c.device)
        return c

    def start(self) -> None:
        self.before = self._counts()

    def union(self) -> float:
        """Mean over the MoE layers of the experts selected since start()."""
        return float(((self._counts() - self.before) > 0).sum(dim=1).float().mean())


@contextlib.contextmanager
def layer_loop(engine: Any):
    """One-row forwards through the layer loop while inside (the CUDA engine's decode graph off)."""
    graphs = getattr(engine, "graphs", None)
    if graphs is None:
        yield
        return
    engine.graphs = None
    try:
        yield
    finally:
        engine.graphs = graphs


def verify_cost(engine: Any, context: int, k_max: int = 8, repeats: int = 7, seed: int = 0) -> VerifyTiming:
    """Median forward times at a context of `context` random tokens, rows 1..k_max+1, each timed after a
    one-row forward. Everything is interleaved within each repeat (the first repeat warms up: graph capture,
    kernel tuning). With a rollback window (the hybrid engine's), two passes: first the one-row baselines and
    the rows within the window, then the wider rows, whose truncates replay the context: on the H200 at 24 GB
    the one-row step timed right after such a replay took 68.8 ms against 23.7 for the same forward timed
    later in the repeat, so nothing within the window is timed after one."""
    import torch
    from runtime.engine import random_tokens
    from runtime.speculative.core import timed_forward
    g = torch.Generator().manual_seed(seed)
    vocab = engine.info.vocab_size

    def rand(n: int) -> list[int]:
        return random_tokens(engine, n, g, vocab)

    probe = RoutingProbe(engine)

    def timed(tokens: list[int]) -> tuple[float, Optional[float]]:
        # after an untimed one-row forward, as in decoding, where a verify follows a step: a forward wider
        # than a hybrid engine's rollback window replays the context at its truncate, and the first forward
        # after a long one may pay an offloaded engine's staging (on the H200 a step timed first after such
        # a forward took 61 ms against 21 for the same step timed later)
        engine.forward(rand(1))
        engine.truncate(context)
        if probe:
            probe.start()
        _, dt = timed_forward(engine, tokens)
        union = probe.union() if probe else None
        engine.truncate(context)
        return dt, union

    engine.reset()
    engine.prefill(rand(context))
    had_graph = getattr(engine, "graphs", None) is not None
    window = engine.telemetry().get("rollback_window") or k_max + 1
    samples: dict[str, list[tuple[float, Optional[float]]]] = {}
    for widths in (range(1, min(window, k_max + 1) + 1), range(window + 1, k_max + 2)):
        if not widths:
            continue
        for rep in range(repeats + 1):
            got = {}
            if widths[0] == 1:
                got["step"] = timed(rand(1))
                with layer_loop(engine):
                    got["loop"] = timed(rand(1))
            for rows in widths:
                got[f"random{rows}"] = timed(rand(rows))
                if probe and rows > 1:
                    got[f"repeat{rows}"] = timed(rand(1) * rows)
            if rep:
                for key, value in got.items():
                    samples.setdefault(key, []).append(value)

    def sec(key: str) -> float:
        return statistics.median(s for s, _ in samples[key])

    def experts(key: str) -> Optional[float]:
        return statistics.median(u for _, u in samples[key]) if probe else None

    step_s, loop_s = sec("step"), sec("loop")
    one_experts = experts("random1")
    costs = []
    for rows in range(1, k_max + 2):
        s, u = sec(f"random{rows}"), experts(f"random{rows}")
        c = VerifyCost(rows - 1, rows, s, s / step_s, s / loop_s, u)
        if probe:
            c.relative_to_loop_per_union = c.relative_to_loop / (u / one_experts) if u and one_experts else None
            if rows > 1:
                c.repeat_seconds, c.repeat_experts = sec(f"repeat{rows}"), experts(f"repeat{rows}")
        costs.append(c)
    graph_on = getattr(engine, "graphs", None) is not None
    graph_error = None if graph_on or not had_graph else getattr(engine, "graph_error", "unknown")
    return VerifyTiming(costs, "cuda_graph" if graph_on else "layer_loop", step_s, loop_s, graph_error,
                        marginal_expert_cost(costs))


def marginal_expert_cost(costs: list[VerifyCost], min_gap: float = 2.0) -> Optional[float]:
    """Median over K of (random - repeat seconds) / (random - repeat union), where the two row sets
    of the same K differ by at least `min_gap` experts per layer; None where none do."""
    slopes = [(c.seconds - c.repeat_seconds) / (c.experts - c.repeat_experts) for c in costs
              if c.repeat_seconds is not None and c.experts is not None and c.repeat_experts is not None
              and c.experts - c.repeat_experts >= min_gap]
    return statistics.median(slopes) if slopes else None


def speedup_at(costs: list[VerifyCost], acceptance: float, baseline: str = "step",
               draft_cost: float = 0.0) -> dict[int, float]:
    """Expected speedup over plain decoding for each K at a per-token acceptance rate, a verify of
    K+1 rows costing `relative` (baseline "step") or `relative_to_loop` ("loop") one-row forwards and
    a draft costing `draft_cost` of them per drafted token: (1 + a + ... + a^K) / (cost(K+1) + K * draft_cost)."""
    if baseline not in ("step", "loop"):
        raise ValueError(f"baseline: expected 'step' or 'loop', got {baseline!r}")
    out = {}
    for c in costs:
        if c.k == 0:
            continue
        tokens = sum(acceptance ** i for i in range(c.k + 1))
        rel = c.relative if baseline == "step" else c.relative_to_loop
        out[c.k] = tokens / (rel + c.k * draft_cost)
    return out


def forced_acceptance_decode(engine: Any, prompt: list[int], k: int, n_tokens: int, seed: int = 0) -> float:
    """Tokens/s of the verify path with every draft accepted (FORCED: drafts are random tokens kept
    regardless of the target). k = 0 is plain decoding. Times forward + argmax, as a step would."""
    import torch
    from runtime.engine import offered, random_tokens
    g = torch.Generator().manual_seed(seed)
    engine.reset()
    engine.prefill(prompt[:-1])
    pending, produced = prompt[-1], 0
    t0 = time.perf_counter()
    while produced < n_tokens:
        drafts = random_tokens(engine, k, g)
        logits = offered(engine, engine.forward([pending] + drafts))   # [k+1, V]
        pending = int(torch.argmax(logits[-1]))
        produced += k + 1
    return produced / (time.perf_counter() - t0)


def verify_result(engine: Any, context: int, forced: bool, n_tokens: int, say=print, repeats: int = 7) -> dict:
    """Run the benchmark (`repeats` timed repeats after the warm-up one); returns the fields of the result
    file (see bench.record)."""
    t = verify_cost(engine, context, repeats=repeats)
    tables = {base: {f"{a:.1f}": {str(k): round(v, 3) for k, v in speedup_at(t.costs, a, base).items()}
                     for a in ACCEPTANCE_RATES} for base in ("step", "loop")}
    say(f"one-row step ({t.step_kind}) {t.step_s * 1e3:.2f} ms, one-row layer loop {t.loop_s * 1e3:.2f} ms")
    window = engine.telemetry().get("rollback_window")        # the hybrid engine's: rows a verify may span
    if window:
        say(f"rollback window {window} rows: wider forwards run as a prompt's would, and a truncate after "
            "one replays the context (the app's verifies stay within it)")
    for c in t.costs:
        moe = "" if c.experts is None else f"  experts/layer {c.experts:5.1f}"
        if c.repeat_seconds is not None:
            moe += f"  (one token repeated: {c.repeat_seconds * 1e3:.2f} ms, experts/layer {c.repeat_experts:.1f})"
        say(f"K={c.k}  rows={c.rows}  {c.seconds * 1e3:8.2f} ms  x{c.relative:.2f} of the step  "
            f"x{c.relative_to_loop:.2f} of the loop{moe}")
    info = engine.info
    moe = None
    if t.costs[0].experts is not None:
        moe = {"experts": info.num_experts, "experts_per_token": info.experts_per_token,
               "one_row_experts": t.costs[0].experts, "marginal_expert_s": t.marginal_expert_s,
               "note": ("experts = distinct experts per MoE layer (mean over layers, median over repeats) "
                        "that the rows selected, read from the routing counters; repeat_* = the same row "
                        "count with one token repeated; marginal_expert_s = median over K of the time "
                        "difference over the union difference at equal rows")}
    bench = {"kind": "speculative_verify_cost", "context_tokens": context,
             "one_row": {"step": {"kind": t.step_kind, "seconds": t.step_s},
                         "loop": {"kind": "layer_loop", "seconds": t.loop_s}},
             "graph_error": t.graph_error, "rollback_window": window,
             "verify_cost": [dataclasses.asdict(c) for c in t.costs],
             "expected_speedup_by_acceptance": {"vs_step": tables["step"], "vs_loop": tables["loop"]},
             "moe": moe}
    notes = (f"verify cost: forward over K+1 random token ids after {context} random ids; `relative` is to "
             f"the one-row step plain decoding runs ({t.step_kind}), `relative_to_loop` to a one-row forward "
             "through the layer loop; expected speedups assume a free draft "
             "(n-gram) and independent acceptance")
    fields: dict[str, Any] = {"prompt_tokens": context, "notes": notes, "bench": bench}
    if forced:
        prompt = list(range(1, context + 1))
        plain_tps = forced_acceptance_decode(engine, prompt, 0, n_tokens)
        by_k = {k: forced_acceptance_decode(engine, prompt, k, n_tokens) for k in FORCED_K}
        best = max(by_k, key=by_k.get)
        fields.update(decode_tps=by_k[best], baseline={"name": "plain", "decode_tps": plain_tps},
                      draft={"mode": "forced_acceptance", "draft_tokens": best, "acceptance_rate": 1.0,
                             "decode_tps_by_k": by_k})
        bench["forced_acceptance"] = {
            "label": "FORCED ACCEPTANCE: every draft kept regardless of the target; times the verify path only",
            "tokens": n_tokens, "plain_tps": plain_tps, "decode_tps_by_k": by_k,
            "speedup_by_k": {k: v / plain_tps for k, v in by_k.items()}}
        fields["notes"] += "; FORCED ACCEPTANCE: every draft kept regardless of the target, to time the verify path only"
        for k, tps in by_k.items():
            say(f"forced acceptance K={k}: {tps:.1f} tok/s (plain {plain_tps:.1f}, x{tps / plain_tps:.2f})")
    return fields
