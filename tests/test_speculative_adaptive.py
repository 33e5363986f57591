"""The adaptive draft-length policy and the n-gram drafter, as pure logic."""
from __future__ import annotations

import pytest

from runtime.speculative.adaptive import (BASELINE_STEPS, PROBE_FIRST, REBASE_EVERY, TRIAL_STEPS, CostModel,
                                          DraftPolicy, WallWindow)
from runtime.speculative.drafters import NgramDrafter


def test_cost_model_interpolates_and_extrapolates():
    c = CostModel()
    assert c.verify(3) is None
    c.record(1, 1.0)
    assert c.verify(5) == 1.0                     # one point: optimistic (flat) until a second is measured
    c.record(5, 2.0)
    assert c.verify(3) == pytest.approx(1.5)
    assert c.verify(7) == pytest.approx(2.5)      # along the last slope
    c.record(3, 1.2)
    assert c.verify(3) == pytest.approx(1.2)      # measured beats interpolated
    c.record(3, 2.2)
    assert c.verify(3) == pytest.approx(0.7 * 1.2 + 0.3 * 2.2)   # moving average


def run(policy: DraftPolicy, accept_prob: float, cost, steps: int, after=lambda rows: 0.0) -> tuple[list[int], float]:
    """Run the policy against a synthetic target on an injected clock: verifying R rows costs
    cost(R) seconds of forward; `after(R)` seconds more land in the step's wall time outside the
    forward (what the K model cannot see: copies in flight, re-placement after a wide verify).
    Each draft is accepted while a deterministic pattern with the given acceptance rate says so.
    Returns the K of each step and the emitted tokens per second of the clock."""
    ks = []
    credit = clock = tokens = 0.0
    for _ in range(steps):
        k = policy.choose()
        ks.append(k)
        accepted = 0
        for _ in range(k):
            credit += accept_prob
            if credit >= 1.0:
                credit -= 1.0
                accepted += 1
            else:
                break
        forward = cost(k + 1)
        clock += forward + after(k + 1)
        tokens += accepted + 1
        policy.observe(k, accepted, k + 1, forward, forward + after(k + 1))
    return ks, tokens / clock


def drive(policy: DraftPolicy, accept_prob: float, cost, steps: int, after=lambda rows: 0.0) -> list[int]:
    return run(policy, accept_prob, cost, steps, after)[0]


def tokens_per_second(policy: DraftPolicy, accept_prob: float, cost, steps: int, after=lambda rows: 0.0) -> float:
    return run(policy, accept_prob, cost, steps, after)[1]


def test_policy_speculates_when_it_pays():
    p = DraftPolicy(k_max=8, adaptive=True)
    ks = drive(p, accept_prob=0.95, cost=lambda r: 1.0 + 0.05 * (r - 1), steps=200)
    assert not p.off
    assert p.k_now >= 4
    assert sum(k > 0 for k in ks[-64:]) >= 56     # speculating, bar the re-measurements of plain decoding
    assert p.measured()["measured_speedup"] > 2


def test_policy_switches_off_when_it_does_not_pay_and_probes_rarely():
    p = DraftPolicy(k_max=8, adaptive=True)
    ks = drive(p, accept_prob=0.0, cost=lambda r: 1.0 + 0.3 * (r - 1), steps=600)
    assert p.off and "drafting off" in p.reason
    assert sum(k > 0 for k in ks[-300:]) <= 16    # a probe or two, backing off


def test_steps_where_lookup_found_nothing_are_plain_steps_not_a_verdict():
    """N-gram lookup with nothing to propose makes a plain step whatever K was chosen: such steps
    feed the plain window and judge nothing (on the H200 a random model's answer drafted no token,
    and a window of them read "drafting pays: 1.07x"); real drafts are then judged against them."""
    p = DraftPolicy(k_max=4, adaptive=True)
    for i in range(100):
        p.choose()
        step = 1.0 + 0.01 * (i % 7)                # plain steps' noise
        p.observe(0, 0, 1, step, step)              # nothing drafted, whatever k was
    assert "pays" not in p.reason and "off" not in p.reason and not p.off
    assert len(p.plain) >= 16 and len(p.drafting) == 0
    drive(p, accept_prob=0.9, cost=lambda r: 1.0 + 0.05 * (r - 1), steps=40)
    assert not p.off and "drafting pays" in p.reason


def test_policy_prefers_short_drafts_when_verifying_is_costly():
    p = DraftPolicy(k_max=8, adaptive=True)
    drive(p, accept_prob=0.7, cost=lambda r: 1.0 + 0.25 * (r - 1), steps=300)
    assert not p.off and 1 <= p.k_now <= 3


