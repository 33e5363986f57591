"""The MoE block's entry in one launch (runtime/experts/routing.py, route_normed), in Triton's interpreter: the
normed rows equal exllamav2's rms_norm (its arithmetic in PyTorch), and the picks, weights and counts equal
route_fused's on those rows; the per-row counters are back at 0 after every launch; forced (uniform) routing
and bad shapes."""
from __future__ import annotations

import pytest

from tests.interpreted import run_interpreted

_CHECK = """
import torch
from runtime.experts.routing import UniformPicks, route_fused
from runtime.experts.routing import RowCounters, route_normed


def rms_norm_like_exllamav2(h, norm_w, eps):
    # exllamav2's rms_norm kernel in PyTorch: fp32, x clamped to fp16's range, x * w * rsqrt(mean(x^2) + eps)
    x = h.float().clamp(-65504.0, 65504.0)
    return (x * norm_w.float() * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)).half()


torch.manual_seed(0)
for E, A, H, T, dtype, renorm in [(128, 8, 256, 1, torch.float16, True), (8, 2, 192, 5, torch.float16, True),
                                  (16, 4, 128, 9, torch.float32, False), (60, 4, 96, 3, torch.float16, True)]:
    h = (torch.randn(T, H) * 3).to(dtype)
    h[0, 0] = 70000.0 if dtype == torch.float32 else h[0, 0]            # past fp16's range: clamped as exllamav2
    norm_w = (1 + 0.1 * torch.randn(H)).half()
    gate = (torch.randn(E, H) * 0.05).half()
    counters = RowCounters("cpu", rows=4)                                # T = 5 and 9: counters of their own
    for launch in range(2):                                              # the counters are back at 0 between
        counts, want_counts = torch.zeros(E, dtype=torch.int32), torch.zeros(E, dtype=torch.int32)
        x, ids, w = route_normed(h, norm_w, 1e-6, gate, A, counts, counters, renormalize=renorm)
        want_x = rms_norm_like_exllamav2(h, norm_w, 1e-6)
        assert x.dtype == torch.float16 and torch.equal(x, want_x), (E, H, (x.float() - want_x.float()).abs().max())
        want_ids, want_w = route_fused(want_x, gate, A, want_counts, renormalize=renorm)
        assert torch.equal(ids, want_ids), (E, A, ids, want_ids)
        assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-7), (w, want_w)
        assert torch.equal(counts, want_counts)
        assert int(counters.buf.abs().sum()) == 0, counters.buf
picks = UniformPicks.draw(16, 4, "cpu", rows=100, seed=3).for_layer(1)
start = int(picks.step)
h, norm_w, gate = torch.randn(7, 64).half(), torch.ones(64).half(), torch.randn(16, 64).half()
counts = torch.zeros(16, dtype=torch.int32)
x, ids, w = route_normed(h, norm_w, 1e-5, gate, 4, counts, RowCounters("cpu"), forced=picks)
want = picks.table[[(start + t) % 100 for t in range(7)]]
assert torch.equal(ids, want)                               # row t takes the t-th set after the counter
assert int(picks.step) == start + 7 and torch.allclose(w, torch.full((7, 4), 0.25))
_, one, _ = route_normed(h[:1], norm_w, 1e-5, gate, 4, counts, RowCounters("cpu"), forced=picks)
assert torch.equal(one, picks.table[[(start + 7) % 100]]) and int(picks.step) == start + 8
for bad, says in [((h, torch.ones(32).half(), 1e-5, gate, 4), "do not agree"),
                  ((torch.randn(2, 60).half(), torch.ones(60).half(), 1e-5, torch.randn(16, 60).half(), 4),
                   "not a multiple of 32"),
                  ((h, norm_w, 1e-5, gate, 3), "pick sets of 4 experts for top-k 3")]:
    try:
        route_normed(*bad, torch.zeros(16, dtype=torch.int32), RowCounters("cpu"),
                     forced=picks if "pick sets" in says else None)
    except ValueError as e:
        assert says in str(e), (says, str(e))
    else:
        raise AssertionError(f"accepted: {says}")
print("route_normed ok")
"""


def test_the_fused_entry_equals_the_norm_then_the_router_in_the_interpreter():
    run_interpreted(_CHECK, "route_normed ok", timeout=600)


def test_the_counters_buffer_never_moves_and_a_capture_gets_no_new_one(monkeypatch):
    import torch
    from runtime.experts.routing import RowCounters
    c = RowCounters("cpu", rows=4)
    buf = c.buf
    assert c.for_rows(3) is buf
    more = c.for_rows(9)                                # a prefill's own counters: the buffer stays
    assert more is not buf and more.numel() == 9 and int(more.abs().sum()) == 0 and c.buf is buf
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert c.for_rows(4) is buf                         # covered: no allocation
    with pytest.raises(RuntimeError, match="graph capture"):
        c.for_rows(1000)
