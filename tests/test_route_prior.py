"""The routing prior measured at a first load, on the CPU: when a load measures one, what it counts
and with which weight, the calibration prompt's tokens, and the load's step (one prefill, one
re-placement, only where no saved statistics are usable). The GPU side: tests/gpu/test_route_prior_gpu.py."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from bench.check_experts import random_layer
from runtime.backends import routing_prior
from runtime.budget import MemoryBudget
from runtime.errors import BadRequest
from runtime.offload import route_prior as rp
from runtime.offload.manager import OffloadManager
from runtime.offload.routing_stats import RoutingStats

E, TOP_K, L = 8, 2, 4
HOT = (5, 6, 7)                 # the experts the fake calibration prompt routes to


# -- when a prior is measured ----------------------------------------------------------------------

def test_a_prior_is_measured_without_usable_saved_statistics_only():
    assert rp.prior_reason(None) == "no saved routing statistics"
    assert rp.prior_reason(None, "Ignoring routing statistics in x: bad") == "the saved routing statistics are invalid"
    few = RoutingStats(np.ones((L, E)), tokens=10.0)
    assert "cover 10 tokens" in rp.prior_reason(few)
    hole = RoutingStats(np.ones((L, E)), tokens=500.0)
    hole.counts[1] = 0
    assert rp.prior_reason(hole) == "the saved routing statistics have no counts for MoE layer 1"
    assert rp.prior_reason(RoutingStats(np.ones((L, E)), tokens=500.0)) is None


def test_saved_statistics_say_a_first_load_measures_and_a_later_one_does_not(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    stats, file, warning, reason = routing_prior.saved_statistics(model, L, E, cache=tmp_path)
    assert stats is None and warning is None and reason == "no saved routing statistics"
    RoutingStats(np.ones((L, E)), tokens=300.0).save(file)
    stats, _, _, reason = routing_prior.saved_statistics(model, L, E, cache=tmp_path)
    assert stats is not None and reason is None
    file.write_text("{not json")
    stats, _, warning, reason = routing_prior.saved_statistics(model, L, E, cache=tmp_path)
    assert stats is None and warning and reason == "the saved routing statistics are invalid"
    from runtime import tuning
    off = tuning.Tuning.from_environment({"MOEDESK_ROUTE_PRIOR": "0"})
    assert not off.route_prior
    assert routing_prior.saved_statistics(model, L, E, cache=tmp_path, route_prior=off.route_prior)[3] is None


# -- what is counted, with which weight --------------------------------------------------------------

def test_the_prior_weighs_its_tokens_whatever_the_calibrations_length():
    window = np.zeros((2, E))
    window[0, [5, 6]] = [300, 100]                    # 200 tokens x top-2
    window[1, :] = 50
    c = rp.prior_counts(window, TOP_K, weight_tokens=256)
    assert c.sum(axis=1) == pytest.approx([512, 512])
    assert c[0, 5] == pytest.approx(384) and c[0, 6] == pytest.approx(128) and c[0, 0] == 0
    assert np.all(rp.prior_counts(np.zeros((L, E)), TOP_K) == 0)          # nothing routed: stays unknown
    with pytest.raises(ValueError, match="non-negative"):
        rp.prior_counts(-window, TOP_K)
    with pytest.raises(ValueError, match="expected \\[layers, experts\\]"):
        rp.prior_counts(np.ones(E), TOP_K)


def test_the_users_traffic_outweighs_the_prior_after_about_its_weight_in_tokens():
    stats = RoutingStats.empty(1, E)
    prior = np.zeros((1, E))
    prior[0, 0] = 1000                                # the prior: expert 0 only
    rp.absorb_prior(stats, prior, TOP_K)
    assert stats.tokens == pytest.approx(rp.PRIOR_TOKENS)
    assert stats.frequencies()[0, 0] == pytest.approx(1.0)
    user = np.zeros((1, E))
    for n in range(1, 2000):                          # the user: expert 3 only, one token at a time
        user[0, 3] = TOP_K
        stats.absorb(user, 1)
        if stats.counts[0, 3] > stats.counts[0, 0]:
            break
    assert 0.9 * rp.PRIOR_TOKENS < n < 1.1 * rp.PRIOR_TOKENS, n


# -- the calibration prompt ----------------------------------------------------------------------------

def test_the_calibration_conversation_ships_with_the_runtime():
    messages, answer = rp.calibration_messages()
    assert [m["role"] for m in messages] == ["system", "user"] and len(answer) > 200
    assert rp.calibration_messages.__defaults__[0].parent.name == "offload"


def test_a_broken_calibration_file_says_what_is_wrong(tmp_path):
    bad = tmp_path / "calibration.json"
    bad.write_text(json.dumps({"system": "s", "user": "u"}))
    with pytest.raises(ValueError, match="calibration.json cannot be read: 'answer'"):
        rp.calibration_messages(bad)
    bad.write_text(json.dumps({"system": "s", "user": "", "answer": "a"}))
    with pytest.raises(ValueError, match="must be non-empty text"):
        rp.calibration_messages(bad)


def _tokenizer_folder(tmp_path: Path, chat: str = "chatml", vocab: int = 1024) -> Path:
    from runtime.exl2.synth_tokenizer import write_tokenizer
    folder = tmp_path / f"tok-{chat}"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    write_tokenizer(folder, vocab, vocab - 16, 4096, chat=chat)
    return folder


def test_calibration_ids_are_the_conversation_in_the_models_chat_template(tmp_path):
    from runtime.tokenizer import Tokenizer
    folder = _tokenizer_folder(tmp_path)
    ids, source = rp.calibration_ids(folder, 1024, limit=100000)
    assert source == "a calibration prompt in the model's chat template"
    text = Tokenizer.from_folder(folder).decode(ids, skip_special_tokens=False)
    messages, answer = rp.calibration_messages()
    assert text.startswith("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n" + answer)                # an answer begun, not ended
    short, _ = rp.calibration_ids(folder, 1024, limit=40)
    assert short == ids[:40]


def test_without_a_template_the_text_alone_and_without_a_tokenizer_random_ids(tmp_path):
    folder = _tokenizer_folder(tmp_path)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ids, source = rp.calibration_ids(folder, 1024, limit=100000)
    assert source.startswith("a calibration prompt as plain text") and len(ids) > 300
    cfg["chat_template"] = "{{ raise_exception('this template takes no system message') }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert rp.calibration_ids(folder, 1024, limit=100000) == (ids, source)      # refused: the text alone
    empty = tmp_path / "empty"
    empty.mkdir()
    ids, source = rp.calibration_ids(empty, 1000, limit=64)
    assert source.startswith("random ids (no usable tokenizer") and len(ids) == 64
    assert all(0 <= i < 1000 for i in ids)
    ids, source = rp.calibration_ids(folder, 300, limit=64)               # the tokenizer outgrows the model
    assert source.startswith("random ids (the tokenizer's ids reach") and max(ids) < 300
    with pytest.raises(ValueError, match="no room for a calibration prompt"):
        rp.calibration_ids(folder, 1024, limit=0)


# -- the load's step: one prefill, one re-placement --------------------------------------------------------

def _manager(reason="no saved routing statistics") -> OffloadManager:
    layers = [random_layer(E, 64, 32, TOP_K, 4, "cpu", seed=i, host_codes=True) for i in range(L)]
    m = OffloadManager(layers, MemoryBudget(1 << 40))
    m.vram.total_bytes = 24 * m.layers[0].code_bytes            # 3 hot experts per layer + staging for 6 (x2)
    m.place()
    m.prior_reason = reason
    return m


class FakeEngine:
    """An engine's part that the load's step uses; a prefill routes every token to HOT (the
    calibration) and a warm-up's random ids anywhere, as the device counters would show."""

    def __init__(self, manager, path="", context=4096):
        self.offload, self.position = manager, 0
        self.info = SimpleNamespace(path=path, context_length=context, vocab_size=1024)
        self.prefills: list[int] = []
        self.refuse = False

    def prefill(self, ids):
        if self.refuse:
            raise BadRequest(f"token {ids[0]} is an image or video placeholder")
        self.offload.step_boundary(len(ids))
        for lo in self.offload.layers:
            for i, _ in enumerate(ids):
                lo.layer.counts[HOT[i % len(HOT)]] += 1
                lo.layer.counts[HOT[(i + 1) % len(HOT)]] += 1
        self.position += len(ids)
        self.prefills.append(len(ids))

    def truncate(self, n):
        self.position = n

    def _drop_graphs(self):
        self.dropped = True


