"""Decode prefetch (runtime/offload/prefetch.py): the plan and copy kernels in Triton's interpreter, the
pages in the VRAM ledger, and the switch that stops copying when predictions do not come true.
(On the GPU, tests/gpu/test_offload_gpu.py runs it inside captured decode steps against all-in-VRAM.)"""
from __future__ import annotations

import pytest
import torch

from bench.check_experts import random_layer
from runtime.budget import MemoryBudget
from runtime.offload import prefetch as pfm
from runtime.offload.manager import OffloadManager
from runtime.offload.slots import word_distance
from tests.interpreted import run_interpreted


_KERNELS = r"""
import torch
from runtime.experts.routing import UniformPicks
from runtime.offload.prefetch import predict_logits, prefetch_copy, prefetch_plan
torch.manual_seed(0)
E, A, H, P = 8, 3, 64, 2
W = [48, 48, 32]                                       # words per expert of gate, up, down
qw = [torch.zeros(2, w, dtype=torch.int32) for w in W]             # two slots
cold = [torch.randint(-2 ** 31, 2 ** 31 - 1, (E, w), dtype=torch.int32) for w in W]
pages = [[torch.zeros(w, dtype=torch.int32) for w in W] for _ in range(P)]
d = lambda a, b: (a.data_ptr() - b.data_ptr()) // 4
resident = {1: 0, 4: 1}                                 # expert -> slot
tables = [torch.tensor([resident[e] * W[j] if e in resident else d(cold[j], qw[j]) + e * W[j] for e in range(E)])
          for j in range(3)]
mask = torch.tensor([int(e in resident) for e in range(E)], dtype=torch.int32)
page_words = torch.tensor([[d(pages[k][j], qw[j]) for k in range(P)] for j in range(3)])
desc = torch.tensor([[d(cold[j], qw[0]), W[j]] + [d(pages[k][j], qw[0]) for k in range(P)] for j in range(3)])
skip = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1], dtype=torch.uint8)
steps = [torch.zeros(E, dtype=torch.int64) for _ in range(3)]
step_skip = torch.zeros(E, dtype=torch.uint8)
cand, copy = torch.zeros(P, dtype=torch.int32), torch.zeros(P, dtype=torch.int32)
score, on = torch.zeros(4, dtype=torch.int64), torch.ones(1, dtype=torch.int32)

# the next layer's router on the residual stream, scaled by its norm weight
h, nw, gate = torch.randn(1, H).half(), (torch.rand(H) + 0.5).half(), torch.randn(E, H).half()
logits = predict_logits(h, nw, gate, torch.zeros(E))
want = (h.float() * nw.float()) @ gate.float().T
assert torch.allclose(logits, want[0], rtol=1e-4, atol=1e-3), (logits, want)
top = torch.argsort(logits, descending=True)[:A].tolist()
want_cand = [e for e in top if e not in resident][:P]
want_cand += [-1] * (P - len(want_cand))

def plan(on_value, ids=None, prev=None, oracle=None):
    on.fill_(on_value)
    prefetch_plan(logits, mask, tables, steps, page_words, skip, step_skip, cand, copy, on, ids,
                  prev[0] if prev else None, prev[1] if prev else None, score, top_k=A, plan=True, oracle=oracle)

plan(1)
assert cand.tolist() == want_cand and copy.tolist() == want_cand, (cand, want_cand)
for j in range(3):
    exp = tables[j].clone()
    for k, e in enumerate(want_cand):
        if e >= 0:
            exp[e] = page_words[j, k]
    assert torch.equal(steps[j], exp), (j, steps[j], exp)
exp_skip = skip.clone()
exp_skip[[e for e in want_cand if e >= 0]] = 0
assert torch.equal(step_skip, exp_skip)
prefetch_copy(qw[0], desc, copy, max(W))
for k, e in enumerate(want_cand):
    for j in range(3):
        assert torch.equal(pages[k][j], cold[j][e]), (k, j)
assert all(torch.equal(q, torch.zeros_like(q)) for q in qw)            # the slots untouched

# the score of that prediction against the picks the layer then made (one of two candidates picked)
prev = (cand.clone(), copy.clone())
ids = torch.tensor([[want_cand[0], 1, 4]], dtype=torch.int32)
plan(0, ids=ids, prev=prev)
assert score.tolist() == [2, 1, 2, 1], score
assert copy.tolist() == [-1] * P and cand.tolist() == want_cand                # off: predicted, not copied
assert all(torch.equal(steps[j], tables[j]) for j in range(3)) and torch.equal(step_skip, skip)

# the last layer scores only
prefetch_plan(None, mask, None, None, None, None, None, cand, copy, on, ids, prev[0], prev[1], score, top_k=A, plan=False)
assert score.tolist() == [4, 2, 4, 2], score

# benchmarks: the next layer's forced picks, kept with probability 1 (0: pseudo-random experts)
picks = UniformPicks.draw(E, A, "cpu", rows=16, seed=3)
picks.step.fill_(5)
plan(1, oracle=(picks, 1.0))
truth = [e for e in picks.table[5].tolist() if e not in resident][:P]
assert cand.tolist()[:len(truth)] == truth, (cand, truth)
plan(1, oracle=(picks, 0.0))
assert all(-1 <= e < E for e in cand.tolist())
print("prefetch kernels ok")
"""


def test_plan_and_copy_kernels_in_the_interpreter():
    """The next layer's router on the residual stream (norm weight applied) gives its top-k; the first
    P of them that are cold there are copied into pages, its step tables point them there and its
    step mask leaves them to the GPU; switched off, nothing is copied and the tables are the layer's
    own; each prediction is scored against the picks the layer made; the benchmark oracle hands over
    the forced picks."""
    run_interpreted(_KERNELS, "prefetch kernels ok")


