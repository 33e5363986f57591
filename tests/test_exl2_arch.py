"""The CUDA engine's per-architecture table and the offload planning for few large experts, on the CPU.

Mixtral-8x22B at 3 bpw: 8 experts of ~113 MB per layer (56 layers), 2 per token; DBRX: 16 of ~74 MB
(40 layers), 4 per token. The planner, staging, the CPU split and the LayerNorm-folded prefetch router
are checked at those sizes (byte counts only; the layers themselves are small).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from runtime.backends import exl2_arch
from runtime.errors import InvalidModel, UnsupportedArchitecture
from runtime.exl2.shapes import SHAPES, hf_config
from runtime.modelfolder import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, flat_config
from runtime.options import OffloadOptions

MB = 1 << 20
GB = 1 << 30


def _bytes_per_expert(shape: str, bits: float = 3.0) -> int:
    s = SHAPES[shape]
    return int(3 * s.hidden * s.expert_intermediate * bits / 8 * (1 + 1 / 32))   # codes + fp16 scale per 128


def test_every_architecture_the_folders_accept_has_a_row():
    from runtime.loader import HYBRID
    assert set(exl2_arch.SUPPORTED) == set(SUPPORTED_ARCHITECTURES) - set(HYBRID)
    assert set(MOE_ARCHITECTURES) - set(HYBRID) <= {a for a, t in exl2_arch.TRAITS.items() if t.expert_norm}


def test_mixtral_renormalises_and_caps_the_context_at_a_sliding_window():
    cfg = hf_config(SHAPES["mixtral-8x22b"])
    p = exl2_arch.plan(cfg)
    assert (p.renormalize, p.clip_qkv, p.window) == (True, 0.0, 0)
    off = OffloadOptions(context_length=8192)
    assert exl2_arch.cap_context(p, off) == (off, "applied")
    p = exl2_arch.plan({**cfg, "sliding_window": 4096})
    capped, note = exl2_arch.cap_context(p, off)
    assert capped.context_length == 4096 and "sliding window" in note
    assert exl2_arch.cap_context(p, OffloadOptions(context_length=2048))[0].context_length == 2048
    with pytest.raises(InvalidModel, match="sliding_window"):
        exl2_arch.plan({**cfg, "sliding_window": -1})


def test_dbrx_clips_qkv_and_normalises_by_its_p():
    cfg = hf_config(SHAPES["dbrx"])
    p = exl2_arch.plan(cfg)
    assert (p.renormalize, p.clip_qkv, p.window) == (True, 8.0, 0)
    assert exl2_arch.plan(flat_config(cfg)).clip_qkv == 8.0            # as the model folder flattens it
    ffn = dict(cfg["ffn_config"])
    assert not exl2_arch.plan({**cfg, "ffn_config": {**ffn, "moe_normalize_expert_weights": None}}).renormalize
    with pytest.raises(UnsupportedArchitecture, match="moe_normalize_expert_weights"):
        exl2_arch.plan({**cfg, "ffn_config": {**ffn, "moe_normalize_expert_weights": 2}})
    assert exl2_arch.plan({**cfg, "attn_config": {**cfg["attn_config"], "clip_qkv": None}}).clip_qkv == 0.0
    with pytest.raises(InvalidModel, match="clip_qkv"):
        exl2_arch.plan({**cfg, "attn_config": {**cfg["attn_config"], "clip_qkv": "8"}})


def test_qwen3_moe_follows_norm_topk_prob_and_unknown_architectures_are_named():
    cfg = hf_config(SHAPES["qwen3-30b-a3b"])
    assert exl2_arch.plan(cfg).renormalize
    assert not exl2_arch.plan({**cfg, "norm_topk_prob": False}).renormalize
    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel is not supported"):
        exl2_arch.plan({"architectures": ["GPT2LMHeadModel"]}, "x/config.json")


def test_layer_norm_folded_router_ranks_experts_as_the_layer_norm_does():
    """DBRX's router follows a bias-free LayerNorm: the prefetch's prediction h . predict_gate[e]
    must rank experts as the true logits do (a positive multiple of them)."""
    from bench.check_experts import random_layer
    layer = random_layer(16, 64, 32, 4, 4, "cpu", seed=3)
    g = torch.Generator().manual_seed(5)
    w = 1 + 0.3 * torch.randn(64, generator=g)
    layer.fold_layer_norm(w.half())
    h = torch.randn(20, 64, generator=g) * 3 + 1.5                      # an offset: centring matters
    true = F.layer_norm(h, (64,), w.half().float(), None, 1e-5) @ layer.gate_w.float().T
    pred = h @ layer.predict_gate.float().T
    sigma = torch.sqrt(h.var(dim=1, unbiased=False, keepdim=True) + 1e-5)   # LayerNorm's scale
    assert ((pred - sigma * true).norm() / pred.norm()).item() < 5e-3       # fp16 rounding of the fold
    assert torch.equal(pred.argmax(dim=1), true.argmax(dim=1))
    plain = (h * w) @ layer.gate_w.float().T                            # the RMS-style prediction
    assert not torch.equal(plain.argsort(dim=1), true.argsort(dim=1))   # ... would rank differently


@pytest.mark.parametrize("E, top_k", [(8, 2), (16, 4)], ids=["mixtral", "dbrx"])
def test_verify_sized_forwards_never_stage_with_few_experts(E, top_k):
    """Forwards of up to 9 rows replay decode graphs, which read cold experts in place; with 8 or 16
    experts 2 x E pairs would have staged (copied every cold expert of every layer) from 8 rows."""
    from bench.check_experts import random_layer
    from runtime.backends.exl2_graph import MAX_ROWS
    from runtime.budget import MemoryBudget
    from runtime.offload.manager import OffloadManager
    layers = [random_layer(E, 64, 32, top_k, 4, "cpu", seed=i, host_codes=True) for i in range(2)]
    m = OffloadManager(layers, MemoryBudget(1 << 40))
    m.apply([[0, 1], [2]])
    assert m.staging.capacity > 0
    assert not any(m.staging.worth(rows) for rows in range(1, MAX_ROWS + 1))
    assert m.staging.worth(512)


@pytest.mark.parametrize("shape, budget_gb", [("mixtral-8x22b", 24), ("mixtral-8x22b", 40), ("dbrx", 24)])
def test_placement_of_few_large_experts_fills_the_budget(shape, budget_gb):
    """The load-time planner at the real byte sizes (the layers small, their byte counts real): staging
    for every expert of a layer (double-buffered) and the rest of the budget in hot slots, spread
    evenly under uniform routing; the ledger never exceeds what was free."""
    from bench.check_experts import random_layer
    from runtime.budget import MemoryBudget
    from runtime.offload.manager import OffloadManager
    s = SHAPES[shape]
    cb = _bytes_per_expert(shape)
    L = 8                                               # of the model's layers, with their share of the budget
    free = (budget_gb - 4) * GB * L // s.layers         # attention, head, cache, scratch: about 4 GB
    layers = [random_layer(s.experts, 64, 32, s.experts_per_token, 4, "cpu", seed=0, host_codes=True)
              for _ in range(L)]
    m = OffloadManager(layers, MemoryBudget(free))
    m.residency.code_bytes = lambda: [cb] * L
    m.place(free_bytes=free)
    residents = [len(lo.expert_slot) for lo in m.layers]
    assert m.vram.used_bytes <= free
    assert m.vram.items["prefill staging"] == 2 * m.staging.capacity * cb
    assert m.staging.capacity >= s.experts - min(residents)               # every cold expert has a place
    slack = free - m.vram.used_bytes
    assert slack < cb or min(residents) == s.experts                    # no expert left out that fit
    assert 0 < sum(residents) < L * s.experts
    assert all(m.staging.worth(r) is False for r in range(1, 10))


@pytest.mark.parametrize("shape", ["mixtral-8x22b", "dbrx"])
def test_cpu_cut_of_few_large_experts(shape):
    """The CPU split at the real sizes: every cold expert cut, a share in (0, 1), and the cut the
    manager derives from it a multiple of the kernels' alignment within the intermediate."""
    from runtime.experts.decode import CUT_ALIGN
    from runtime.offload.placement import CpuSplitCosts, plan_cpu_split, plan_resident
    s = SHAPES[shape]
    cb = _bytes_per_expert(shape)
    freq = np.full((s.layers, s.experts), 1.0 / s.experts)
    resident = plan_resident(freq, [cb] * s.layers, 18 * GB)
    assert resident is not None and any(len(r) < s.experts for r in resident)
    costs = CpuSplitCosts(50e9, 40e9, 30e-6, 1.0)
    split = plan_cpu_split(freq, resident, [cb] * s.layers, s.experts_per_token, costs, cut=True)
    assert split.gain > 0.5
    I = s.expert_intermediate
    assert I % CUT_ALIGN == 0 and I >= 2 * CUT_ALIGN                     # the layout allows cutting
    for r, owned, f in zip(resident, split.owned, split.shares):
        assert owned == tuple(e for e in range(s.experts) if e not in r)
        if not owned:                                                   # a layer kept whole in VRAM
            assert f == 0
            continue
        assert 0 < f < 1
        cut = int(min(I, max(CUT_ALIGN, round(f * I / CUT_ALIGN) * CUT_ALIGN)))
        assert cut % 16 == 0 and CUT_ALIGN <= cut < I


