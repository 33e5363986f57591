"""A dense EXL2 linear through the experts' split-K GEMV (`TritonExl2Linear`, `kernels.linear_decode`)
equals the dequantized weight (runtime/exl2/format.py) at 1..9 rows, on the CPU under Triton's
interpreter; more rows go to its fallback; the tuning switch picks it in `quant_linear.cuda_exl2`.

As in test_attention_kernel.py, the kernel tests run in a child pytest with TRITON_INTERPRET=1 (Triton
decides at import time for the whole process) and are skipped in the parent."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in a child process with TRITON_INTERPRET=1")
CHILD_TESTS = 8 + 2 + 1 + 1 + 1 + 2 + 2


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_gemv_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert f"{CHILD_TESTS} passed" in r.stdout, r.stdout[-2000:]              # every kernel test ran


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


def gemv(parts, outs, fallback=None):
    from runtime.backends.quant_linear import TritonExl2Linear
    return TritonExl2Linear(parts, outs, [f"p{i}" for i in range(len(parts))], torch.device("cpu"), fallback)


def rows(t: int, k: int, seed: int = 1):
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).half()


# Qwen3-30B-A3B's attention scaled down by 16 (hidden 2048 -> 128, 32 q heads / 4 kv heads of 128 -> of 8
# dims... kept as 32 x 8 = 256 and 4 x 8 = 32): q [256, 128], k/v [32, 128], o [128, 256]
@interpreted
@pytest.mark.parametrize("bits,props,group", [
    (4, None, 32), (3, None, 32), (3, None, 128), (5, None, 32), (6, None, 64), (8, None, 32),
    ([4, 3], [0.5, 0.5], 32), ([5, 3], [0.25, 0.75], 32),       # mixed widths: stored at 4 / at 8 bits
])
def test_q_k_v_fused_and_o_at_1_to_9_rows(bits, props, group):
    q, k, v = (exl2_linear(n, 128, bits, s, group, props) for n, s in ((256, 0), (32, 1), (32, 2)))
    o = exl2_linear(128, 256, bits, 3, group, props)
    qkv, lo = gemv([q, k, v], [256, 32, 32]), gemv([o], [128])
    assert (qkv.in_features, qkv.out_features, lo.in_features, lo.out_features) == (128, 320, 256, 128)
    for t in range(1, 10):
        x = rows(t, 128, seed=t)
        close(qkv(x), reference([q, k, v], [256, 32, 32], x))
        h = rows(t, 256, seed=10 + t)
        close(lo(h), reference([o], [128], h))


@interpreted
@pytest.mark.parametrize("splitk", ["32x1", "128x2"])
def test_other_launch_shapes(splitk):
    """Launch shapes the GPU may pick by timing (narrow / wide column blocks, K cut in 1 or 2)."""
    from runtime import tuning
    t = exl2_linear(96, 256, 4, 5)
    with tuning.use(tuning.with_changes(splitk=tuple(int(v) for v in splitk.split("x")))):
        for r in (1, 4, 9):
            x = rows(r, 256, seed=r)
            close(gemv([t], [96])(x), reference([t], [96], x))


@interpreted
def test_padded_columns_are_cut():
    """Stored columns beyond `outs` (padding) are not written: part two starts right after part one's
    asked-for columns."""
    a, b = exl2_linear(64, 128, 4, 7), exl2_linear(64, 128, 4, 8)
    x = rows(3, 128)
    close(gemv([a, b], [40, 64])(x), reference([a, b], [40, 64], x))


@interpreted
def test_more_rows_go_to_the_fallback():
    from runtime.backends.quant_linear import CpuExl2Linear
    t = exl2_linear(64, 128, 4, 9)
    fb = CpuExl2Linear([t], [64], ["p0"], torch.float32)
    lin = gemv([t], [64], fallback=fb)
    x = rows(10, 128)
    y = lin(x)
    assert y.dtype == torch.float32                                            # the fallback's, not the GEMV's
    assert torch.equal(y, fb(x))
    with pytest.raises(Exception, match="10 rows"):
        gemv([t], [64])(x)


@interpreted
def test_bad_parts_are_refused_with_their_names():
    from runtime.errors import InvalidModel
    a, b = exl2_linear(64, 128, 4, 1), exl2_linear(64, 256, 4, 2)
    with pytest.raises(InvalidModel, match="p1.*256 inputs.*128"):
        gemv([a, b], [64, 64])
    with pytest.raises(InvalidModel, match="p0.*80 output features but 64"):
        gemv([a], [80])


@interpreted
@pytest.mark.parametrize("on", [False, True])
def test_the_tuning_switch_picks_the_gemv(monkeypatch, on):
    """quant_linear.cuda_exl2 (what `build` runs on CUDA): exllamav2's GEMM alone with the switch off,
    the GEMV in front of it with the switch on; here exllamav2 is a stand-in that multiplies by the
    dequantized weight, so the CUDA-side construction runs on the CPU."""
    from runtime import tuning
    from runtime.backends import quant_linear
    from runtime.exl2 import format as exl2
    made = {}

    def make_q_matrix(w, temp_dq, max_dq_rows):
        made[len(made)] = exl2.dequantize({k: v for k, v in w.items() if k != "q_perm"}).float()
        return len(made) - 1

    def gemm_half_q_half(x, handle, y, force_cuda):
        y.copy_((x.float() @ made[handle].T).half())

    ext = types.SimpleNamespace(make_q_matrix=make_q_matrix, exllamav2_ext=types.SimpleNamespace(
        gemm_half_q_half=gemm_half_q_half))
    monkeypatch.setitem(sys.modules, "exllamav2", types.SimpleNamespace(ext=ext))
    monkeypatch.setitem(sys.modules, "exllamav2.ext", ext)
    q, k = exl2_linear(64, 128, 4, 1), exl2_linear(32, 128, 3, 2)
    with tuning.use(tuning.with_changes(dense_gemv=on)):
        lin = quant_linear.cuda_exl2([q, k], [64, 32], ["q", "k"], torch.device("cpu"))
    assert type(lin) is (quant_linear.TritonExl2Linear if on else quant_linear.CudaExl2Linear)
    for t in (1, 9, 12):
        x = rows(t, 128, seed=t)
        close(lin(x), reference([q, k], [64, 32], x))
    if on:
        assert isinstance(lin.fallback, quant_linear.CudaExl2Linear)


@interpreted
@pytest.mark.parametrize("t", [0, 10])
def test_linear_decode_refuses_row_counts_it_does_not_take(t):
    from runtime.experts.kernels import linear_decode
    from runtime.experts.pack import pack_experts
    p = pack_experts([exl2_linear(64, 128, 4, 1)], "p")
    with pytest.raises(ValueError, match=f"{t} rows"):
        linear_decode(torch.zeros(t, 128, dtype=torch.float16), [p], [64])
