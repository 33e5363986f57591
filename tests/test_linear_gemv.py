"""A dense EXL2 linear through the experts' split-K GEMV (`linear_gemv.linear_into`: attention's o in the decode
graphs) equals the dequantized weight (runtime/exl2/format.py) at 1..9 rows, on the CPU under Triton's
interpreter; `exl2_gemv.install` gives the attentions it takes the one-launch prologue and o's GEMV.

As in test_attention_kernel.py, the kernel tests run in a child pytest with TRITON_INTERPRET=1 (Triton
decides at import time for the whole process) and are skipped in the parent."""
from __future__ import annotations

import os
import sys
import types

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in a child process with TRITON_INTERPRET=1")
CHILD_TESTS = 8 + 2 + 1 + 2 + 10 + 2 + 7 + 5 + 3 + 2 + 1 + 3   # + 3: the tests without a kernel

# The rows a kernel test runs. `_linear_splitk` has one branch per row block (`linear_rows_block`): 1 row the
# GEMV (BT 1); 2..9 rows with the dot all in BT 16, the rows past T masked, so 9 (the most the GEMV takes)
# stands for 2..8 there; without the dot BT is the power of two >= T (the 2..8 rows test reaches each one).
# The interpreter runs every launch in Python: each row count more is a launch per part more.
DOT_ROWS = (1, 9)


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_gemv_in_the_interpreter():
    from tests.interpreted import run_child_pytest
    run_child_pytest(__file__, CHILD_TESTS)


def exl2_linear(n: int, k: int, bits, seed: int, group=32, props=None) -> dict:
    from runtime.exl2 import format as exl2
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    perm = torch.randperm(k, generator=g)
    return exl2.quantize(w, bits, group, perm=perm, bits_prop=props)


def reference(parts, outs, x):
    from runtime.exl2 import format as exl2
    w = torch.cat([exl2.dequantize(t, out_features=o) for t, o in zip(parts, outs)])       # exllamav2's fp16 values
    return x.float() @ w.T


def close(got, want):
    assert got.dtype == torch.float16 and got.shape == want.shape
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-3 * want.abs().max().item() + 1e-4, err


def linear_decode(x, packs, outs, splitk=None):
    """x fp16 [T, K] -> fp16 [T, sum(outs)]: part i's first outs[i] columns side by side (a fused projection),
    each part into its own columns of one output through `linear_into`."""
    from runtime.experts.linear_gemv import linear_into
    out = torch.empty((x.shape[0], sum(outs)), dtype=torch.float16)
    cols = [0] + list(torch.tensor(outs).cumsum(0).tolist())
    linear_into(x, packs, [out[:, a:b] for a, b in zip(cols, cols[1:])], splitk=splitk)
    return out


def rows(t: int, k: int, seed: int = 1):
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).half()


# Qwen3-30B-A3B's attention scaled down by 16 (hidden 2048 -> 128, 32 q heads / 4 kv heads of 128 -> of 8
# dims... kept as 32 x 8 = 256 and 4 x 8 = 32): q [256, 128], k/v [32, 128], o [128, 256]
@interpreted
@pytest.mark.parametrize("bits,props,group", [
    (4, None, 32), (3, None, 32), (3, None, 128), (5, None, 32), (6, None, 64), (8, None, 32),
    ([4, 3], [0.5, 0.5], 32), ([5, 3], [0.25, 0.75], 32),       # mixed widths: stored at 4 / at 8 bits
])       # every width and mix (stored at 3, 4, 8 bits; 3 bits by tiles of 32 and of 128), at DOT_ROWS
def test_q_k_v_fused_and_o_at_1_and_9_rows(bits, props, group):
    q, k, v = (exl2_linear(n, 128, bits, s, group, props) for n, s in ((256, 0), (32, 1), (32, 2)))
    o = exl2_linear(128, 256, bits, 3, group, props)
    qkv, lo = _packs([q, k, v]), _packs([o])
    for t in DOT_ROWS:
        x = rows(t, 128, seed=t)
        close(linear_decode(x, qkv, [256, 32, 32]), reference([q, k, v], [256, 32, 32], x))
        h = rows(t, 256, seed=10 + t)
        close(linear_decode(h, lo, [128]), reference([o], [128], h))


