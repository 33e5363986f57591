"""Whether the CPU expert path runs ("auto" placement), decided by measured decode steps.

The planner predicts the CPU path's gain from two rates measured once at load (the CPU kernel's and
PCIe's, runtime/experts/placement.plan_cpu_split). On the H200 one noisy measurement flipped the
choice between loads of the same model (39.6 tokens/s with the path, 29.3 without, "a gain of 0%").
So where the prediction is close (a predicted gain within +-CLOSE), both paths decode `TRIAL_STEPS`
steps and the faster by their median step time runs; within `TIE` of each other the GPU-only path
runs (fewer cores and less host RAM busy for about the same speed). The choice is measured again when the
live decode steps drift from what was measured for it (`DRIFT`), or after `RECHECK_STEPS` steps.

Pure logic; the steps are timed by the engine (runtime/backends/exl2_placement.py).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

CLOSE = 0.25          # predicted gains within +-CLOSE are measured, not believed
TRIAL_STEPS = 64      # decode steps timed per path (the median decides): ~2 s a path at 30 tokens/s
TIE = 0.05            # medians within 5%: the GPU-only path ("stream"; it keeps the cores free)
DRIFT = 0.20          # live median step this far from the chosen path's measured one: measure again
DRIFT_WINDOW = 64     # live one-row decode steps in the drift window
RECHECK_STEPS = 8192  # decode steps after which the choice is measured again anyway


@dataclass
class PathJudge:
    policy: str                           # the user's placement: "auto", "cpu", "stream"
    predicted_gain: Optional[float]       # the planner's, None when no CPU path can run
    unavailable: str = ""                 # why no CPU path can run ("" when one can)
    running: str = ""                     # the path the manager placed by the prediction ("" unknown)
    step_ms: dict[str, float] = field(default_factory=dict)     # path -> median decode step, measured
    path: str = ""                        # "cpu" or "stream": what runs
    reason: str = ""
    trials: int = 0
    _live: deque = field(default_factory=lambda: deque(maxlen=DRIFT_WINDOW))
    _steps_since: int = 0
    _baseline_ms: Optional[float] = None  # the chosen path's step time the drift is judged against
    _again: bool = False                  # a re-measurement was asked for (both paths, whatever predicted)

    # -- what to measure --------------------------------------------------------------------------

    @property
    def measurable(self) -> bool:
        return self.policy == "auto" and not self.unavailable and self.predicted_gain is not None

    def plan(self) -> list[str]:
        """Paths to time before deciding (empty: decided without measuring; `decide` says how)."""
        if not self.measurable:
            return []
        return ["cpu", "stream"] if self._again or abs(self.predicted_gain) <= CLOSE else []

    def ask_again(self) -> None:
        """Time both paths at the next decision, whatever the prediction (benchmarks; drift)."""
        self._again = self.measurable

    def record(self, path: str, step_seconds: Optional[Sequence[float]]) -> None:
        """The timed decode steps of one path (None: it could not run)."""
        if step_seconds:
            self.step_ms[path] = statistics.median(step_seconds) * 1e3
        else:
            self.step_ms.pop(path, None)

    # -- the decision -----------------------------------------------------------------------------

    def decide(self) -> str:
        if self.unavailable:
            self.path, self.reason = "stream", self.unavailable
        elif self.policy in ("cpu", "stream"):
            self.path, self.reason = self.policy, f"placement '{self.policy}'"
        elif "cpu" in self.step_ms and "stream" in self.step_ms:
            cpu, stream = self.step_ms["cpu"], self.step_ms["stream"]
            self.trials += 1
            if cpu < stream * (1 - TIE):
                self.path = "cpu"
                self.reason = f"measured: {cpu:.1f} ms per decode step with the CPU path, {stream:.1f} without"
            else:
                self.path = "stream"
                self.reason = (f"measured: {stream:.1f} ms per decode step without the CPU path, {cpu:.1f} with"
                               + (f" (within {TIE:.0%}: the path that keeps the CPU free)" if cpu < stream else ""))
        elif "stream" in self.step_ms and self.plan():       # the CPU path was tried and could not run
            self.path, self.reason = "stream", "the CPU path could not be built (host RAM)"
        else:                                                 # not timed: the prediction's path
            g = self.predicted_gain or 0.0
            self.path = self.running or ("cpu" if g > CLOSE else "stream")
            self.reason = f"predicted gain {g:+.0%} from the measured rates (not timed)"
        self._baseline_ms = self.step_ms.get(self.path)
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
            self._baseline_ms = statistics.median(self._live)     # decided unmeasured: the first window

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
                "summary": self.summary()}

    def summary(self) -> str:
        on = "CPU expert path on" if self.path == "cpu" else "CPU expert path off"
        return f"{on}: {self.reason}"