def test_the_load_measures_the_prior_once_and_places_the_hot_set_it_found(tmp_path):
    m = _manager()
    assert all(set(lo.resident()) != set(HOT) for lo in m.layers)          # placed blind (uniform)
    for lo in m.layers:                                             # the warm-up's random ids, before
        lo.layer.counts[0] += 500
    eng = FakeEngine(m, path=str(_tokenizer_folder(tmp_path)))
    heard = []
    assert routing_prior.measure_at_load(eng, lambda stage, msg, d, t: heard.append((stage, msg, d, t)))
    assert len(eng.prefills) == 1 and 100 < eng.prefills[0] <= rp.MAX_TOKENS and eng.position == 0
    assert heard[0] == ("load", routing_prior.MESSAGE, 0, 1) and heard[-1] == ("load", routing_prior.MESSAGE, 1, 1)
    assert ("load", "Placing experts: filling the hot experts' slots", 0, 1) in heard
    assert [set(lo.resident()) for lo in m.layers] == [set(HOT)] * L          # placed by the prior
    assert m.stats.tokens == pytest.approx(rp.PRIOR_TOKENS)
    assert m.stats.counts[:, 0].sum() == 0                                   # the random ids left out
    assert m.stats.counts[:, list(HOT)].sum() == pytest.approx(L * rp.PRIOR_TOKENS * TOP_K)
    assert m.prior_reason is None and m.prior_source == "a calibration prompt in the model's chat template"
    assert eng.dropped                                                     # no graph keeps the old slots
    assert not routing_prior.measure_at_load(eng, lambda *a: None)          # once per load
    assert len(eng.prefills) == 1
    m.on_stage("later placements reach no load's progress")


