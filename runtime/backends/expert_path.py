"""The GPU engines' side of the CPU-path decision (runtime/offload/path_judge.py): time decode
steps with the CPU expert path on and off (more rounds where they are close), keep the faster; at the
first load of a model at a budget on a machine, behind the progress, then saved in the user cache
(`decision_key`) and reused by later loads; again in the worker's idle time when the live steps drift.
Each step of a trial is bounded (a switch of the path, or, building the CPU copies, one MoE layer's
copies; one graph capture; or a run of `TRIAL_CHUNK` decode steps: untimed ones letting the CPU path's
cut settle first, once a trial (later rounds find the cut where it was), then a path's `TRIAL_STEPS`
timed ones), so an idle-time trial delays a new command by one of them at most; commands between the steps may
move the cache, drop graphs or change what the timings stand on (`trial` says what it does about
each). The timed steps decode the model's own greedy continuation of a random token past the cache's
end (as an answer decodes); the cache is rolled back after each run (the engine's `hold_position` where
it has one: the Qwen3.5 engine's DeltaNet states cannot be truncated past its rollback window without
replaying the conversation).

Both GPU engines (runtime/backends/exl2.py, hybrid.py) provide what the trial uses: gpu_engine.GpuEngine's
`offload`, `setup`, `path_judge`, `decision_save`, `_trial` and `_drop_graphs`, and `info`, `vocab`,
`position`, `forward`, `truncate`, `graphs`, `_prepare_graph`, `prepare_graphs`; each keeps a `StepClock`
for the drift check. The decisions are saved in the user cache (path_judge.decisions_file), keyed by
what one is valid for (path_judge.key_for)."""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Generator, Iterator, Optional

import torch

from runtime.engine import ProgressFn, offered, random_tokens
from runtime.offload.path_judge import (TRIAL_CHUNK, TRIAL_STEPS, PathJudge, decisions_file, key_for, read_decision,
                                       write_decision)


def make_judge(manager, prior: Optional[dict] = None) -> PathJudge:
    """The judge for a manager just placed: its policy, its predicted gain, what rules the path out,
    and the decision saved by an earlier load (`prior`)."""
    return PathJudge(policy=manager.cpu.policy, predicted_gain=manager.cpu.predicted_gain,
                     unavailable=manager.cpu.unavailable, running=current_path(manager), prior=prior)


def decision_key(engine) -> str:
    """What the engine's decision is saved under: the model, budget and machine (key_for), and the
    forced routing a benchmark runs (a path timed under it says nothing of the model's own routing)."""
    key = key_for(engine.info.path, engine.setup)
    experiment = getattr(engine, "experiment", None)
    if getattr(experiment, "forced_routing", None) is not None:
        key += f"|forced routing {getattr(experiment, 'routing_label', '') or 'unnamed'}"
    if getattr(experiment, "trial_stream", False):
        key += "|trials on a random token stream"
    return key


def current_path(manager) -> str:
    return "cpu" if manager.cpu.active else "stream"


class StepClock:
    """One-row decode steps' wall time (start to next start, pauses over 1 s left out), handed to the
    expert-path judge for its drift check: an engine ticks it at the start of every forward."""

    def __init__(self) -> None:
        self.last: Optional[float] = None         # when the last one-row forward started

    def tick(self, rows: int, judge: Optional[PathJudge]) -> None:
        t = time.perf_counter()
        if judge is not None and self.last is not None and t - self.last < 1.0:
            judge.observe_step(t - self.last)
        self.last = t if rows == 1 else None


@contextmanager
def _rolled_back(engine, position: int):
    try:
        yield
    finally:
        engine.truncate(position)


def time_decode_steps(engine, steps: int = TRIAL_STEPS, seed: int = 0) -> list[float]:
    """Wall time of `steps` one-row decode steps from the cache position, timed as the decode loop
    times them: each feeds the argmax of the step before (the model's own greedy text, routed as its
    answers route, not random tokens whose experts answers rarely use), at the next position, and
    ends when the token is read back on the host. Starts from a random token, untimed (the first
    step after a switch); the cache is rolled back afterwards. Under a benchmark's `trial_stream`
    experiment the steps are fed a fixed random stream instead (the argmax still read back)."""
    g = torch.Generator().manual_seed(seed)
    token = random_tokens(engine, 1, g, engine.vocab)[0]
    stream = None
    if getattr(getattr(engine, "experiment", None), "trial_stream", False):
        stream = random_tokens(engine, max(1, steps), g, engine.vocab)
    pos0 = engine.position
    room = engine.info.context_length - pos0 - 1
    out: list[float] = []
    if room < 2:                                          # the cache is full: nothing can be timed here
        return out
    judge = getattr(engine, "path_judge", None)
    engine.path_judge = None                              # these steps are no live decoding (drift, verdict)
    hold = getattr(engine, "hold_position", None)
    try:
        with hold() if hold is not None else _rolled_back(engine, pos0):
            # the argmax among what the decoders may sample (a refused token fed back would be refused)
            token = int(offered(engine, engine.forward([token]))[-1].argmax().item())     # untimed
            for i in range(max(1, min(steps, room - 1))):
                t0 = time.perf_counter()
                fed = token if stream is None else stream[i]
                token = int(offered(engine, engine.forward([fed]))[-1].argmax().item())
                out.append(time.perf_counter() - t0)
    finally:
        engine.path_judge = judge
    return out


