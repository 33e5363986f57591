"""Adaptive draft length: pick K for the next step to maximise expected tokens per second.

Model, per request, all from measurements made while decoding:
    alpha        chance that a draft token is accepted, from recent steps (decayed counts)
    E(K)         tokens per speculative step = 1 + alpha + ... + alpha^K
    cost(K)      verify(K+1) + K * draft_token, where verify(R) is the measured time of a target
                 step over R rows (forward + acceptance) and draft_token the draft model's time per
                 token (0 for n-gram lookup)
    rate(K)      E(K) / cost(K);  plain decoding is rate(0) = 1 / verify(1)
For MoE targets verify(R) grows with the union of the experts the R rows select (and, with offload,
the cold experts they pull in); nothing is assumed about it, it is timed as it runs.

K = argmax rate(K) for K in 1..k_max; if even that does not beat plain decoding, drafting is off,
and the policy probes again after a while (backing off while probes keep failing). A plain step now
and then keeps verify(1) fresh and gives the speedup figure something to compare with.
"""
from __future__ import annotations

from typing import Optional

DECAY = 0.9              # weight of older acceptance observations per new one
TIME_EMA = 0.3           # weight of the newest timing sample
CALIBRATE_EVERY = 32     # a plain step this often (while speculating) to keep verify(1) measured
PROBE_FIRST = 8          # plain steps before the first probe once drafting was switched off
PROBE_MAX = 128          # longest wait between probes


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


class DraftPolicy:
    """Chooses K (0 = a plain step) before each step and learns from each step's outcome."""

    def __init__(self, k_max: int, adaptive: bool):
        self.k_max = k_max
        self.adaptive = adaptive
        self.costs = CostModel()
        self.draft_token_s = 0.0          # draft model time per drafted token (0 for lookup)
        self.hits, self.misses = 1.0, 1.0  # decayed counts of accepted / rejected drafts (a prior)
        self.k_now = k_max
        self.off = False
        self._steps = 0
        self._wait = 0                    # plain steps left before the next probe while off
        self._backoff = PROBE_FIRST

    # -- before a step -------------------------------------------------------------------------

    def choose(self) -> int:
        self._steps += 1
        if not self.adaptive:
            return self.k_max
        if self.costs.verify(1) is None or self._steps % CALIBRATE_EVERY == 0:
            return 0
        if self.off:
            self._wait -= 1
            if self._wait > 0:
                return 0
            return max(self.k_now, 1)     # probe
        return self.k_now

    # -- after a step --------------------------------------------------------------------------

    def observe(self, drafted: int, accepted: int, rows: int, target_s: float) -> None:
        """One step's outcome: drafts offered and kept, rows verified, and the step's time
        excluding drafting."""
        self.costs.record(rows, target_s)
        if drafted:
            self.observe_acceptance(accepted, rejected=accepted < drafted)
            if self.off:                  # that was a probe
                self._decide()
                if self.off:
                    self._backoff = min(self._backoff * 2, PROBE_MAX)
                    self._wait = self._backoff
                return
        if self.adaptive and not self.off:
            self._decide()

    def observe_acceptance(self, accepted: int, rejected: bool) -> None:
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (1 if rejected else 0)

    def shadow(self, accepted: bool) -> None:
        """A free observation: what lookup would have proposed vs the token a plain step produced.
        Lets n-gram drafting switch itself back on without paying for a probe."""
        self.observe_acceptance(int(accepted), rejected=not accepted)
        if self.adaptive and self.off:
            self._decide()

    def set_draft_cost(self, seconds_per_token: Optional[float]) -> None:
        if seconds_per_token is not None:
            self.draft_token_s = seconds_per_token

    # -- the model -----------------------------------------------------------------------------

    @property
    def alpha(self) -> float:
        return self.hits / (self.hits + self.misses)

    def rate(self, k: int) -> Optional[float]:
        """Expected tokens per second with K drafts (K = 0: plain decoding)."""
        verify = self.costs.verify(k + 1)
        if verify is None:
            return None
        a = self.alpha
        tokens = float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
        return tokens / (verify + k * self.draft_token_s)

    def _decide(self) -> None:
        plain = self.rate(0)
        if plain is None:
            return
        best_k, best = max(((k, self.rate(k) or 0.0) for k in range(1, self.k_max + 1)), key=lambda kv: kv[1])
        self.k_now = best_k
        was_off = self.off
        self.off = best <= plain
        if was_off and not self.off:
            self._backoff = PROBE_FIRST
        if self.off and not was_off:
            self._wait = self._backoff