@interpreted
@pytest.mark.parametrize("splitk", ["32x1", "128x2"])
def test_other_launch_shapes(splitk):
    """Launch shapes the GPU may pick by timing (narrow / wide column blocks, K cut in 1 or 2)."""
    t = exl2_linear(96, 256, 4, 5)
    for r in DOT_ROWS:
        x = rows(r, 256, seed=r)
        close(linear_decode(x, _packs([t]), [96], tuple(int(v) for v in splitk.split("x"))), reference([t], [96], x))


@interpreted
def test_padded_columns_are_cut():
    """Stored columns beyond `outs` (padding) are not written: part two starts right after part one's
    asked-for columns."""
    a, b = exl2_linear(64, 128, 4, 7), exl2_linear(64, 128, 4, 8)
    x = rows(3, 128)
    close(linear_decode(x, _packs([a, b]), [40, 64]), reference([a, b], [40, 64], x))


@interpreted
@pytest.mark.parametrize("t", [0, 10])
def test_linear_into_refuses_row_counts_it_does_not_take(t):
    from runtime.experts.linear_gemv import linear_into
    from runtime.experts.pack import pack_experts
    p = pack_experts([exl2_linear(64, 128, 4, 1)], "p")
    with pytest.raises(ValueError, match=f"{t} rows"):
        linear_into(torch.zeros(t, 128, dtype=torch.float16), [p], [torch.empty((t, 64), dtype=torch.float16)])


def _packs(parts):
    from runtime.experts.pack import pack_experts
    return [pack_experts([t], f"p{i}") for i, t in enumerate(parts)]


@interpreted
@pytest.mark.parametrize("splitk", ["32x1", "64x4"])
@pytest.mark.parametrize("bits", [3, 4, 6, 8, 4.5])
def test_linear_decode_is_fp16_at_1_and_9_rows(bits, splitk):
    """`linear_into` stores fp16 equal to x @ W.T, q/k/v fused, with K whole (KSPLIT 1: stored straight into
    the output) and cut in 4 (the workspace, finished in the launch), at DOT_ROWS."""
    parts = [exl2_linear(n, 128, bits, s) for n, s in ((256, 20), (32, 21), (32, 22))]
    packs = _packs(parts)
    for t in DOT_ROWS:
        x = rows(t, 128, seed=30 + t)
        close(linear_decode(x, packs, [256, 32, 32], tuple(int(v) for v in splitk.split("x"))),
              reference(parts, [256, 32, 32], x))


@interpreted
@pytest.mark.parametrize("ks", [(1, 1, 1), (1, 2, 1)])
def test_fused_columns_with_each_part_its_own_shape(monkeypatch, ks):
    """Each part of a fused projection runs its own chosen shape: q, k and v with K whole store fp16 into
    an uninitialised output; when one part splits K, every part goes into the zeroed fp32 buffer (k
    by atomics, q and v by stores) and lands in its own columns all the same."""
    from runtime.experts import shapes
    from runtime.experts.shapes import SplitK
    parts = [exl2_linear(n, 128, 4, s) for n, s in ((96, 23), (40, 24), (64, 25))]
    outs = [96, 33, 64]                                     # k: 7 padded columns cut
    packs = _packs(parts)
    for t in DOT_ROWS:
        chosen = {("linear", 128, p.out_features, n, t, p.bits, p.group, None, torch.device("cpu")): SplitK(bn, k)
                  for p, n, bn, k in zip(packs, outs, (32, 16, 64), ks)}
        monkeypatch.setattr(shapes, "CHOSEN", chosen)
        monkeypatch.setattr("runtime.experts.linear_gemv.CHOSEN", chosen)
        x = rows(t, 128, seed=40 + t)
        close(linear_decode(x, packs, outs), reference(parts, outs, x))


@interpreted
@pytest.mark.parametrize("t,ksplit,dot", [(1, 1, True), (9, 1, True), (1, 2, True), (5, 4, True), (2, 1, False),
                                          (5, 2, False), (8, 1, False)])
