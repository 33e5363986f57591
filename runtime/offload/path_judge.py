"""Whether the CPU expert path runs ("auto" placement), decided by measured decode steps.

The planner predicts the CPU path's gain from two rates measured once at load (the CPU kernel's and
PCIe's, runtime/offload/placement.plan_cpu_split). On the H200 one noisy measurement flipped the
choice between loads of the same model (39.6 tokens/s with the path, 29.3 without, "a gain of 0%").
So the choice is measured, once per model, budget and machine, and kept:

- The first load of a model at a budget on a machine times both paths (`TRIAL_STEPS` decode steps
  each; where their medians are within `NOISE` of each other, more rounds, up to `MAX_ROUNDS`,
  alternating which path goes first) and runs the faster by the median of all their steps; within
  `TIE` of each other the GPU-only path runs (fewer cores and less host RAM busy for about the same
  speed). The decision is saved (`read_decision` / `write_decision`: the user cache, keyed by model
  folder, budget, threads and machine); later loads with the same key run the saved path untimed.
- Once per judge, the first live window is checked against the decision's own timing: the chosen
  path decoding more than `DRIFT` slower than timed, and slower than the other path was timed, asks
  for a new measurement (a saved decision timed under other conditions, or steps that did not
  represent decoding; `_check_verdict`).
- The choice is measured again when the live decode steps drift from those right after the decision
  (`DRIFT`, judged against the first `DRIFT_WINDOW` live steps, never against the trial's steps,
  whose random tokens route differently from answers), or after `RECHECK_STEPS` steps. A measured
  path already chosen is left only for one faster by more than `TIE` (hysteresis), and the new
  decision is saved.

Pure logic and a small JSON file; the steps are timed by the engine (runtime/backends/expert_path.py).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

CLOSE = 0.25          # predicted gains within +-CLOSE: said to be close in the reason (all are measured once)
TRIAL_STEPS = 64      # decode steps timed per path and round: ~2 s a path at 30 tokens/s
TRIAL_CHUNK = 16      # ... timed in runs of this many, one run a step (idle time: a command waits for one run)
NOISE = 0.10          # medians within 10% of each other: another round of both paths ...
MAX_ROUNDS = 3        # ... up to this many rounds per decision
TIE = 0.05            # medians within 5%: the GPU-only path ("stream"; it keeps the cores free), or the
                      # measured path already chosen (hysteresis)
DRIFT = 0.20          # live median step this far from the chosen path's measured one: measure again
DRIFT_WINDOW = 64     # live one-row decode steps in the drift window
RECHECK_STEPS = 8192  # decode steps after which the choice is measured again anyway


@dataclass
class PathJudge:
    policy: str                           # the user's placement: "auto", "cpu", "stream"
    predicted_gain: Optional[float]       # the planner's, None when no CPU path can run
    unavailable: str = ""                 # why no CPU path can run ("" when one can)
    running: str = ""                     # the path the manager placed by the prediction ("" unknown)
    prior: Optional[dict] = None          # a decision measured on an earlier load (read_decision), reused
    step_ms: dict[str, float] = field(default_factory=dict)     # path -> median decode step, measured
    path: str = ""                        # "cpu" or "stream": what runs
    reason: str = ""
    trials: int = 0
    rounds: int = 0                       # rounds of both paths timed for the decision in progress
    measured: str = ""                    # the path the last measured decision chose ("" none yet)
    fresh: bool = False                   # the last decision was timed just now (worth saving)
    _steps: dict = field(default_factory=dict)   # path -> step seconds of the decision in progress
    _unbuilt: str = ""                    # why the CPU path could not be built for the decision in progress
    _live: deque = field(default_factory=lambda: deque(maxlen=DRIFT_WINDOW))
    _steps_since: int = 0
    _baseline_ms: Optional[float] = None  # the chosen path's step time the drift is judged against
    _again: bool = False                  # a re-measurement was asked for (both paths, whatever predicted)
    _verdict_checked: bool = False        # the live steps were checked against a decision's timing (once a judge)
    _decided_ms: dict = field(default_factory=dict)   # step_ms as the last decision left it (`abandon`)
    timing: dict = field(default_factory=dict)   # path -> how its last timing went (`note_timing`)

    # -- what to measure --------------------------------------------------------------------------

    @property
    def measurable(self) -> bool:
        return self.policy == "auto" and not self.unavailable and self.predicted_gain is not None

    def plan(self) -> list[str]:
        """Paths to time before deciding (empty: decided without measuring; `decide` says how)."""
        if not self.measurable:
            return []
        return ["cpu", "stream"] if self._again or self.prior is None else []

    def ask_again(self) -> None:
        """Time both paths at the next decision, whatever was decided before (benchmarks; drift)."""
        self._again = self.measurable

    def record(self, path: str, step_seconds: Optional[Sequence[float]], why: str = "") -> None:
        """The timed decode steps of one path in a round (None: it could not run, `why` says what
        ran out or failed, in words); the median of all its rounds' steps counts."""
        if step_seconds is None and path == "cpu":
            self._unbuilt = why or "the manager gave no reason"
        if step_seconds:
            self._steps.setdefault(path, []).extend(step_seconds)
            self.step_ms[path] = statistics.median(self._steps[path]) * 1e3
        else:
            self._steps.pop(path, None)
            self.step_ms.pop(path, None)

    def note_timing(self, path: str, run_ms: Sequence[float], cut: tuple = (None, None), moves: int = 0,
                    **figures) -> None:
        """How a path's timing went, for telemetry: each run's median step (ms), in order (a path still
        settling, e.g. the CPU path's cut climbing, shows as runs getting faster), the CPU path's cut
        before and after with the moves between, and `figures` the engine adds (per run: the hit rate,
        the CPU's share of the work; the CPU path's team size)."""
        self.timing[path] = {"run_ms": [round(m, 2) for m in run_ms], "cut": list(cut), "cut_moves": moves,
                             **figures}

    def abandon(self) -> None:
        """The measurement in progress stopped before its decision (the engine changed under it, or
        closed): its steps are dropped and the last decision's step times are back; a measurement
        asked for stays asked for, and starts afresh."""
        self._steps, self.rounds, self._unbuilt = {}, 0, ""
        self.step_ms = dict(self._decided_ms)

    def needs_another_round(self) -> bool:
        """After a round of both paths: their medians are too close to call (within NOISE) and
        fewer than MAX_ROUNDS rounds ran."""
        self.rounds += 1
        if "cpu" not in self._steps or "stream" not in self._steps or self.rounds >= MAX_ROUNDS:
            return False
        cpu, stream = self.step_ms["cpu"], self.step_ms["stream"]
        return abs(cpu - stream) < NOISE * min(cpu, stream)

    # -- the decision -----------------------------------------------------------------------------

    def decide(self) -> str:
        measured = False
        if self.unavailable:
            self.path, self.reason = "stream", self.unavailable
        elif self.policy in ("cpu", "stream"):
            self.path, self.reason = self.policy, f"placement '{self.policy}'"
        elif "cpu" in self._steps and "stream" in self._steps:
            cpu, stream = self.step_ms["cpu"], self.step_ms["stream"]
            self.trials += 1
            measured = True
            rounds = f" ({self.rounds} rounds)" if self.rounds > 1 else ""
            kept = self.measured or (self.prior or {}).get("path", "")
            other = stream if kept == "cpu" else cpu
            mine = cpu if kept == "cpu" else stream
            if kept in ("cpu", "stream") and other >= mine * (1 - TIE):
                self.path = kept                                   # the other is not clearly faster
                self.reason = f"measured{rounds}: {cpu:.1f} ms per decode step with the CPU path, {stream:.1f} without"
                if other < mine:                                   # faster, but by less than TIE
                    self.reason += f" (the other path is faster by less than {TIE:.0%}: the path already chosen stays)"
            elif cpu < stream * (1 - TIE):
                self.path = "cpu"
                self.reason = f"measured{rounds}: {cpu:.1f} ms per decode step with the CPU path, {stream:.1f} without"
            else:
                self.path = "stream"
                self.reason = (f"measured{rounds}: {stream:.1f} ms per decode step without the CPU path, {cpu:.1f} with"
                               + (f" (within {TIE:.0%}: the path that keeps the CPU free)" if cpu < stream else ""))
        elif "stream" in self._steps and self.plan():        # the CPU path was tried and could not run
            self.path, self.reason = "stream", f"the CPU path could not be built: {self._unbuilt}"
        elif self.prior is not None and self.prior.get("path") in ("cpu", "stream"):
            self.path = self.prior["path"]
            self.reason = f"as measured on an earlier load ({self.prior.get('reason', '')})"
            self.step_ms = {k: float(v) for k, v in (self.prior.get("step_ms") or {}).items()}
        else:                                                 # not timed: the prediction's path
            g = self.predicted_gain or 0.0
            self.path = self.running or ("cpu" if g > CLOSE else "stream")
            self.reason = f"predicted gain {g:+.0%} from the measured rates (not timed)"
        if measured:
            self.measured = self.path
        self.fresh = measured
        self._decided_ms = dict(self.step_ms)
        self._steps, self.rounds, self._unbuilt = {}, 0, ""
        self._baseline_ms = None          # the first live window after the decision is the drift baseline
        self._again = False
        self._live.clear()
        self._steps_since = 0
        return self.path

    # -- while decoding ---------------------------------------------------------------------------

    def observe_step(self, seconds: float) -> None:
        """A one-row decode step's wall time (from one step's start to the next's)."""
        self._live.append(seconds * 1e3)
        self._steps_since += 1
        if self._baseline_ms is None and len(self._live) == DRIFT_WINDOW:
            self._baseline_ms = statistics.median(self._live)     # the first window after the decision
            self._check_verdict(self._baseline_ms)

    def _check_verdict(self, live_ms: float) -> None:
        """The first live window after a timed decision (this load's or a saved one): the chosen path
        decoding more than DRIFT slower than it was timed, and slower than the other path was timed,
        means the timing did not represent decoding (other routing, another machine load, experts
        the timed steps found staged) and the verdict may be wrong: measure again, once per judge
        (a trial that misleads the same way again is not repeated). Faster than timed is no doubt."""
        mine, other = self.step_ms.get(self.path), self.step_ms.get("stream" if self.path == "cpu" else "cpu")
        if self._verdict_checked or not self.measurable or mine is None or other is None:
            return
        if live_ms > (1 + DRIFT) * mine and live_ms > other:
            self._verdict_checked = True
            self._again = True
            self.reason += (f"; measuring again (decoding took {live_ms:.1f} ms a step, "
                            f"{mine:.1f} when timed)")

    def wants_recheck(self) -> bool:
        """Measure again (both paths): the live steps drifted from the choice's, or it is old."""
        if not self.measurable:
            return False
        if self._again:
            return True
        if self._steps_since >= RECHECK_STEPS:
            self._again = True
        elif self._baseline_ms is not None and len(self._live) == DRIFT_WINDOW:
            self._again = abs(statistics.median(self._live) / self._baseline_ms - 1) > DRIFT
        if self._again:
            self.reason += "; measuring again (decode steps drifted from it, or it is old)"
        return self._again

    def telemetry(self) -> dict:
        return {"path": self.path, "reason": self.reason, "policy": self.policy,
                "predicted_gain": self.predicted_gain, "step_ms": dict(self.step_ms), "trials": self.trials,
                "reused": self.prior is not None and self.trials == 0, "timing": dict(self.timing),
                "summary": self.summary()}

    def summary(self) -> str:
        on = "CPU expert path on" if self.path == "cpu" else "CPU expert path off"
        return f"{on}: {self.reason}"


