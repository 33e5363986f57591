"""EXL2 format: round trips through safetensors, the error bound, the bitstream against a slow
independent decoder written from the layout description, and clear errors for bad input.

Error bound of the round-to-nearest quantizer (stated in runtime/exl2/format.py):
    |w - deq| <= step/2 + 2**-11 * |deq| + 2**-25
half a quantization step of the weight's group and column, plus the fp16 rounding of the product.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.exl2 import format as fmt
from runtime.exl2.bitpack import pack_codes, pack_scales, unpack_codes, unpack_scales


def _bound_ok(w, deq, step):
    bound = step / 2 + deq.abs() * 2.0 ** -11 + 2.0 ** -25
    return bool(((w - deq).abs() <= bound * (1 + 1e-6)).all())


def _roundtrip(tmp_path, tensors):
    path = tmp_path / "layer.safetensors"
    save_file({f"model.layers.0.mlp.up_proj.{k}": v for k, v in tensors.items()}, str(path))
    loaded = load_file(str(path))
    return {k.rsplit(".", 1)[1]: v for k, v in loaded.items()}


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_roundtrip_each_width_and_group_size(tmp_path, bits, group_size):
    g = torch.Generator().manual_seed(bits * 1000 + group_size)
    out, inp = 72, 256                          # out not a multiple of 32: exercises padding
    w = torch.randn(out, inp, generator=g) * 0.03
    w[5, :] = 0.0                               # an all-zero row and an outlier column
    w[:, 7] *= 20
    t = _roundtrip(tmp_path, fmt.quantize(w, bits, group_size))

    assert t["q_weight"].dtype == torch.int32 and t["q_weight"].shape == (inp * bits // 32, 96)
    assert t["q_scale"].dtype == torch.int32 and t["q_scale"].shape == (inp // group_size, 96 // 8)
    assert t["q_scale_max"].dtype == torch.float16 and t["q_scale_max"].shape == (inp // group_size,)
    assert t["q_groups"].dtype == torch.int16
    assert t["q_groups"].tolist() == [v for i in range(inp // group_size) for v in (bits, i * group_size * bits // 32)]
    assert t["q_invperm"].dtype == torch.int32 and t["q_invperm"].tolist() == list(range(inp))

    full = fmt.dequantize(t)
    assert full.shape == (96, inp) and full.dtype == torch.float32
    assert torch.count_nonzero(full[out:]) == 0               # padded columns hold the zero code
    deq = fmt.dequantize(t, out_features=out)
    assert torch.equal(deq, full[:out])
    assert _bound_ok(w, deq, fmt.step_sizes(t)[:out])
    assert torch.count_nonzero(deq[5]) == 0
    # the step is no coarser than the quantizer needs: the bound is tight to within one qscale step
    rel = ((w - deq).abs() / fmt.step_sizes(t)[:out]).max()
    assert 0.3 < rel <= 0.6


@pytest.mark.parametrize("bits,expect", [
    ([5, 4], (5, 4)), ([4, 3], (4, 3)), ([3, 2], (3, 2)), ([6, 5], (6, 5)), ([8, 6], (8, 6)),
    ([8, 4], (8, 4)), ([8, 6, 5], (8, 6, 5)), ([6, 3, 2], (6, 3, 2)), ([4, 3, 2], (4, 3, 2)),
    (2.5, (3, 2)), (3.0, (3,)), (4.0, (4,)), (4.5, (5, 4)), (6.5, (8, 6)), (7.0, (8, 6)),
])
def test_bit_mixes_descend_and_round_trip(tmp_path, bits, expect):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 1024, generator=g) * 0.05
    perm = torch.randperm(1024, generator=g)
    t = _roundtrip(tmp_path, fmt.quantize(w, bits, 64, perm=perm))
    widths = t["q_groups"].view(-1, 2)[:, 0].tolist()
    assert tuple(dict.fromkeys(widths)) == expect
    assert widths == sorted(widths, reverse=True)
    assert torch.equal(t["q_invperm"].long(), torch.argsort(perm))
    deq = fmt.dequantize(t)
    assert _bound_ok(w, deq, fmt.step_sizes(t))
    if isinstance(bits, float):                 # the code bits land on the target
        code_bits = t["q_weight"].shape[0] * 32 / 1024
        assert abs(code_bits - bits) <= 0.1


def test_mix_proportions_follow_exllamav2_configure():
    # 4096 rows, [5,4] at [0.1,0.9], group 128: ceil(409.6/128)=4 groups of 5 bits, then 28 of 4
    groups = fmt.plan_groups(4096, (5, 4), (0.1, 0.9), {5: 128, 4: 128})
    assert [b for b, _ in groups] == [5] * 4 + [4] * 28 and all(r == 128 for _, r in groups)
    # short last group
    assert fmt.plan_groups(96, (4,), (1.0,), {4: 64}) == [(4, 64), (4, 32)]
    # a tiny matrix can leave a width without rows: it is dropped
    assert fmt.plan_groups(64, (5, 4), (0.1, 0.9), {5: 128, 4: 128}) == [(5, 64)]


@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (576, 1536), (40, 96)])
@pytest.mark.parametrize("bpw", [2.5, 3.0, 4.0, 6.0, 8.0])
def test_stored_target_counts_every_stored_bit(shape, bpw):
    # the mix chosen for a stored bits-per-weight target stores at most that (codes, scales, group table,
    # permutation: exllamav2's -b), and one more group of the wider width would store more
    out_f, in_f = shape
    mix, props = fmt.stored_target(bpw, in_f, out_f, 32)
    q = fmt.quantize(torch.randn(shape), list(mix), 32, bits_prop=props)
    groups = fmt.plan_groups(in_f, mix, props, {b: 32 for b in mix})
    assert fmt.stored_bits(q) == fmt.planned_bits(in_f, out_f, groups)
    if fmt.stored_bits(q) > bpw * in_f * out_f:         # a tiny matrix (padding, permutation): even 2 bits
        assert mix == (2,) and out_f == 40 and bpw <= 4   # store more; the narrowest is the fallback
        return
    assert fmt.stored_bits(q) <= bpw * in_f * out_f
    wider = [(max(mix), r) if i == sum(b == max(mix) for b, _ in groups) else (b, r)
             for i, (b, r) in enumerate(groups)]
    if wider != groups:
        assert fmt.planned_bits(in_f, out_f, wider) > bpw * in_f * out_f


def test_stored_target_rejects_out_of_range():
    with pytest.raises(fmt.Exl2FormatError, match="outside"):
        fmt.stored_target(1.5, 64, 64, 32)


# ------------------------------------------------------------------------------------------
# An independent, slow decoder written from the layout description (Python ints + numpy fp16)

def _slow_dequantize(t):
    qw = t["q_weight"].numpy().view(np.uint32)
    qs = t["q_scale"].numpy().view(np.uint32)
    qsm = t["q_scale_max"].numpy()
    pairs = t["q_groups"].numpy().reshape(-1, 2)
    inv = t["q_invperm"].numpy()
    n_in, n = len(inv), qw.shape[1]
    wt = np.zeros((n_in, n), dtype=np.float16)
    row = 0
    for gi, (bits, qrow) in enumerate(pairs):
        bits, qrow = int(bits), int(qrow)
        end = int(pairs[gi + 1][1]) if gi + 1 < len(pairs) else qw.shape[0]
        rows = (end - qrow) * 32 // bits
        mx = np.float16(qsm[gi]) * np.float16(1 / 256)
        for col in range(n):
            stream = 0
            for i, word in enumerate(qw[qrow:end, col]):
                stream |= int(word) << (32 * i)
            q = ((int(qs[gi, col // 8]) >> (4 * (col % 8))) & 15) + 1
            scale = np.float16(np.float16(q * q) * mx)
            for k in range(rows):
                code = (stream >> (k * bits)) & ((1 << bits) - 1)
                wt[row + k, col] = np.float16(np.float16(code - (1 << (bits - 1))) * scale)
        row += rows
    return wt[inv].T


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8, [8, 6, 5], [6, 3, 2], [5, 4]])
def test_dequantize_matches_slow_reference_bit_for_bit(bits):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(40, 128, generator=g) * 0.02          # small: 8-bit q_scale_max/256 is fp16-subnormal
    t = fmt.quantize(w, bits, 32, perm=torch.randperm(128, generator=g))
    ours = fmt.dequantize(t, dtype=torch.float16).numpy()
    ref = _slow_dequantize(t)
    assert ours.shape == ref.shape
    assert np.array_equal(ours.view(np.uint16), ref.view(np.uint16))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_codes_is_lsb_first_bitstream_per_column(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (64, 5), generator=g)
    words = pack_codes(codes, bits)
    assert words.shape == (64 * bits // 32, 5) and words.dtype == torch.int32
    for col in range(5):
        stream = sum(int(c) << (bits * k) for k, c in enumerate(codes[:, col].tolist()))
        expect = [(stream >> (32 * i)) & 0xFFFFFFFF for i in range(64 * bits // 32)]
        assert words[:, col].numpy().view(np.uint32).tolist() == expect
    assert torch.equal(unpack_codes(words, bits), codes)


def test_scales_pack_as_nibbles_of_qscale_minus_one():
    qscale = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 16, 16, 1, 1, 1, 1, 1, 1, 9]])
    packed = pack_scales(qscale)
    assert packed.numpy().view(np.uint32).tolist() == [[0xF6543210, 0x8000000F]]
    assert torch.equal(unpack_scales(packed), qscale)


def test_hand_built_layer_dequantizes_to_the_formula():
    # one 4-bit group, 32 rows x 32 columns; code k+8 in row k -> value k * qscale**2 * max/256
    codes = (torch.arange(32) % 8 + 8).unsqueeze(1).expand(32, 32)
    qscale = torch.full((1, 32), 4)
    t = {"q_weight": pack_codes(codes, 4), "q_scale": pack_scales(qscale),
         "q_scale_max": torch.tensor([2.0], dtype=torch.float16),
         "q_groups": torch.tensor([4, 0], dtype=torch.int16), "q_invperm": torch.arange(32, dtype=torch.int32)}
    w = fmt.dequantize(t)
    expect = (torch.arange(32) % 8).float() * 16 * 2.0 / 256
    assert torch.equal(w, expect.unsqueeze(0).expand(32, 32))


def test_exact_scales_are_taken_instead_of_the_steps(tmp_path):
    """q_scale_exact (any fp16 scale per group and column): the weight is fp16(code * scale), the steps' values
    left aside; through safetensors too, and `step_sizes` gives the exact scales."""
    g = torch.Generator().manual_seed(5)
    k, n, out = 96, 64, 50
    codes = torch.randint(-8, 8, (k, n), generator=g)
    perm = torch.randperm(k, generator=g)
    exact = (torch.rand(3, n, generator=g) * 0.02 + 1e-4).half()
    t = fmt.assemble(codes, torch.randint(1, 17, (3, n), generator=g).float(), torch.tensor([0.5, 0.25, 1.0]).half(),
                     [(4, 32)] * 3, perm)
    t["q_scale_exact"] = exact
    wt = (codes.half() * exact.repeat_interleave(32, dim=0)).float()          # [K, N] packed order, fp16 products
    want = torch.empty_like(wt)
    want[perm] = wt
    assert torch.equal(fmt.dequantize(t, out_features=out), want.t()[:out])
    assert torch.equal(fmt.dequantize(_roundtrip(tmp_path, t), out_features=out), want.t()[:out])
    steps = torch.empty(k, n)
    steps[perm] = exact.float().repeat_interleave(32, dim=0)
    assert torch.equal(fmt.step_sizes(t), steps.t())
    without = {key: v for key, v in t.items() if key != "q_scale_exact"}
    assert not torch.equal(fmt.dequantize(without, out_features=out), want.t()[:out])


# ------------------------------------------------------------------------------------------
# Bad input

def _good():
    return fmt.quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), [5, 4], 32)


@pytest.mark.parametrize("mutate,match", [
    (lambda t: t.pop("q_scale"), r"layer: missing EXL2 tensors \['q_scale'\]"),
    (lambda t: t.update(q_weight=t["q_weight"].long()), r"layer\.q_weight: expected 2-D torch\.int32"),
    (lambda t: t.update(q_scale_max=t["q_scale_max"].float()), r"layer\.q_scale_max: expected 1-D torch\.float16"),
    (lambda t: t.update(q_groups=t["q_groups"][:2]), r"layer: group counts disagree"),
    (lambda t: t.update(q_groups=torch.tensor([4, 0, 5, 4], dtype=torch.int16)), r"widths must be in .* and descend"),
    (lambda t: t.update(q_groups=torch.tensor([7, 0, 4, 5], dtype=torch.int16)), r"group 0 has 7 bits"),
    (lambda t: t.update(q_invperm=torch.zeros(64, dtype=torch.int32)), r"layer\.q_invperm: not a permutation"),
    (lambda t: t.update(q_invperm=torch.arange(96, dtype=torch.int32)), r"groups cover 64 input rows but q_invperm has 96"),
    (lambda t: t.update(q_scale=t["q_scale"][:, :2]), r"layer\.q_scale: 2 words hold 16 scales"),
    (lambda t: t.update(q_weight=t["q_weight"][:-1]), r"not a whole multiple of 32 input rows"),
    (lambda t: t.update(q_scale_exact=torch.ones(2, 32)), r"layer\.q_scale_exact: expected float16 \[2, 32\]"),
    (lambda t: t.update(q_scale_exact=torch.ones(1, 32).half()), r"layer\.q_scale_exact: expected float16 \[2, 32\]"),
    (lambda t: t.update(q_scale_exact=torch.full((2, 32), float("nan")).half()),
     r"layer\.q_scale_exact: holds scales that are not finite numbers"),
    (lambda t: t.update(q_scale_exact=torch.full((2, 32), float("inf")).half()), r"not finite"),
])
def test_bad_tensors_raise_clear_value_errors(mutate, match):
    t = _good()
    mutate(t)
    with pytest.raises(ValueError, match=match):
        fmt.dequantize(t, name="layer")


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=7), r"bit mix \[7\] has no exllamav2 kernel"),
    (dict(bits=[4, 5]), r"bit mix \[4, 5\] has no exllamav2 kernel"),
    (dict(bits=[5, 4], bits_prop=[0.5, 0.6]), r"proportions .* sum 1"),
    (dict(bits=9.5), r"outside EXL2's range"),
    (dict(bits=4, group_size=48), r"multiple of 32"),
])
def test_bad_quantize_requests(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fmt.quantize(torch.randn(32, 64), name="w", **kwargs)


def test_bad_weights():
    with pytest.raises(ValueError, match=r"w: expected a 2-D weight"):
        fmt.quantize(torch.randn(64), 4, name="w")
    with pytest.raises(ValueError, match=r"in_features 48 must be a positive multiple of 32"):
        fmt.quantize(torch.randn(32, 48), 4, name="w")
    with pytest.raises(ValueError, match=r"non-finite"):
        fmt.quantize(torch.full((32, 64), float("nan")), 4, name="w")
    with pytest.raises(ValueError, match=r"floating-point"):
        fmt.quantize(torch.ones(32, 64, dtype=torch.int32), 4, name="w")
    with pytest.raises(ValueError, match=r"perm must be a permutation"):
        fmt.quantize(torch.randn(32, 64), 4, perm=torch.zeros(64, dtype=torch.long), name="w")