def test_kernel_writes_its_rows_and_columns_only(t, ksplit, dot):
    """`_linear_splitk` into a wider, taller output filled with NaN (KSPLIT 1: stored in the output's
    dtype, fp16) or with zeros in its own block (KSPLIT > 1: added, fp32): its block holds x @ W.T,
    the padded rows (up to 16; without the dot up to the power of two) and the other columns are
    untouched."""
    from runtime.experts.linear_gemv import _linear_splitk, linear_rows_block
    from runtime.experts.shapes import SplitK
    part = exl2_linear(48, 128, 4, 26)
    p = _packs([part])[0]
    x = rows(t, 128, seed=50 + t)
    out = torch.full((t + 3, 60), float("nan"), dtype=torch.float16 if ksplit == 1 else torch.float32)
    if ksplit > 1:
        out[:t, 5:45] = 0
    _linear_splitk[(3, ksplit)](x, p.qweight, p.scales, p.perm, out, out, out, t, 60, 5, K=128, N=p.out_features,
                                NOUT=40, BITS=p.bits, G=p.group, BK=32, BN=16, KSPLIT=ksplit, DOT=dot,
                                BT=linear_rows_block(t, SplitK(16, ksplit, dot=dot)))
    want = reference([part], [40], x)
    got = out[:t, 5:45]
    assert got.dtype == (torch.float16 if ksplit == 1 else torch.float32)
    assert (got.float() - want).abs().max() <= 2e-3 * want.abs().max() + 1e-4
    rest = out.clone()
    rest[:t, 5:45] = float("nan")
    assert rest.isnan().all()


@interpreted
@pytest.mark.parametrize("t,ksplit,dot,add", [(1, 2, True, False), (5, 4, True, True), (1, 4, True, True),
                                              (3, 2, False, False), (9, 8, True, False)])
def test_kernel_finishes_a_cut_k_in_its_own_launch(t, ksplit, dot, add):
    """FINISH: the K slices add into the float32 workspace and count per column block; the last one stores
    the block in fp16 into the output (ADD: added to what it holds), and the workspace and counters are
    zero again; the output's other rows and columns are untouched."""
    from runtime.experts.linear_gemv import _linear_splitk, linear_rows_block
    from runtime.experts.shapes import SplitK
    part = exl2_linear(48, 128, 4, 27)
    p = _packs([part])[0]
    x = rows(t, 128, seed=80 + t)
    out = torch.full((t + 3, 60), float("nan"), dtype=torch.float16)
    base = rows(t, 40, seed=90 + t)
    out[:t, 5:45] = base
    ws, cnt = torch.zeros(t * 40 + 7), torch.zeros(5, dtype=torch.int32)
    _linear_splitk[(3, ksplit)](x, p.qweight, p.scales, p.perm, out[:, 5:], ws, cnt, t, 60, 0, K=128,
                                N=p.out_features, NOUT=40, BITS=p.bits, G=p.group, BK=16, BN=16, KSPLIT=ksplit,
                                DOT=dot, ADD=add, FINISH=True, BT=linear_rows_block(t, SplitK(16, ksplit, dot=dot)))
    want = reference([part], [40], x) + (base.float() if add else 0)
    close(out[:t, 5:45], want)
    assert not ws.any() and not cnt.any()
    rest = out.clone()
    rest[:t, 5:45] = float("nan")
    assert rest.isnan().all()


