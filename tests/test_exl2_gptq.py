"""GPTQ quantization of one linear into EXL2's format: lower output error than rounding, valid tensors."""
from __future__ import annotations

import pytest
import torch

from runtime.exl2 import format as fmt
from runtime.exl2.gptq import DAMP_PER_INPUT, DEFAULT_DAMP, HessianAccumulator, act_order, damping, quantize_gptq


def _inputs(g, inn, tokens):
    mix = torch.randn(inn, inn, generator=torch.Generator().manual_seed(1234)) / inn ** 0.5
    return torch.randn(tokens, inn, generator=g) @ mix * torch.linspace(0.2, 3, inn)   # correlated, uneven


def _layer(inn=256, out=96, tokens=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = _inputs(g, inn, tokens)
    w = torch.randn(out, inn, generator=g) * 0.05
    acc = HessianAccumulator(inn)
    acc.add(x[:1000])
    acc.add(x[1000:].view(2, -1, inn))              # batches of any leading shape
    return x, w, acc


@pytest.mark.parametrize("bits", [2, 3, 4, 2.5])
def test_gptq_output_error_clearly_below_round_to_nearest(bits):
    x, w, acc = _layer()
    out = w.shape[0]
    gptq = quantize_gptq(w, acc.h, bits, tokens=acc.tokens)
    rtn = fmt.quantize(w, bits)
    err_gptq = (x @ (w - fmt.dequantize(gptq, out_features=out)).t()).norm()
    err_rtn = (x @ (w - fmt.dequantize(rtn, out_features=out)).t()).norm()
    assert err_gptq < 0.75 * err_rtn, (float(err_gptq), float(err_rtn))


def test_gptq_tensors_are_valid_exl2_and_round_trip():
    x, w, acc = _layer(inn=320, out=40)
    q = quantize_gptq(w, acc.h, 3.5, group_size=64)
    in_features, n, groups = fmt.read_layout(q)
    assert (in_features, n) == (320, 64)
    assert [g.bits for g in groups] == sorted((g.bits for g in groups), reverse=True)
    # act-order: the stored order is descending diag(H); the channels that see most input get most bits
    assert torch.equal(torch.argsort(q["q_invperm"].long()), act_order(acc.h))
    deq = fmt.dequantize(q)
    steps = fmt.step_sizes(q)
    codes = deq.float() / steps
    assert torch.allclose(codes, codes.round(), atol=1e-2)      # every weight is a code times its step
    assert deq[40:].abs().max() == 0                            # padded columns are zero
    rtn = fmt.quantize(w, 3.5, 64, perm=act_order(acc.h))
    assert {k: (v.dtype, v.shape) for k, v in q.items()} == {k: (v.dtype, v.shape) for k, v in rtn.items()}


def test_gptq_dead_channels_and_bad_hessian():
    x, w, acc = _layer(inn=64, out=32)
    h = acc.h.clone()
    h[5, :] = 0
    h[:, 5] = 0
    deq = fmt.dequantize(quantize_gptq(w, h, 4), out_features=32)
    assert deq[:, 5].abs().max() == 0                  # never-seen channel quantized to zero
    with pytest.raises(fmt.Exl2FormatError, match="Hessian of shape"):
        quantize_gptq(w, h[:32, :32], 4, name="layer.q_proj")
    h[0, 0] = float("nan")
    with pytest.raises(fmt.Exl2FormatError, match="non-finite"):
        quantize_gptq(w, h, 4)


@pytest.mark.parametrize("seed", [0, 1])
def test_gptq_calibrated_on_few_tokens_beats_round_to_nearest_on_unseen_inputs(seed):
    # 128 calibration tokens for 256 input channels: H is singular, and GPTQ with the plain 1% damping fits
    # the error feedback to those tokens (1.17x round-to-nearest's error on other inputs of the same kind);
    # the damping floor DAMP_PER_INPUT x in_features / tokens keeps it below round-to-nearest's.
    g = torch.Generator().manual_seed(seed)
    inn, out = 256, 96
    w = torch.randn(out, inn, generator=g) * 0.05
    acc = HessianAccumulator(inn)
    acc.add(_inputs(g, inn, 128))
    unseen = _inputs(g, inn, 4096)
    rtn = fmt.dequantize(fmt.quantize(w, 4), out_features=out)
    gptq = fmt.dequantize(quantize_gptq(w, acc.h, 4, tokens=acc.tokens), out_features=out)
    err_rtn = (unseen @ (w - rtn).t()).norm()
    err_gptq = (unseen @ (w - gptq).t()).norm()
    assert err_gptq < 0.97 * err_rtn, (float(err_gptq), float(err_rtn))


def test_damping_floor_follows_tokens_per_input_channel():
    assert damping(DEFAULT_DAMP, 576, None) == DEFAULT_DAMP                # token count unknown: as given
    assert damping(DEFAULT_DAMP, 576, 1024) == pytest.approx(DAMP_PER_INPUT * 576 / 1024)
    assert damping(DEFAULT_DAMP, 1536, 1024) == pytest.approx(DAMP_PER_INPUT * 1.5)
    assert damping(DEFAULT_DAMP, 576, 576 * 1000) == DEFAULT_DAMP          # a large calibration: as given
    assert damping(0.5, 576, 576 * 1000) == 0.5
    x, w, acc = _layer(inn=64, out=32)
    with pytest.raises(fmt.Exl2FormatError, match="0 tokens"):
        quantize_gptq(w, acc.h, 4, tokens=0, name="layer.o_proj")


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_scale_search_clips_where_that_lowers_the_error(bits):
    # heavy-tailed weights: the absmax step wastes codes on a few outliers; the searched scales may clip them
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(64, 256, generator=g) * 0.02
    w[torch.rand(w.shape, generator=g) < 0.01] *= 6
    qscale, qsm, step = fmt.search_scales(w, bits)
    assert qscale.min() >= 1 and qscale.max() <= 16 and qsm.dtype == torch.float16
    assert torch.equal(step, fmt.group_steps(qscale, qsm))
    zero = 1 << (bits - 1)

    def err(s):
        q = torch.clamp(torch.round(w / s), -zero, zero - 1)
        return float((w - q * s).pow(2).sum())
    rtn = fmt.quantize(w.t().contiguous(), bits, 64)        # rows = input channels, as search_scales' groups
    rtn_err = float((w.t() - fmt.dequantize(rtn, out_features=256)).pow(2).sum())
    assert err(step) < 0.9 * rtn_err, (err(step), rtn_err)


def test_one_inverse_per_hessian_reused_for_every_linear_that_shares_it():
    from runtime.exl2 import gptq
    x, w, acc = _layer(inn=128, out=64)
    prep = gptq.prepare(acc.h, tokens=acc.tokens)
    a = quantize_gptq(w, prep, 4)
    b = quantize_gptq(w, acc.h, 4, tokens=acc.tokens)
    assert all(torch.equal(a[k], b[k]) for k in a)             # the prepared inverse is the same computation
    with pytest.raises(fmt.Exl2FormatError, match="does not match"):
        quantize_gptq(w[:, :96], prep, 4)


def test_many_weights_in_one_loop_are_bit_for_bit_what_each_gets_alone():
    """quantize_gptq_many (a group of experts in one column loop): each weight, with its own Hessian, its own
    act order and dead channels, gets exactly the tensors quantize_gptq gives it alone, for a mix of widths;
    weights of other shapes are refused, naming the weight."""
    from runtime.exl2.gptq import prepare, quantize_gptq_many
    torch.manual_seed(3)
    weights, preps = [], []
    for e in range(3):
        x = torch.randn(400, 96) * torch.linspace(0.2, 2.0, 96)[torch.randperm(96)]
        x[:, e] = 0                                          # a dead channel, a different one each
        weights.append(torch.randn(72, 96) * 0.02)
        preps.append(prepare(2 * x.T @ x, damp=0.01, tokens=400))
    assert not torch.equal(preps[0].perm, preps[1].perm)
    many = quantize_gptq_many(weights, preps, [5, 4], 32, bits_prop=[0.3, 0.7], names=["a", "b", "c"])
    for w, p, got in zip(weights, preps, many):
        alone = quantize_gptq(w, p, [5, 4], 32, bits_prop=[0.3, 0.7])
        assert got.keys() == alone.keys() and all(torch.equal(got[k], alone[k]) for k in alone)
    with pytest.raises(fmt.Exl2FormatError, match="b: weight of shape \\[72, 64\\]"):
        quantize_gptq_many([weights[0], weights[1][:, :64]], preps[:2], 4, 32, names=["a", "b"])
