"""The float32 reference engine on the GPU (load(device="cuda")), which the engine-vs-reference tests
use at real widths: the same weights as on the CPU, bit for bit (EXL2 dequantized on the GPU), and the
same logits up to float32 summation order; full float32 matmuls even where the process turned TF32 on.

Models: the miniatures of Mixtral, DBRX (clip_qkv) and Qwen3 (dense, conftest's tiny_dense), and
conftest's dense_2l (Qwen3-0.6B widths, 2 layers). TOL: float32 roundoff (~1e-7 a sum) over 2 layers
and a vocabulary; TF32 (10-bit mantissa, unit roundoff 4.9e-4) gives ~1e-3 here.
"""
from __future__ import annotations

import pytest
import torch

from runtime.options import LoadOptions

pytestmark = pytest.mark.gpu
TOL = 1e-4


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def tf32_on():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("bpw", [3.0, 4.0, 6.0])
def test_dequantize_on_the_gpu_equals_the_cpu_bit_for_bit(bpw):
    from runtime.exl2 import format as fmt
    from runtime.exl2.synth import _random_linear
    parts = _random_linear(1024, 768, bpw, torch.Generator().manual_seed(int(bpw)))
    cpu = fmt.dequantize(parts, torch.float32, out_features=1000)
    gpu = fmt.dequantize(parts, torch.float32, out_features=1000, device="cuda")
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-dbrx", "tiny_dense", "dense_2l"])
def test_reference_on_the_gpu_matches_the_cpu(model, synthetic, request, tf32_on):
    import json
    from runtime import reference
    from runtime.exl2 import synth
    if model.startswith("tiny-"):
        def make(out):
            synth.write_synthetic(model, 3.0, out, seed=2)
            if model == "tiny-dbrx":                          # a clamp the random weights reach
                cfg = json.loads((out / "config.json").read_text())
                cfg["attn_config"]["clip_qkv"] = 0.25
                (out / "config.json").write_text(json.dumps(cfg, indent=2))
        path = synthetic(f"{model}-3.0bpw-s2-ref", make)
    else:
        path = request.getfixturevalue(model)
    cpu = reference.load(path, LoadOptions(), None, precision="float32")[0]
    gpu = reference.load(path, LoadOptions(), None, precision="float32", device="cuda")[0]
    try:
        assert gpu.weights.embed.device.type == "cuda" and gpu.cache.k.device.type == "cuda"
        assert torch.equal(gpu.weights.layers[0].qkv.weight.cpu(), cpu.weights.layers[0].qkv.weight)
        toks = torch.randint(0, cpu.info.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
        steps = [toks[:24], [toks[24]], toks[25:30]]
        for t in steps:
            want, got = cpu.forward(t), gpu.forward(t)
            assert got.device.type == "cpu" and got.dtype == torch.float32
            assert _rel(got, want) < TOL, (model, len(t), _rel(got, want))
        assert torch.backends.cuda.matmul.allow_tf32                  # the process's setting, restored
        gpu.truncate(24), cpu.truncate(24)
        assert _rel(gpu.forward(toks[30:33]), cpu.forward(toks[30:33])) < TOL
    finally:
        gpu.close()
        torch.cuda.empty_cache()