@interpreted
# 32x1: K whole, stored / added in the launch (a workspace or none: the same launch, so once); 16x8: q/k/v's
# K of 128 takes no 8 slices, so they run the default 64x4 and o (K 256) 16x8: with the workspace every part
# FINISHes in its launch (stored, and added into the residual), without one they go through the zeroed
# buffer, copied (q/k/v) and added (o). These reach every branch the dropped 64x4 did.
@pytest.mark.parametrize("splitk,room", [("32x1", True), ("16x8", True), ("16x8", False)])
def test_linear_into_stores_or_adds_into_its_destinations(monkeypatch, splitk, room):
    """`linear_into`: q, k and v straight into a graph's own tensors, o added into the residual stream (rows
    further apart than the part is wide), K whole or cut; with a workspace (each part one launch, the
    workspace zero after) and without one, as in a graph capture when none fits (a zeroed buffer, added and
    cast)."""
    from runtime.experts import linear_gemv, shapes
    from runtime.experts.linear_gemv import linear_into
    if not room:
        monkeypatch.setattr(linear_gemv, "workspace", lambda *a: None)
    q, k, v = (exl2_linear(n, 128, 4, s) for n, s in ((256, 30), (32, 31), (32, 32)))
    o = exl2_linear(128, 256, 4, 33)
    qkv, lo = _packs([q, k, v]), _packs([o])
    force = tuple(int(v) for v in splitk.split("x"))
    for t in DOT_ROWS:
        x = rows(t, 128, seed=100 + t)
        dq, dk, dv = (torch.full((t, n), float("nan"), dtype=torch.float16) for n in (256, 32, 32))
        linear_into(x, qkv, [dq, dk, dv], splitk=force)
        close(torch.cat([dq, dk, dv], dim=1), reference([q, k, v], [256, 32, 32], x))
        h = rows(t, 256, seed=110 + t)
        resid = torch.full((t, 200), float("nan"), dtype=torch.float16)
        resid[:, :128] = rows(t, 128, seed=120 + t)
        before = resid[:, :128].float().clone()
        linear_into(h, lo, [resid[:, :128]], add=True, splitk=force)
        close(resid[:, :128], before + reference([o], [128], h))
        assert resid[:, 128:].isnan().all()
    for ws, cnt in shapes._WORKSPACES.get(torch.device("cpu"), []):
        assert not ws.any() and not cnt.any()
    with pytest.raises(ValueError, match="2 destinations"):
        linear_into(rows(1, 128), qkv, [dq[:1], dk[:1]])


@interpreted
@pytest.mark.parametrize("ks", [1, 2])
def test_linear_into_without_the_dot_at_2_to_8_rows(monkeypatch, ks):
    """The shapes that sum a verify's rows on the CUDA cores (no padding to 16 for a tensor-core dot),
    which the timing may pick at 2..8 rows: the same x @ W.T, q/k/v fused. Rows 2, 3, 4, 5, 8: each row block
    (BT 2, 4, 8), filled (2, 4, 8) and with masked rows (3 in 4, 5 in 8; 6 and 7 are masked 8s too). Column
    blocks of 32: q's 256 columns in 8 programs, k's and v's 32 in one (16 ran twice the programs through
    the interpreter for the same code)."""
    from runtime.experts.shapes import SplitK
    parts = [exl2_linear(n, 128, 4, s) for n, s in ((256, 60), (32, 61), (32, 62))]
    outs, packs = [256, 32, 32], _packs(parts)
    for t in (2, 3, 4, 5, 8):
        chosen = {("linear", 128, p.out_features, n, t, p.bits, p.group, None, torch.device("cpu")):
                  SplitK(32, ks, dot=False) for p, n in zip(packs, outs)}
        monkeypatch.setattr("runtime.experts.linear_gemv.CHOSEN", chosen)
        x = rows(t, 128, seed=70 + t)
        close(linear_decode(x, packs, outs), reference(parts, outs, x))


def test_linear_candidates_without_the_dot_only_at_a_few_rows():
    """2..FMA_MAX_ROWS rows: every shape also without the dot where its [rows, BK, BN] block is small
    enough, the default (with the dot) still first; one row or more rows: the dot's shapes only."""
    from runtime.experts.linear_gemv import FMA_MAX_ROWS, FMA_MAX_TILE, linear_candidates, linear_rows_block
    one = linear_candidates(2048, 4096, 128)
    assert all(c.dot for c in one) and linear_candidates(2048, 4096, 128, FMA_MAX_ROWS + 1) == one
    for t in (2, 3, 4, 8):
        cands = linear_candidates(2048, 4096, 128, t)
        fma = [c for c in cands if not c.dot]
        assert cands[0] == one[0] and cands[:len(one)] == one and fma and len(set(cands)) == len(cands)
        assert all(linear_rows_block(t, c) * 128 * c.bn <= FMA_MAX_TILE for c in fma)
    assert [linear_rows_block(t, c) for t, c in ((1, one[0]), (3, one[0]), (3, fma[0]), (8, fma[0]))] == [1, 16, 4, 8]


