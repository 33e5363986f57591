"""Calibration data of the converter: exllamav2's standard set found without importing exllamav2, rows shared
between its sources, the shipped text as the announced fallback, the held-out text kept out."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runtime.exl2 import caldata

HELDOUT = Path(__file__).resolve().parents[1] / "bench" / "data" / "heldout_english.txt"


class _WordTokenizer:
    """One token per whitespace-separated word: enough to check how rows are cut."""

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        import torch
        return {"input_ids": torch.arange(len(text.split())).unsqueeze(0)}


def test_standard_set_is_found_without_importing_exllamav2():
    sys.modules.pop("exllamav2", None)
    folder = caldata.standard_dir()
    if folder is None:
        pytest.skip("exllamav2 is not installed here")
    assert "exllamav2" not in sys.modules                      # its import would load the CUDA extension
    texts = caldata.standard_texts(folder)
    assert set(texts) == set(caldata.STANDARD_WEIGHTS)
    assert "<doc" not in texts["wiki"][:10000] and "</doc>" not in texts["wiki"][:10000]
    heldout = HELDOUT.read_text()
    for line in [ln for ln in heldout.splitlines() if len(ln) > 80][:5]:    # the evaluation text is not in it
        assert all(line[:80] not in t for t in texts.values())


def test_default_falls_back_to_the_shipped_text_with_a_note(monkeypatch):
    monkeypatch.setattr(caldata, "standard_dir", lambda: None)
    texts, name, note = caldata.default_texts()
    assert name == "calibration.txt" and list(texts) == ["calibration"] and "--calibration" in note


def test_rows_are_shared_in_proportion_and_cut_per_source():
    share = caldata.share_rows(caldata.STANDARD_WEIGHTS, 113)
    assert sum(share.values()) == 113 and share["wiki"] == 48 and share["c4"] == 10
    small = caldata.share_rows(caldata.STANDARD_WEIGHTS, 8)
    assert sum(small.values()) == 8 and min(small.values()) == 1 and small["wiki"] == 3
    assert caldata.share_rows(["a", "b"], 1) in ({"a": 1, "b": 0}, {"a": 0, "b": 1})
    texts = {"wiki": "w " * 1000, "code": "c " * 40}        # code has too few words for its share
    ids = caldata.calibration_ids(_WordTokenizer(), texts, 10, 16, "set")
    assert ids.shape == (caldata.share_rows(texts, 10)["wiki"] + 2, 16)
    with pytest.raises(caldata.CalibrationDataError, match="set/code: calibration text has 10 tokens"):
        caldata.calibration_ids(_WordTokenizer(), {"wiki": "w " * 1000, "code": "c " * 10}, 10, 16, "set")
    assert caldata.fingerprint(texts) != caldata.fingerprint({**texts, "code": "d " * 40})
