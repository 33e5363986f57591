"""runtime.sampling: hand-computed cases, edge cases, and agreement with transformers' logits processors."""
from __future__ import annotations

import math

import pytest
import torch

from runtime import sampling
from runtime.options import SamplingOptions

INF = float("-inf")


def opts(**kw) -> SamplingOptions:
    base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    base.update(kw)
    return SamplingOptions(**base)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


P4 = [0.5, 0.3, 0.15, 0.05]


def kept(x: torch.Tensor) -> list[int]:
    return torch.isfinite(x).nonzero().flatten().tolist()


# --- repetition penalty and greedy -------------------------------------------------------------

def test_repetition_penalty_divides_positive_and_multiplies_negative():
    x = torch.tensor([3.0, -2.0, 2.0, 0.0])
    out = sampling.penalise(x, [0, 1, 1], 2.0)
    assert out.tolist() == [1.5, -4.0, 2.0, 0.0]
    assert x.tolist() == [3.0, -2.0, 2.0, 0.0]          # input untouched


def test_greedy_is_argmax_of_penalised_logits():
    x = torch.tensor([3.0, -2.0, 2.0, 0.0])
    assert sampling.sample(x, [], opts(temperature=0)) == 0
    assert sampling.sample(x, [0], opts(temperature=0, repetition_penalty=2.0)) == 2
    p = sampling.probabilities(x, [0], opts(temperature=0, repetition_penalty=2.0))
    assert p.tolist() == [0.0, 0.0, 1.0, 0.0]


def test_greedy_ignores_top_p_top_k_and_generator():
    x = torch.tensor([0.1, 5.0, 0.2])
    g = torch.Generator().manual_seed(1)
    assert sampling.sample(x, [], opts(temperature=0, top_k=1, top_p=0.1, min_p=0.9), g) == 1


def test_history_as_tensor_and_empty_history():
    x = torch.tensor([1.0, 2.0, -1.0])
    a = sampling.penalise(x, torch.tensor([1, 2]), 1.5)
    b = sampling.penalise(x, [2, 1, 2], 1.5)
    assert torch.equal(a, b)
    assert torch.equal(sampling.penalise(x, [], 1.5), x)


# --- temperature, top-k, top-p, min-p ----------------------------------------------------------

def test_temperature_scales_logits():
    x = torch.tensor([0.0, math.log(2.0)])
    assert sampling.probabilities(x, [], opts()).tolist() == pytest.approx([1 / 3, 2 / 3])
    assert sampling.probabilities(x, [], opts(temperature=0.5)).tolist() == pytest.approx([1 / 5, 4 / 5])
    assert sampling.probabilities(x, [], opts(temperature=2.0)).tolist() == pytest.approx(
        [1 / (1 + math.sqrt(2)), math.sqrt(2) / (1 + math.sqrt(2))])


def test_top_k():
    x = torch.tensor([1.0, 2.0, 4.0, 3.0])
    assert kept(sampling.transform(x, [], opts(top_k=2))) == [2, 3]
    assert kept(sampling.transform(x, [], opts(top_k=1))) == [2]
    assert kept(sampling.transform(x, [], opts(top_k=0))) == [0, 1, 2, 3]     # 0 = off
    assert kept(sampling.transform(x, [], opts(top_k=9))) == [0, 1, 2, 3]     # more than V = off
    p = sampling.probabilities(x, [], opts(top_k=2))
    assert p.tolist() == pytest.approx([0, 0, math.e / (math.e + 1), 1 / (math.e + 1)])


@pytest.mark.parametrize("top_p, expect", [(1.0, [0, 1, 2, 3]), (0.97, [0, 1, 2, 3]), (0.81, [0, 1, 2]),
                                           (0.75, [0, 1]), (0.5, [0]), (0.4, [0]), (0.0, [0])])
def test_top_p_keeps_smallest_set_reaching_p(top_p, expect):
    x = logits_of(P4)[[2, 0, 3, 1]]       # shuffled: token ids 1, 3, 0, 2 have 0.5, 0.3, 0.15, 0.05
    ids = [1, 3, 0, 2]
    assert kept(sampling.transform(x, [], opts(top_p=top_p))) == sorted(ids[i] for i in expect)
    p = sampling.probabilities(x, [], opts(top_p=top_p))
    mass = sum(P4[i] for i in expect)
    for rank, tid in enumerate(ids):
        assert p[tid].item() == pytest.approx(P4[rank] / mass if rank in expect else 0.0, abs=1e-6)


@pytest.mark.parametrize("min_p, expect", [(0.0, [0, 1, 2, 3]), (0.25, [0, 1, 2]), (0.5, [0, 1]),
                                           (0.7, [0]), (1.0, [0])])
def test_min_p(min_p, expect):
    assert kept(sampling.transform(logits_of(P4), [], opts(min_p=min_p))) == expect