E, TOP_K = 8, 2


def _manager(pages: int, n: int = 3) -> OffloadManager:
    layers = [random_layer(E, 64, 32, TOP_K, 4, "cpu", seed=i, host_codes=True) for i in range(n)]
    return OffloadManager(layers, MemoryBudget(1 << 40), prefetch_pages=pages)


def test_pages_come_out_of_the_budget_and_point_from_every_layer():
    m = _manager(2)
    cb = m.layers[0].code_bytes
    m.place(free_bytes=20 * cb)
    pf = m.prefetch
    assert pf is not None and m.vram.items["decode prefetch"] == 2 * cb
    assert m.vram.used_bytes <= 20 * cb                             # planned with the pages set aside
    for lo in m.layers:
        for j, p in enumerate(lo.packs):
            assert pf.page_words[lo.index, j].tolist() == [word_distance(pg[j], p.qweight) for pg in pf.pages]
            base = lo.packs[0].qweight
            assert pf.desc[lo.index, j].tolist() == ([word_distance(p.cold, base), p.words_per_expert]
                                                     + [word_distance(pg[j], base) for pg in pf.pages])
    m.apply([list(range(E))] * 3)                                   # everything in VRAM: nothing to fetch
    assert m.prefetch is None and "decode prefetch" not in m.vram.items
    none = _manager(0)
    none.place(free_bytes=20 * cb)
    assert none.prefetch is None and "decode prefetch" not in none.vram.items


def test_copying_starts_when_predictions_come_true_and_stops_when_they_fail():
    m = _manager(1)
    m.place(free_bytes=20 * m.layers[0].code_bytes)
    pf = m.prefetch
    assert not pf.copying and int(pf.on) == 0                   # nothing copied before predictions prove out
    w = pfm.WINDOW

    def window(cands, picked):
        with torch.inference_mode():
            pf.score[0] += torch.tensor([cands, picked, cands, picked])
        for f in range(1, w + 1):
            m.counters.forwards += 1
            pf.boundary(m.counters.forwards)
    # each look decides by the score copied out at the look before (read without waiting)
    window(0, 0)
    window(100, 95)
    window(0, 0)                                 # 95% of the candidates came true: copy
    assert pf.copying and int(pf.on) == 1 and pf.window_use == pytest.approx(0.95)
    window(8, 0)
    window(0, 0)                                 # too few candidates to judge: unchanged
    assert pf.copying
    window(100, 60)
    window(0, 0)                                 # 60%: copies cost more than they save here
    assert not pf.copying and int(pf.on) == 0
    pf.set_mode("off")
    window(100, 100)
    window(0, 0)
    assert not pf.copying                        # held off
    pf.set_mode("on")
    assert pf.copying and int(pf.on) == 1
    with pytest.raises(ValueError, match="prefetch mode 'sometimes'"):
        pf.set_mode("sometimes")
    tel = m.telemetry().expert_prefetch
    assert tel["pages"] == 1 and tel["mode"] == "on" and tel["candidates"] == 308 and tel["copies_used"] == 255


def test_a_plan_waits_for_its_release_and_predicts_from_the_residual_kept(monkeypatch):
    """After layer l only its residual is kept: the side stream's prediction, plan and copy start when
    layer l+1's q/k/v are queued (the decode graphs' `release_prefetch`; exllamav2's GEMM there is wrong
    beside a kernel reading host memory) or, on other paths, at l+1's router (`planned`); never for
    another layer, once per forward, from the residual as layer l left it."""
    from runtime.offload import prefetch as kernels
    m = _manager(1)
    m.place(free_bytes=20 * m.layers[0].code_bytes)
    pf = m.prefetch
    calls = []
    monkeypatch.setattr(kernels, "predict_logits", lambda h, norm, gate, out: calls.append(("predict", h.clone())))
    monkeypatch.setattr(kernels, "prefetch_plan",
                        lambda *a, **k: calls.append(("plan", k["plan"], k["ids"] is not None)))
    monkeypatch.setattr(kernels, "prefetch_copy", lambda *a, **k: calls.append(("copy",)))
    l0, l1, l2 = m.layers
    assert [lo.path for lo in m.layers] == ["stream"] * 3
    h = torch.randn(1, l0.packs[0].in_features).half()
    kept, ids = h.clone(), torch.zeros(1, TOP_K, dtype=torch.int32)
    pf.begin()
    pf.after_layer(l0, h, ids)
    h.add_(1)                                   # the next attention adds into the residual in place
    assert calls == []
    pf.release(l2)                              # another layer's call: not this plan
    assert calls == [] and not pf.planned(l2)
    m.release_prefetch(l1.layer)                # as the decode graphs call it
    assert [c[0] for c in calls] == ["predict", "plan", "copy"] and torch.equal(calls[0][1], kept)
    assert calls[1][1:] == (True, False)        # planned; nothing to score (layer 0 had no prediction)
    assert pf.planned(l1) and len(calls) == 3   # its router finds it launched
    calls.clear()
    pf.after_layer(l1, h, ids)                  # no release call (the layer loop): the router releases
    assert calls == []
    assert pf.planned(l2) and [c[0] for c in calls] == ["predict", "plan", "copy"]
    assert calls[1][1:] == (True, True)         # layer 1's own prediction scored with it
    calls.clear()
    pf.after_layer(l2, h, ids)                  # the last layer: its prediction scored at once, nothing planned
    assert calls == [("plan", False, True)]
    calls.clear()
    pf.after_layer(l0, h, ids)
    pf.begin()                                  # a new forward drops what was pending
    m.release_prefetch(l1.layer)
    assert calls == [] and not pf.planned(l1)
