"""Adaptive drafting: draft only while it pays in wall time, and pick K for the steps that draft.

Two questions, answered from measurements made while decoding:

1. **Draft at all?** Judged by wall time per emitted token, measured, never modelled: the policy
   keeps a window of recent plain steps and one of recent drafting steps (seconds of the whole step,
   drafting included, and the tokens it emitted) and drafts only while drafting's seconds per token
   beat plain decoding's by `KEEP_MARGIN`. Plain decoding is re-measured now and then while drafting
   (`REBASE_EVERY`: a few plain steps), and drafting is probed again now and then while off (backing
   off while probes keep failing). With offload, a verify over R rows touches the union of the rows'
   experts and may pull cold ones over PCIe; the cost may even land in later steps (copies in flight,
   re-placement): only the windows' wall time sees all of it. On the H200 the acceptance-based
   model below claimed large speedups while n-gram drafting decoded slower than plain decoding
   (docs/engine-notes.md, issue "What the user runs is what we measure").
2. **How many drafts (K)?** From the model, per request:
    alpha        chance that a draft token is accepted, from recent steps (decayed counts)
    E(K)         tokens per speculative step = 1 + alpha + ... + alpha^K
    cost(K)      verify(K+1) + K * draft_token, where verify(R) is the measured time of a target
                 step over R rows and draft_token the draft model's time per token (0 for n-gram lookup)
    rate(K)      E(K) / cost(K);   K = argmax rate(K), K in 1..k_max
   While off, the model also says when a probe is worth trying early (n-gram lookup's free shadow
   guesses raise alpha).

A step that takes far longer than its window's median (a stall: a graph captured, the machine busy)
is left out of the window's rate.

One policy serves every request of an engine (runtime/speculative/__init__.make_decoder keeps it):
the windows measure the machine, not the prompt. Per request they were measured anew, and a 160-token
answer ended before `REBASE_EVERY`, so a plain baseline taken once, right after the prefill, judged
the whole answer. And the steps right after a prefill are slower than decoding's (under offload the
staging pages are lent then, their copies on a side stream sharing PCIe with the decode's; graphs
are captured for the answer's buckets): on the H200 that made n-gram drafting at 0.8x plain
decoding's tokens/s look like a gain on every answer. So the first `SETTLE_STEPS` steps after each
prefill enter neither window (`new_request`): they are plain until a measured verdict says drafting
pays, and draft from then on (short answers draft too); the plain baseline is measured after them; a trial that runs slower than plain
decoding per token is cut after `EARLY_STEPS` steps, and a probe after `PROBE_STEPS`.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

DECAY = 0.9              # weight of older acceptance observations per new one
TIME_EMA = 0.3           # weight of the newest timing sample (the K model)
WINDOW = 16              # steps per mode in the wall-time windows
BASELINE_STEPS = 4       # plain steps measured before drafting starts, and at each re-measurement
TRIAL_STEPS = 8          # drafting steps before judging drafting against plain decoding
REBASE_EVERY = 32        # drafting steps between re-measurements of plain decoding
KEEP_MARGIN = 0.02       # drafting must be this much faster per token to stay on
EARLY_STEPS = 2          # a trial judged after this many steps already ...
EARLY_FACTOR = 1.0       # ... when drafting is this many times slower per token than plain decoding
PROBE_STEPS = 1          # a probe (drafting re-tried while off) judged after this many steps when slower
SETTLE_STEPS = 8         # steps after each prefill that enter neither window (see `new_request`)
SHADOW_RISE = 0.25       # while off: lookup's shadow acceptance this much above what it was at the switch
STALL_FACTOR = 4.0       # a step this many times its window's median is a stall, not a rate
PROBE_FIRST = 32         # plain steps before the first probe once drafting was switched off
PROBE_MAX = 256          # longest wait between probes
CALIBRATE_EVERY = REBASE_EVERY   # (the name older callers use)


class CostModel:
    """Seconds per target step by number of verified rows, as exponential moving averages."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else (1 - TIME_EMA) * old + TIME_EMA * seconds

    def verify(self, rows: int) -> Optional[float]:
        """Measured time for `rows`, else interpolated between the nearest measured row counts,
        else extrapolated along the last measured slope; None before any measurement."""
        s = self.seconds
        if rows in s:
            return s[rows]
        below = [r for r in s if r < rows]
        above = [r for r in s if r > rows]
        if below and above:
            lo, hi = max(below), min(above)
            return s[lo] + (s[hi] - s[lo]) * (rows - lo) / (hi - lo)
        if not s:
            return None
        if not below:
            return s[min(above)]
        known = sorted(s)
        if len(known) == 1:
            return s[known[0]]          # optimistic until a second row count is measured
        a, b = known[-2], known[-1]
        slope = max((s[b] - s[a]) / (b - a), 0.0)
        return s[b] + slope * (rows - b)


