"""The routing prior at a first load (runtime/offload/route_prior.py), on the GPU.

Model: conftest's moe_8l at a VRAM budget that keeps about half of each layer's experts resident
("stream" placement: no CPU path trials). A fresh load (empty user cache) prefills the calibration
prompt in the model's chat template and places the hot experts by it; the prompt of a different
conversation then routes mostly to that placement, its first decode steps (reading an answer's tokens) close
most of the gap between the blind placement's hit rate and the steady state's (issue 19's figure, within 10% of the
steady state, is the worker benchmark's on q125-a11: see the assertion), and the next load uses the saved
statistics without a calibration prefill. A load with the prior off (MOEDESK_ROUTE_PRIOR=0) gives the
blind placement to compare with. MOEDESK_GPU_REPORT=<file> appends the figures as JSON lines.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from gpu_budget import assert_closed_freed, offload_budget
from gpu_figures import record as _record
from runtime.options import LoadOptions, OffloadOptions

pytestmark = pytest.mark.gpu
GiB = 1024 ** 3
FIRST, STEADY_AFTER, STEADY = 32, 320, 64         # decode steps: the first answer's, then to settle, then measured
QUESTION = ("Write a short story about a lighthouse keeper who finds a message in a bottle, and explain "
            "in two sentences why lighthouses were built on rocks and headlands.")
# The answer the decode steps read, a token a step (teacher forcing: what an answer's routing meets, where a
# greedy decode of random weights soon repeats itself).
ANSWER = """The keeper of the Skerry light had kept the lamp for eleven winters when the bottle came ashore.
It was green glass, thick as a thumb at the base, stopped with wax that had gone grey in the salt. He found it
on a Tuesday in March, wedged between two black rocks below the landing stage, while he was checking the
rope on the supply boat's mooring ring. Inside was a single sheet of paper folded into eight, dry as the day
it was written. The hand was careful and a little old fashioned: a child's hand, he thought, practising
letters. It said that a girl named Ada, aged nine, lived in a grey house at the end of Harbour Row in a
town he had never heard of, that she had a brother who snored and a cat who did not, and that if anybody
found this letter they should write back and tell her what the sea was like where they were.
He read it three times by the window of the watch room while the kettle boiled. Then he took out the log
book, turned to a clean page at the back, and began to answer. He told her that the sea at the Skerry was
never the same colour twice: pewter in the morning, bottle green at noon, and at dusk a purple so deep
that the first sweep of the lamp seemed to cut it in half. He told her about the gannets that dived like
dropped knives, the seals that sang on the north ledge in autumn, and the storm of the previous January,
when spray had reached the gallery rail ninety feet above the tide and the whole tower had hummed like a
struck bell. He wrote that he had a cat too, a tabby called Fresnel after the lens, who slept on the warm
brass housing of the clockwork and disapproved of visitors.
When the relief boat came at the end of the month, he gave the letter to the skipper with money for the
stamp. Spring came, and then summer, and he forgot about it, or nearly. In September a parcel arrived with
the stores: a photograph of a grey house, a drawing of a lighthouse with far too many windows, and a note
that said the sea at Harbour Row was brown and cross and smelled of fish, and could she please visit.
Lighthouses were built on rocks and headlands because those are the places where ships are wrecked: the
light has to stand on the danger itself, so that a captain who sees it knows exactly where the hazard lies.
High ground also carries the beam farther over the curve of the sea, and solid rock gives the tower a
foundation that waves cannot wash away, which is why the oldest lights still stand where they were built."""


def _load(path, **off):
    from runtime.backends import exl2
    opts = LoadOptions(offload=OffloadOptions(context_length=1024, **off))
    stages = []
    eng, _ = exl2.load(path, opts, lambda stage, msg, d, t: stages.append((stage, msg, time.perf_counter())))
    return eng, [m for _, m, _ in stages]


@pytest.fixture(scope="module")
def budget(moe_8l, tmp_path_factory) -> float:
    """About half of each layer's experts resident, by the planner's own figures (gpu_budget)."""
    return offload_budget(moe_8l, 0.5, tmp_path_factory.mktemp("probe"))


def _prompt(path) -> tuple[list[int], list[int]]:
    """The question in the model's chat template, and the answer's tokens (at least the decode steps')."""
    from runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(path)
    answer = tok.encode(" ".join(ANSWER.split()))
    assert len(answer) >= FIRST + STEADY_AFTER + STEADY, len(answer)
    return tok.encode_chat([{"role": "user", "content": QUESTION}]), answer


def _hit_rate(eng, toks: list[int]) -> float:
    """The decode steps of `toks`, one a step; the share of their expert picks that hit VRAM."""
    t0 = eng.telemetry()
    for tok in toks:
        eng.forward([tok])
    t1 = eng.telemetry()
    pairs = t1["expert_pairs"] - t0["expert_pairs"]
    return (t1["expert_hits"] - t0["expert_hits"]) / pairs


def _answer(eng, prompt: list[int], answer: list[int]) -> dict:
    """The prompt's routing (prefill + the first decode steps of `answer`) and the hit rates of the first
    steps and of the steady state after re-placement; the cache rolled back."""
    m = eng.offload
    before = m.routing_counts()
    eng.prefill(prompt)
    eng.prepare_decode(FIRST + STEADY_AFTER + STEADY + 1)
    first = _hit_rate(eng, answer[:FIRST])
    routed = (m.routing_counts() - before) % (1 << 32)
    _hit_rate(eng, answer[FIRST:FIRST + STEADY_AFTER])
    steady = _hit_rate(eng, answer[FIRST + STEADY_AFTER:FIRST + STEADY_AFTER + STEADY])
    eng.truncate(0)
    return {"routed": routed, "first": first, "steady": steady}


def _coverage(routed: np.ndarray, resident: list[list[int]]) -> float:
    """Share of the routed picks that land on `resident` experts."""
    return float(sum(routed[i, r].sum() for i, r in enumerate(resident)) / routed.sum())


def test_a_first_load_places_by_a_measured_prior_and_the_first_answer_hits_as_the_steady_state(
        moe_8l, budget, monkeypatch, tmp_path):
    from runtime import tuning
    from runtime.backends.routing_prior import MESSAGE
    from runtime.offload.route_prior import PRIOR_TOKENS
    prompt, answer = _prompt(moe_8l)
    allocated = torch.cuda.memory_allocated()
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path / "blind"))
    with tuning.use(tuning.with_changes(route_prior=False)):
        eng, messages = _load(moe_8l, placement="stream", vram_budget_gb=budget)
    try:
        assert MESSAGE not in messages and eng.offload.stats.tokens < PRIOR_TOKENS / 4
        blind_resident = [lo.resident() for lo in eng.offload.layers]
        blind = _answer(eng, prompt, answer)
    finally:
        eng.close()
    assert_closed_freed(allocated)                      # the next load finds the same VRAM

    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path / "prior"))
    eng, messages = _load(moe_8l, placement="stream", vram_budget_gb=budget)
    try:
        m = eng.offload
        assert MESSAGE in messages, messages
        assert m.prior_source == "a calibration prompt in the model's chat template", m.prior_source
        assert m.stats.tokens == pytest.approx(PRIOR_TOKENS, rel=1e-6)       # the warm-up's steps left out
        assert any(lo.path == "stream" for lo in m.layers), [lo.path for lo in m.layers]
        resident = [lo.resident() for lo in m.layers]
        assert resident != blind_resident, "the placement after load is the blind one"
        assert m.telemetry().expert_pairs == 0                               # the prior is no answer's traffic
        got = _answer(eng, prompt, answer)
    finally:
        eng.close()
    assert_closed_freed(allocated)
    cover, cover_blind = _coverage(got["routed"], resident), _coverage(got["routed"], blind_resident)
    figures = dict(test="route_prior", first=got["first"], steady=got["steady"], blind_first=blind["first"],
                   blind_steady=blind["steady"], coverage=cover, blind_coverage=cover_blind)
    print(figures)
    _record(**figures)
    assert cover >= cover_blind - 0.02, figures              # the prompt routes to the prior's hot set
    # The first answer under the prior closes most of the gap between the blind placement and the steady state.
    # Not "within 10% of the steady state" (issue 19's figure, which the worker benchmark measures on q125-a11):
    # random weights route mostly by the token itself, and this tokenizer's answer is 1,243 tokens of 244
    # distinct ones, so a placement fitted to its first 352 tokens covers the next 64 almost wholly (0.99 on
    # the H200 at 5bdd370), where the prior measured on another text gave 0.80 and the blind placement 0.45.
    assert got["first"] - blind["first"] >= 0.5 * (got["steady"] - blind["first"]), figures

    eng, messages = _load(moe_8l, placement="stream", vram_budget_gb=budget)     # the prior was saved
    try:
        assert MESSAGE not in messages and eng.offload.prior_reason is None, messages
        assert eng.offload.stats.tokens >= PRIOR_TOKENS / 2
    finally:
        eng.close()


