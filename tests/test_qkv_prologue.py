"""Attention's decode prologue in one launch (runtime/experts/qkv_prologue.py) equals the steps
it fuses, done one by one in torch as exllamav2 does them (RMSNorm rounded to fp16, the dequantized q/k/v
weights, the GEMM's fp16 output, RMS head norms, NEOX RoPE), at 1..9 rows, each part at its own width, K whole
or cut; and exl2_gemv.install gives the attentions it can take this prologue, the others none.

As in test_linear_gemv.py, the kernel tests run in a child pytest with TRITON_INTERPRET=1 and are skipped in the
parent."""
from __future__ import annotations

import os
import types

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in a child process with TRITON_INTERPRET=1")
CHILD_TESTS = 6 + 2 + 1 + 1 + 1                # the tests marked `interpreted` below, parameters counted

K, HQ, HK, D = 256, 4, 2, 32                     # a Qwen3 attention scaled down: 4 query heads, 2 KV heads of 32


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_prologue_in_the_interpreter():
    from tests.interpreted import run_child_pytest
    run_child_pytest(__file__, CHILD_TESTS, timeout=900)


def _linear(n: int, k: int, bits, seed: int, group: int = 32) -> dict:
    """Random weights quantized at `bits` (a list: mixed widths, in equal shares)."""
    from runtime.exl2 import format as exl2
    g = torch.Generator().manual_seed(seed)
    props = [1 / len(bits)] * len(bits) if isinstance(bits, list) else None
    return exl2.quantize(torch.randn(n, k, generator=g) * 0.05, bits, group, perm=torch.randperm(k, generator=g),
                         bits_prop=props)


def _tables(S: int = 64, base: float = 10000.0, D: int = D):
    """exllamav2's NEOX tables (runtime's device context): [1, 1, S, D], each frequency twice."""
    inv = 1.0 / base ** (torch.arange(0, D, 2).float() / D)
    f = torch.outer(torch.arange(S).float(), inv)
    emb = torch.cat([f, f], -1)
    return emb.sin().half()[None, None], emb.cos().half()[None, None]