def switch_path(engine, on: bool, reason: str, keep: bool = False) -> Generator[str, None, bool]:
    """The CPU path on or off (its CPU share's set_path_steps: building the copies takes a step per
    MoE layer, and commands may run between the steps, on the GPU-only path); graphs dropped before,
    and after where steps were yielded (a command's captures ran the GPU-only path). Closed midway,
    the copies made so far are freed. Returns whether the CPU path runs."""
    engine._drop_graphs()
    steps = engine.offload.cpu.set_path_steps(on, reason, keep)
    stepped = False
    try:
        while True:
            try:
                message = next(steps)
            except StopIteration as stop:
                active = stop.value
                break
            stepped = True
            yield message
    finally:
        steps.close()
    if stepped:
        engine._drop_graphs()
    return active


def _footing(engine) -> tuple:
    """What a trial's timings stand on: the manager (None once the engine closed), the judge the
    engine consults, the experiment its forwards run under (benchmarks' forced routing)."""
    return engine.offload, getattr(engine, "path_judge", None), getattr(engine, "experiment", None)


def _moved(engine, footing: tuple) -> bool:
    return any(now is not then for now, then in zip(_footing(engine), footing))


def _capture_decode_graph(engine) -> bool:
    """The one-row decode graph of the cache position's bucket captured where it is missing (graphs
    dropped by a switch or a command, the position moved by an answer); True when one was captured."""
    from runtime.backends.exl2_graph import bucket
    graphs = getattr(engine, "graphs", None)
    if graphs is None:
        return False
    L = bucket(engine.position, 1, engine.info.context_length)
    return (L, 1) not in graphs.captured() and bool(engine._prepare_graph(L, 1))


def _cut(engine) -> tuple:
    """The CPU path's cut (None: no cut) and how many times it has moved since its build."""
    cpu = getattr(engine.offload, "cpu", None)
    return getattr(cpu, "cut", None), len(getattr(cpu, "cut_log", None) or ())


def _traffic(engine) -> Optional[tuple[int, int, int, int]]:
    """Expert traffic so far, summed over the MoE layers: (hits, pairs, pairs the CPU computed, ns the
    CPU path's worker spent); None where the engine has no offloaded layers to ask."""
    layers = getattr(engine.offload, "layers", None)
    if not layers:
        return None
    hits = pairs = cpu_pairs = cpu_ns = 0
    for lo in layers:
        h, n = lo.hit_counts()
        ns, _, c, _ = lo.cpu.counters() if lo.cpu is not None else (0, 0, 0, 0)
        hits, pairs, cpu_pairs, cpu_ns = hits + h, pairs + n, cpu_pairs + c, cpu_ns + ns
    return hits, pairs, cpu_pairs, cpu_ns


def _run_figures(before, after, steps: int) -> dict:
    """One run's traffic (two `_traffic` readings around it, `steps` forwards): its hit rate, and the
    CPU's pairs and milliseconds per step."""
    if before is None or after is None or steps < 1:
        return {}
    hits, pairs, cpu_pairs, cpu_ns = (b - a for a, b in zip(before, after))
    return {"hit_rate": round(hits / pairs, 3) if pairs > 0 else None,
            "cpu_pairs_per_step": round(cpu_pairs / steps, 1), "cpu_ms_per_step": round(cpu_ns / steps / 1e6, 2)}


SETTLE_MAX_STEPS = 128     # untimed decode steps at most, letting the CPU path's cut settle before it is timed
SETTLE_QUIET_RUNS = 2      # ... ended early after this many runs in a row that left the cut where it was


def _run(engine, path: str, footing: tuple, steps: int, seed: int) -> Generator[str, None, Optional[list[float]]]:
    """One run of `steps` one-row decode steps of `path` from the cache position (time_decode_steps),
    the decode graph of its bucket captured first where missing, in a step of its own; None, nothing
    run, where the engine changed under it (see `trial`)."""
    while True:
        if _moved(engine, footing) or current_path(engine.offload) != path:
            return None
        if not _capture_decode_graph(engine):
            return time_decode_steps(engine, steps, seed=seed)
        yield "decode graph captured"


