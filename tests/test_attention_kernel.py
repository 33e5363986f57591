"""The Triton decode-attention kernel equals a float32 torch reference, on the CPU under Triton's interpreter.

Small shapes only (the interpreter is slow); `python -m runtime.backends.attention --check` runs the
comparison with the bmm path at real sizes on the GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]

# Triton decides at import time whether kernels run in its interpreter, for the whole process, and a
# GPU run of the suite must not get interpreted kernels: the kernel tests run in a child pytest with
# TRITON_INTERPRET=1 (test_kernel_in_the_interpreter), and are skipped in the parent.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in a child process with TRITON_INTERPRET=1")


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernel_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "22 passed" in r.stdout, r.stdout[-2000:]              # every kernel test ran


@pytest.fixture(scope="module")
def attn():
    import runtime.backends.attention as mod
    return mod


def make(Hq, Hk, D, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(1, S, Hk, D, generator=g).half()                     # [1, S, Hk, D]
    V = torch.randn(1, S, Hk, D, generator=g).half()
    q = torch.randn(1, 1, Hq * D, generator=g).half()
    k = torch.randn(1, 1, Hk * D, generator=g).half()
    v = torch.randn(1, 1, Hk * D, generator=g).half()
    return q, k, v, K, V


def reference(q, k, v, K, V, pos, scale):
    """fp32: the cache with row pos replaced by k/v, each query head over rows 0..pos of its KV head."""
    _, _, Hk, D = K.shape
    Kr, Vr = K[0, :pos + 1].float().clone(), V[0, :pos + 1].float().clone()   # [pos+1, Hk, D]
    Kr[pos], Vr[pos] = k.view(Hk, D).float(), v.view(Hk, D).float()
    qh = q.float().view(Hk, -1, D)                                             # [Hk, R, D]
    p = (torch.einsum("hrd,nhd->hrn", qh, Kr) * scale).softmax(-1)             # [Hk, R, pos+1]
    return torch.einsum("hrn,nhd->hrd", p, Vr).reshape(-1)                     # [Hq*D]


def run(attn, q, k, v, K, V, pos, L, **kw):
    D = K.shape[-1]
    o = attn.decode_attention(q, k, v, K, V, torch.tensor([pos], dtype=torch.int32), L, D ** -0.5,
                              block_n=16, **kw)
    assert o.shape == (1, 1, q.numel()) and o.dtype == torch.float16
    return o.float().view(-1)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@interpreted
@pytest.mark.parametrize("Hq,Hk,D", [(2, 2, 64), (8, 2, 128), (16, 1, 64)])     # R = 1, 4, 16
@pytest.mark.parametrize("pos", [0, 21, 47])                                     # first, middle, last of L
@pytest.mark.parametrize("chunk", [16, 48])                                      # 3 splits + combine; 1 launch
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
