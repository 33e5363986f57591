"""GPTQ quantization of one linear into EXL2's format: lower output error than rounding, valid tensors."""
from __future__ import annotations

import pytest
import torch

from runtime.exl2 import format as fmt
from runtime.exl2.gptq import HessianAccumulator, act_order, quantize_gptq


def _layer(inn=256, out=96, tokens=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(inn, inn, generator=g) / inn ** 0.5
    x = torch.randn(tokens, inn, generator=g) @ mix * torch.linspace(0.2, 3, inn)   # correlated, uneven
    w = torch.randn(out, inn, generator=g) * 0.05
    acc = HessianAccumulator(inn)
    acc.add(x[:1000])
    acc.add(x[1000:].view(2, -1, inn))              # batches of any leading shape
    return x, w, acc


@pytest.mark.parametrize("bits", [2, 3, 4, 2.5])
def test_gptq_output_error_clearly_below_round_to_nearest(bits):
    x, w, acc = _layer()
    out = w.shape[0]
    gptq = quantize_gptq(w, acc.h, bits)
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
