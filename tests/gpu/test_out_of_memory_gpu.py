"""A load that runs out of GPU memory is an error that says what was free, and the process recovers: the
next load works. Fills the GPU's free memory, so it runs with the GPU to itself (bench/gpu_suite.sh's SOLO)."""
from __future__ import annotations

import pytest
import torch

from runtime.errors import OutOfMemory
from test_exl2_engine import _load_exl2

pytestmark = pytest.mark.gpu


def test_out_of_memory_is_an_error_and_the_process_recovers(tiny_moe):
    from runtime.errors import EngineError
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    filler = torch.empty(torch.cuda.mem_get_info()[0] - (8 << 20), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(EngineError) as ei:
            # 8 MiB left: the weights fit, a 64K-token cache (32 MiB here) does not
            _load_exl2(tiny_moe, context_length=65536)
    finally:
        del filler
    assert isinstance(ei.value, OutOfMemory) and ei.value.free_bytes is not None   # measured after the cleanup
    assert "free" in ei.value.message
    assert torch.cuda.memory_allocated() - before < 64 << 20
    # the next load works, with the filler's blocks still in torch's cache (the load hands them back
    # first: allocations outside torch's allocator could not use them)
    try:
        eng = _load_exl2(tiny_moe)
    except EngineError as e:
        pytest.fail(f"the load after the out-of-memory failed: {e.message}\ndetail: {e.detail}")
    try:
        assert eng.forward([1, 2, 3]).shape[0] == 3
    finally:
        eng.close()
