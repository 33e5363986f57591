"""The CUDA load's expert stacks (tensors read over the mapped files, repacked on the GPU in batches)
equal the per-expert repacking of the same tensors (tests/pack_per_expert.py) bit for bit: with
offload (codes in the page-locked host arena) and without (codes in VRAM), Qwen3-MoE and DBRX
shapes, batches cut small so that several run per projection."""
from __future__ import annotations

import pytest
import torch

from runtime.options import LoadOptions, OffloadOptions
from tests.gpu.conftest import synth_model
from tests.pack_per_expert import pack_experts_v1

pytestmark = pytest.mark.gpu
ROLES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3", "v1"), "down": ("down_proj", "w2")}
KEYS = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path))


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "tiny-dbrx"])
@pytest.mark.parametrize("budget", [None, 100.0])    # 100: offloaded (host arena), every expert fits
def test_loaded_stacks_equal_the_per_expert_repacking(tmp_path_factory, monkeypatch, shape, budget):
    from safetensors import safe_open

    from runtime.backends import exl2
    from runtime.experts import pack
    folder = synth_model(shape, 2, 3.0, tmp_path_factory.mktemp("models") / f"{shape}-2l")
    monkeypatch.setattr(pack, "CHUNK_ELEMENTS", 3 * 768 * 2048 if shape != "tiny-dbrx" else 5 * 128 * 256)
    opts = LoadOptions(offload=OffloadOptions(context_length=512, vram_budget_gb=budget, placement="stream"))
    eng, _ = exl2.load(folder, opts, lambda *a: None, warm=False)
    try:
        files = [safe_open(str(f), "pt", device="cuda") for f in sorted(folder.glob("*.safetensors"))]
        index = {k: f for f in files for k in f.keys()}
        for m in eng.moe:
            prefix = f"{m.key}.experts" if any(k.startswith(f"{m.key}.experts.") for k in index) else None
            assert prefix is not None, m.key
            E = m.experts.w1.num_experts

            def tensors(role):
                name = next(n for n in ROLES[role] if f"{prefix}.0.{n}.q_weight" in index)
                return [{k: index[f"{prefix}.{e}.{name}.{k}"].get_tensor(f"{prefix}.{e}.{name}.{k}") for k in KEYS}
                        for e in range(E)]
            down = pack_experts_v1(tensors("down"), "down", device="cuda")
            I = down.in_features
            cols = [torch.cat([down.perm[e].long(), torch.arange(I, m.experts.w1.out_features, device="cuda")])
                    for e in range(E)]
            for got, role in ((m.experts.w1, "gate"), (m.experts.w3, "up"), (m.experts.w2, "down")):
                ref = down if role == "down" else pack_experts_v1(tensors(role), role, device="cuda", columns=cols)
                codes = torch.stack([got.codes(e) for e in range(E)]).cpu()
                assert torch.equal(codes, ref.qweight.cpu()), (m.key, role)
                assert torch.equal(got.scales.cpu(), ref.scales.cpu()), (m.key, role)
                if role != "down":
                    assert torch.equal(got.perm.cpu(), ref.perm.cpu()), (m.key, role)
            assert (m.experts.w1.cold is not None) == (budget is not None)
    finally:
        eng.close()
