"""The CUDA load's expert stacks (tensors read over the mapped files, repacked on the GPU in batches)
equal the per-expert repacking (tests/pack_per_expert.py) of the tensors exllamav2's own reader
gives (the load's reader before), bit for bit: with offload (codes in the page-locked host arena) and
without (codes in VRAM), Qwen3-MoE and DBRX shapes, batches cut small so that several run per projection."""
from __future__ import annotations

import pytest
import torch

from runtime.options import LoadOptions, OffloadOptions
from tests.gpu.conftest import synth_model
from tests.pack_per_expert import pack_experts_v1

pytestmark = pytest.mark.gpu
KEYS = ["q_weight", "q_invperm", "q_scale", "q_scale_max", "q_groups"]
CHUNKS = {"qwen3-30b-a3b": 3 * 768 * 2048, "tiny-dbrx": 5 * 128 * 256}     # batches of 3 / 5 experts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("load-repack")
    return {shape: synth_model(shape, 2, 3.0, root / f"{shape}-2l") for shape in CHUNKS}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path))


@pytest.mark.parametrize("shape", list(CHUNKS))
@pytest.mark.parametrize("budget", [None, 100.0])     # 100: offloaded (the host arena), every expert fits
def test_loaded_stacks_equal_the_per_expert_repacking(models, monkeypatch, shape, budget):
    from runtime.backends import exl2
    from runtime.experts import pack
    monkeypatch.setattr(pack, "CHUNK_ELEMENTS", CHUNKS[shape])
    opts = LoadOptions(offload=OffloadOptions(context_length=512, vram_budget_gb=budget, placement="stream"))
    eng, _ = exl2.load(models[shape], opts, lambda *a: None, warm=False)
    try:
        assert eng.moe
        for m in eng.moe:
            E = m.experts.w1.num_experts

            def tensors(linears):
                return [m.load_multi(lin.key, KEYS) for lin in linears]      # exllamav2's reader, to the GPU
            down = pack_experts_v1(tensors(m.w2), "down", device="cuda")
            I = down.in_features
            cols = [torch.cat([down.perm[e].long(), torch.arange(I, m.experts.w1.out_features, device="cuda")])
                    for e in range(E)]
            for got, linears in ((m.experts.w1, m.w1), (m.experts.w3, m.w3), (m.experts.w2, m.w2)):
                ref = down if linears is m.w2 else pack_experts_v1(tensors(linears), "gate/up", device="cuda",
                                                                   columns=cols)
                codes = torch.stack([got.codes(e).cuda() for e in range(E)])
                assert torch.equal(codes, ref.qweight), (m.key, linears[0].key)
                assert torch.equal(got.scales, ref.scales), (m.key, linears[0].key)
                if linears is not m.w2:                  # down's permutation: the identity after the load
                    assert torch.equal(got.perm, ref.perm), (m.key, linears[0].key)
            assert torch.equal(m.experts.w2.perm.cpu(), torch.arange(I, dtype=torch.int32).expand(E, I))
            assert (m.experts.w1.cold is not None) == (budget is not None)
    finally:
        eng.close()
