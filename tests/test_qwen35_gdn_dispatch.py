"""Which form of the gated delta rule the hybrid engine's DeltaNet layer runs (fla's kernels through
runtime/backends/gdn_kernels.py, or its PyTorch forms), and the adapter's mapping onto fla's API.

fla's Triton kernels need a GPU (Triton's interpreter gives NaN on the recurrent kernel and cannot run
the chunked one), so here `fla` is a stand-in written from fla's contract (gdn_kernels' docstring):
[B, T, H, K] layouts, value head h reading key head h // (HV // H), q scaled inside, float32 states
[N, HV, K, V]. A layer run through it must give the PyTorch forms' outputs and states, snapshots
included. tests/gpu/test_gdn_fla_gpu.py compares the real kernels.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from runtime.backends import gdn_kernels
from runtime.backends.hybrid_layers import DeltaNetLayer
from runtime.backends.hybrid_state import HybridCache
from runtime.reference import deltanet

HK, HV, DK, DV, KERNEL, HIDDEN = 2, 8, 16, 8, 4, 32      # Qwen3.5's grouping: 4 value heads per key head


def _spec():
    c = 2 * HK * DK + HV * DV
    return SimpleNamespace(conv_channels=c, lin_value_heads=HV, lin_value_dim=DV, lin_key_heads=HK,
                           lin_key_dim=DK, conv_kernel=KERNEL, eps=1e-6, layers=1, full_layers=0, kv_heads=1,
                           head_dim=8)


def _layer(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    c, vd = spec.conv_channels, HV * DV
    wp = torch.randn(c + vd + 2 * HV, HIDDEN, generator=g) * 0.3
    wo = torch.randn(HIDDEN, vd, generator=g) * 0.3
    return DeltaNetLayer(spec, 0, lambda h: h @ wp.t(), lambda o: o @ wo.t(),
                         torch.randn(c, KERNEL, generator=g) * 0.5, -torch.rand(HV, generator=g) - 0.1,
                         torch.randn(HV, generator=g) * 0.5, 1.0 + 0.1 * torch.randn(DV, generator=g))


class FakeFla:
    """fla's two entry points as its source defines them, in plain PyTorch; records every call."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _rule(q, k, v, g, beta, scale, h0):
        b, t, h, _ = k.shape
        group = v.shape[2] // h
        heads = torch.arange(v.shape[2]) // group                 # value head -> its key head
        s = h0.float().clone()
        out = torch.zeros(b, t, v.shape[2], v.shape[3])
        for i in range(t):
            qi, ki = q[:, i, heads].float() * scale, k[:, i, heads].float()       # [B, HV, K]
            s = s * g[:, i].float().exp()[..., None, None]
            write = beta[:, i].float()[..., None] * (v[:, i].float() - torch.einsum("bhk,bhkv->bhv", ki, s))
            s = s + ki[..., None] * write[..., None, :]
            out[:, i] = torch.einsum("bhk,bhkv->bhv", qi, s)
        return out.to(v.dtype), s

    # the parameters in fla-core 0.6.0's order: the fused recurrent entry has gk and gv (per-key and
    # per-value decays) between g and beta, so a positional beta lands in gk there, as it would in fla
    def chunk(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
        self.calls.append(("chunk", q.shape[1], q.dtype, g.dtype))
        return self._rule(q, k, v, g, beta, scale, initial_state)

    def fused(self, q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
              output_final_state=False, **kw):
        assert gk is None and gv is None and beta is not None, "beta went into gk: pass g and beta by keyword"
        self.calls.append(("recurrent", q.shape[1], q.dtype, g.dtype))
        return self._rule(q, k, v, g, beta, scale, initial_state)


@pytest.fixture
def fake(monkeypatch):
    f = FakeFla()
    monkeypatch.setattr(gdn_kernels, "_ops", (f.chunk, f.fused))
    return f


def _script(layer, spec, use_fla: bool, monkeypatch):
    """Prefill 70 rows, 7 rows, a decode, a verify of 4 rows (snapshotted), a roll back to 2 of them,
    a decode: the outputs of each step and the cache's states."""
    monkeypatch.setattr(gdn_kernels, "available", lambda x: use_fla)
    cache = HybridCache(spec, 128, 5, torch.float32, torch.device("cpu"))
    x = torch.randn(90, HIDDEN, generator=torch.Generator().manual_seed(3))
    outs = []

    def step(rows):
        logged = cache.begin(rows.shape[0])
        outs.append(layer(rows, cache, logged))
        cache.end(rows.shape[0], logged)

    step(x[:70])
    step(x[70:77])                   # longer than the window: not snapshotted, still the recurrent form
    step(x[77:78])
    step(x[78:82])
    assert cache.rollback(cache.length - 2)
    outs.append(cache.rec.clone())
    step(x[85:86])
    return outs, cache


def test_the_layer_through_fla_matches_its_pytorch_forms(fake, monkeypatch):
    spec = _spec()
    layer = _layer(spec)
    want, ref = _script(layer, spec, False, monkeypatch)
    assert fake.calls == []
    got, cache = _script(layer, spec, True, monkeypatch)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.rec, ref.rec, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.hist_rec, ref.hist_rec, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.conv, ref.conv)