def reference(x, norm_w, eps, parts, head_w, head_eps, tables, heads=(HQ, HK, D)):
    """The fused steps one by one, rounded to fp16 where exllamav2's kernels store (on x's device)."""
    from runtime.exl2 import format as exl2
    T, (Hq, Hk, D) = x.shape[0], heads
    xf = x.float()
    xn = (xf * norm_w.float() * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).half().float()
    out = []
    for i, (t, h) in enumerate(zip(parts, (Hq, Hk, Hk))):
        y = (xn @ exl2.dequantize(t, out_features=h * D).to(x.device).T).half().float().view(T, h, D)
        if i < 2 and head_w is not None:
            y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + head_eps[i]) * head_w[i].float()).half().float()
        if i < 2 and tables is not None:
            sin, cos, pos = tables
            p = int(pos[0]) + torch.arange(T, device=x.device)
            c, s = cos.view(-1, D)[p].float()[:, None], sin.view(-1, D)[p].float()[:, None]
            y = y * c + torch.cat([-y[..., D // 2:], y[..., :D // 2]], -1) * s
        out.append(y.reshape(T, h * D))
    return out


def _close(got, want, what):
    assert got.dtype == torch.float16 and got.shape == want.shape, what
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-3 * want.abs().max().item() + 1e-4, (what, err)


def _force(shape, packs, T, head_w, tables):
    """The launch shape the next call at T rows takes (the interpreter would take the default)."""
    from runtime.experts import shapes
    key = ("qkv", K, HQ, HK, D, T, tuple((p.out_features, p.bits, p.group) for p in packs), head_w is not None,
           tables is not None, torch.device("cpu"))
    shapes.CHOSEN[key] = shape


def _packs(parts):
    from runtime.experts.pack import pack_experts
    return [pack_experts([t], f"part{i}", device=torch.device("cpu")) for i, t in enumerate(parts)]


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand(K, generator=g) + 0.5).half(),
            ((torch.rand(D, generator=g) + 0.5).half(), (torch.rand(D, generator=g) + 0.5).half()))


# The rows: the kernel's row block is linear_rows_block's. With the dot, 1 row is the GEMV (BT 1) and 2..9 rows
# one block of 16 whose rows past T are masked, so 1 and 9 reach both. Without the dot (2..8 rows) the block
# is the power of two >= T: between the two cases every block (2, 4, 8) filled (2, 4, 8) and with masked rows
# (3, 5), the masked ones where K is cut (the workspace's masked sums) and rotated (masked table loads).
# The interpreter runs each row count as one more launch: the other counts repeat these blocks.
@interpreted
@pytest.mark.parametrize("bits,ksplit,dot,steps,rows", [
    ((4, 4, 4), 1, True, "norms+rope", (1, 9)), ((4, 8, 3), 2, True, "per-head norms+rope", (1, 9)),
    ((3, 3, 3), 4, True, "rope", (1, 9)), (([4, 3], 8, 4), 8, True, "none", (1, 9)),
    ((4, 4, 8), 2, False, "norms+rope", (2, 3, 5)), ((8, 4, 4), 1, False, "norms", (4, 8)),
])
def test_one_launch_equals_the_steps_it_fuses(monkeypatch, bits, ksplit, dot, steps, rows):
    from runtime.experts import shapes
    from runtime.experts.qkv_prologue import qkv_prologue
    from runtime.experts.shapes import SplitK
    shapes.CHOSEN.clear()
    parts = [_linear(h * D, K, b, s, group=32 if b != [4, 3] else 64) for h, b, s in zip((HQ, HK, HK), bits, (1, 2, 3))]
    packs = _packs(parts)
    norm_w, head_w = _weights(4)
    sin, cos = _tables()
    if steps.startswith("per-head"):           # as exllamav2 holds them: [heads, D]
        head_w = tuple(torch.rand(h, D, generator=torch.Generator().manual_seed(h)).half() + 0.5 for h in (HQ, HK))
    head_w = head_w if "norms" in steps else None
    for T in rows:
        tables = (sin, cos, torch.tensor([5 * T], dtype=torch.int32)) if "rope" in steps else None
        _force(SplitK(D, ksplit, 4, dot), packs, T, head_w, tables)
        x = torch.randn(T, K, generator=torch.Generator().manual_seed(T)).half()
        q, k, v = (torch.full((T, h * D), float("nan"), dtype=torch.float16) for h in (HQ, HK, HK))
        qkv_prologue(x, norm_w, 1e-6, packs, (HQ, HK, D), q, k, v, head_w, (1e-6, 1e-5), tables)
        for got, want, name in zip((q, k, v), reference(x, norm_w, 1e-6, parts, head_w, (1e-6, 1e-5), tables), "qkv"):
            _close(got, want, (name, T))
        ws, counts = shapes._WORKSPACES[torch.device("cpu")][-1]
        assert not ws.any() and not counts.any(), "the workspace and counters are left at zero"


@interpreted
@pytest.mark.parametrize("T", [1, 5])
def test_the_default_shape_and_each_candidate_give_the_same_heads(monkeypatch, T):
    """Every launch shape the timing may pick (K cut in 1..8, 4 or 8 warps, with or without the dot) stores the
    same heads, to the order of the split-K sums. The interpreter takes no warps (it runs a program's block
    whole), so the shapes that differ only in them are one launch here: each K cut, with and without the dot."""
    from runtime.experts import shapes
    from runtime.experts.qkv_prologue import candidates, qkv_prologue
    shapes.CHOSEN.clear()
    parts = [_linear(h * D, K, 4, s) for h, s in ((HQ, 7), (HK, 8), (HK, 9))]
    packs = _packs(parts)
    norm_w, head_w = _weights(5)
    sin, cos = _tables()
    tables = (sin, cos, torch.tensor([3], dtype=torch.int32))
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(11)).half()
    want = reference(x, norm_w, 1e-6, parts, head_w, (1e-6, 1e-6), tables)
    offered = candidates(K, HQ + 2 * HK, shapes.tile(*packs, cap=128), D, T)
    assert offered[0].bn == D and len(set(offered)) == len(offered) and any(not c.dot for c in offered) == (T > 1)
    assert {c.warps for c in offered} == {4, 8}
    run = [c for i, c in enumerate(offered) if all((c.ksplit, c.dot) != (b.ksplit, b.dot) for b in offered[:i])]
    assert len(run) == (8 if T > 1 else 4), run            # K whole, cut in 2, 4, 8; with the dot (and without)
    for c in run:
        _force(c, packs, T, head_w, tables)
        q, k, v = (torch.empty((T, h * D), dtype=torch.float16) for h in (HQ, HK, HK))
        qkv_prologue(x, norm_w, 1e-6, packs, (HQ, HK, D), q, k, v, head_w, (1e-6, 1e-6), tables)
        for got, w, name in zip((q, k, v), want, "qkv"):
            _close(got, w, (name, c))