def test_wall_time_overrules_the_acceptance_model():
    """The H200 case: acceptance is high and the forward of a wide verify looks cheap, but each verify
    costs wall time outside its forward (under offload: cold experts of the rows' union copied,
    re-placement). The K model alone would keep drafting; the measured windows switch it off, and
    the run ends within a few percent of plain decoding."""
    cost = lambda r: 1.0 + 0.05 * (r - 1)                     # noqa: E731
    after = lambda r: 0.0 if r == 1 else 4.0                  # noqa: E731
    p = DraftPolicy(k_max=4, adaptive=True)
    drive(p, accept_prob=0.6, cost=cost, steps=200, after=after)
    assert p.rate(p.k_now) > p.rate(0)                        # the model would draft ...
    assert p.off                                              # ... the wall clock does not
    q = DraftPolicy(k_max=4, adaptive=True)
    assert tokens_per_second(q, 0.6, cost, 1000, after) >= 0.95 * 1.0   # plain decoding: 1 token/s


def test_drafting_that_pays_in_wall_time_beats_plain_by_far():
    cost = lambda r: 1.0 + 0.05 * (r - 1)                     # noqa: E731
    q = DraftPolicy(k_max=4, adaptive=True)
    assert tokens_per_second(q, 0.9, cost, 1000) >= 2.5       # plain: 1 token/s


def test_stalls_do_not_decide():
    """A step 20x its window's median (a graph captured, say) is left out of the window's rate."""
    w = WallWindow()
    for _ in range(10):
        w.add(1.0, 1)
    w.add(20.0, 1)
    assert w.seconds_per_token() == pytest.approx(1.0)


def test_a_stall_among_a_trials_first_two_steps_does_not_decide():
    """A trial is judged early, after two drafting steps; a verify graph captured in one of them
    (hundreds of ms) counted, and drafting was switched off on that capture alone."""
    w = WallWindow()
    w.add(30.0, 5)
    w.add(1.2, 5)
    assert w.seconds_per_token() == pytest.approx(1.2 / 5)
    p = DraftPolicy(k_max=4, adaptive=True)
    stalls = iter([30.0])
    drive(p, accept_prob=1.0, cost=lambda r: 1.0 if r == 1 else next(stalls, 1.4), steps=BASELINE_STEPS + 2)
    assert not p.off


def test_policy_comes_back_on_after_a_good_shadow_run():
    p = DraftPolicy(k_max=4, adaptive=True)
    cost = lambda r: 1.0 + 0.1 * (r - 1)                      # noqa: E731
    drive(p, accept_prob=0.0, cost=cost, steps=100)
    assert p.off
    for _ in range(30):
        p.shadow(True)
    ks = drive(p, accept_prob=1.0, cost=cost, steps=PROBE_FIRST + 2 * TRIAL_STEPS)
    assert not p.off and ks[-1] > 0


def test_fixed_policy_always_drafts_k():
    p = DraftPolicy(k_max=3, adaptive=False)
    assert drive(p, 0.0, lambda r: 1.0 + r, 50) == [3] * 50


def test_adaptive_policy_remeasures_plain_decoding_now_and_then():
    p = DraftPolicy(k_max=4, adaptive=True)
    ks = drive(p, 1.0, lambda r: 1.0, REBASE_EVERY * 3)
    assert ks[:BASELINE_STEPS] == [0] * BASELINE_STEPS
    assert ks.count(0) >= 3 * BASELINE_STEPS


# --- n-gram lookup -----------------------------------------------------------------------------

def test_ngram_proposes_continuation_of_longest_suffix_match():
    d = NgramDrafter(n_max=3, n_min=1)
    #         0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 5, 6, 7]
    # suffix (5, 6, 7) occurred at 0..2 followed by 8, 9, 1; the shorter (6, 7) also at 6..7 -> 2
    assert d.propose(tokens, 3).tokens == [8, 9, 1]
    assert d.propose(tokens + [4], 2).tokens == []            # (.., 7, 4) never seen, nor 4
    assert d.propose(tokens + [4, 6, 7], 2).tokens == [4, 6]  # (4, 6, 7) unseen; latest (6, 7) is at 10..11


def test_ngram_drafts_k_tokens_in_text_that_repeats_with_a_short_period():
    """Text repeating every 2 or 3 tokens: the latest occurrence of the suffix is one period back, and
    the drafts go on past the end as the repetition does (they stopped at the end: 2 or 3 drafts)."""
    d = NgramDrafter()
    assert d.propose([9, 1, 2, 1, 2, 1, 2], 6).tokens == [1, 2, 1, 2, 1, 2]
    assert d.propose([5, 6, 7, 5, 6, 7, 5], 5).tokens == [6, 7, 5, 6, 7]
    tokens = [8, 1, 2, 3, 4, 5, 6, 9, 1, 2]                  # a copy far back: as before
    assert d.propose(tokens, 3).tokens == [3, 4, 5]


def test_ngram_handles_edits_and_short_inputs():
    d = NgramDrafter()
    assert d.propose([1], 4).tokens == []
    assert d.propose([1, 1], 4).tokens == [1, 1, 1, 1]       # the copy runs on into its own drafts
    assert d.propose([3, 4, 3], 4).tokens == [4, 3, 4, 3]    # a different list: the index is rebuilt
    with pytest.raises(ValueError, match="n_min"):
        NgramDrafter(n_max=1, n_min=2)