# -- the saved decisions (one JSON file in the user cache) ---------------------------------------------

def read_decision(file: Path, key: str) -> Optional[dict]:
    """The decision saved for `key` ({path, step_ms, reason, saved}), or None (none, or an unreadable
    file: then the paths are measured again and the file rewritten)."""
    try:
        entry = json.loads(Path(file).read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(entry, dict) or entry.get("path") not in ("cpu", "stream"):
        return None
    return entry


def write_decision(file: Path, key: str, judge: PathJudge) -> None:
    """Save the judge's measured decision under `key` (other keys kept); a file that cannot be
    written leaves the decision to be measured again at the next load."""
    file = Path(file)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data[key] = {"path": judge.path, "step_ms": dict(judge.step_ms), "reason": judge.reason,
                 "saved": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(file.name + f".{os.getpid()}.part")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(file)
    except OSError:
        pass


# -- where the decisions are kept, and what one is valid for --------------------------------------------

DECISIONS_FILE = "expert-path-decisions.json"     # in the user cache (runtime.paths.cache_dir)


def key_for(model_path, budget) -> str:
    """What a saved decision is valid for: the model folder, the VRAM budget (to 1/4 GiB), the CPU
    threads asked for, the CPU split ("cut": one since the whole-experts switch went, kept so that saved
    decisions stay found), and the machine (host, cores, GPU)."""
    vram = round(budget.vram.total_bytes / (1 << 28)) / 4 if budget is not None else None
    threads = budget.cpu_threads if budget is not None else 0
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (f"{Path(model_path).resolve()}|vram {vram} GiB|threads {threads or 'auto'}|split "
            f"cut|{platform.node()}|{os.cpu_count()} cpus|{gpu}")


def decisions_file() -> Path:
    from runtime.paths import cache_dir
    return cache_dir() / DECISIONS_FILE


def saved_off(model_path, budget) -> str:
    """Where "auto" placement will run the GPU-only path anyway: the reason a decision saved by an
    earlier load gives (the judge reuses it untimed), else "" (nothing saved, or the CPU path)."""
    if budget is None or getattr(budget, "policy", "auto") != "auto":
        return ""
    prior = read_decision(decisions_file(), key_for(model_path, budget))
    if prior is None or prior.get("path") != "stream":
        return ""
    return f"as measured on an earlier load ({prior.get('reason', '')})"
