"""The GPU tests' record/replay of router picks (tests/gpu/routing_replay.py), on the CPU: a stand-in
engine whose layers route through `layer.route_fused` as the CUDA engine's do, with a CPU top-k in place
of the Triton router. A replay must hold (every layer computes with the picks given) and must say so when
a layer escapes it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime.experts import layer as expert_layer
from tests.gpu.routing_replay import Picks, Routing

E, A, H = 8, 2, 16


def _cpu_route(x, gate_w, top_k, counts, renormalize=True, forced=None):
    logits = x.float() @ gate_w.float().t()
    w, ids = torch.softmax(logits, -1).topk(top_k, -1)
    counts.index_add_(0, ids.flatten().long(), torch.ones(ids.numel(), dtype=counts.dtype))
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True) if renormalize else w)


class _Engine:
    """Layers route their input (fixed per token) through the router; `escaped` layers call the router
    they were built with instead of the module's (as a layer would that bound it before the patch)."""

    def __init__(self, layers: int, escaped=(), seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.moe = [SimpleNamespace(experts=SimpleNamespace(gate_w=torch.randn(E, H, generator=g), top_k=A))
                    for _ in range(layers)]
        self.escaped = set(escaped)
        self.bound = _cpu_route                     # the router, not the replay's patch of it
        self.graphs = None
        self.used: list[torch.Tensor] = []

    @torch.inference_mode()                         # (as the engines' forwards)
    def forward(self, tokens: list[int]) -> torch.Tensor:
        x = torch.stack([torch.randn(H, generator=torch.Generator().manual_seed(t)) for t in tokens])
        self.used = []
        for i, m in enumerate(self.moe):
            route = self.bound if i in self.escaped else expert_layer.route_fused
            ids, w = route(x, m.experts.gate_w, A, torch.zeros(E, dtype=torch.int64))
            self.used.append(ids.clone())
        return torch.stack(self.used).float().sum(0)


@pytest.fixture
def routing(monkeypatch):
    monkeypatch.setattr(expert_layer, "route_fused", _cpu_route)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)   # (a CPU-only torch has none)
    r = Routing(monkeypatch)
    yield r
    r.undo()


def test_a_replay_holds_and_keeps_the_routers_own_picks(routing):
    eng = _Engine(3)
    rec = Picks(routing, eng)
    rec("prefill", [1, 2, 3], lambda: eng.forward([1, 2, 3]))
    own = [u.clone() for u in eng.used]
    assert [p[0].tolist() for p in rec.picks["prefill"]] == [u.tolist() for u in own]
    given = {"prefill": [((ids + 1) % E, w) for ids, w in rec.picks["prefill"]]}
    other = _Engine(3)                              # (same seed: the same routers)
    routing.reset()
    play = Picks(routing, other, given)
    play("prefill", [1, 2, 3], lambda: other.forward([1, 2, 3]))
    assert [u.tolist() for u in other.used] == [g[0].tolist() for g in given["prefill"]]
    assert [o[0].tolist() for o in play.own["prefill"]] == [u.tolist() for u in own]


def test_a_layer_that_escapes_the_replay_is_named(routing):
    eng = _Engine(3)
    rec = Picks(routing, eng)
    rec("prefill", [4, 5], lambda: eng.forward([4, 5]))
    rec("decode", [6], lambda: eng.forward([6]))
    routing.reset()
    escaping = _Engine(3, escaped={1})
    play = Picks(routing, escaping, rec.picks)
    with pytest.raises(AssertionError, match=r"prefill: MoE layers \[1\] did not take the picks given"):
        play("prefill", [4, 5], lambda: escaping.forward([4, 5]))
    # a later, shorter forward is checked on its own: the longer one's rows do not stand in for it
    escaping.escaped = {2}
    with pytest.raises(AssertionError, match=r"decode: MoE layers \[2\] did not take"):
        play("decode", [6], lambda: escaping.forward([6]))
