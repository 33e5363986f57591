"""The expert repacking (runtime/experts/pack.py) is lossless against the EXL2 format's own dequantizer,
and the MoE layer's plain-PyTorch path (the kernels' oracle) equals a dense fp64 MoE."""
from __future__ import annotations

import pytest
import torch

from runtime.exl2 import format as exl2
from runtime.experts.layer import ExpertLayer, route
from runtime.experts.pack import PackError, dequantize_codes, dequantize_packed, pack_experts, unpack_exl2


def _q(out, inp, bits, gs=64, seed=0, perm=True, bits_prop=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    p = torch.randperm(inp, generator=g) if perm else None
    return exl2.quantize(w, bits, gs, perm=p, bits_prop=bits_prop)


@pytest.mark.parametrize("bits,props,gs", [
    (4, None, 64), (3, None, 32), (2, None, 128), (6, None, 64), (8, None, 32),
    ([5, 4], [0.25, 0.75], {5: 32, 4: 128}), ([4, 3, 2], [0.2, 0.3, 0.5], 32), ([8, 4], [0.5, 0.5], 64),
])
def test_unpack_matches_format_dequantize(bits, props, gs):
    t = _q(70, 256, bits, gs, bits_prop=props)            # 70 columns: padded to 96
    ref = exl2.dequantize(t)                                # [96, 256], exllamav2's fp16 values
    u = unpack_exl2(t)
    assert torch.equal(dequantize_codes(u).half().float(), ref)


def test_pack_experts_is_lossless_and_reports_layout():
    ts = [_q(64, 128, [5, 4], {5: 32, 4: 64}, seed=e, bits_prop=[0.25, 0.75]) for e in range(3)]
    p = pack_experts(ts, "layer.up")
    assert p.bits == 8 and p.group == 32 and p.num_experts == 3
    assert p.qweight.shape == (3, 128 // 4, 64) and p.scales.shape == (3, 128 // 32, 64)
    for e in range(3):
        assert torch.equal(dequantize_packed(p, e).half().float(), exl2.dequantize(ts[e]))
    t3 = [_q(64, 128, 3, 32, seed=e) for e in range(2)]
    p3 = pack_experts(t3, "layer.gate")                     # 3-bit: two planes, exactly 3 bits a code
    assert p3.bits == 3 and p3.qweight.shape == (2, 128 * 3 // 32, 64)
    assert p3.expert_bytes() == 12 * 64 * 4 + 4 * 64 * 2 + 128 * 4
    for e in range(2):
        assert torch.equal(dequantize_packed(p3, e).half().float(), exl2.dequantize(t3[e]))
    t32 = [_q(64, 128, [3, 2], 32, seed=e, bits_prop=[0.5, 0.5]) for e in range(2)]
    assert pack_experts(t32).bits == 3
    assert torch.equal(dequantize_packed(pack_experts(t32), 1).half().float(), exl2.dequantize(t32[1]))
    t4 = [_q(64, 128, [4, 3], 32, seed=e, bits_prop=[0.5, 0.5]) for e in range(2)]
    p4 = pack_experts(t4)
    assert p4.bits == 4 and p4.qweight.shape == (2, 16, 64)
    assert torch.equal(dequantize_packed(p4, 0).half().float(), exl2.dequantize(t4[0]))


def _exact(t, seed):
    from bench.check_experts import with_exact_scales
    return with_exact_scales(t, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits,props,gs", [(4, None, 32), ([5, 4], [0.25, 0.75], {5: 32, 4: 64}), (3, None, 32)])
def test_exact_scales_are_packed_instead_of_the_steps(bits, props, gs):
    """Experts with q_scale_exact pack to the weights format.dequantize gives with them (not the steps'), beside
    experts without in one projection (batches of one layout each), through pack_layer's column order too."""
    ts = [_q(64, 128, bits, gs, seed=e, bits_prop=props) for e in range(4)]
    ts = [_exact(t, e) if e % 2 == 0 else t for e, t in enumerate(ts)]
    assert not torch.equal(exl2.dequantize(ts[0]), exl2.dequantize({k: v for k, v in ts[0].items()
                                                                    if k != "q_scale_exact"}))
    u = unpack_exl2(ts[0])
    assert torch.equal(dequantize_codes(u).half().float(), exl2.dequantize(ts[0]))
    p = pack_experts(ts, "layer.up")
    for e in range(4):
        assert torch.equal(dequantize_packed(p, e).half().float(), exl2.dequantize(ts[e])), e
    cols = [torch.randperm(64, generator=torch.Generator().manual_seed(e)) for e in range(4)]
    pc = pack_experts(ts, "layer.up", columns=cols)
    for e in range(4):
        assert torch.equal(dequantize_packed(pc, e).half().float(), exl2.dequantize(ts[e])[cols[e]]), e


def test_bad_exact_scales_are_refused_naming_the_expert():
    t = _exact(_q(32, 64, 4, 32), 0)
    with pytest.raises(PackError, match=r"layer.7.down\[1\]: q_scale_exact is torch.float32 \(2, 32\), not float16"):
        pack_experts([t, {**t, "q_scale_exact": t["q_scale_exact"].float()}], "layer.7.down")
    with pytest.raises(PackError, match=r"layer.7.down\[0\]: q_scale_exact is torch.float16 \(1, 32\)"):
        pack_experts([{**t, "q_scale_exact": t["q_scale_exact"][:1]}], "layer.7.down")
    bad = t["q_scale_exact"].clone()
    bad[1, 3] = float("inf")
    with pytest.raises(PackError, match=r"layer.7.down\[2\]: q_scale_exact holds scales that are not finite"):
        pack_experts([t, t, {**t, "q_scale_exact": bad}], "layer.7.down")
    with pytest.raises(PackError, match=r"one: q_scale_exact holds scales that are not finite"):
        unpack_exl2({**t, "q_scale_exact": bad}, "one")


def test_pack_errors_name_the_tensor():
    t = _q(32, 64, 4, 32)
    with pytest.raises(PackError, match="layer.7.down\\[0\\].*q_scale_max"):
        pack_experts([{k: v for k, v in t.items() if k != "q_scale_max"}], "layer.7.down")
    other = _q(32, 128, 4, 32)
    with pytest.raises(PackError, match="expert 0's"):
        pack_experts([t, other], "layer.7.down")


def _layer(E=8, H=128, I=64, top_k=3, bits=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, H, generator=g)
    w1 = [_q(I, H, bits, 32, seed=100 + e) for e in range(E)]
    w3 = [_q(I, H, bits, 32, seed=200 + e) for e in range(E)]
    w2 = [_q(H, I, bits, 32, seed=300 + e) for e in range(E)]
    layer = ExpertLayer(gate, pack_experts(w1), pack_experts(w3), pack_experts(w2), top_k)
    dense = [tuple(exl2.dequantize(t).double() for t in (w1[e], w3[e], w2[e])) for e in range(E)]
    return layer, gate, dense


def test_reference_layer_equals_dense_moe():
    layer, gate, dense = _layer()
    x = (torch.randn(5, 128) * 0.5).half()
    out = layer(x)                                          # CPU: the plain-PyTorch path
    xd = x.double()
    probs = torch.softmax(xd @ gate.double().T, -1)
    w, ids = torch.topk(probs, 3, -1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros(5, 128, dtype=torch.float64)
    for t in range(5):
        for j in range(3):
            g1, g3, g2 = dense[ids[t, j]]
            h = torch.nn.functional.silu(xd[t] @ g1.T) * (xd[t] @ g3.T)
            ref[t] += w[t, j] * (h @ g2.T)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 2e-3, err                                  # h is rounded to fp16, as in the kernels
    assert int(layer.counts.sum()) == 15


def test_route_renormalises_and_orders():
    x = torch.randn(4, 16)
    gate = torch.randn(6, 16)
    r = route(x, gate, 2)
    assert r.ids.shape == (4, 2) and torch.allclose(r.weights.sum(-1), torch.ones(4))
    assert (r.weights[:, 0] >= r.weights[:, 1]).all()


@pytest.mark.parametrize("bits, H, I, N", [(3, 128, 64, 64), ([4, 3], 128, 64, 96), (8, 64, 32, 32)])
def test_pack_layer_equals_packing_then_aligning_bit_for_bit(bits, H, I, N):
    """A load packs gate and up straight into down's intermediate order (pack_layer) instead of
    packing them and then moving every expert's codes to the GPU and back (align_intermediate):
    the stacks, scales and permutations are the same bits, in host-arena stacks too."""
    from runtime.experts.pack import HostArena, align_intermediate, pack_layer
    props = None if isinstance(bits, int) else [0.5, 0.5]
    E = 4
    # gate/up: [N, H] (N >= I: padded intermediate columns), down: [H, I]
    gate = [_q(N, H, bits, 32, seed=10 + e, bits_prop=props) for e in range(E)]
    up = [_q(N, H, bits, 32, seed=20 + e, bits_prop=props) for e in range(E)]
    down = [_q(H, I, bits, 32, seed=30 + e, bits_prop=props) for e in range(E)]
    ref = [pack_experts(ts, name) for ts, name in ((gate, "g"), (up, "u"), (down, "d"))]
    assert not bool((ref[2].perm == torch.arange(I, dtype=torch.int32)).all())   # a real permutation
    align_intermediate(*ref)
    order = []

    def load(proj):
        order.append(proj)
        return {"gate_proj": gate, "up_proj": up, "down_proj": down}[proj]

    for host in (None, HostArena(block_bytes=1 << 20)):
        order.clear()
        packed = []
        got = pack_layer(load, "layer.3", host=host, on_packed=lambda p, pack: packed.append(p))
        assert order == ["down_proj", "gate_proj", "up_proj"] == packed
        for a, b in zip(got, ref):
            assert a.bits == b.bits and a.group == b.group
            assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
            assert torch.equal(a.perm, b.perm) and torch.equal(a.woff, b.woff)
            assert (a.cold is not None) == (host is not None)
    if I == 64:
        with pytest.raises(PackError, match="layer.3.gate_proj has 32 columns, down takes 64"):
            pack_layer(lambda p: down if p == "down_proj" else [_q(16, H, 4, 32)], "layer.3")


def test_host_arena_page_locks_the_next_block_ahead_and_gives_back_an_unused_one(monkeypatch):
    """The same stacks at the same offsets with the next block allocated ahead on a thread; the
    block left over at the end is dropped by finish()."""
    import threading

    from runtime.experts.pack import HostArena
    where = []
    real = HostArena._allocate

    def allocate(size):
        where.append(threading.current_thread().name)
        return real(size)

    monkeypatch.setattr(HostArena, "_allocate", staticmethod(allocate))
    shapes = [(3, 100, 64), (2, 300, 64), (5, 64, 64), (1, 1000, 64), (4, 50, 64)]
    stacks = {}
    plain = HostArena(block_bytes=1 << 17)
    for arena in (plain, None):
        if arena is None:                                          # made after the plain one's stacks
            arena = ahead = HostArena(block_bytes=1 << 17, ahead=True)
            assert len(ahead._next) == 1                           # page-locking from its creation on
        stacks[arena] = [arena.empty(shape) for shape in shapes]
        for i, t in enumerate(stacks[arena]):
            t.fill_(i)
    assert [b.numel() for b in plain.blocks] == [b.numel() for b in ahead.blocks] and len(plain.blocks) >= 2
    offsets = [[t.data_ptr() - next(b.data_ptr() for b in arena.blocks
                                    if b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel())
                for t in stacks[arena]] for arena in (plain, ahead)]
    assert offsets[0] == offsets[1] and plain.used == ahead.used
    assert all(torch.equal(a, b) for a, b in zip(stacks[plain], stacks[ahead]))
    n = len(plain.blocks)
    assert where[:n] == ["MainThread"] * n                         # without ahead: in the loading thread
    assert where[n].startswith("pin-ahead")                        # with it: the first block on a thread too
    assert "MainThread" in where[n:]                               # (a stack over a block: its own, here)
    assert len(ahead._next) == 1
    ahead.finish()
    assert not ahead._next and len(ahead.blocks) == n
    ahead.empty((1, 10, 64))                                       # usable after finish (no thread left)
    ahead.release()
    assert ahead.blocks == []


def test_host_arena_page_locks_several_blocks_ahead_and_gives_back_the_unused(monkeypatch):
    """ahead=3: three blocks on three threads from the start, topped up as they are taken; the same
    stacks; finish gives back the three left over."""
    from runtime.experts.pack import HostArena
    made = []
    real = HostArena._allocate
    monkeypatch.setattr(HostArena, "_allocate", staticmethod(lambda size: made.append(size) or real(size)))
    arena = HostArena(block_bytes=1 << 16, ahead=3)
    assert len(arena._next) == 3 and arena._pool._max_workers == 3
    stacks = [arena.empty((4, 64, 64)) for _ in range(5)]          # 64 KiB each: a block each
    for i, t in enumerate(stacks):
        t.fill_(i)
    assert len(arena.blocks) == 5 and len(arena._next) == 3
    assert all(int(t[0, 0, 0]) == i and t.data_ptr() == b.data_ptr() for i, (t, b) in enumerate(zip(stacks, arena.blocks)))
    arena.finish()                                                 # waits for the three in flight
    assert not arena._next and arena._pool is None and len(arena.blocks) == 5 and len(made) == 8
