"""The import on CUDA (`import_model(..., device="cuda")`): the repacked linears byte for byte those of the CPU
(the same fp16 and integer steps), bit-exact where the build's scales are EXL2 steps, and the calibrated import
of a Qwen3.5-MoE build through our own forward on the GPU."""
from __future__ import annotations

import pytest
import torch

from runtime.exl2.gptq_import import import_model
from tests.convert_fixtures import TEXT, tiny_checkpoint
from tests.gptq_fixtures import gptq_folder
from tests.test_exl2_convert import _tensors

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("opts", [dict(grid=True, desc_act=True), dict(method="awq", sym=False)],
                         ids=["exact-actorder", "awq-asymmetric"])
def test_cuda_repack_matches_the_cpu(tmp_path, opts):
    gptq_folder(tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=2), tmp_path / "gptq", **opts)
    cpu = import_model(tmp_path / "gptq", tmp_path / "cpu", calibrate=False, device="cpu", say=lambda m: None)
    gpu = import_model(tmp_path / "gptq", tmp_path / "gpu", calibrate=False, device="cuda", say=lambda m: None)
    a, b = _tensors(cpu), _tensors(gpu)
    experts = [k for k in a if ".experts." in k]
    assert experts and all(torch.equal(a[k], b[k]) for k in experts)


def test_calibrated_qwen35_import_on_cuda(tmp_path):
    from tests.test_exl2_convert_qwen35 import tiny_qwen35
    gptq_folder(tiny_qwen35(tmp_path / "hf", mtp=True), tmp_path / "gptq", group_size=32)
    out = import_model(tmp_path / "gptq", tmp_path / "out", calibrate=True, calibration_text=TEXT, rows=4,
                       seq_len=64, device="cuda", say=lambda m: None)
    from runtime.reference import load
    engine, _ = load(out, precision="float32")
    try:
        assert torch.isfinite(engine.forward([1, 2, 3, 4])).all()
    finally:
        engine.close()
