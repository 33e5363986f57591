"""The CUDA engine's contract where there is no GPU: a clear error, and exllamav2 is never imported."""
from __future__ import annotations

import sys

import pytest
import torch

from runtime.options import LoadOptions


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_load_without_cuda_says_so(tmp_path):
    from runtime.backends import exl2
    from runtime.engine import EngineError
    with pytest.raises(EngineError) as ei:
        exl2.load(tmp_path, LoadOptions(), lambda *a: None)
    assert ei.value.code == "cuda_unavailable"
    assert "CPU" in ei.value.message
    assert "exllamav2" not in sys.modules


def test_out_of_memory_recognised():
    from runtime.backends.exl2 import _is_oom
    assert _is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not _is_oom(RuntimeError("shape mismatch"))
    assert not _is_oom(ValueError("out of memory"))