class WallWindow:
    """The last `WINDOW` steps of one mode: (wall seconds, tokens emitted)."""

    def __init__(self) -> None:
        self.steps: deque[tuple[float, int]] = deque(maxlen=WINDOW)

    def add(self, seconds: float, tokens: int) -> None:
        self.steps.append((seconds, tokens))

    def __len__(self) -> int:
        return len(self.steps)

    def seconds_per_token(self) -> Optional[float]:
        """Wall seconds per emitted token over the window, stalls left out; None when empty."""
        if not self.steps:
            return None
        times = sorted(s for s, _ in self.steps)
        # the lower median: of an early trial's two steps, the upper one is the stall itself
        limit = STALL_FACTOR * times[(len(times) - 1) // 2]
        kept = [(s, n) for s, n in self.steps if s <= limit]
        tokens = sum(n for _, n in kept)
        return sum(s for s, _ in kept) / tokens if tokens else None


class DraftPolicy:
    """Chooses K (0 = a plain step) before each step and learns from each step's outcome."""

    def __init__(self, k_max: int, adaptive: bool):
        self.k_max = k_max
        self.adaptive = adaptive
        self.costs = CostModel()
        self.draft_token_s = 0.0          # draft model time per drafted token (0 for lookup)
        self.hits, self.misses = 1.0, 1.0  # decayed counts of accepted / rejected drafts (a prior)
        self.k_now = k_max
        self.off = False                  # drafting judged not to pay (plain steps, probes now and then)
        self.plain = WallWindow()
        self.drafting = WallWindow()
        self.reason = "measuring plain decoding"
        self._plain_left = BASELINE_STEPS  # plain steps before the next drafting steps
        self._trial_left = TRIAL_STEPS     # drafting steps before the next judgement
        self._since_rebase = 0
        self._wait = 0                    # plain steps left before the next probe while off
        self._backoff = PROBE_FIRST
        self._last: Optional[int] = None  # K chosen for the step in progress
        self._probing = False
        self._alpha_off = 1.0             # alpha when drafting was last switched off
        self._settle = 0                  # steps left that enter no window (after a prefill)
        self._pays = False                # the last verdict measured drafting faster than plain decoding

    def new_request(self) -> None:
        """A new request on the same engine: its first steps follow a prefill and are not measured."""
        if self.adaptive:
            self._settle = SETTLE_STEPS

    # -- before a step -------------------------------------------------------------------------

    def choose(self) -> int:
        if not self.adaptive:
            self._last = self.k_max
            return self.k_max
        if self._settle > 0:              # unmeasured: draft only where a measured verdict says it pays
            k = max(self.k_now, 1) if self._pays else 0
        elif self._plain_left > 0:
            k = 0
        elif self.off:
            self._wait -= 1
            k = max(self.k_now, 1) if self._wait <= 0 or self._worth_probing() else 0
        else:
            k = max(self.k_now, 1)
        self._last = k
        return k

    def _worth_probing(self) -> bool:
        """While off: lookup's free shadow guesses now match far more often than when drafting was
        switched off, and the K model predicts a clear gain."""
        if self.alpha < self._alpha_off + SHADOW_RISE:
            return False
        plain = self.rate(0)
        best = max((self.rate(k) or 0.0) for k in range(1, self.k_max + 1))
        return plain is not None and best > 1.5 * plain and self._wait <= self._backoff // 2

    # -- after a step --------------------------------------------------------------------------

    def observe(self, drafted: int, accepted: int, rows: int, target_s: float,
                step_s: Optional[float] = None) -> None:
        """One step's outcome: drafts offered and kept, rows verified, the target forward's time,
        and the whole step's wall time (drafting included; default: the forward's)."""
        step_s = target_s if step_s is None else step_s
        self.costs.record(rows, target_s)
        if drafted:
            self.observe_acceptance(accepted, rejected=accepted < drafted)
        if not self.adaptive:
            return
        if self._settle > 0:
            self._settle -= 1                     # just after a prefill: not what decoding costs
            return
        if not drafted:                           # a plain step, also where lookup found nothing for K > 0
            self.plain.add(step_s, 1)             # (judged as drafting, a window of them read "pays 1.07x")
            if self._plain_left > 0:
                self._plain_left -= 1
                if self._plain_left == 0 and len(self.drafting) >= TRIAL_STEPS:   # re-measured while on
                    self._trial_left = 0
                    self._judge()
            return
        # A drafting step (a probe while off, or one of a trial): tokens = accepted drafts + 1.
        if self.off:                              # a probe: it goes on as a trial of its own
            self.off, self._probing = False, True
            self.drafting = WallWindow()
            self._trial_left = TRIAL_STEPS
            self.reason = "probing drafting again"
        self.drafting.add(step_s, accepted + 1)
        self._pick_k()
        self._trial_left -= 1
        self._since_rebase += 1
        if self._trial_left <= 0 or self._clearly_slower():
            self._trial_left = 0
            self._judge()
        if not self.off and self._since_rebase >= REBASE_EVERY:
            self._since_rebase = 0
            self._plain_left = BASELINE_STEPS      # measure plain decoding again, then judge

    def _clearly_slower(self) -> bool:
        """A trial cut short: after EARLY_STEPS drafting steps (a probe: PROBE_STEPS), already
        EARLY_FACTOR times slower per token than plain decoding."""
        early = PROBE_STEPS if self._probing else EARLY_STEPS
        if len(self.drafting) < early or TRIAL_STEPS - self._trial_left < early:
            return False
        plain, draft = self.plain.seconds_per_token(), self.drafting.seconds_per_token()
        return plain is not None and draft is not None and draft > EARLY_FACTOR * plain

    def _judge(self) -> None:
        """Drafting on or off, by the windows' seconds per token."""
        plain, draft = self.plain.seconds_per_token(), self.drafting.seconds_per_token()
        if plain is None or draft is None or self._trial_left > 0:
            return
        self._pays = draft < plain * (1 - KEEP_MARGIN)
        if self._pays:
            self.off = False
            self._backoff = PROBE_FIRST
            self.reason = f"drafting pays: {plain / draft:.2f}x plain decoding's tokens/s (measured)"
        else:
            if self._probing:                     # probes keep failing: wait longer
                self._backoff = min(self._backoff * 2, PROBE_MAX)
            self.off = True
            self._wait = self._backoff
            self._alpha_off = self.alpha
            self.reason = (f"drafting off: {plain / draft:.2f}x plain decoding's tokens/s (measured; "
                           f"kept only above {1 / (1 - KEEP_MARGIN):.2f}x)")
        self._probing = False
        self._trial_left = TRIAL_STEPS

    def observe_acceptance(self, accepted: int, rejected: bool) -> None:
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (1 if rejected else 0)

    def shadow(self, accepted: bool) -> None:
        """A free observation: what lookup would have proposed vs the token a plain step produced.
        Lets n-gram drafting come back sooner (a probe) without paying for blind probes."""
        self.observe_acceptance(int(accepted), rejected=not accepted)

    def set_draft_cost(self, seconds_per_token: Optional[float]) -> None:
        if seconds_per_token is not None:
            self.draft_token_s = seconds_per_token

    # -- the K model ---------------------------------------------------------------------------

    @property
    def alpha(self) -> float:
        return self.hits / (self.hits + self.misses)

    def rate(self, k: int) -> Optional[float]:
        """Expected tokens per second with K drafts (K = 0: plain decoding), by the model."""
        verify = self.costs.verify(k + 1)
        if verify is None:
            return None
        a = self.alpha
        tokens = float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
        return tokens / (verify + k * self.draft_token_s)

    def _pick_k(self) -> None:
        rates = [(k, self.rate(k) or 0.0) for k in range(1, self.k_max + 1)]
        self.k_now = max(rates, key=lambda kv: kv[1])[0]

    def measured(self) -> dict:
        """The windows' figures (telemetry, benchmarks)."""
        plain, draft = self.plain.seconds_per_token(), self.drafting.seconds_per_token()
        return {"plain_s_per_token": plain, "draft_s_per_token": draft,
                "measured_speedup": plain / draft if plain and draft else None,
                "drafting": not self.off and self._plain_left == 0, "reason": self.reason}