def test_a_load_with_saved_statistics_runs_no_calibration_prefill():
    m = _manager(reason=None)
    before = [lo.resident() for lo in m.layers]
    eng = FakeEngine(m)
    assert not routing_prior.measure_at_load(eng, lambda *a: None)
    assert eng.prefills == [] and [lo.resident() for lo in m.layers] == before
    with pytest.raises(ValueError, match="no routing prior is due"):
        m.learn_prior(np.zeros((L, E)), np.zeros((L, E)))
    full = FakeEngine(_manager(), context=rp.MIN_TOKENS)                    # too little room in the cache
    assert not routing_prior.measure_at_load(full, lambda *a: None) and full.prefills == []
    refused = FakeEngine(_manager())
    refused.refuse = True
    before = [lo.resident() for lo in refused.offload.layers]
    assert not routing_prior.measure_at_load(refused, lambda *a: None)      # no prior, the load goes on
    assert [lo.resident() for lo in refused.offload.layers] == before and refused.offload.prior_reason is None
    placeholders = FakeEngine(_manager())                   # random ids (no folder) draw around refused ones
    placeholders.refused_tokens = tuple(range(0, 1024, 2))
    fed = []
    plain_prefill = placeholders.prefill
    placeholders.prefill = lambda ids: fed.extend(ids) or plain_prefill(ids)
    assert routing_prior.measure_at_load(placeholders, lambda *a: None)
    assert fed and all(t % 2 for t in fed)
    fits = _manager()
    fits.vram.total_bytes = 1 << 40
    fits.place()                                                            # every expert resident
    eng = FakeEngine(fits)
    assert not routing_prior.measure_at_load(eng, lambda *a: None) and eng.prefills == []