def test_linear_candidates_keep_k_whole_and_divide_k():
    """Every part has KSPLIT 1 shapes to time (the grid no longer grows with the rows, so k/v's 512
    columns alone are few programs), the default first, every K cut a whole number of tiles; a forced
    shape is the only one."""
    from runtime.experts.linear_gemv import linear_candidates
    from runtime.experts.shapes import SplitK, ksplit
    for n in (512, 2048, 4096):
        cands = linear_candidates(2048, n, 128)
        assert cands[0] == SplitK(64, ksplit(2048, 128, -(-n // 64)))
        assert any(c.ksplit == 1 for c in cands) and any(c.ksplit > 1 for c in cands)
        assert all(2048 % (c.ksplit * 128) == 0 for c in cands) and len(set(cands)) == len(cands)
    assert linear_candidates(2048, 512, 128, forced=(32, 1)) == [SplitK(32, 1)]


class _Folder:
    """The tensors of a model folder, from a dict (ModelFolder's has / tensor / close)."""

    def __init__(self, tensors: dict):
        self.tensors, self.closed = tensors, False

    def has(self, name):
        return name in self.tensors

    def tensor(self, name):
        return self.tensors[name]

    def close(self):
        self.closed = True


def _standin_exllamav2(monkeypatch, calls: list):
    """exllamav2's modules as far as exl2_gemv uses them: the norms in plain torch, RoPE and its fused
    attention prologue / epilogue only recorded."""
    class Attention:
        pass

    class RMSNorm:
        def __init__(self, w):
            self.weight, self.variance_epsilon = w, 1e-6

    def rms_norm(h, w, out, eps):
        hf = h.float()
        out.copy_((hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).half())

    def head_norm(x, w, b, out, eps, rms):
        assert rms
        rms_norm(x, w, out, eps)

    ext = types.SimpleNamespace(
        rms_norm=rms_norm, head_norm=head_norm,
        rope_=lambda t, sin, cos, past, heads, dim, pos, neox: calls.append(("rope", heads, neox)),
        q_attn_forward_1=lambda *a: calls.append(("forward_1", a[3])),
        q_attn_forward_2=lambda *a: calls.append(("forward_2", a[4])))
    mods = {"exllamav2": types.SimpleNamespace(), "exllamav2.attn": types.SimpleNamespace(ExLlamaV2Attention=Attention),
            "exllamav2.ext": types.SimpleNamespace(exllamav2_ext=ext, none_tensor=torch.empty(0)),
            "exllamav2.rmsnorm": types.SimpleNamespace(ExLlamaV2RMSNorm=RMSNorm),
            "exllamav2.architecture": types.SimpleNamespace(RopeStyle=types.SimpleNamespace(NONE=0, NEOX=1, GPTJ=2))}
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    return Attention, RMSNorm


def attention_tensors(layers: int, H: int, Hq: int, Hk: int, D: int, seed: int) -> dict:
    """A model folder's EXL2 tensors of `layers` attentions l0, l1, ... (4-bit q/k/v/o, random)."""
    tensors = {}
    for layer in range(layers):
        for name, n, k in (("q_proj", Hq * D, H), ("k_proj", Hk * D, H), ("v_proj", Hk * D, H), ("o_proj", H, Hq * D)):
            seed += 1
            for part, t in exl2_linear(n, k, 4, seed).items():
                tensors[f"l{layer}.{name}.{part}"] = t
    return tensors


def _attention(Attention, RMSNorm, key, H, Hq, Hk, D, **changes):
    def lin(name, n, k):
        return types.SimpleNamespace(key=f"{key}.{name}", out_features=n, in_features=k, has_bias=False,
                                     f_key=None, q_handle=0, device=lambda: "cpu")
    a = Attention()
    a.__dict__.update(q_handle=0, has_norm=True, has_residual=True, post_layernorm=None,
                      q_proj=lin("q_proj", Hq * D, H), k_proj=lin("k_proj", Hk * D, H), v_proj=lin("v_proj", Hk * D, H),
                      o_proj=lin("o_proj", H, Hq * D), num_attention_heads=Hq, num_key_value_heads=Hk, head_dim=D,
                      pre_layernorm=RMSNorm(torch.rand(H) + 0.5), q_norm=RMSNorm(torch.rand(D) + 0.5),
                      k_norm=RMSNorm(torch.rand(D) + 0.5),
                      archparams=types.SimpleNamespace(headnorm="rmsnorm", rope_style=1))
    a.q_norm.bias = a.k_norm.bias = None
    a.__dict__.update(changes)
    return a


@interpreted
def test_exl2_engine_hooks(monkeypatch):
    """exl2_gemv.install (the exllamav2 engine's decode graphs, a load without offload), with no switch to turn
    on: plain attentions get the one-launch prologue and o through the GEMV, the others (a bias, a post-norm,
    a prologue of the architecture's own) keep exllamav2's fused path; x + o @ W_o.T equals the dequantized
    weight's; above 9 rows exllamav2's prologue and epilogue run."""
    from runtime.backends import exl2_gemv
    calls = []
    Attention, RMSNorm = _standin_exllamav2(monkeypatch, calls)
    H, Hq, Hk, D = 256, 4, 2, 32
    tensors = attention_tensors(4, H, Hq, Hk, D, seed=0)
    plain = _attention(Attention, RMSNorm, "l0", H, Hq, Hk, D)
    biased = _attention(Attention, RMSNorm, "l1", H, Hq, Hk, D)
    biased.q_proj.has_bias = True
    post = _attention(Attention, RMSNorm, "l2", H, Hq, Hk, D, post_layernorm=object())
    own = _attention(Attention, RMSNorm, "l3", H, Hq, Hk, D, moedesk_qkv=print)
    model = types.SimpleNamespace(modules=[object(), plain, biased, post, own])
    folder = _Folder(tensors)
    assert exl2_gemv.install(model, folder) == 1
    assert folder.closed and plain.moedesk_qkv.func is exl2_gemv.fused_qkv and own.moedesk_qkv is print
    assert plain.moedesk_o.func is exl2_gemv.gemv_o
    assert not any(hasattr(a, "moedesk_o") for a in (biased, post, own))
    assert exl2_gemv.install(model, _Folder(tensors)) == 1                  # a second graph build: as it was

    from runtime.exl2 import format as exl2
    from runtime.modelfolder import EXL2_PARTS
    w_o = exl2.dequantize({p: tensors[f"l0.o_proj.{p}"] for p in EXL2_PARTS})
    for T in (1, 9):
        x = rows(T, H, seed=T).view(1, T, H)
        o = rows(T, Hq * D, seed=20 + T).view(1, T, Hq * D)
        before = x.clone()
        calls.clear()
        plain.moedesk_o(x, o, T)
        assert calls == []
        close(x.view(T, H), before.view(T, H).float() + o.view(T, -1).float() @ w_o.T)
    calls.clear()
    x10 = rows(10, H).view(1, 10, H)
    plain.moedesk_qkv(x10, 10, None, *(torch.empty(1) for _ in range(3)), None, None)
    plain.moedesk_o(x10, torch.empty(1), 10)
    assert calls == [("forward_1", 10), ("forward_2", 10)]


def test_a_shape_that_does_not_compile_here_is_passed_over(monkeypatch):
    """Timing the candidates on a GPU: a shape Triton cannot build there (registers, shared memory) is
    skipped and the fastest of the others kept; the default failing is an error."""
    from triton.runtime.errors import OutOfResources

    from runtime.experts import shapes
    from runtime.experts.shapes import SplitK
    monkeypatch.setattr(shapes, "interpreting", lambda: False)
    monkeypatch.setattr(shapes.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shapes.torch.cuda, "is_current_stream_capturing", lambda: False)
    times = {SplitK(64, 1): 3.0, SplitK(16, 1, dot=False): 1.0, SplitK(32, 1, dot=False): 2.0}
    current = []
    monkeypatch.setattr(shapes, "_time_eager", lambda run: times[current[-1]])

    def launch(c):
        current.append(c)
        if c == SplitK(16, 1, dot=False):
            raise OutOfResources(300000, 232448, "shared memory")
    monkeypatch.setattr(shapes, "CHOSEN", {})
    assert shapes.choose("k", list(times), launch) == SplitK(32, 1, dot=False)
    monkeypatch.setattr(shapes, "CHOSEN", {})
    with pytest.raises(OutOfResources):
        shapes.choose("k2", [SplitK(16, 1, dot=False), SplitK(64, 1)], launch)
