"""How the speculative decoder times a forward on the GPU, with fakes for CUDA (the real engines run
under tests/gpu): it waits for the stream that computed the logits, never for the whole device."""
from __future__ import annotations

import types

import pytest
import torch

from runtime.speculative import core


class CudaLogits:
    is_cuda = True
    device = "cuda:0"


def test_a_timed_forward_waits_for_the_logits_stream_not_for_the_offloads_side_streams(monkeypatch):
    waited = []
    stream = types.SimpleNamespace(synchronize=lambda: waited.append("stream"))

    def device_wide(*_):
        raise AssertionError("waited for every stream of the device (offload copies in flight included)")

    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream if device == "cuda:0" else None)
    engine = types.SimpleNamespace(forward=lambda tokens: CudaLogits())
    logits, seconds = core.timed_forward(engine, [1, 2])
    assert isinstance(logits, CudaLogits) and waited == ["stream"] and seconds >= 0


def test_a_timed_forward_on_the_cpu_waits_for_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: pytest.fail("asked for a CUDA stream"))
    engine = types.SimpleNamespace(forward=lambda tokens: torch.zeros(len(tokens), 3))
    logits, _ = core.timed_forward(engine, [1, 2])
    assert logits.shape == (2, 3)