def test_temperature_applies_before_top_p():
    # At temperature 1, 0.5 + 0.3 reaches 0.75; flattened by temperature 4 it takes three tokens.
    x = logits_of(P4)
    assert kept(sampling.transform(x, [], opts(top_p=0.75))) == [0, 1]
    assert kept(sampling.transform(x, [], opts(top_p=0.75, temperature=4.0))) == [0, 1, 2]


def test_never_all_masked():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for o in (opts(top_p=0.0), opts(min_p=1.0), opts(top_k=1, top_p=0.0, min_p=1.0),
              opts(temperature=0.01, top_p=1e-9), opts(repetition_penalty=3.0, top_p=0.0)):
        out = sampling.transform(x, list(range(500)), o)
        assert torch.isfinite(out).sum() >= 1
        assert sampling.probabilities(x, list(range(500)), o).sum().item() == pytest.approx(1.0)


def test_low_precision_input_gives_float32():
    x = torch.randn(50, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = sampling.transform(x, [1, 2], opts(repetition_penalty=1.3, top_k=10))
    assert out.dtype == torch.float32
    assert kept(out) == kept(sampling.transform(x.float(), [1, 2], opts(repetition_penalty=1.3, top_k=10)))


# --- sampling ----------------------------------------------------------------------------------

def test_sample_is_reproducible_and_follows_probabilities():
    x = logits_of(P4)
    o = opts()
    draws = [sampling.sample(x, [], o, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(draws)) == 1
    g = torch.Generator().manual_seed(11)
    n = 4000
    counts = torch.bincount(torch.tensor([sampling.sample(x, [], o, g) for _ in range(n)]), minlength=4)
    chi2 = sum((counts[i].item() - n * P4[i]) ** 2 / (n * P4[i]) for i in range(4))
    assert chi2 < 16.27            # chi-square, 3 degrees of freedom, significance 0.001


def test_sample_respects_masks():
    x = logits_of(P4)
    g = torch.Generator().manual_seed(5)
    assert {sampling.sample(x, [], opts(top_k=2), g) for _ in range(300)} == {0, 1}


# --- agreement with transformers ---------------------------------------------------------------

def test_matches_transformers_logits_processors():
    tf = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        V = 257
        x = torch.randn(V, generator=g) * 3
        history = torch.randint(0, V, (30,), generator=g).tolist()
        o = opts(temperature=float(torch.empty(1).uniform_(0.3, 2.0, generator=g)),
                 top_k=[0, 5, 40, 300][trial % 4], top_p=[1.0, 0.9, 0.5, 0.99][(trial // 4) % 4],
                 min_p=[0.0, 0.05, 0.2][trial % 3], repetition_penalty=[1.0, 1.3, 0.8][(trial // 3) % 3])
        ids = torch.tensor([history])
        s = x[None].clone()
        if o.repetition_penalty != 1.0:
            s = tf.RepetitionPenaltyLogitsProcessor(o.repetition_penalty)(ids, s)
        s = tf.TemperatureLogitsWarper(o.temperature)(ids, s)
        if o.top_k:
            s = tf.TopKLogitsWarper(o.top_k)(ids, s)
        if o.top_p < 1.0:
            s = tf.TopPLogitsWarper(o.top_p)(ids, s)
        if o.min_p:
            s = tf.MinPLogitsWarper(o.min_p)(ids, s)
        ours = sampling.transform(x, history, o)
        assert kept(ours) == kept(s[0]), (trial, o)
        m = torch.isfinite(ours)
        torch.testing.assert_close(ours[m], s[0][m])


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, words", [
    (dict(temperature=-1.0), "sampling.temperature"),
    (dict(top_k=-2), "sampling.top_k"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(min_p=-0.1), "sampling.min_p"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty"),
])
def test_bad_options_are_named(bad, words):
    with pytest.raises(sampling.SamplingError, match=words):
        sampling.transform(torch.zeros(4), [], opts(**bad))


def test_bad_logits_and_history_are_named():
    with pytest.raises(sampling.SamplingError, match="logits: expected one row"):
        sampling.transform(torch.zeros(2, 4), [], opts())
    with pytest.raises(sampling.SamplingError, match="token id 9 is outside the vocabulary of 4"):
        sampling.transform(torch.zeros(4), [1, 9], opts(repetition_penalty=1.2))


@pytest.mark.gpu
def test_cuda_matches_cpu():
    x = torch.randn(49152, generator=torch.Generator().manual_seed(2))
    o = opts(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.1)
    history = list(range(0, 2000, 7))
    cpu = sampling.probabilities(x, history, o)
    gpu = sampling.probabilities(x.cuda(), history, o)
    torch.testing.assert_close(gpu.cpu(), cpu)
    g = torch.Generator(device="cuda").manual_seed(3)
    assert 0 <= sampling.sample(x.cuda(), history, o, g) < 49152