def test_bad_inputs_are_refused_with_what_is_wrong():
    from runtime.experts.qkv_prologue import qkv_prologue
    parts = [_linear(h * D, K, 4, s) for h, s in ((HQ, 1), (HK, 2), (HK, 3))]
    packs = _packs(parts)
    norm_w, head_w = _weights(1)
    x = torch.zeros(2, K, dtype=torch.float16)
    outs = [torch.empty((2, h * D), dtype=torch.float16) for h in (HQ, HK, HK)]
    sin, cos = _tables()
    cases = [
        (dict(x=torch.zeros(10, K, dtype=torch.float16)), "1..9"),
        (dict(x=x.float()), "fp16"),
        (dict(heads=(HQ, HK, 24)), "head size 24"),
        (dict(norm_w=norm_w[:10]), "input norm"),
        (dict(packs=packs[:2]), "q, k and v"),
        (dict(packs=[packs[1], packs[1], packs[2]]), "part q"),
        (dict(outs=[outs[0], outs[1], outs[1][:1]]), "v fp16 [2, 64]"),
        (dict(head_w=(head_w[0][:8], head_w[1])), "head norms"),
        (dict(head_w=(head_w[0], torch.ones(HQ, D).half())), "head norms"),          # k has HK heads
        (dict(tables=(sin[..., :16], cos[..., :16], torch.zeros(1, dtype=torch.int32))), "RoPE tables"),
        (dict(tables=(sin, cos, torch.zeros(1, dtype=torch.int64))), "int32 position"),
    ]
    for change, says in cases:
        a = dict(x=x, norm_w=norm_w, packs=packs, heads=(HQ, HK, D), outs=outs, head_w=head_w, tables=None)
        a.update(change)
        with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            qkv_prologue(a["x"], a["norm_w"], 1e-6, a["packs"], a["heads"], *a["outs"], a["head_w"], (1e-6, 1e-6),
                         a["tables"])


def test_candidates_keep_whole_tiles_and_the_default_first():
    from runtime.experts.linear_gemv import FMA_MAX_TILE, linear_rows_block
    from runtime.experts.qkv_prologue import candidates
    from runtime.experts.shapes import SplitK, ksplit
    one = candidates(2048, 40, 128, 128)
    assert one[0] == SplitK(128, ksplit(2048, 128, 40)) and all(c.dot and c.bn == 128 for c in one)
    assert all(2048 % (c.ksplit * 128) == 0 for c in one) and {c.warps for c in one} == {4, 8}
    for t in (2, 8):
        few = candidates(2048, 40, 64, 128, t)
        fma = [c for c in few if not c.dot]
        assert few[:len(candidates(2048, 40, 64, 128))] == candidates(2048, 40, 64, 128)
        assert all(linear_rows_block(t, c) * 64 * 128 <= FMA_MAX_TILE for c in fma)
        assert bool(fma) == (t == 2), "heads of 128 at tiles of 64: 2 rows fit the CUDA cores' block, 8 do not"
    assert all(c.dot for c in candidates(2048, 40, 128, 128, 9))


