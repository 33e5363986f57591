"""The Triton decode/verify-attention kernel equals a float32 torch reference, on the CPU under Triton's
interpreter: one new row (decode) and T rows (verify), causal within the new rows.

Small shapes only (the interpreter is slow); `python -m bench.check_attention --check` runs the
comparison with the bmm path at real sizes on the GPU."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

# Triton decides at import time whether kernels run in its interpreter, for the whole process, and a
# GPU run of the suite must not get interpreted kernels: the kernel tests run in a child pytest with
# TRITON_INTERPRET=1 (test_kernel_in_the_interpreter), and are skipped in the parent.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in a child process with TRITON_INTERPRET=1")
CHILD_TESTS = 10 + 9 + 3 + 1 + 3 + 1 + 1


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernel_in_the_interpreter():
    from tests.interpreted import run_child_pytest
    run_child_pytest(__file__, CHILD_TESTS, timeout=300, stop_first=False)


@pytest.fixture(scope="module")
def attn():
    import runtime.backends.attention as mod
    return mod


def make(Hq, Hk, D, S, seed=0, T=1):
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(1, S, Hk, D, generator=g).half()                     # [1, S, Hk, D]
    V = torch.randn(1, S, Hk, D, generator=g).half()
    q = torch.randn(1, T, Hq * D, generator=g).half()
    k = torch.randn(1, T, Hk * D, generator=g).half()
    v = torch.randn(1, T, Hk * D, generator=g).half()
    return q, k, v, K, V


def reference(q, k, v, K, V, pos, scale):
    """fp32: the cache with rows pos..pos+T-1 replaced by k/v; row t, each query head over rows
    0..pos+t of its KV head. Returns [T*Hq*D]."""
    _, _, Hk, D = K.shape
    T = q.shape[1]
    Kr, Vr = K[0, :pos + T].float().clone(), V[0, :pos + T].float().clone()   # [pos+T, Hk, D]
    Kr[pos:], Vr[pos:] = k.view(T, Hk, D).float(), v.view(T, Hk, D).float()
    out = []
    for t in range(T):
        qh = q[0, t].float().view(Hk, -1, D)                                   # [Hk, R, D]
        n = pos + t + 1
        p = (torch.einsum("hrd,nhd->hrn", qh, Kr[:n]) * scale).softmax(-1)     # [Hk, R, n]
        out.append(torch.einsum("hrn,nhd->hrd", p, Vr[:n]).reshape(-1))        # [Hq*D]
    return torch.cat(out)


def run(attn, q, k, v, K, V, pos, L, **kw):
    D = K.shape[-1]
    o = attn.decode_attention(q, k, v, K, V, torch.tensor([pos], dtype=torch.int32), L, D ** -0.5,
                              block_n=16, **kw)
    assert o.shape == q.shape and o.dtype == torch.float16
    return o.float().view(-1)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


HEADS = [(2, 2, 64), (8, 2, 128), (16, 1, 64)]          # R = 1, 4, 16 query heads per KV head; D 64, 128


# Every position (first, middle, last of L) with each chunk (16: 3 splits + the combine; 48: one launch), each
# head shape with both chunks. At one row the kernel's compile-time shape differs only by R's masked query
# rows (MP 16 for every R) and D, and its run-time branches by the position against the chunks: these six
# reach each pairing of the two (the full cross product repeats them with the other head shapes).
@interpreted
@pytest.mark.parametrize("Hq,Hk,D,pos,chunk", [
    (*HEADS[0], 0, 16), (*HEADS[1], 21, 16), (*HEADS[2], 47, 16),
    (*HEADS[1], 0, 48), (*HEADS[2], 21, 48), (*HEADS[0], 47, 48),
])
def test_matches_reference_and_writes_the_row(attn, Hq, Hk, D, pos, chunk):
    S, L = 64, 48
    q, k, v, K, V = make(Hq, Hk, D, S)
    K0, V0 = K.clone(), V.clone()
    o = run(attn, q, k, v, K, V, pos, L, chunk=chunk)
    assert rel(o, reference(q, k, v, K0, V0, pos, D ** -0.5)) < 2e-3
    assert torch.equal(K[0, pos], k.view(Hk, D)) and torch.equal(V[0, pos], v.view(Hk, D))
    others = torch.arange(S) != pos
    assert torch.equal(K[0, others], K0[0, others]) and torch.equal(V[0, others], V0[0, others])


@interpreted
def test_rows_after_pos_do_not_matter(attn):
    """Causality: garbage after pos (huge values, inf, NaN) changes nothing; a change before pos does."""
    Hq, Hk, D, S, L, pos = 8, 2, 64, 64, 48, 20
    q, k, v, K, V = make(Hq, Hk, D, S, seed=1)
    base = run(attn, q, k, v, K.clone(), V.clone(), pos, L, chunk=16)
    K2, V2 = K.clone(), V.clone()
    K2[0, pos + 1] = 6e4
    V2[0, pos + 1] = float("nan")
    K2[0, pos + 2:] = float("inf")
    V2[0, pos + 2:] = -6e4
    assert torch.equal(run(attn, q, k, v, K2, V2, pos, L, chunk=16), base)
    K3 = K.clone()
    K3[0, pos - 1] += 1.0
    assert not torch.equal(run(attn, q, k, v, K3, V.clone(), pos, L, chunk=16), base)


@interpreted
def test_new_row_comes_from_k_v_not_the_stale_cache(attn):
    """A stale row at pos (e.g. after a rollback) is replaced, and the result attends the new one."""
    Hq, Hk, D, S, L, pos = 4, 1, 64, 32, 32, 31
    q, k, v, K, V = make(Hq, Hk, D, S, seed=2)
    K[0, pos], V[0, pos] = float("nan"), float("nan")
    o = run(attn, q, k, v, K, V, pos, L, chunk=16)
    assert torch.isfinite(o).all()
    K[0, pos], V[0, pos] = k.view(Hk, D), v.view(Hk, D)
    assert rel(o, reference(q, k, v, K, V, pos, D ** -0.5)) < 2e-3


@interpreted
def test_chunk_rows_bounds_the_grid(attn):
    for L, Hk in [(512, 4), (4096, 4), (32768, 4), (40960, 8), (100, 1)]:
        c = attn.chunk_rows(L, Hk, 64)
        assert c % 64 == 0 and (c == 64 or Hk * -(-L // c) <= attn.TARGET_PROGRAMS)


@interpreted
def test_bad_shapes_are_named(attn):
    q, k, v, K, V = make(8, 2, 64, 32)
    pos = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of Hk"):
        attn.decode_attention(q[..., :3 * 64], k, v, K, V, pos, 32, 0.1)
    with pytest.raises(ValueError, match="outside 1..32"):
        attn.decode_attention(q, k, v, K, V, pos, 64, 0.1)
    with pytest.raises(ValueError, match="fp16"):
        attn.decode_attention(q, k, v, K.float(), V, pos, 32, 0.1)


# -- T new rows (verify) ------------------------------------------------------------------------------

# Each row count with each head shape (T and R set the compile-time blocks: TP 2, 8, 16 new rows, MP 16 up to 256
# query rows, a different pair each), each at one of the three positions (a Latin square: every T and every
# head shape at start, middle and end) and every position with both chunks (48 on the diagonal: one launch;
# 16 elsewhere: the splits and the combine). The full cross product (54) repeats these pairings.
@interpreted
@pytest.mark.parametrize("T,Hq,Hk,D,where,chunk", [
    (2, *HEADS[0], "start", 48), (2, *HEADS[1], "middle", 16), (2, *HEADS[2], "end", 16),
    (5, *HEADS[0], "middle", 16), (5, *HEADS[1], "end", 48), (5, *HEADS[2], "start", 16),
    (9, *HEADS[0], "end", 16), (9, *HEADS[1], "start", 16), (9, *HEADS[2], "middle", 48),
])
def test_rows_match_reference_and_write_the_rows(attn, T, Hq, Hk, D, where, chunk):
    S, L = 64, 48
    pos = {"start": 0, "middle": 21, "end": L - T}[where]          # "end": the last row is the bucket's last
    q, k, v, K, V = make(Hq, Hk, D, S, seed=T, T=T)
    K0, V0 = K.clone(), V.clone()
    o = run(attn, q, k, v, K, V, pos, L, chunk=chunk)
    assert rel(o, reference(q, k, v, K0, V0, pos, D ** -0.5)) < 2e-3
    assert torch.equal(K[0, pos:pos + T], k.view(T, Hk, D)) and torch.equal(V[0, pos:pos + T], v.view(T, Hk, D))
    others = (torch.arange(S) < pos) | (torch.arange(S) >= pos + T)
    assert torch.equal(K[0, others], K0[0, others]) and torch.equal(V[0, others], V0[0, others])


@interpreted
@pytest.mark.parametrize("T", [2, 5, 9])
def test_rows_are_causal(attn, T):
    """Row t sees neither the cache after pos + T - 1 (garbage: huge, inf, NaN, and stale values at
    pos..pos+T-1) nor the new rows after t; a change before pos does change every row."""
    Hq, Hk, D, S, L, pos = 8, 2, 64, 64, 48, 19
    q, k, v, K, V = make(Hq, Hk, D, S, seed=10 + T, T=T)
    base = run(attn, q, k, v, K.clone(), V.clone(), pos, L, chunk=16).view(T, -1)
    K2, V2 = K.clone(), V.clone()
    K2[0, pos:pos + T] = float("nan")
    V2[0, pos:pos + T] = float("inf")
    K2[0, pos + T] = 6e4
    V2[0, pos + T] = float("nan")
    K2[0, pos + T + 1:] = float("inf")
    V2[0, pos + T + 1:] = -6e4
    assert torch.equal(run(attn, q, k, v, K2, V2, pos, L, chunk=16).view(T, -1), base)
    for t in range(T - 1):                       # new row t + 1 changed: rows 0..t stay, row t + 1 moves
        k2, v2 = k.clone(), v.clone()
        k2.view(T, -1)[t + 1] += 1.0
        v2.view(T, -1)[t + 1] -= 1.0
        got = run(attn, q, k2, v2, K.clone(), V.clone(), pos, L, chunk=16).view(T, -1)
        assert torch.equal(got[:t + 1], base[:t + 1])
        assert not torch.equal(got[t + 1], base[t + 1])
    K3 = K.clone()
    K3[0, pos - 1] += 1.0
    got = run(attn, q, k, v, K3, V.clone(), pos, L, chunk=16).view(T, -1)
    assert all(not torch.equal(got[t], base[t]) for t in range(T))


@interpreted
def test_rows_equal_one_row_at_a_time(attn):
    """A verify forward of T rows gives what T decode steps at pos, pos+1, ... give (and the same cache)."""
    Hq, Hk, D, S, L, pos, T = 8, 2, 64, 64, 48, 13, 5
    q, k, v, K, V = make(Hq, Hk, D, S, seed=4, T=T)
    Kb, Vb = K.clone(), V.clone()
    batched = run(attn, q, k, v, Kb, Vb, pos, L, chunk=16).view(T, -1)
    for t in range(T):
        one = run(attn, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], K, V, pos + t, L, chunk=16)
        assert rel(batched[t], one) < 2e-3
    assert torch.equal(K, Kb) and torch.equal(V, Vb)


@interpreted
@pytest.mark.parametrize("T,chunk", [(9, 16), (3, 16), (9, 64)])
def test_rows_spilling_into_the_next_chunk(attn, T, chunk):
    """New rows straddling a split boundary: each split writes only its own rows, the merge weighs the
    earlier split for the first rows only."""
    Hq, Hk, D, S, L = 4, 1, 64, 64, 64
    pos = 16 - T // 2
    q, k, v, K, V = make(Hq, Hk, D, S, seed=5, T=T)
    K0, V0 = K.clone(), V.clone()
    o = run(attn, q, k, v, K, V, pos, L, chunk=chunk)
    assert rel(o, reference(q, k, v, K0, V0, pos, D ** -0.5)) < 2e-3
    assert torch.equal(K[0, pos:pos + T], k.view(T, Hk, D))


@interpreted
def test_row_shapes_are_named(attn):
    q, k, v, K, V = make(8, 2, 64, 32, T=3)
    pos = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k, v \[1, T, Hk\*D\] = \[1, 3, 128\]"):
        attn.decode_attention(q, k[:, :2], v[:, :2], K, V, pos, 32, 0.1)
    with pytest.raises(ValueError, match="outside 3..32"):
        attn.decode_attention(q, k, v, K, V, pos, 2, 0.1)
    q2, k2, v2, K2, V2 = make(32, 1, 16, 32, T=9)
    with pytest.raises(ValueError, match="288 query rows"):
        attn.decode_attention(q2, k2, v2, K2, V2, pos, 32, 0.1)


# -- warm-up at load: every variant run once, the cache and position left as they were ----------------

@interpreted
def test_warm_attention_runs_each_variant_once_and_restores_the_cache(attn, monkeypatch):
    """DecodeGraphs.warm_attention (at load) launches decode_attention once per compile-time variant of
    the graphs' buckets over a 4096-token cache (8 KV heads: the chunk doubles past 2112 rows), on the
    first attention layer's cache at position 0: that cache's rows, the other layer's and the graphs'
    position are left as they were. The kernel runs for 1 and for the most rows at each length (every chunk
    and split count of these buckets, its one-row and its many-rows branch, and rows 0..8 written, which the
    restore must undo); the calls at 2..8 rows are only recorded: the interpreter takes seconds for each, and
    the kernel's row blocks are the verify tests' above."""
    import types

    import runtime.backends.exl2_graph as eg
    Hq, Hk, D, S = 8, 8, 16, 4096

    class Attn:
        def __init__(self, i):
            self.num_attention_heads, self.num_key_value_heads, self.head_dim = Hq, Hk, D
            self.scaling, self.layer_idx = D ** -0.5, i

    g = torch.Generator().manual_seed(7)
    keys = [torch.randn(1, S, Hk, D, generator=g).half() for _ in range(2)]
    values = [torch.randn(1, S, Hk, D, generator=g).half() for _ in range(2)]
    before = [t.clone() for t in keys + values]
    graphs = eg.DecodeGraphs.__new__(eg.DecodeGraphs)
    graphs.attention, graphs.Attention, graphs.max_rows = "triton", Attn, eg.MAX_ROWS
    graphs.body = [object(), Attn(0), object(), Attn(1)]
    graphs.cache = types.SimpleNamespace(max_seq_len=S, key_states=keys, value_states=values)
    graphs.device = torch.device("cpu")
    graphs.pos32 = torch.tensor([77], dtype=torch.int32)
    calls, real = [], eg.decode_attention

    def spy(q, k, v, K, V, pos, L, scale):
        calls.append((L, q.shape[1]))
        assert K is keys[0] and V is values[0] and pos.item() == 0
        return real(q, k, v, K, V, pos, L, scale) if q.shape[1] in (1, eg.MAX_ROWS) else None

    monkeypatch.setattr(eg, "decode_attention", spy)
    seen = []
    runs = graphs.warm_attention(lambda stage, msg, done, total: seen.append((stage, msg, done, total)))
    want = eg.attention_variants(S, Hq, Hk, D)
    assert len(want) == 4 * eg.MAX_ROWS                    # chunk 64 with 8/16/32 splits, chunk 128
    assert runs == len(calls) == len(want) and sorted(calls) == sorted(want.values())
    assert {attn.variant(L, T, Hq, Hk, D) for L, T in calls} == set(want)
    assert all(torch.equal(a, b) for a, b in zip(keys + values, before))
    assert graphs.pos32.item() == 77
    assert seen[-1] == ("warmup", "Compiling attention kernels for 4 context lengths", runs, runs)
    assert all(d <= t for _, _, d, t in seen)


# -- the GPU check's reference (bench/check_attention.py: the bmm path the graphs ran before), plain torch ----

@pytest.mark.skipif(INTERPRETED, reason="plain torch: runs in the parent")
@pytest.mark.parametrize("T", [1, 5])
def test_the_bmm_reference_matches_the_plain_one(T):
    from bench.check_attention import _bmm_path
    Hq, Hk, D, S, L, pos = 8, 2, 64, 64, 48, 21
    q, k, v, K, V = make(Hq, Hk, D, S, seed=6, T=T)
    K0, V0 = K.clone(), V.clone()
    pos64 = pos + torch.arange(T)
    mask = torch.where(torch.arange(L)[None, :] <= pos64[:, None], 0.0, float("-inf"))     # [T, L]
    o = _bmm_path(q, k, v, K, V, pos64, mask, L, Hq, Hk, D, D ** -0.5)
    assert o.shape == q.shape
    assert rel(o.float().view(-1), reference(q, k, v, K0, V0, pos, D ** -0.5)) < 2e-3
    assert torch.equal(K[0, pos:pos + T], k.view(T, Hk, D))


@pytest.mark.skipif(INTERPRETED, reason="plain Python: runs in the parent")
def test_graph_bucket_holds_the_last_row():
    """The attended length is chosen from the last new row: rows spilling past a bucket take the next."""
    from runtime.backends.exl2_graph import BUCKET, bucket
    assert BUCKET == 512
    assert [bucket(0, 1, 4096), bucket(511, 1, 4096), bucket(512, 1, 4096)] == [512, 512, 1024]
    assert [bucket(503, 9, 4096), bucket(504, 9, 4096), bucket(508, 5, 4096)] == [512, 1024, 1024]
    assert [bucket(4087, 9, 4096), bucket(0, 9, 300), bucket(291, 9, 300)] == [4096, 300, 300]