def test_long_forwards_go_to_the_chunked_kernel_short_ones_to_the_recurrent_one(fake, monkeypatch):
    spec = _spec()
    _script(_layer(spec), spec, True, monkeypatch)
    f32 = torch.float32
    assert 5 < 7 <= deltanet.RECURRENT_MAX_TOKENS < 70
    # the prefill in the activation dtype; 7 rows in one recurrent call; snapshotted rows one by one
    assert fake.calls == [("chunk", 70, f32, f32), ("recurrent", 7, f32, f32)] + \
        [("recurrent", 1, f32, f32)] * (1 + 4 + 1)


def test_the_chunked_kernel_gets_the_activation_dtype_and_float32_decays(fake):
    q, k = (deltanet.l2norm(torch.randn(70, HK, DK)) for _ in range(2))
    v, g, beta = torch.randn(70, HV, DV), -torch.rand(70, HV), torch.rand(70, HV)
    state = torch.zeros(HV, DK, DV)
    o = gdn_kernels.chunked(q, k, v, g, beta, DK ** -0.5, state, torch.float16)
    assert fake.calls == [("chunk", 70, torch.float16, torch.float32)]
    assert o.dtype == torch.float32 and o.shape == (70, HV, DV) and state.abs().sum() > 0


def test_fla_runs_only_on_cuda_tensors(fake):
    assert gdn_kernels.ops() is not None
    assert not gdn_kernels.available(torch.zeros(1))


def test_without_fla_the_pytorch_forms_run(monkeypatch):
    monkeypatch.setattr(gdn_kernels, "_ops", gdn_kernels._UNSET)
    monkeypatch.setitem(sys.modules, "fla", None)              # `import fla...` raises ImportError
    monkeypatch.setitem(sys.modules, "fla.ops", None)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    assert gdn_kernels.ops() is None
    assert not gdn_kernels.available(torch.zeros(1))


def test_the_load_warms_fla_only_where_it_runs(monkeypatch, tiny_qwen35):
    """gdn_kernels.warm runs both kernels once at the model's widths where fla runs (CUDA), so the
    chunked kernel's autotuning is the load's; on the CPU it does nothing. The spec is the one
    hybrid.load passes (read from a model folder), not a stand-in whose field names could drift."""
    from runtime.modelfolder import ModelFolder
    from runtime.reference.qwen35 import Spec
    folder = ModelFolder(tiny_qwen35)
    spec = Spec.from_config(folder.config, "config.json")
    hk, hv, dk = spec.lin_key_heads, spec.lin_value_heads, spec.lin_key_dim
    assert gdn_kernels.warm(spec, torch.device("cpu"), torch.float16) is False
    calls = []
    monkeypatch.setattr(gdn_kernels, "available", lambda x: True)
    monkeypatch.setattr(gdn_kernels, "chunked", lambda q, k, v, g, beta, scale, state, dtype: calls.append(("chunked", q.shape, dtype)))
    monkeypatch.setattr(gdn_kernels, "recurrent", lambda q, k, v, g, beta, scale, state: calls.append(("recurrent", q.shape)))
    monkeypatch.setattr(gdn_kernels.torch.cuda, "synchronize", lambda device=None: None)
    assert gdn_kernels.warm(spec, torch.device("cpu"), torch.float16) is True
    assert calls == [("chunked", (128, hk, dk), torch.float16), ("recurrent", (1, hk, dk))] and hv % hk == 0