def test_forget_warmup_leaves_the_prior_in_the_statistics_and_out_of_the_figures():
    m = _manager()
    eng = FakeEngine(m)                                                     # no folder: random ids
    routing_prior.measure_at_load(eng, lambda *a: None)
    assert m.prior_source.startswith("random ids")
    prior = m.stats.counts.copy()
    for lo in m.layers:                                                     # the path trials' decode steps
        lo.layer.counts[1] += 100
    for _ in range(64):
        m.step_boundary(1)
    assert m.stats.counts[:, 1].sum() > 0                                   # absorbed meanwhile
    m.forget_warmup()
    assert np.array_equal(m.stats.counts, prior) and m.stats.tokens == pytest.approx(rp.PRIOR_TOKENS)
    t = m.telemetry()
    assert t.expert_pairs == 0 and t.expert_hits == 0
    for lo in m.layers:                                                     # the first answer's steps
        lo.layer.counts[HOT[0]] += 3
    assert m.telemetry().expert_pairs == 3 * L and m.telemetry().expert_hits == 3 * L
    for _ in range(32):
        m.step_boundary(1)
    assert m.stats.counts[:, 1].sum() == 0 and m.stats.counts[:, HOT[0]].sum() > prior[:, HOT[0]].sum() * 0.99


def test_the_prior_is_saved_at_close_and_the_next_load_uses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path / "home"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    _, file, _, reason = routing_prior.saved_statistics(model, L, E)
    assert reason is not None
    m = _manager(reason)
    m.stats_file = file
    routing_prior.measure_at_load(FakeEngine(m), lambda *a: None)
    m.close()
    stats, _, _, reason = routing_prior.saved_statistics(model, L, E)
    assert reason is None and sorted(np.argsort(stats.counts[0])[-3:].tolist()) == sorted(HOT)


def test_the_hybrid_engine_runs_the_same_step(tmp_path, monkeypatch):
    """Qwen3.5's engine (hybrid.py, on the CPU: every expert's codes in host memory, part placed in
    slots): the calibration prompt goes through its own prefill and chat template, the cache is
    empty after, and each layer's residents are then its most routed experts in the prior."""
    from runtime.backends import hybrid
    from runtime.exl2 import synth
    from runtime.options import LoadOptions, OffloadOptions
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path / "home"))
    folder = tmp_path / "tiny-qwen3.5"
    synth.write_synthetic("tiny-qwen3.5", 3.0, folder, seed=1)
    eng, _ = hybrid.load(folder, LoadOptions(offload=OffloadOptions(context_length=1024)), device="cpu",
                         window=6, host_experts=True)
    try:
        m = eng.offload
        m.vram.total_bytes = 3 * m.E * sum(m.residency.code_bytes()) // 4
        m.place()
        before = [lo.resident() for lo in m.layers]
        assert all(0 < len(r) < m.E for r in before), before
        m.prior_reason = "no saved routing statistics"
        heard = []
        assert routing_prior.measure_at_load(eng, lambda stage, msg, d, t: heard.append(msg))
        assert heard[0] == heard[-1] == routing_prior.MESSAGE and eng.position == 0
        assert m.prior_source == "a calibration prompt in the model's chat template"
        assert m.stats.tokens == pytest.approx(rp.PRIOR_TOKENS)
        freq = m.stats.frequencies()
        for lo in m.layers:
            r = lo.resident()
            nth = np.sort(freq[lo.index])[::-1][len(r) - 1]
            assert freq[lo.index, r].min() >= nth - 1e-12, (lo.index, r, freq[lo.index])
        assert [lo.resident() for lo in m.layers] != before
    finally:
        eng.close()
