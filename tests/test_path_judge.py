"""The CPU-path decision ("auto" placement) from measured decode steps, with injected step times."""
from __future__ import annotations

import random

import pytest

from runtime.offload.path_judge import (CLOSE, DRIFT_WINDOW, MAX_ROUNDS, RECHECK_STEPS, TRIAL_CHUNK, TRIAL_STEPS,
                                        PathJudge, read_decision, write_decision)

RUNS = -(-TRIAL_STEPS // TRIAL_CHUNK)       # runs of timed steps per path and round (a step each)


def steps(mean_ms: float, rng: random.Random, noise: float = 0.08, n: int = TRIAL_STEPS) -> list[float]:
    """Decode step times around a mean, with noise and an occasional stall."""
    out = [mean_ms / 1e3 * (1 + rng.uniform(-noise, noise)) for _ in range(n)]
    out[rng.randrange(n)] *= 10
    return out


def judged(gain: float, cpu_ms: float, stream_ms: float, seed: int, j: PathJudge | None = None) -> PathJudge:
    """A decision as the trial makes it: rounds of both paths while they are too close to call."""
    rng = random.Random(seed)
    j = j or PathJudge("auto", predicted_gain=gain)
    paths = j.plan()
    while paths:
        for path in paths:
            j.record(path, steps(cpu_ms if path == "cpu" else stream_ms, rng))
        paths = paths[::-1] if j.needs_another_round() else []
    j.decide()
    return j


@pytest.mark.parametrize("cpu_ms, stream_ms, want", [(25.2, 34.1, "cpu"),     # the H200's 39.6 vs 29.3 tok/s
                                                     (34.1, 25.2, "stream"),
                                                     (25.0, 25.4, "stream")])  # a tie: the CPU stays free
def test_five_loads_choose_the_same_path_whatever_the_noisy_prediction(cpu_ms, stream_ms, want):
    # the prediction itself wanders between loads (the H200 saw "a gain of 0%" once among gains that turned the path on)
    gains = [0.0, 0.12, -0.2, 0.24, 0.05]
    chosen = [judged(g, cpu_ms, stream_ms, seed).path for seed, g in enumerate(gains)]
    assert chosen == [want] * 5
    j = judged(0.0, cpu_ms, stream_ms, 0)
    assert set(j.step_ms) == {"cpu", "stream"} and "measured" in j.reason


def test_a_saved_decision_is_reused_untimed_and_said_so():
    """The first load times both paths even where the prediction looks clear (the H200's predictions
    wandered from 0% to +76%); a later load with the saved decision runs it without timing."""
    j = PathJudge("auto", predicted_gain=CLOSE + 0.3)
    assert j.plan() == ["cpu", "stream"]
    prior = {"path": "stream", "step_ms": {"cpu": 30.0, "stream": 29.0}, "reason": "measured: ..."}
    j = PathJudge("auto", predicted_gain=CLOSE + 0.3, running="cpu", prior=prior)
    assert j.plan() == [] and j.decide() == "stream" and "earlier load" in j.reason
    assert j.step_ms == {"cpu": 30.0, "stream": 29.0} and j.telemetry()["reused"] and not j.fresh


def test_close_medians_take_more_rounds_clear_ones_do_not():
    j = judged(0.0, 25.0, 34.0, 3)
    assert j.path == "cpu" and "rounds" not in j.reason and j.fresh
    j = judged(0.0, 26.0, 26.5, 3)                    # within NOISE: as many rounds as allowed
    assert "(3 rounds)" in j.reason and MAX_ROUNDS == 3


def test_a_measured_path_is_left_only_for_one_clearly_faster():
    """Hysteresis: once measured, the path stays unless the other is faster by more than TIE."""
    j = judged(0.0, 25.0, 34.0, 1)
    assert j.path == "cpu"
    j.ask_again()
    judged(0.0, 25.5, 24.8, 2, j)                    # stream 3% faster: within TIE, cpu stays
    assert j.path == "cpu" and "stays" in j.reason
    j.ask_again()
    judged(0.0, 25.5, 20.0, 4, j)                    # stream 22% faster: it runs
    assert j.path == "stream"
    j = judged(0.0, 25.2, 25.6, 5, PathJudge("auto", 0.0, prior={"path": "cpu"}))   # prior measured: kept
    assert j.plan() == [] and j.path == "cpu"
    j = PathJudge("auto", 0.0, prior={"path": "cpu"})
    j.ask_again()
    assert judged(0.0, 25.6, 25.2, 6, j).path == "cpu"     # re-measured within TIE: the saved path stays


def test_five_loads_with_the_saved_decision_choose_the_same_path(tmp_path):
    """The first load measures and saves; the next four read it, whatever their own noise would say."""
    file, key = tmp_path / "decisions.json", "model|24 GiB|host"
    chosen, timed = [], []
    for load, (cpu_ms, stream_ms) in enumerate([(25.0, 25.9), (26.5, 24.0), (24.0, 26.0), (27.0, 24.5), (25, 25)]):
        j = judged(0.0, cpu_ms, stream_ms, load, PathJudge("auto", 0.0, prior=read_decision(file, key)))
        if j.fresh:
            write_decision(file, key, j)
        chosen.append(j.path)
        timed.append(j.trials)
    assert chosen == [chosen[0]] * 5 and timed == [1, 0, 0, 0, 0]
    assert read_decision(file, "another model|24 GiB|host") is None
    file.write_text("{not json")
    assert read_decision(file, key) is None            # a damaged file: measured again, then rewritten
    write_decision(file, key, j)
    assert read_decision(file, key)["path"] == j.path


def test_the_users_choice_and_an_impossible_path_are_not_measured():
    assert PathJudge("cpu", 0.0).plan() == [] and PathJudge("cpu", 0.0).decide() == "cpu"
    assert PathJudge("stream", 0.0).decide() == "stream"
    j = PathJudge("auto", None, unavailable="host RAM is short for the CPU copies")
    assert j.plan() == [] and j.decide() == "stream" and "host RAM" in j.summary()


def test_a_cpu_path_that_cannot_be_built_leaves_the_gpu_path():
    j = PathJudge("auto", 0.0)
    j.record("cpu", None, "page-locked host memory ran out for the CPU path's buffers")
    j.record("stream", [0.03] * TRIAL_STEPS)
    assert j.decide() == "stream"
    assert j.reason == "the CPU path could not be built: page-locked host memory ran out for the CPU path's buffers"
    assert "(host RAM)" not in j.summary()


def test_drift_and_age_ask_for_a_new_measurement():
    j = judged(0.0, 25.0, 34.0, 1)
    assert j.path == "cpu"
    for _ in range(DRIFT_WINDOW):
        j.observe_step(0.0255)                       # as measured
    assert not j.wants_recheck()
    for _ in range(DRIFT_WINDOW):
        j.observe_step(0.040)                         # conditions changed (routing, the machine's load)
    assert j.wants_recheck() and j.plan() == ["cpu", "stream"]
    assert j.reason.count("measuring again") == 1 and j.wants_recheck()
    j = judged(0.0, 25.0, 34.0, 1)                    # answers route unlike the trial's random tokens:
    for _ in range(4 * DRIFT_WINDOW):                 # steady live steps far from the trial's are no drift
        j.observe_step(0.010)
    assert not j.wants_recheck()
    j = PathJudge("auto", predicted_gain=0.9)         # decided by the prediction: the first window is its baseline
    j.decide()
    for _ in range(RECHECK_STEPS):
        j.observe_step(0.02)
    assert j.wants_recheck() and j.plan() == ["cpu", "stream"]
    assert not PathJudge("cpu", 0.0).wants_recheck()
    t = j.telemetry()
    assert {"path", "reason", "step_ms", "predicted_gain", "summary"} <= set(t)


class FakeManager:
    """The manager's side of a switch: its CPU share (here the fake itself, `cpu`): whether the CPU path runs,
    and whether it can be built."""

    def __init__(self, cpu: bool, gain: float, buildable: bool = True):
        self.active, self.predicted_gain, self.buildable = cpu, gain, buildable
        self.policy, self.unavailable, self.reason = "auto", "", ""
        self.switches = 0
        self.build_steps = 0           # steps set_path_steps yields before a switch on takes effect
        self.abandoned = 0             # ... and how often it was closed before that
        self.released = 0              # trials' ends: the CPU copies set aside freed

    @property
    def cpu(self):
        return self

    def set_path(self, on: bool, reason: str = "", keep: bool = False) -> bool:
        self.switches += 1
        self.active = on and self.buildable
        return self.active

    def release_parked(self) -> None:
        self.released += 1

    def set_path_steps(self, on: bool, reason: str = "", keep: bool = False):
        done = False
        try:
            for i in range(self.build_steps if on and not self.active else 0):
                yield f"copied layer {i}"
            done = True
        finally:
            self.abandoned += not done
        return self.set_path(on, reason, keep)


class FakeGraphs:
    def __init__(self):
        self.shapes: set[tuple[int, int]] = set()

    def captured(self):
        return sorted(self.shapes)


class FakeEngine:
    """The engine's side of a trial: the cache position, the captured graphs, the judge it consults."""

    def __init__(self, manager):
        self.offload, self.position = manager, 0
        self.info = type("Info", (), {"context_length": 4096})()
        self.graphs = FakeGraphs()
        self.path_judge = self.experiment = None
        self.dropped = self.captured = 0

    def _drop_graphs(self):
        self.dropped += 1
        self.graphs.shapes.clear()

    def _prepare_graph(self, L, T):
        if (L, T) in self.graphs.shapes:
            return False
        self.captured += 1
        self.graphs.shapes.add((L, T))
        return True


def fake_timing(monkeypatch, cpu_ms: float, stream_ms: float, seed: int = 0, log: list | None = None):
    """time_decode_steps replaced: noisy step times of the path that runs; each run logged as
    (path, steps asked, cache position), and checked to find its bucket's decode graph captured."""
    from runtime.backends import expert_path as xp
    from runtime.backends.exl2_graph import bucket
    rng = random.Random(seed)

    def timed(e, n=TRIAL_STEPS, seed=0):
        path = "cpu" if e.offload.cpu.active else "stream"
        if isinstance(e, FakeEngine):
            assert (bucket(e.position, 1, e.info.context_length), 1) in e.graphs.captured()
        if log is not None:
            log.append((path, n, e.position))
        return steps(cpu_ms if path == "cpu" else stream_ms, rng, n=n)

    monkeypatch.setattr(xp, "time_decode_steps", timed)


@pytest.mark.parametrize("starts_on, cpu_ms, stream_ms, want, switches", [
    (False, 25.2, 34.1, "cpu", 1),          # planned off, measured faster on: one switch, stays on
    (True, 25.2, 34.1, "cpu", 2),           # planned on: off to measure, back on
    (True, 34.1, 25.2, "stream", 1)])
def test_trial_times_both_paths_in_bounded_steps_and_keeps_the_faster(monkeypatch, starts_on, cpu_ms, stream_ms,
                                                                      want, switches):
    from runtime.backends import expert_path as xp
    manager = FakeManager(starts_on, 0.05)
    engine = FakeEngine(manager)
    fake_timing(monkeypatch, cpu_ms, stream_ms)
    judge = xp.make_judge(manager)
    messages = list(xp.trial(engine, judge))
    assert judge.path == want and manager.cpu.active == (want == "cpu")
    assert manager.switches == switches and engine.dropped == switches
    assert manager.released == 1                          # the copies set aside, if any, freed at the end
    assert len(messages) == 2 * (1 + RUNS) + switches    # per path: capture, the runs of timing; each switch
    assert set(judge.step_ms) == {"cpu", "stream"}


def test_trial_when_the_cpu_path_cannot_be_built(monkeypatch):
    from runtime.backends import expert_path as xp
    manager = FakeManager(False, 0.0, buildable=False)
    engine = FakeEngine(manager)
    manager.cpu.reason = "the RAM budget is short for the CPU copies (... needs 9 GiB of RAM but only 2 GiB ...)"
    monkeypatch.setattr(xp, "time_decode_steps", lambda e, n=TRIAL_STEPS, seed=0: [0.03] * n)
    judge = xp.make_judge(manager)
    messages = list(xp.trial(engine, judge))
    assert judge.path == "stream" and not manager.cpu.active
    assert judge.reason.startswith("the CPU path could not be built: the RAM budget is short")
    assert any("the RAM budget is short" in m for m in messages)       # the load's progress says it too



def test_trial_builds_the_cpu_copies_a_step_at_a_time(monkeypatch):
    """In idle time a command waits for one step at most: building the CPU path yields after each
    layer's copies, graphs are dropped again after it (a command between the steps captured the
    GPU-only path's), and a trial abandoned midway closes the build (its copies freed)."""
    from runtime.backends import expert_path as xp
    monkeypatch.setattr(xp, "time_decode_steps",
                        lambda e, n=TRIAL_STEPS, seed=0: [0.025 if e.offload.cpu.active else 0.034] * n)
    manager = FakeManager(False, 0.05)
    manager.build_steps = 3
    engine = FakeEngine(manager)
    messages = list(xp.trial(engine, xp.make_judge(manager)))
    assert manager.cpu.active and [m for m in messages if m.startswith("copied")] == ["copied layer 0", "copied layer 1",
                                                                                      "copied layer 2"]
    assert len(messages) == 2 * (1 + RUNS) + 1 + 3 and engine.dropped == 2 and manager.abandoned == 0
    manager = FakeManager(False, 0.05)
    manager.build_steps = 3
    trial = xp.trial(FakeEngine(manager), xp.make_judge(manager))
    while next(trial) != "copied layer 1":
        pass
    trial.close()
    assert manager.abandoned == 1 and manager.switches == 0 and not manager.cpu.active

def _recording(judge: PathJudge) -> list[tuple[str, int]]:
    """The judge's record calls as (path, samples), the judge still recording them."""
    seen, record = [], judge.record

    def spy(path, step_seconds, why=""):
        seen.append((path, len(step_seconds or ())))
        record(path, step_seconds, why)

    judge.record = spy
    return seen


def test_an_idle_trial_times_each_path_in_runs_yielding_between_them(monkeypatch):
    """A command that arrives while a path is timed waits for one run of TRIAL_CHUNK steps, not all
    TRIAL_STEPS: each step of the trial times one run at most; the judge still gets all TRIAL_STEPS
    of each path as one round's (the rounds and medians as before)."""
    from runtime.backends import expert_path as xp
    manager = FakeManager(False, 0.05)
    engine = FakeEngine(manager)
    log = []
    fake_timing(monkeypatch, 25.0, 25.4, log=log)          # close: more rounds
    judge = xp.make_judge(manager)
    seen = _recording(judge)
    per_step = []
    for _ in xp.trial(engine, judge):
        per_step.append(len(log) - sum(per_step))
    assert max(per_step) == 1 and all(n <= TRIAL_CHUNK for _, n, _ in log)
    assert TRIAL_CHUNK < TRIAL_STEPS and len(log) == 2 * MAX_ROUNDS * RUNS
    assert seen == [(p, TRIAL_STEPS) for p in ["stream", "cpu", "cpu", "stream", "stream", "cpu"]]
    assert judge.trials == 1 and "(3 rounds)" in judge.reason


def test_commands_between_the_runs_leave_the_timing_correct(monkeypatch):
    """Between two runs of timed steps an answer moves the cache (past a bucket, or back) and a
    command drops the graphs: the next run starts from the position then, with its bucket's decode
    graph captured first (in a step of its own: fake_timing checks it), and the judge gets every step."""
    from runtime.backends import expert_path as xp
    manager = FakeManager(True, 0.05)
    engine = FakeEngine(manager)
    log = []
    fake_timing(monkeypatch, 25.0, 34.0, log=log)
    judge = engine.path_judge = xp.make_judge(manager)
    seen = _recording(judge)
    trial, moves, messages = xp.trial(engine, judge), iter([300, 17, 1000, 0, 600, 4000]), []
    for msg in trial:
        messages.append(msg)
        if msg.startswith("timed"):                        # a command between two steps of the trial
            engine.position = next(moves, engine.position)
            engine._drop_graphs()
    assert [pos for _, _, pos in log] == [0, 300, 17, 1000, 0, 600, 4000, 4000]
    assert seen == [("cpu", TRIAL_STEPS), ("stream", TRIAL_STEPS)] and judge.path == "cpu" and manager.cpu.active
    assert sum(m == "decode graph captured" for m in messages) == len(log)      # recaptured before each run
    assert judge.step_ms["cpu"] < judge.step_ms["stream"] and not judge.wants_recheck()


@pytest.mark.parametrize("command", ["switched the path", "replaced the judge", "closed the engine",
                                     "ran an experiment"])
def test_a_trial_the_engine_changed_under_ends_and_starts_afresh(monkeypatch, command):
    """A command between two runs that changes what the timings stand on (the path, the judge, the
    engine, the routing) ends the trial without a decision: its steps dropped, the last decision's
    step times back, a re-measure still asked for (a new trial completes); nothing is left half-set."""
    from runtime.backends import expert_path as xp
    manager = FakeManager(True, 0.05)
    engine = FakeEngine(manager)
    fake_timing(monkeypatch, 25.0, 34.0)
    judge = engine.path_judge = xp.make_judge(manager)
    judge.record("cpu", [0.030] * TRIAL_STEPS)
    judge.record("stream", [0.020] * TRIAL_STEPS)
    judge.decide()
    decided = dict(judge.step_ms)
    judge.ask_again()
    trial = xp.trial(engine, judge)
    while next(trial) != "switched to the GPU-only expert path":     # the CPU path timed, the other begun
        pass
    assert next(trial).startswith("decode graph captured") and next(trial).startswith("timed without")
    if command == "switched the path":
        manager.cpu.active = True
    elif command == "replaced the judge":
        engine.path_judge = xp.make_judge(manager)
    elif command == "closed the engine":
        engine.offload = None
    else:
        engine.experiment = object()
    assert list(trial) == []
    assert judge._steps == {} and judge.rounds == 0 and judge.step_ms == decided and judge.trials == 1
    assert judge.path == "stream" and judge.wants_recheck()
    if command in ("switched the path", "ran an experiment"):                  # the judge is still the engine's
        list(xp.trial(engine, judge))
        assert judge.trials == 2 and judge.path == "cpu" and manager.cpu.active and not judge.wants_recheck()


def test_a_trial_closed_midway_leaves_a_valid_path_and_no_dangling_state(monkeypatch, tmp_path):
    """The trial generator closed between runs: the path as it runs, the judge's steps dropped; closed
    while building the copies of the path it chose: the build freed, the path before the switch, the
    judge asking to measure again. settle_cpu_path (a load, recheck_placement) closes an idle trial."""
    from runtime.backends import expert_path as xp
    monkeypatch.setattr(xp, "decisions_file", lambda: tmp_path / "decisions.json")
    manager = FakeManager(True, 0.05)
    engine = FakeEngine(manager)
    fake_timing(monkeypatch, 25.0, 34.0)
    judge = engine.path_judge = xp.make_judge(manager)
    trial = xp.trial(engine, judge)
    for msg in trial:
        if msg.startswith("timed without"):                # a run of the GPU-only path's timing
            break
    trial.close()
    assert judge._steps == {} and judge.step_ms == {} and judge.rounds == 0 and not manager.cpu.active
    assert manager.abandoned == 0 and judge.plan() == ["cpu", "stream"] and judge.path == ""
    assert manager.released == 1                           # the CPU copies set aside to time the other: freed
    manager.cpu.active, manager.build_steps = True, 3      # the faster (CPU) path to be built again after
    trial = xp.trial(engine, judge)
    while next(trial) != "copied layer 1":
        pass
    trial.close()
    assert manager.abandoned == 1 and not manager.cpu.active and judge.path == "cpu" and judge.wants_recheck()
    engine._trial = xp.trial(engine, judge)                # an idle re-measure in progress, then a load's settle
    while not next(engine._trial).startswith("timed"):
        pass
    stale = engine._trial
    engine.info.path, engine.prepare_graphs = str(tmp_path / "model"), lambda progress: None
    from types import SimpleNamespace
    engine.setup = SimpleNamespace(vram=SimpleNamespace(total_bytes=24 << 30), cpu_threads=0, policy="auto",
                                    applied={})
    xp.settle_cpu_path(engine, lambda *a: None)
    assert stale.gi_frame is None and engine._trial is None and judge._steps == {}
    assert engine.path_judge is not judge and engine.path_judge.trials == 1


def test_an_untimed_decision_says_what_the_prediction_placed():
    """After a new budget (set_vram_budget) the manager placed by the prediction; until timed the
    judge reports that path, not one of its own."""
    j = PathJudge("auto", predicted_gain=0.15, running="cpu")
    assert j.decide() == "cpu" and "not timed" in j.reason


def test_a_measured_trial_is_saved_and_a_close_one_alternates_rounds(monkeypatch, tmp_path):
    from runtime.backends import expert_path as xp
    manager = FakeManager(True, 0.05)
    engine = FakeEngine(manager)
    log = []
    fake_timing(monkeypatch, 25.0, 25.4, log=log)
    judge = xp.make_judge(manager)
    file = tmp_path / "d.json"
    list(xp.trial(engine, judge, (file, "k")))
    order = [path for path, _, _ in log[::RUNS]]
    assert order == ["cpu", "stream", "stream", "cpu", "cpu", "stream"]      # close: 3 rounds, alternating
    assert [path for path, _, _ in log] == [p for p in order for _ in range(RUNS)]
    saved = read_decision(file, "k")
    assert saved["path"] == judge.path and set(saved["step_ms"]) == {"cpu", "stream"}
    again = xp.make_judge(FakeManager(True, 0.05), read_decision(file, "k"))
    assert again.plan() == [] and again.decide() == judge.path


def test_loads_reuse_the_saved_path_and_a_recheck_times_again(monkeypatch, tmp_path):
    """settle_cpu_path as a load runs it: the first load times both and saves; the next (placed the
    other way by its prediction) switches to the saved path untimed; a recheck times both again."""
    from types import SimpleNamespace
    from runtime.backends import expert_path as xp
    monkeypatch.setattr(xp, "decisions_file", lambda: tmp_path / "decisions.json")
    timed = []
    fake_timing(monkeypatch, 25.0, 34.0, log=timed)

    def engine(cpu_on: bool):
        e = FakeEngine(FakeManager(cpu_on, 0.5))
        e.info.path = str(tmp_path / "model")
        e.setup = SimpleNamespace(vram=SimpleNamespace(total_bytes=24 << 30), cpu_threads=0, policy="auto",
                                   applied={})
        e.prepare_graphs = lambda progress: None
        return e

    first, shown = engine(False), []
    xp.settle_cpu_path(first, lambda stage, msg, done, total: shown.append((done, total)))
    assert first.path_judge.path == "cpu" and len(timed) == 2 * RUNS and first.offload.cpu.active
    assert len(shown) >= 2 * (1 + RUNS)                    # a message per run of timed steps
    assert all(0 <= d < t for d, t in shown) and [d for d, _ in shown] == sorted(d for d, _ in shown)
    second = engine(False)
    messages = []
    xp.settle_cpu_path(second, lambda stage, msg, d, t: messages.append(msg))
    assert len(timed) == 2 * RUNS and second.offload.cpu.active and second.path_judge.telemetry()["reused"]
    assert "earlier load" in messages[-1], messages
    assert second.setup.applied["offload.placement"].startswith("applied: CPU expert path on"), second.setup.applied
    xp.settle_cpu_path(second, lambda *a: None, measure=True)
    assert len(timed) == 4 * RUNS and second.path_judge.trials == 1


def test_the_hysteresis_note_appears_only_where_the_other_path_was_faster():
    """The H200 said "11.4 ms with the CPU path, 8.9 without (within 5% of the path already chosen,
    which stays)": the kept path was 22% faster, not within 5% of anything."""
    j = PathJudge("auto", 0.0, prior={"path": "stream"})
    j.ask_again()
    j.record("cpu", [0.0114] * TRIAL_STEPS)
    j.record("stream", [0.0089] * TRIAL_STEPS)
    assert j.decide() == "stream" and "within" not in j.reason and "stays" not in j.reason
    j.ask_again()
    j.record("cpu", [0.0255] * TRIAL_STEPS)                # the kept path faster by 2%: kept, plainly
    j.record("stream", [0.0250] * TRIAL_STEPS)
    assert j.decide() == "stream" and "stays" not in j.reason
    j.ask_again()
    j.record("cpu", [0.0250] * TRIAL_STEPS)                # the other faster by 2%: kept, said so
    j.record("stream", [0.0255] * TRIAL_STEPS)
    assert j.decide() == "stream" and "faster by less than 5%" in j.reason
    j = PathJudge("auto", 0.0, prior={"path": "cpu"})
    j.ask_again()
    j.record("cpu", [0.0250] * TRIAL_STEPS)                # kept cpu, 2% faster than stream: cpu stays
    j.record("stream", [0.0255] * TRIAL_STEPS)
    assert j.decide() == "cpu" and "stays" not in j.reason
    j.ask_again()
    j.record("cpu", [0.0255] * TRIAL_STEPS)                # stream 2% faster: cpu stays, said so
    j.record("stream", [0.0250] * TRIAL_STEPS)
    assert j.decide() == "cpu" and "faster by less than 5%" in j.reason


def test_decoding_slower_than_the_verdict_was_timed_measures_again_once():
    """A saved decision (8.9 ms a step without the CPU path, 11.4 with, under the model's routing)
    reused where decoding takes 34 ms a step (uniform routing): the verdict is timed again, in the
    worker's idle time, once; live steps faster than timed raise no doubt."""
    prior = {"path": "stream", "step_ms": {"cpu": 11.4, "stream": 8.9}, "reason": "measured: ..."}
    j = PathJudge("auto", 0.0, prior=prior)
    j.decide()
    for _ in range(DRIFT_WINDOW - 1):
        j.observe_step(0.034)
    assert not j.wants_recheck()
    j.observe_step(0.034)
    assert j.wants_recheck() and j.plan() == ["cpu", "stream"] and "34.0 ms a step, 8.9 when timed" in j.reason
    j.record("cpu", [0.050] * TRIAL_STEPS)                 # timed again: stream still, now at 33 ms
    j.record("stream", [0.033] * TRIAL_STEPS)
    j.decide()
    for _ in range(2 * DRIFT_WINDOW):                      # the same misleading steps: not timed a third time
        j.observe_step(0.060)
    assert j.path == "stream" and not j.wants_recheck()
    j = PathJudge("auto", 0.0, prior=prior)                # live faster than timed (answers reuse experts)
    j.decide()
    for _ in range(2 * DRIFT_WINDOW):
        j.observe_step(0.005)
    assert not j.wants_recheck()
    j = PathJudge("auto", 0.0, prior={"path": "stream", "step_ms": {"cpu": 40.0, "stream": 8.9}})
    j.decide()                                             # slower than timed but still faster than the other was
    for _ in range(DRIFT_WINDOW):
        j.observe_step(0.034)
    assert not j.wants_recheck()


class ReplayEngine:
    """A greedy model on the host: the next token is a function of the fed token; each step's cost
    (slept) is higher for a token it has not seen in the last few steps, as an expert not staged is."""

    def __init__(self, vocab=50, context=4096):
        import torch
        self.torch, self.vocab, self.position = torch, vocab, 0
        self.info = type("Info", (), {"context_length": context})()
        self.fed: list[tuple[int, int]] = []
        self.path_judge = "the judge"

    def forward(self, tokens):
        (t,) = tokens
        assert self.path_judge is None                 # the timed steps are not fed to the live windows
        self.fed.append((t, self.position))
        self.position += 1
        logits = self.torch.zeros(1, self.vocab)
        logits[0, (3 * t + 1) % self.vocab] = 1.0
        return logits

    def truncate(self, n):
        self.position = n


def test_the_timed_steps_decode_as_an_answer_does():
    """Each timed step feeds the argmax of the one before, at the next position (not a random token
    whose experts answers never use), and the cache ends where it began."""
    from runtime.backends.expert_path import time_decode_steps
    e = ReplayEngine()
    e.position = 100
    out = time_decode_steps(e, steps=20)
    assert len(out) == 20 and all(s >= 0 for s in out)
    toks = [t for t, _ in e.fed]
    assert all(b == (3 * a + 1) % e.vocab for a, b in zip(toks, toks[1:]))
    assert [p for _, p in e.fed] == list(range(100, 100 + 21))
    assert e.position == 100 and e.path_judge == "the judge"
    e = ReplayEngine(context=110)
    e.position = 100
    assert len(time_decode_steps(e, steps=64)) == 8 and e.position == 100   # room for 9 tokens: 1 untimed + 8


def test_a_benchmarks_trial_decodes_its_random_stream_and_is_saved_apart():
    """Under a benchmark's trial_stream experiment the timed steps are fed a fixed random stream (as
    bench.offload decodes; a random model's greedy continuation loops over a few experts), the same for the
    same seed, and the decision is keyed apart from the model's own."""
    from types import SimpleNamespace
    from runtime.backends import expert_path as xp
    from runtime.offload.experiment import NO_EXPERIMENT
    e = ReplayEngine(vocab=1000)
    e.experiment = NO_EXPERIMENT.replace(trial_stream=True)
    e.position = 100
    assert len(xp.time_decode_steps(e, steps=20)) == 20 and e.position == 100
    toks = [t for t, _ in e.fed][1:]                       # after the untimed first step
    assert sum(b == (3 * a + 1) % e.vocab for a, b in zip(toks, toks[1:])) <= 2      # not the argmax chain
    again = ReplayEngine(vocab=1000)
    again.experiment, again.position = e.experiment, 100
    xp.time_decode_steps(again, steps=20)
    assert [t for t, _ in again.fed] == [t for t, _ in e.fed]
    eng = SimpleNamespace(info=SimpleNamespace(path="/models/m"), setup=None, experiment=NO_EXPERIMENT)
    plain = xp.decision_key(eng)
    eng.experiment = e.experiment
    assert xp.decision_key(eng) == plain + "|trials on a random token stream"


def test_a_saved_gpu_only_decision_is_read_before_placing(monkeypatch, tmp_path):
    """What the load tells the placement before it copies experts for the CPU: the reason of a saved
    GPU-only decision for this model, budget and machine; nothing for a saved CPU path, another
    budget, or a placement other than "auto"."""
    from types import SimpleNamespace
    from runtime.offload import path_judge as xp
    monkeypatch.setattr(xp, "decisions_file", lambda: tmp_path / "decisions.json")
    budget = SimpleNamespace(vram=SimpleNamespace(total_bytes=24 << 30), cpu_threads=0, policy="auto")
    model = tmp_path / "model"
    assert xp.saved_off(model, budget) == ""
    j = PathJudge("auto", 0.0)
    j.record("cpu", [0.0114] * TRIAL_STEPS)
    j.record("stream", [0.0089] * TRIAL_STEPS)
    j.decide()
    write_decision(tmp_path / "decisions.json", xp.key_for(model, budget), j)
    assert xp.saved_off(model, budget).startswith("as measured on an earlier load (measured: 8.9 ms")
    other = SimpleNamespace(vram=SimpleNamespace(total_bytes=12 << 30), cpu_threads=0, policy="auto")
    assert xp.saved_off(model, other) == ""
    assert xp.saved_off(model, SimpleNamespace(**{**vars(budget), "policy": "cpu"})) == ""
    j.path = "cpu"
    write_decision(tmp_path / "decisions.json", xp.key_for(model, budget), j)
    assert xp.saved_off(model, budget) == ""


def test_the_judge_tells_how_each_paths_timing_went(monkeypatch):
    """Telemetry carries, per path, each run's median step in order (a CPU path whose cut still
    climbs shows as runs getting faster) and the cut before and after the timing with its moves."""
    from runtime.backends import expert_path as xp
    manager = FakeManager(False, 0.05)
    engine = FakeEngine(manager)
    fake_timing(monkeypatch, 20.0, 30.0)
    judge = xp.make_judge(manager)
    for _ in xp.trial(engine, judge):
        pass
    timing = judge.telemetry()["timing"]
    assert set(timing) == {"cpu", "stream"}
    for path, want in (("cpu", 20.0), ("stream", 30.0)):
        assert len(timing[path]["run_ms"]) == RUNS
        assert all(abs(m - want) < 0.2 * want for m in timing[path]["run_ms"]), timing[path]
        assert timing[path]["cut_moves"] == 0
        assert len(timing[path]["runs"]) == RUNS and "threads" in timing[path]      # per run: its figures


def test_a_timing_run_s_figures_come_from_the_layers_traffic():
    """What each timed run reports beside its median step: from the MoE layers' counters read before and
    after it, its hit rate and the CPU's pairs and milliseconds per forward; the CPU path's team size."""
    import types
    from runtime.backends import expert_path as xp
    from runtime.offload.cpu_share import CpuShare

    class Ctx:
        threads = 14

    def layer(hits, pairs, cpu):
        cpu_path = None if cpu is None else types.SimpleNamespace(counters=lambda: cpu, ctx=Ctx())
        return types.SimpleNamespace(hit_counts=lambda: (hits, pairs), cpu=cpu_path)

    engine = types.SimpleNamespace(offload=types.SimpleNamespace(layers=[layer(10, 40, (2_000_000, 3, 5, 0)),
                                                                         layer(30, 40, None)]))
    before = xp._traffic(engine)
    assert before == (40, 80, 5, 2_000_000) and CpuShare.team.fget(engine.offload) == 14
    engine.offload.layers = [layer(10 + 12, 40 + 16, (2_000_000 + 8_000_000, 7, 5 + 8, 0)),
                             layer(30 + 10, 40 + 16, None)]
    figures = xp._run_figures(before, xp._traffic(engine), steps=2)
    assert figures == {"hit_rate": round(22 / 32, 3), "cpu_pairs_per_step": 4.0, "cpu_ms_per_step": 4.0}
    assert xp._run_figures(None, before, 2) == {} and xp._traffic(types.SimpleNamespace(offload=object())) is None
    assert CpuShare.team.fget(types.SimpleNamespace(layers=[layer(0, 0, None)])) is None


def test_the_cpu_paths_cut_settles_untimed_before_it_is_timed(monkeypatch):
    """The CPU path in cut mode moves its cut while it decodes: the trial runs it untimed, a run a step,
    until two runs in a row leave the cut put (bounded), and only then times it; the judge's telemetry
    shows no move during the timing. The GPU-only path is timed at once."""
    import types
    from runtime.backends import expert_path as xp
    manager = FakeManager(False, 0.05)
    manager.cut, manager.cut_log = 512, []              # (the fake is its own CPU share)
    engine = FakeEngine(manager)
    log = []
    fake_timing(monkeypatch, 20.0, 30.0, log=log)
    timed = xp.time_decode_steps

    def climbing(e, n=TRIAL_STEPS, seed=0):            # the cut moves in the first three runs with the CPU path
        if e.offload.cpu.active and sum(1 for p, *_ in log if p == "cpu") < 3:
            manager.cpu.cut += 64
            manager.cpu.cut_log.append((0, manager.cpu.cut, 0.5))
        return timed(e, n, seed)
    monkeypatch.setattr(xp, "time_decode_steps", climbing)
    judge = xp.make_judge(manager)
    messages = list(xp.trial(engine, judge))
    settle = [m for m in messages if m.startswith("letting the CPU path's cut settle")]
    assert len(settle) == 3 + xp.SETTLE_QUIET_RUNS, messages        # three moving runs, then two quiet ones
    cpu_runs = [n for p, n, _ in log if p == "cpu"]
    assert len(cpu_runs) == len(settle) + RUNS and all(n <= TRIAL_CHUNK for n in cpu_runs)
    timing = judge.telemetry()["timing"]
    assert timing["cpu"]["cut"] == [704, 704] and timing["cpu"]["cut_moves"] == 0
    assert len([p for p, *_ in log if p == "stream"]) == RUNS       # no settling for the GPU-only path
    assert judge.path == "cpu"


@pytest.mark.parametrize("cpu_ms, stream_ms, rounds", [(20.0, 30.0, 1), (25.0, 25.4, MAX_ROUNDS)])
def test_settling_is_bounded_and_done_once_a_trial(monkeypatch, cpu_ms, stream_ms, rounds):
    """A cut that never rests settles for SETTLE_MAX_STEPS untimed steps, before the CPU path's first
    timing only: switching back restores the cut the last timing left, so a later round (paths too
    close to call) times it at once (on the H200 a restless Mixtral cut spent 128 untimed steps, 22 s,
    in each of three rounds)."""
    import types
    from runtime.backends import expert_path as xp
    manager = FakeManager(True, 0.05)
    manager.cut, manager.cut_log = 512, []              # (the fake is its own CPU share)
    engine = FakeEngine(manager)
    log = []
    fake_timing(monkeypatch, cpu_ms, stream_ms, log=log)
    timed = xp.time_decode_steps

    def restless(e, n=TRIAL_STEPS, seed=0):
        manager.cpu.cut_log.append((0, manager.cpu.cut, 0.5))
        return timed(e, n, seed)
    monkeypatch.setattr(xp, "time_decode_steps", restless)
    judge = xp.make_judge(manager)
    messages = list(xp.trial(engine, judge))
    settle = [m for m in messages if m.startswith("letting the CPU path's cut settle")]
    assert len(settle) == xp.SETTLE_MAX_STEPS // TRIAL_CHUNK and f"{xp.SETTLE_MAX_STEPS} steps" in settle[-1]
    assert (f"({rounds} rounds)" in judge.reason) == (rounds > 1)
    assert len([p for p, *_ in log if p == "cpu"]) == len(settle) + rounds * RUNS


def test_the_step_clock_hands_the_judge_one_row_steps_only(monkeypatch):
    """Both GPU engines tick a StepClock at every forward: the judge hears the time from one one-row
    forward's start to the next forward's, not a verify's or a prefill's, nor a pause over a second."""
    from runtime.backends import expert_path as xp
    now = [100.0]
    monkeypatch.setattr(xp.time, "perf_counter", lambda: now[0])
    heard: list[float] = []
    judge = type("Judge", (), {"observe_step": lambda self, dt: heard.append(round(dt, 6))})()
    clock = xp.StepClock()
    for rows, dt in ((1, 0.02), (1, 0.03), (5, 0.05), (1, 0.02), (1, 2.0), (1, 0.01)):
        clock.tick(rows, judge)
        now[0] += dt
    clock.tick(1, None)                          # no judge (none decided, or a trial's own steps)
    assert heard == [0.02, 0.03, 0.02]