@pytest.fixture(scope="module")
def tiny_q35(tmp_path_factory):
    from runtime.exl2 import synth
    from runtime.exl2.shapes import get_shape
    out = tmp_path_factory.mktemp("q35") / "tiny-qwen3.5"
    synth.write_synthetic(get_shape("tiny-qwen3.5"), 3.0, out, seed=1)
    return out


def test_the_hybrid_engine_measures_the_same_prior(tiny_q35, monkeypatch, tmp_path):
    """Qwen3.5 (hybrid.py) runs the same step: loaded with every expert fitting it measures none; with
    part of them placed cold, the step prefills the calibration prompt through the hybrid engine and
    each layer's residents are then its most routed experts in the prior."""
    from runtime.backends import hybrid
    from runtime.backends.routing_prior import MESSAGE
    from runtime.offload.route_prior import PRIOR_TOKENS
    free = torch.cuda.mem_get_info()[0]
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path / "fits"))
    off = OffloadOptions(context_length=1024, vram_budget_gb=0.9 * free / GiB, placement="stream")
    heard = []
    eng, _ = hybrid.load(tiny_q35, LoadOptions(offload=off), lambda stage, msg, d, t: heard.append(msg),
                         window=6, graphs=False, host_experts=True)
    try:
        m = eng.offload
        assert all(lo.path == "vram" for lo in m.layers), [lo.path for lo in m.layers]
        assert MESSAGE not in heard and m.prior_reason is None and m.stats.tokens == 0   # all fit: none measured
        # A quarter resident, plus half an expert of slack: this model's experts are ~40 KB, so a slack
        # in MiB (gpu_budget.SLACK) would fit all 64 of them and nothing would be placed cold
        budget = m.budget_for(m.E // 4) + max(m.residency.code_bytes()) // 2
    finally:
        eng.close()
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path / "cold"))     # no saved statistics here either
    off = OffloadOptions(context_length=1024, vram_budget_gb=budget / GiB, placement="stream")
    heard = []
    eng, _ = hybrid.load(tiny_q35, LoadOptions(offload=off), lambda stage, msg, d, t: heard.append(msg),
                         window=6, graphs=False, host_experts=True)
    try:
        m = eng.offload
        assert any(lo.path == "stream" and lo.resident() for lo in m.layers), [lo.path for lo in m.layers]
        assert MESSAGE in heard and eng.position == 0 and m.prior_reason is None
        assert m.prior_source == "a calibration prompt in the model's chat template", m.prior_source
        assert m.stats.tokens == pytest.approx(PRIOR_TOKENS, rel=1e-6)
        freq = m.stats.frequencies()
        for lo in m.layers:
            r = lo.resident()
            if 0 < len(r) < m.E:
                nth = np.sort(freq[lo.index])[::-1][len(r) - 1]
                assert freq[lo.index, r].min() >= nth - 1e-12, (lo.index, r, freq[lo.index])
        ids, _ = _prompt(tiny_q35)
        assert eng.prefill(ids).shape[-1] == eng.info.vocab_size          # the engine answers as before
    finally:
        eng.close()