def _settle(engine, path: str, footing: tuple) -> Generator[str, None, bool]:
    """The CPU path in cut mode adapts while it decodes: every REBALANCE_EVERY one-row steps its cut
    moves to a faster neighbour or tries one not yet measured (cpu_share.rebalance). Timed right after a
    switch it would be judged at a cut still climbing, so first untimed runs of TRIAL_CHUNK steps (a
    step each) until SETTLE_QUIET_RUNS in a row leave the cut put, or SETTLE_MAX_STEPS. Nothing to do
    for the GPU-only path or a CPU path without a cut. False where the engine changed under it."""
    if path != "cpu" or _cut(engine)[0] is None:
        return True
    done = quiet = 0
    while done < SETTLE_MAX_STEPS and quiet < SETTLE_QUIET_RUNS:
        moves = _cut(engine)[1]
        run = yield from _run(engine, path, footing, min(TRIAL_CHUNK, SETTLE_MAX_STEPS - done), 10_000 + done)
        if run is None:
            return False
        if not run:                        # the cache is full: nothing can run here
            break
        done += len(run)
        cut, now = _cut(engine)
        quiet = quiet + 1 if now == moves else 0
        yield f"letting the CPU path's cut settle ({cut} rows, {done} steps)"
    return True


def _time_path(engine, judge: PathJudge, path: str, footing: tuple, settle: bool = True
               ) -> Generator[str, None, bool]:
    """`TRIAL_STEPS` decode steps of the running path, in runs of `TRIAL_CHUNK` (a step each, from
    the cache position then, its decode graph captured first where missing, in a step of its own),
    recorded with the judge as one round's; False, nothing recorded, where the engine changed under
    the timing (see `trial`). A run shorter than asked (the cache nearly full) ends the timing.
    settle: let the CPU path's cut settle first (`_settle`); a later round of the same trial finds
    the cut where the last timing left it (switching back restores it) and times at once."""
    label = "with" if path == "cpu" else "without"
    samples: list[float] = []
    run_ms: list[float] = []
    if settle and not (yield from _settle(engine, path, footing)):
        return False
    cut0, moves0 = _cut(engine)
    runs: list[dict] = []                  # per run: its traffic (hit rate, the CPU's share), its cut at the end
    while True:
        want = min(TRIAL_CHUNK, TRIAL_STEPS - len(samples))
        before = _traffic(engine)
        run = yield from _run(engine, path, footing, want, len(samples))      # each run its own text
        if run is None:
            return False
        samples += run
        if run:
            run_ms.append(statistics.median(run) * 1e3)
            runs.append({**_run_figures(before, _traffic(engine), len(run) + 1), "cut": _cut(engine)[0]})
        done = len(run) < want or len(samples) >= TRIAL_STEPS
        if done:
            judge.record(path, samples)
            cut1, moves1 = _cut(engine)
            judge.note_timing(path, run_ms, (cut0, cut1), moves1 - moves0, runs=runs,
                              threads=getattr(getattr(engine.offload, "cpu", None), "team", None))
        yield f"timed {label} the CPU path ({len(samples)}/{TRIAL_STEPS} steps)"
        if done:
            return True


def trial(engine, judge: PathJudge, save: Optional[tuple[Path, str]] = None) -> Iterator[str]:
    """Measure the judge's paths (the one running first; more rounds, alternating, where they are
    close), then run the faster; yields a message after each bounded step. save: (file, key) where a
    measured decision is written.

    In idle time a command (a whole answer) may run between any two steps. What it can change, and
    what the trial does about it:
    - the cache position (an answer decoded, a truncate): each run of timed steps starts from the
      position then and rolls the cache back to it; the graph of its bucket is captured first;
    - the graphs (dropped by a command's switch, placement or experiment, or `reset_graphs`): the
      decode graph is captured again before the next run;
    - the path running, the manager (the engine closed), the judge the engine consults (a new budget,
      `recheck_placement`) or the experiment (forced routing): the timings would mix conditions, so
      the trial ends (`judge.abandon`: its steps dropped, the path left as it runs); a judge still
      the engine's keeps asking, and the next idle step starts a trial afresh.
    Closed midway (the generator; `settle_cpu_path` closes an idle-time one), the same: a CPU-path
    build in progress frees its copies, the cache was rolled back within the step that moved it; closed
    while switching to the path it chose, the judge asks to measure again.

    However it ends, the CPU copies set aside while the GPU-only path was timed are freed: kept, they
    held their host RAM under a GPU-only verdict, and a later trial (other statistics, another
    placement's promotions) would have timed copies planned for this one's."""
    manager = engine.offload
    try:
        yield from _trial(engine, manager, judge, save)
    finally:
        manager.cpu.release_parked()


