"""The import on CUDA (`import_model(..., device="cuda")`): the repacked linears byte for byte those of the CPU
(the same fp16 and integer steps), exact scales included; the experts of an import with trained scales packed on
the GPU (runtime/experts/pack.py, as the hybrid engine and exllamav2's engine with our experts load them) are the
build's weights bit for bit; and the calibrated import of a Qwen3.5-MoE build through our own forward on the GPU."""
from __future__ import annotations

import pytest
import torch

from runtime.exl2.gptq_import import import_model
from tests.convert_fixtures import TEXT, tiny_checkpoint
from tests.gptq_fixtures import gptq_folder, packed_layer_matches
from tests.test_exl2_convert import _tensors

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("opts", [dict(grid=True, desc_act=True), dict(desc_act=True), dict(method="awq", sym=False)],
                         ids=["grid-actorder", "exact-actorder", "awq-asymmetric"])
def test_cuda_repack_matches_the_cpu(tmp_path, opts):
    gptq_folder(tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=2), tmp_path / "gptq", **opts)
    cpu = import_model(tmp_path / "gptq", tmp_path / "cpu", calibrate=False, device="cpu", say=lambda m: None)
    gpu = import_model(tmp_path / "gptq", tmp_path / "gpu", calibrate=False, device="cuda", say=lambda m: None)
    a, b = _tensors(cpu), _tensors(gpu)
    experts = [k for k in a if ".experts." in k]
    assert experts and all(torch.equal(a[k], b[k]) for k in experts)
    assert any(k.endswith(".q_scale_exact") for k in experts) == (opts.get("sym", True))


def test_experts_packed_on_cuda_are_the_builds_weights(tmp_path, monkeypatch):
    """A Qwen3-MoE build with trained scales (g32, act order), imported on the CPU: packed on the GPU by
    pack_layer from the model folder's tensors (the hybrid engine's reader), and loaded by exllamav2's engine with
    our experts (its own reader of the files), every expert's weights are the build's, bit for bit."""
    from runtime.backends import exl2
    from runtime.backends.hybrid_layers import _expert_tensors
    from runtime.experts.pack import pack_layer
    from runtime.modelfolder import ModelFolder
    from runtime.options import LoadOptions, OffloadOptions
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path / "home"))
    hf = tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=2, hidden=256, head_dim=64)
    build = gptq_folder(hf, tmp_path / "gptq", group_size=32, desc_act=True)
    out = import_model(tmp_path / "gptq", tmp_path / "out", calibrate=False, say=lambda m: None)
    folder = ModelFolder(out)
    for i in range(2):
        mp = f"model.layers.{i}.mlp.experts"
        packs = pack_layer(lambda name: [_expert_tensors(folder, f"{mp}.{e}.{name}") for e in range(4)], mp,
                           device="cuda")
        assert packs[0].scales.is_cuda and packed_layer_matches(*packs, folder, mp, build, 1, 32), mp
    eng, _ = exl2.load(out, LoadOptions(offload=OffloadOptions(context_length=256)), lambda *a: None, warm=False)
    try:
        assert len(eng.moe) == 2
        for m in eng.moe:
            x, mp = m.experts, m.w2[0].key.rsplit(".", 2)[0]          # ...mlp.experts.0.down_proj -> ...mlp.experts
            assert packed_layer_matches(x.w1, x.w3, x.w2, folder, mp, build, 1, 32), mp
    finally:
        eng.close()


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