@interpreted
def test_install_gives_the_attentions_it_takes_the_one_launch_prologue(monkeypatch):
    """With no switch: a plain attention's prologue is one launch whose q/k/v equal the steps'; an attention
    with a LayerNorm before, GPTJ's RoPE or a head norm's bias keeps exllamav2's path (no hooks); a call with a
    RoPE other than NEOX or past 9 rows runs exllamav2's prologue."""
    from test_linear_gemv import _Folder, _attention, _standin_exllamav2, attention_tensors

    from runtime.backends import exl2_gemv
    from runtime.modelfolder import EXL2_PARTS
    calls = []
    Attention, RMSNorm = _standin_exllamav2(monkeypatch, calls)
    tensors = attention_tensors(4, K, HQ, HK, D, seed=40)
    plain = _attention(Attention, RMSNorm, "l0", K, HQ, HK, D)
    layer_norm = _attention(Attention, RMSNorm, "l1", K, HQ, HK, D, pre_layernorm=object())
    gptj = _attention(Attention, RMSNorm, "l2", K, HQ, HK, D)
    gptj.archparams.rope_style = 2
    biased = _attention(Attention, RMSNorm, "l3", K, HQ, HK, D)
    biased.k_norm.bias = torch.zeros(D)
    model = types.SimpleNamespace(modules=[object(), plain, layer_norm, gptj, biased])
    assert exl2_gemv.install(model, _Folder(tensors)) == 1
    assert plain.moedesk_qkv.func is exl2_gemv.fused_qkv and plain.moedesk_o.func is exl2_gemv.gemv_o
    assert not any(hasattr(a, "moedesk_qkv") or hasattr(a, "moedesk_o") for a in (layer_norm, gptj, biased))

    parts = [{p: tensors[f"l0.{n}.{p}"] for p in EXL2_PARTS} for n in ("q_proj", "k_proj", "v_proj")]
    sin, cos = _tables()
    pos = torch.tensor([17], dtype=torch.int32)
    norms = (plain.q_norm.weight, plain.k_norm.weight)
    for T in (1, 9):
        x = torch.randn(1, T, K, generator=torch.Generator().manual_seed(T)).half()
        q, k, v = (torch.empty((1, T, n * D), dtype=torch.float16) for n in (HQ, HK, HK))
        calls.clear()
        plain.moedesk_qkv(x, T, pos, q, k, v, sin, cos)
        assert calls == [], "one launch: exllamav2's kernels not called"
        want = reference(x.view(T, K), plain.pre_layernorm.weight, 1e-6, parts, norms, (1e-6, 1e-6), (sin, cos, pos))
        for got, w, name in zip((q, k, v), want, "qkv"):
            _close(got.view(T, -1), w, (name, T))
    x = torch.randn(1, 2, K).half()
    q, k, v = (torch.empty((1, 2, n * D), dtype=torch.float16) for n in (HQ, HK, HK))
    plain.archparams.rope_style = 2                                   # GPTJ
    calls.clear()
    plain.moedesk_qkv(x, 2, pos, q, k, v, sin, cos)
    assert calls == [("forward_1", 2)], "exllamav2's prologue"
    plain.archparams.rope_style = 1
    calls.clear()
    plain.moedesk_qkv(torch.zeros(1, 10, K).half(), 10, pos, q, k, v, sin, cos)
    assert calls == [("forward_1", 10)]


@pytest.mark.skipif(INTERPRETED, reason="compiled in the parent")
@pytest.mark.parametrize("rows_block,ksplit,warps,dot", [(1, 8, 4, True), (16, 2, 4, True), (2, 1, 8, False)])
def test_it_compiles_for_an_h200_with_nothing_spilled(monkeypatch, rows_block, ksplit, warps, dot):
    """Compiled for sm_90 on this machine (Triton's own ptxas, no GPU), at Qwen3-30B-A3B's widths, 3-bit v among
    4-bit q and k: what the interpreter does not check (the compiler's view of the code), and no registers
    spilled to local memory (bench.kernel_sass's tools)."""
    kernel_sass = pytest.importorskip("bench.kernel_sass")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    try:
        kernel_sass._tools()
    except RuntimeError as e:
        pytest.skip(str(e))
    from runtime.experts.qkv_prologue import XB, _qkv_prologue
    const = dict(K=2048, HQ=32, HK=4, D=128, N1=4096, BITS1=4, G1=128, N2=512, BITS2=4, G2=128, N3=512, BITS3=3,
                 G3=128, BK=64 if not dot else 128, BT=rows_block, KSPLIT=ksplit, DOT=dot, HEADNORM=True, ROPE=True,
                 XB=XB)
    usage = kernel_sass.resource_usage(kernel_sass.compile_jit(_qkv_prologue, kernel_sass._TYPES, const, warps, 90))
    assert 0 < usage["registers"] <= 255 and usage["stack"] == 0 and usage["local"] == 0, usage