def _trial(engine, manager, judge: PathJudge, save: Optional[tuple[Path, str]]) -> Iterator[str]:
    footing = _footing(engine)
    paths = sorted(judge.plan(), key=lambda p: p != current_path(manager))
    timed: set[str] = set()                # paths timed in an earlier round (the CPU path's cut settled)
    decided = False
    try:
        while paths:
            for path in paths:
                if _moved(engine, footing):
                    return
                if current_path(manager) != path:
                    if not (yield from switch_path(engine, path == "cpu", "measuring the GPU-only path", keep=True)):
                        if path == "cpu":
                            judge.record("cpu", None, manager.cpu.reason)
                            yield f"the CPU path could not be built ({manager.cpu.reason})"
                            continue
                    yield f"switched to the {'CPU' if path == 'cpu' else 'GPU-only'} expert path"
                if not (yield from _time_path(engine, judge, path, footing, settle=path not in timed)):
                    return
                timed.add(path)
            paths = paths[::-1] if judge.needs_another_round() else []
        if _moved(engine, footing):
            return
        best = judge.decide()
        decided = True
    finally:
        if not decided:
            judge.abandon()
    if current_path(manager) != best:
        switched = False
        try:
            yield from switch_path(engine, best == "cpu", judge.reason)
            switched = True
        finally:
            if not switched:               # closed midway: the path the judge chose does not run; measure again
                judge.ask_again()
        yield "kept the faster path"
    if best == "stream":
        manager.cpu.reason = judge.reason
    if save is not None and judge.fresh:
        write_decision(save[0], save[1], judge)


def set_vram_budget(engine, vram_budget_gb: float) -> None:
    """Either engine's `set_vram_budget` (benchmarks): the offloaded experts placed again for another
    VRAM budget without reloading (gpu_offload.replace_for_budget), captured graphs (which hold the
    old slots' addresses) dropped first; the CPU path then by the prediction until `recheck_placement`
    (saved decisions are per budget: none is saved until then)."""
    from runtime.backends.gpu_offload import replace_for_budget
    engine._drop_graphs()
    replace_for_budget(engine.setup, engine.offload, vram_budget_gb)
    engine.path_judge = make_judge(engine.offload)
    engine.path_judge.decide()
    engine.decision_save = None


def idle_trial_step(engine) -> bool:
    """Either engine's idle work, first: a step of the expert-path trial in progress, or a new trial
    where the live decode steps drifted from the choice; False when there is neither."""
    if engine._trial is not None:
        try:
            next(engine._trial)
        except StopIteration:
            engine._trial = None
        return True
    if engine.path_judge is not None and engine.path_judge.wants_recheck():
        engine._trial = trial(engine, engine.path_judge, engine.decision_save)
        return True
    return False


def settle_cpu_path(engine, progress: ProgressFn, measure: bool = False, load: bool = False) -> None:
    """At load, after the warm-up: the CPU path as saved by an earlier load of this model at this
    budget on this machine, else decided by timing both and saved; with `measure` both are timed
    whatever was saved (which then stays unless the other is clearly faster). Then the load's
    graphs not captured yet (at load: all of them; after a switch: those it dropped). `load`: first
    the routing prior where the model has no saved statistics (routing_prior.py), so the paths are
    timed on the placement the answers get."""
    from runtime.backends.gpu_offload import cpu_path_applied
    if load:
        from runtime.backends.routing_prior import measure_at_load
        measure_at_load(engine, progress)
    stale, engine._trial = getattr(engine, "_trial", None), None
    if stale is not None:                                   # an idle-time trial in progress: ended (`trial`)
        stale.close()
    save = (decisions_file(), decision_key(engine))
    judge = engine.path_judge = make_judge(engine.offload, read_decision(*save))
    engine.decision_save = save
    if measure:
        judge.ask_again()
    if judge.plan():
        runs = -(-TRIAL_STEPS // TRIAL_CHUNK)               # per path: a capture, the runs of timed steps
        n = (1 + runs) * len(judge.plan()) + 3             # one round (close medians take more)
        n += SETTLE_MAX_STEPS // TRIAL_CHUNK if "cpu" in judge.plan() else 0      # the cut settling, at most
        if not engine.offload.cpu.active:                  # building the CPU copies: a step per layer, + 1
            n += len(getattr(engine.offload, "layers", ())) + 1
        for i, msg in enumerate(trial(engine, judge, save)):
            progress("warmup", f"Choosing the expert path: {msg}", min(i, n - 1), n)
    else:
        judge.decide()
        if judge.path != current_path(engine.offload):      # the saved path (or, today never, the prediction's)
            engine._drop_graphs()
            engine.offload.cpu.set_path(judge.path == "cpu", judge.reason)
            if judge.path == "stream":
                engine.offload.cpu.reason = judge.reason
        progress("warmup", f"Expert path: {judge.summary()}", 1, 1)
    engine.prepare_graphs(progress)                         # the load's graphs, on the path that runs
    cpu_path_applied(engine.setup, engine.offload, judge.summary())
