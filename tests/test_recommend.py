"""Recommended models for this machine: the shipped list, ranked by the fit estimate; no network."""
from __future__ import annotations

import json

import pytest

from app.hub.fit import GB, ModelShape, exl2_size_bytes
from app.hub.recommend import load_candidates, recommend
from app.models_dialog import ModelManagerDialog

GiB = 1024 ** 3


def test_the_shipped_list_is_well_formed_and_sizes_are_plausible():
    cands = load_candidates()
    assert len({c.repo for c in cands}) >= 5
    moe = next(c for c in cands if c.shape.experts)
    assert moe.shape.total_params() == pytest.approx(30.5e9, rel=0.02)      # Qwen3-30B-A3B's published size
    assert moe.size_bytes == pytest.approx(30.5e9 * 4.0 / 8, rel=0.1)


def test_a_24_gb_gpu_gets_the_moe_in_vram_first_and_an_8_gb_one_gets_it_offloaded():
    big = recommend(24 * GiB, 64 * GiB)
    assert big[0].candidate.name.startswith("Qwen3-30B-A3B") and big[0].verdict == "fits in VRAM"
    assert len(big) == 5 and len({r.candidate.repo for r in big}) == 5
    small = recommend(8 * GiB, 32 * GiB)
    assert small[0].candidate.name.startswith("Qwen3-30B-A3B") and "offload" in small[0].verdict
    assert all("14B" not in r.candidate.name for r in small)                 # dense and too big for 8 GB
    params = [r.candidate.shape.total_params() for r in small]
    assert params == sorted(params, reverse=True)


def test_without_a_gpu_only_small_models_smallest_first():
    recs = recommend(0, 16 * GiB)
    assert recs and all(r.candidate.shape.total_params() <= 4e9 and "CPU engine" in r.verdict for r in recs)
    assert recs[0].candidate.name == "Llama 3.2 1B Instruct"
    assert recommend(0, 2 * GiB) == []


def test_a_damaged_list_names_the_entry(tmp_path):
    bad = tmp_path / "list.json"
    bad.write_text(json.dumps({"models": [{"repo": "a/b", "name": "x", "shape": {"hidden_size": 8},
                                           "branches": []}]}))
    with pytest.raises(ValueError, match=r"models\[0\].*num_attention_heads"):
        load_candidates(bad)


def test_size_formula_matches_a_hand_count():
    shape = ModelShape(layers=1, hidden=4, heads=1, kv_heads=1, head_dim=4, vocab=10, intermediate=8)
    # attention 64 + MLP 96 at 4 bits; head 40 at 6 bits; embeddings 40 + norms 12 (2 per layer + final) in FP16
    assert exl2_size_bytes(shape, 4.0, 6.0) == int(160 * 0.5 + 40 * 0.75 + 52 * 2)


def test_the_hub_tab_opens_with_recommendations(qtbot, tmp_path):
    d = ModelManagerDialog(models_dir=tmp_path / "models")
    qtbot.addWidget(d)
    d.set_memory(24 * GiB, 64 * GiB, "Test GPU")
    items = [d.repo_list.item(i) for i in range(d.repo_list.count())]
    assert len(items) == 5 and items[0].text().startswith("★ Qwen3-30B-A3B")
    assert items[0].data(0x0100) == "TheMelonGod/Qwen3-30B-A3B-exl2"           # Qt.UserRole
    assert "Recommended for this machine" in d.hub_status.text()
    d.set_memory(0, 1 * GiB, "no GPU")
    assert d.repo_list.count() == 0 and "search the Hub" in d.hub_status.text()
    d.shutdown()
