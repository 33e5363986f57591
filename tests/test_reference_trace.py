"""The reference engine's residual-stream trace (used to find where the CUDA engine parts from it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.exl2.synth import write_synthetic


def test_trace_has_every_block_and_ends_in_the_logits(tmp_path):
    from bench.check_reference import reference_trace
    path = tmp_path / "m"
    write_synthetic("tiny-moe", 4.0, path, seed=1)
    tokens = list(range(40, 52))
    trace, logits, _ = reference_trace(path, tokens)
    assert len(trace) == 2 * 2                                   # attention and MoE, 2 layers
    assert all(t.shape == (12, 256) for t in trace)
    assert not torch.equal(trace[0], trace[1])                   # the MoE block adds something
    from runtime import reference
    from runtime.options import LoadOptions
    ref = reference.load(path, LoadOptions(), lambda *a: None, precision="float32")[0]
    again = ref.forward(tokens)
    assert torch.allclose(again, logits, atol=1e-5)              # tracing changes nothing
    w, spec = ref.weights, ref.spec
    head = w.lm_head(F.rms_norm(trace[-1], (spec.hidden,), w.norm, spec.eps)).float()
    assert torch.allclose(head, logits, atol=1e-4)               # the last entry is the final stream
