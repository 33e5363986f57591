"""Speculative decoding on a tiny exact model: the sampler's distribution, greedy equality, cache contract.

The toy engine is a second-order Markov model over a 6-token vocabulary: logits at a position are a
fixed random vector chosen by the last two tokens. It is small enough that the exact distribution of
the first generated tokens can be enumerated, so the statistical test compares against the truth.

Statistical test: Pearson's chi-square goodness of fit of N speculative samples of the first three
generated tokens against the enumerated plain-sampling distribution (cells with expected count < 5
pooled), at significance level 0.001, critical value from the Wilson-Hilferty approximation. Seeded,
so the outcome is deterministic; the same test run on deliberately broken acceptance rules fails.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from runtime import sampling
from runtime.engine import Engine, ModelInfo
from runtime.options import DraftOptions, SamplingOptions
from runtime.speculative import core, make_decoder

V = 6


class MarkovEngine(Engine):
    """Test double with a real cache: logits depend on the last two tokens via a random table."""

    backend = "cpu"

    def __init__(self, seed: int, scale: float = 2.0, base: "MarkovEngine | None" = None, noise: float = 0.0):
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(V, V, V, generator=g) * scale                 # [prev, last, V]
        if base is not None:
            table = base.table + noise * table
        self.table = table
        self.cache: list[int] = []
        self.info = ModelInfo(name=f"markov{seed}", path="", architecture="toy", vocab_size=V,
                              context_length=4096, num_layers=1)

    def forward(self, tokens):
        rows = []
        for t in tokens:
            self.cache.append(int(t))
            prev = self.cache[-2] if len(self.cache) > 1 else 0
            rows.append(self.table[prev, self.cache[-1]])
        return torch.stack(rows)                                          # [T, V]

    def truncate(self, length):
        assert 0 <= length <= len(self.cache), (length, len(self.cache))
        del self.cache[length:]

    @property
    def position(self):
        return len(self.cache)


def start(engine: Engine, prompt: list[int]) -> None:
    engine.reset()
    if len(prompt) > 1:
        engine.forward(prompt[:-1])


def run_decoder(target, drafter_engine, draft, opts, prompt, n, seed):
    gen = torch.Generator().manual_seed(seed)
    dec = make_decoder(target, draft, opts, gen, draft_engine=drafter_engine)
    start(target, prompt)
    tokens = list(prompt)
    while len(tokens) - len(prompt) < n:
        new = dec.step(tokens)
        tokens += new
        assert target.cache == tokens[:-1]                                # the cache contract
    return tokens[len(prompt):len(prompt) + n], dec


def plain(target, opts, prompt, n, seed):
    gen = torch.Generator().manual_seed(seed)
    start(target, prompt)
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(sampling.sample(target.forward(tokens[-1:])[0], tokens, opts, gen))
    return tokens[len(prompt):]


# --- exact distribution ------------------------------------------------------------------------

def exact_distribution(target: MarkovEngine, opts, prompt, n) -> dict[tuple[int, ...], float]:
    """P(first n generated tokens) under plain sampling, by enumeration."""
    out = {}
    for seq in itertools.product(range(V), repeat=n):
        tokens, prob = list(prompt), 1.0
        for t in seq:
            prev = tokens[-2] if len(tokens) > 1 else 0
            p = sampling.probabilities(target.table[prev, tokens[-1]], tokens, opts)
            prob *= p[t].item()
            tokens.append(t)
            if prob == 0:
                break
        if prob > 0:
            out[seq] = prob
    return out


def chi_square(counts: dict, expected: dict[tuple, float], total: int) -> tuple[float, float]:
    """(statistic, critical value at significance 0.001) with cells of expected count < 5 pooled."""
    unexpected = sum(c for s, c in counts.items() if s not in expected)
    if unexpected:
        return math.inf, 0.0                 # a sequence plain sampling can never produce
    stat, pooled_e, pooled_o, cells = 0.0, 0.0, 0, 0
    for seq, p in expected.items():
        e, o = p * total, counts.get(seq, 0)
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    df = cells - 1
    z = 3.0902                                # standard normal quantile at 1 - 0.001
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


SAMPLED = SamplingOptions(temperature=0.9, top_k=5, top_p=0.95, min_p=0.02, repetition_penalty=1.2)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
N_TOKENS = 3
N_RUNS = 3000


def speculative_counts(mode: str, runs: int = N_RUNS, opts: SamplingOptions = SAMPLED):
    target = MarkovEngine(0)
    drafter = MarkovEngine(1, base=target, noise=0.8) if mode == "model" else None
    draft = DraftOptions(mode=mode, draft_tokens=3, adaptive=False)
    counts: dict[tuple, int] = {}
    for seed in range(runs):
        seq, _ = run_decoder(target, drafter, draft, opts, PROMPT, N_TOKENS, seed)
        counts[tuple(seq)] = counts.get(tuple(seq), 0) + 1
    return counts, exact_distribution(target, opts, PROMPT, N_TOKENS)


@pytest.mark.parametrize("mode", ["model", "ngram"])
def test_speculative_sampling_matches_plain_distribution(mode):
    counts, expected = speculative_counts(mode)
    stat, critical = chi_square(counts, expected, N_RUNS)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: speculative sampling is biased"


def test_plain_sampling_passes_the_same_test():
    target = MarkovEngine(0)
    counts: dict[tuple, int] = {}
    for seed in range(N_RUNS):
        seq = tuple(plain(target, SAMPLED, PROMPT, N_TOKENS, seed))
        counts[seq] = counts.get(seq, 0) + 1
    stat, critical = chi_square(counts, exact_distribution(target, SAMPLED, PROMPT, N_TOKENS), N_RUNS)
    assert stat < critical


@pytest.mark.parametrize("mode, broken", [
    ("model", "resample_from_p"),        # on rejection, draw from p instead of max(0, p - q)
    ("model", "accept_always"),          # keep every draft
    ("ngram", "resample_from_p"),
])
def test_the_statistical_test_catches_a_broken_acceptance_rule(mode, broken, monkeypatch):
    if broken == "resample_from_p":
        monkeypatch.setattr(core, "_residual", lambda p, q: p)
    else:
        monkeypatch.setattr(core, "_accepts", lambda p_d, q_d, generator: True)
    counts, expected = speculative_counts(mode, runs=1500)
    stat, critical = chi_square(counts, expected, 1500)
    assert stat >= critical, f"broken rule {broken} went unnoticed (chi-square {stat:.1f} < {critical:.1f})"


# --- greedy and the cache contract -------------------------------------------------------------

GREEDY = SamplingOptions(temperature=0.0, repetition_penalty=1.1)


@pytest.mark.parametrize("mode, adaptive, k", [("model", False, 4), ("model", True, 4), ("ngram", False, 3),
                                               ("ngram", True, 8), ("off", True, 4), ("model", False, 1)])
def test_greedy_speculative_equals_plain(mode, adaptive, k):
    target = MarkovEngine(3)
    drafter = MarkovEngine(4, base=target, noise=0.5) if mode == "model" else None
    for prompt in ([0, 1], [5, 4, 3, 5, 4, 3, 5], [2]):
        want = plain(target, GREEDY, prompt, 60, 0)
        got, dec = run_decoder(target, drafter, DraftOptions(mode=mode, draft_tokens=k, adaptive=adaptive),
                               GREEDY, prompt, 60, 0)
        assert got == want
        s = dec.stats()
        assert s.mode == mode
        if mode != "off" and not adaptive:
            assert s.drafted_tokens > 0 and 0 <= s.accepted_tokens <= s.drafted_tokens
            assert sum(s.acceptance_histogram) > 0 and len(s.acceptance_histogram) == k + 1


def test_stats_count_what_happened():
    target = MarkovEngine(3)
    drafter = MarkovEngine(4, base=target, noise=0.5)
    _, dec = run_decoder(target, drafter, DraftOptions(mode="model", draft_tokens=3, adaptive=False),
                         GREEDY, [0, 1], 40, 0)
    s = dec.stats()
    steps = sum(s.acceptance_histogram)
    assert s.accepted_tokens == sum(i * c for i, c in enumerate(s.acceptance_histogram))
    assert s.drafted_tokens == 3 * steps
    assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.drafted_tokens)
    assert s.tokens_per_forward == pytest.approx((s.accepted_tokens + steps) / steps)


def test_draft_cache_follows_after_rejections():
    target = MarkovEngine(3)
    draft_engine = MarkovEngine(4, base=target, noise=1.5)   # a poor draft: many rejections
    tokens, dec = [0, 1], None
    dec = make_decoder(target, DraftOptions(mode="model", draft_tokens=4, adaptive=False), GREEDY,
                       draft_engine=draft_engine)
    start(target, tokens)
    for _ in range(30):
        tokens += dec.step(tokens)
        assert draft_engine.cache == tokens[:len(draft_engine.cache)]     # never holds a rejected draft
    assert dec.stats().acceptance_histogram[0] > 0


def test_bad_settings_are_named():
    target = MarkovEngine(0)
    with pytest.raises(ValueError, match="no draft model is loaded"):
        make_decoder(target, DraftOptions(mode="model"), GREEDY)
    with pytest.raises(ValueError, match="draft.mode"):
        make_decoder(target, DraftOptions(mode="medusa"), GREEDY)


def test_a_greedy_verify_reads_its_rows_choices_at_once_and_keeps_the_penalty_path(monkeypatch):
    """Greedy without a penalty: the verify's K+1 rows are chosen in one read of the logits (on the
    GPU one wait, not one per row), with the same text as plain decoding; with a repetition penalty
    each row still goes through sampling.sample (the history differs from row to row)."""
    greedy = SamplingOptions(temperature=0.0)
    target = MarkovEngine(3)
    want = plain(target, greedy, [5, 4, 3, 5, 4, 3, 5], 40, 0)
    calls = []
    real = sampling.sample
    monkeypatch.setattr(sampling, "sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    target2 = MarkovEngine(3)
    got, dec = run_decoder(target2, None, DraftOptions(mode="ngram", draft_tokens=4, adaptive=False),
                           greedy, [5, 4, 3, 5, 4, 3, 5], 40, 0)
    assert got == want and dec.stats().drafted_tokens > 0
    assert not calls                                         # every row's choice from the one read
    calls.clear()
    penalised = SamplingOptions(temperature=0.0, repetition_penalty=1.3)
    _, dec = run_decoder(MarkovEngine(3), None, DraftOptions(mode="ngram", draft_tokens=4, adaptive=False),
                         penalised, [5, 4, 3, 5, 4, 3, 5], 40, 0)
    assert len(calls) > dec.forwards
