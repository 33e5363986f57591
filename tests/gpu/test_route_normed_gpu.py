"""The MoE block's entry in one launch (runtime/experts/routing.py, route_normed: layers all in VRAM) on the GPU:
its normed rows against exllamav2's own rms_norm kernel, its picks and weights against route_fused over those
rows, the per-row counters back at 0 after every launch and after graph replays, and the engine with it
against the float32 reference (test_exl2_engine.py's MoE checks and tolerances)."""
from __future__ import annotations

import pytest
import torch

from gpu_figures import record as _record

pytestmark = pytest.mark.gpu
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048), "mixtral-8x22b": (8, 2, 6144), "qwen3.5-122b": (256, 8, 3072)}


def _exllamav2_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    from exllamav2.ext import exllamav2_ext as ext_c
    out = torch.empty(h.shape, dtype=torch.float16, device=h.device)
    ext_c.rms_norm(h, w, out, eps)
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("rows", [1, 2, 9, 512])
def test_the_fused_entry_matches_exllamav2s_norm_and_route_fused(shape, rows):
    from runtime.experts.routing import route_fused
    from runtime.experts.routing import RowCounters, route_normed
    E, A, H = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(rows)
    h = (torch.randn((rows, H), generator=g, device="cuda") * 4).half()
    w = (1 + 0.1 * torch.randn(H, generator=g, device="cuda")).half()
    gate = (torch.randn((E, H), generator=g, device="cuda") * 0.02).half()
    counters = RowCounters("cuda")
    for _ in range(2):
        counts = torch.zeros(E, dtype=torch.int32, device="cuda")
        want_counts = torch.zeros_like(counts)
        x, ids, rw = route_normed(h, w, 1e-6, gate, A, counts, counters)
        want_x = _exllamav2_norm(h, w, 1e-6)
        # fp32 sums in another order: at most one fp16 rounding step apart
        assert ((x.float() - want_x.float()).abs() <= 2e-3 * want_x.float().abs() + 1e-6).all(), shape
        want_ids, want_rw = route_fused(x, gate, A, want_counts)
        assert torch.equal(ids, want_ids) and torch.allclose(rw, want_rw, rtol=1e-5, atol=1e-7), shape
        assert torch.equal(counts, want_counts) and int(counters.buf.abs().sum()) == 0
    _record(test="route_normed_vs_exllamav2_norm", shape=shape, rows=rows,
            max_norm_diff=float((x.float() - want_x.float()).abs().max()))


def test_the_fused_entry_replays_in_a_cuda_graph():
    from runtime.experts.routing import route_fused
    from runtime.experts.routing import RowCounters, route_normed
    E, A, H = SHAPES["qwen3-30b-a3b"]
    h = torch.randn((1, H), device="cuda").half()
    w, gate = torch.ones(H, device="cuda").half(), (torch.randn((E, H), device="cuda") * 0.02).half()
    counts, counters = torch.zeros(E, dtype=torch.int32, device="cuda"), RowCounters("cuda")
    route_normed(h, w, 1e-6, gate, A, counts, counters)              # compiled outside the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            x, ids, rw = route_normed(h, w, 1e-6, gate, A, counts, counters)
    for seed in (1, 2, 3):
        h.copy_(torch.randn((1, H), generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").half())
        graph.replay()
        torch.cuda.synchronize()
        want_ids, _ = route_fused(_exllamav2_norm(h, w, 1e-6), gate, A, torch.zeros_like(counts))
        assert torch.equal(ids, want_ids), seed
        assert int(counters.buf.abs().sum()) == 0, seed


def test_the_engine_with_the_fused_entry_matches_the_reference(moe_2l, references):
    """qwen3-30b-a3b's shape, 2 layers, graphs on, as a load without offload runs them (the norm and routing in
    one launch, the experts in two adding into the residual): prefill, decode, verify of 1..8 rows and a
    rollback, the reference routed as the engine routed (test_exl2_engine.moe_checks: near ties of 128
    experts)."""
    from routing_replay import Routing
    from test_exl2_engine import ROWS, _load_exl2, moe_checks
    from runtime.experts import shapes
    ref = references("moe")
    toks = torch.randint(0, ref.info.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    routing = Routing(pytest.MonkeyPatch())
    try:
        eng = _load_exl2(moe_2l, graphs=True)
        try:
            assert all(m.experts._counters is not None for m in eng.moe), "the fused entry did not run"
            seen, bad = moe_checks(eng, ref, toks, routing, "one-launch set")
            assert any(k[0] == "down_finish" for k in shapes.CHOSEN), "the two launches ran"
            tel = eng.telemetry()
        finally:
            eng.close()
    finally:
        routing.undo()
    _record(test="route_normed_vs_reference", **seen)
    assert tel["decode_graphs"] and sorted(t for _, t in tel["graph_shapes"]) == sorted(ROWS), tel
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tokens", [17, 512, 4096])
def test_the_prefill_sort_in_one_launch_equals_the_torch_ops(shape, tokens):
    """The prefill's sort into blocks in one launch (runtime/experts/grouped.py) on the GPU: the same pairs and
    block experts as the torch ops it replaced (bench.check_experts.align_by_torch), bit for bit, at the
    prefill's pair counts (one expert hot, as real routing has)."""
    from bench.check_experts import align_by_torch
    from runtime.experts.grouped import align
    E, A, _ = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.randint(0, E, (tokens * A,), generator=g, device="cuda", dtype=torch.int32)
    ids[: tokens * A // 4] = 3
    for bm in (16, 64):
        want, got = align_by_torch(ids, E, bm), align(ids, E, bm)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), bm
