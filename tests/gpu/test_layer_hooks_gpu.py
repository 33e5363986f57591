"""An expert layer on the GPU with a fake expert source and fake hooks (runtime/experts/layer.py): it
runs its kernels on the projections the hooks hand it, calls before/after once per forward, routes
by the forced picks an Experiment gives, and leaves a CPU path alone when the hooks say so."""
from __future__ import annotations

import types

import pytest
import torch

pytestmark = pytest.mark.gpu
E, H, I, TOP_K = 16, 256, 128, 4


class FakeHooks:
    def __init__(self, packs, cpu_decode=True):
        self.packs, self.cpu_decode, self.prefetch = packs, cpu_decode, None
        self.calls = []

    def before(self, lo, rows, ids):
        self.calls.append(("before", lo.index, rows, ids.clone()))
        return self.packs

    def after(self, lo):
        self.calls.append(("after", lo.index))


class NoCpu:
    def launch(self, *a, **kw):
        raise AssertionError("the CPU path ran under hooks that say cpu_decode=False")


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_a_layer_computes_with_what_its_hooks_hand_it(rows):
    from bench.check_experts import random_layer
    from runtime.experts.routing import UniformPicks
    layer = random_layer(E, H, I, TOP_K, 4, "cuda")
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows)).half().cuda()
    want = layer(x)                                         # no offload: the layer's own packs
    hooks = FakeHooks((layer.w1, layer.w3, layer.w2), cpu_decode=False)
    layer.offload = types.SimpleNamespace(index=2, cpu=NoCpu(), path="stream", mask=None)
    layer.hooks = hooks
    got = layer(x)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2
    assert [c[0] for c in hooks.calls] == ["before", "after"] and hooks.calls[0][1:3] == (2, rows)
    picks = UniformPicks.draw(E, TOP_K, "cuda")
    layer.forced = picks                                     # Experiment.forced_routing, as apply_experiment sets it
    hooks.calls.clear()
    layer(x)
    ids = hooks.calls[0][3].cpu()
    assert sorted(map(sorted, ids.tolist())) == sorted(map(sorted, picks.table[:rows].cpu().tolist()))