def test_clamp_wraps_a_projection_and_leaves_other_models_alone():
    """The layer loop's clip_qkv: a projection's output (or exllamav2's intermediates dict) clamped
    in place; a model without clip_qkv is not touched (nothing imported, nothing changed)."""
    calls = []

    def projection(x, loras=None):
        calls.append(loras)
        return x * 10

    clamped = exl2_arch._clamped(projection, 8.0)
    x = torch.tensor([[-2.0, 0.5, 0.9]])
    assert torch.equal(clamped(x, loras=["a"]), torch.tensor([[-8.0, 5.0, 8.0]])) and calls == [["a"]]
    assert clamped.clip_qkv == 8.0
    out = exl2_arch._clamped(lambda x, intermediates=True: {"hidden_states": x * 10}, 1.0)(x)
    assert torch.equal(out["hidden_states"], torch.tensor([[-1.0, 1.0, 1.0]]))
    assert exl2_arch.install(object(), exl2_arch.plan(hf_config(SHAPES["mixtral-8x22b"]))) == 0


def test_our_renormalised_top_k_is_mixtrals_softmax_over_the_top_k_logits():
    """Mixtral: softmax over the top-2 logits; ours (Qwen3-MoE's): softmax over all, top-k, divided by
    the sum (the full softmax's denominator cancels). DBRX with p = 1 divides by the same sum."""
    from runtime.experts.layer import route
    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(32, 64, generator=g), torch.randn(8, 64, generator=g)
    r = route(x, gate, 2)
    logits = x @ gate.T
    top, ids = torch.topk(logits, 2, dim=-1)
    assert torch.equal(r.ids, ids)
    assert torch.allclose(r.weights, torch.softmax(top, dim=-1), atol=1e-6)
    probs = torch.softmax(logits, dim=-1)
    w4, _ = torch.topk(probs, 4, dim=-1)
    r4 = route(x, gate, 4)
    assert torch.allclose(r4.weights, w4 / torch.linalg.vector_norm(w4, ord=1, dim=-1, keepdim=True), atol=1e-6)
