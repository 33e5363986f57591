"""The CPU engine's integer projections and decode attention (runtime/reference/qlinear.py, the CPU kernel's
linear_forward and attend) against torch, on every vector path this CPU runs."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from runtime.cpu import experts as ce
from runtime.reference import qlinear
from runtime.reference.qlinear import INT8_ACTIVATIONS_TOLERANCE
from runtime.reference.weights import Linear

ISAS = ("scalar", "avx2", "avx512_vnni")
TOL = INT8_ACTIVATIONS_TOLERANCE


@pytest.fixture(scope="module")
def ext():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the CPU kernel cannot be built")
    k = ce.load_kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield k
    torch.set_num_threads(before)
    k.set_isa("auto")


def _isas(ext):
    return ISAS[:ISAS.index(ext.isa_supported()) + 1]


def _rel(y, ref):
    return float((y.double() - ref.double()).abs().max() / ref.double().abs().max())


@pytest.mark.parametrize("n, k", [(48, 256), (20, 100), (3, 33)])
def test_plain_weights_become_8_bit_codes_per_group(n, k):
    """Codes and fp16 scales that give back every weight within half a step; padded rows and columns are
    zero weights (code 128) whose inputs read feature 0."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.1
    p = qlinear.quantize_plain(w)
    kp, np_ = -(-k // 32) * 32, -(-n // 16) * 16
    assert p["qw"].shape == (np_ // 16, kp // 4, 16) and p["shape"].tolist() == [kp, n, kp // 4]
    codes = p["qw"].contiguous().view(torch.uint8).view(np_ // 16, kp // 4, 16, 4).permute(0, 2, 1, 3)
    codes = codes.reshape(np_, kp).to(torch.int64) - 128
    rows = p["grp"][:, 3].tolist()
    assert sum(rows) == kp and all(r % 32 == 0 for r in rows) and p["grp"][:, 0].eq(8).all()
    scale = torch.repeat_interleave(p["sc"].permute(1, 0, 2).reshape(len(rows), np_).float(),
                                    torch.tensor(rows), dim=0).t()                         # [N, K]
    back = codes * scale
    assert (back[:n, :k] - w).abs().le(scale[:n, :k] / 2 + 1e-6).all()
    assert codes[n:].eq(0).all() and codes[:, k:].eq(0).all() and p["perm"][k:].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projections_match_torch_for_any_rows(ext, dtype):
    """Rows 1, 5 and 70 (past the kernel's 64 a block), float32 and bfloat16 in and out, a bias."""
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(80, 96, generator=gen) * 0.1, torch.randn(80, generator=gen)
    q = qlinear.QLinear.from_float(w, b.to(dtype), ext)
    for rows in (1, 5, 70):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        for isa in _isas(ext):
            ext.set_isa(isa)
            y = q(x)
            assert y.dtype == dtype and y.shape == (rows, 80)
            assert _rel(y, x.double() @ w.double().T + b.double()) < TOL, (rows, isa)
    ext.set_isa("auto")


def test_norm_silu_and_residual_in_the_call(ext):
    """rms_norm(x) * weight before the projection, silu(gate) * up of x = [gate | up], the result added to
    the residual in place: as torch computes them."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=gen) * 0.1
    q = qlinear.QLinear.from_float(w, None, ext)
    x, nw = torch.randn(3, 128, generator=gen), torch.rand(128, generator=gen) + 0.5
    ref = F.rms_norm(x.double(), (128,), nw.double(), 1e-5) @ w.double().T
    assert _rel(q(x, norm=nw, eps=1e-5), ref) < TOL
    gu = torch.randn(3, 256, generator=gen)
    res = torch.randn(3, 64, generator=gen)
    want = res.double() + (F.silu(gu[:, :128].double()) * gu[:, 128:].double()) @ w.double().T
    out = q(gu, act="silu_mul", residual=res)
    assert out.data_ptr() == res.data_ptr() and _rel(res, want) < TOL
    with pytest.raises(RuntimeError, match="act: none or silu_mul"):
        q(x, act="gelu")
    with pytest.raises(RuntimeError, match="residual: contiguous"):
        q(x, residual=torch.zeros(3, 64, dtype=torch.bfloat16))           # not x's dtype


def _sdpa(q, k, v, start, window):
    """torch's attention of rows start.. over k, v [KVH, S, D], as the engine's model.py asks it."""
    t, nh, d = q.shape
    kvh = k.shape[0]
    end = start + t
    key, pos = torch.arange(end)[None, :], torch.arange(start, end)[:, None]
    mask = key <= pos
    if window:
        mask &= key > pos - window
    qq = q.view(t, kvh, nh // kvh, d).permute(1, 2, 0, 3).reshape(1, kvh, -1, d).float()
    o = F.scaled_dot_product_attention(qq, k[None, :, :end].float(), v[None, :, :end].float(),
                                       attn_mask=mask.repeat(nh // kvh, 1))
    return o.view(kvh, nh // kvh, t, d).permute(2, 0, 1, 3).reshape(t, nh * d)


@pytest.mark.parametrize("rows, window, d", [(1, 0, 64), (3, 0, 64), (3, 40, 64), (2, 0, 128), (2, 0, 48)])
def test_decode_attention_matches_torch(ext, rows, window, d):
    """Causal rows over 300 cached keys (two blocks of 256: their softmax merged), a sliding window, head
    sizes the AVX-512 loop takes and one it leaves to the plain loop."""
    gen = torch.Generator().manual_seed(rows + d)
    kvh, nh, S, start = 2, 6, 320, 300
    k = torch.randn(kvh, S, d, generator=gen).bfloat16()
    v = torch.randn(kvh, S, d, generator=gen).bfloat16()
    q = (torch.randn(rows, nh, d, generator=gen) * 2).bfloat16()
    ref = _sdpa(q, k, v, start, window)
    for isa in _isas(ext):
        ext.set_isa(isa)
        o = ext.attend(q, k, v, start, window)
        assert o.dtype == torch.bfloat16 and o.shape == (rows, nh * d)
        assert float((o.float() - ref).abs().max()) < 2e-2, isa         # bf16 output: 2**-8 of values ~1
    ext.set_isa("auto")
    with pytest.raises(RuntimeError, match="outside the cache"):
        ext.attend(q, k, v, S, 0)


def test_engine_linears_keep_torch_without_the_kernel(monkeypatch):
    """No C++ compiler: the int8 precision keeps torch's int8 kernel (one scale per row)."""
    monkeypatch.setattr(qlinear, "kernel", lambda: None)
    w = torch.randn(32, 64)
    lin = Linear(w, None, "int8")
    assert lin.q is None and lin.kernel == "torch" and lin.weight.dtype == torch.int8
    x = torch.randn(2, 64).bfloat16()
    assert _rel(lin(x), x.double() @ w.double().T) < TOL
    res = torch.zeros(2, 32, dtype=torch.bfloat16)
    assert _rel(lin.add_to(res, torch.cat([x, x], dim=1), silu_mul=True), (F.silu(x.double()) * x.double()) @ w.double().T) < TOL
