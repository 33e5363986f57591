"""moedesk-cli requantize: an EXL2 model's experts quantized again at a lower width from its own weights and
activations; every other tensor copied as stored; the cold experts alone where asked; bad requests refused."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.exl2 import convert as cv
from runtime.exl2 import format as fmt
from runtime.exl2 import requantize as rq
from tests.convert_fixtures import TEXT, tiny_checkpoint
from tests.test_exl2_convert import _logits, _tensors

KW = dict(calibration_text=TEXT, rows=4, seq_len=64, say=lambda m: None, measure=False)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Qwen3-MoE (2 layers, 4 experts) converted at 4 bits per weight, and its bf16 folder."""
    tmp = tmp_path_factory.mktemp("rq")
    hf = tiny_checkpoint(tmp / "hf", "qwen3_moe")
    return cv.convert(hf, tmp / "q4", 4.0, **KW), hf


def _linears(tensors: dict) -> set[str]:
    return {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".q_weight")}


def _bits(tensors: dict, prefix: str) -> float:
    q = {p: tensors[f"{prefix}.{p}"] for p in fmt.REQUIRED_KEYS}
    return fmt.stored_bits(q) / (q["q_invperm"].shape[0] * q["q_weight"].shape[1])


def test_all_experts_requantized_everything_else_copied(source, tmp_path):
    q4, _ = source
    out = rq.requantize(q4, tmp_path / "q3", 3.0, **KW)
    a, b = _tensors(q4), _tensors(out)
    assert a.keys() == b.keys()
    changed = {k.rsplit(".", 1)[0] for k in a if not torch.equal(a[k], b[k])}
    experts = {p for p in _linears(a) if ".experts." in p}
    assert changed == experts and len(experts) == 2 * 4 * 3          # 2 layers x 4 experts x gate/up/down
    assert all(_bits(b, p) < _bits(a, p) for p in experts)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["linears_copied"] == 2 * 4 and qc["experts_routed"] + qc["experts_all_token_fallback"] == 8
    ids = torch.tensor([[5, 17, 42, 7, 99, 3, 250, 64, 12, 8]])
    la, lb = _logits(q4, ids), _logits(out, ids)
    assert torch.isfinite(lb).all()
    assert (la - lb).abs().mean() < 0.2 * la.abs().mean()            # the same model, a little coarser


def test_cold_experts_are_the_least_routed_share(source, tmp_path, monkeypatch):
    q4, _ = source
    seen = []
    real = rq.Exl2Source.requantized
    monkeypatch.setattr(rq.Exl2Source, "requantized",
                        lambda self, key, counts: seen.append(counts.clone()) or real(self, key, counts))
    out = rq.requantize(q4, tmp_path / "cold", 3.0, experts="cold", cold_share=0.5, **KW)
    a, b = _tensors(q4), _tensors(out)
    changed = {k.rsplit(".", 1)[0] for k in a if not torch.equal(a[k], b[k])}
    assert len(seen) == 2
    for layer, counts in enumerate(seen):
        cold = sorted(range(4), key=lambda e: (int(counts[e]), e))[:2]
        want = {f"model.layers.{layer}.mlp.experts.{e}.{p}" for e in cold for p in ("gate_proj", "up_proj", "down_proj")}
        assert {c for c in changed if c.startswith(f"model.layers.{layer}.")} == want, (counts, changed)


def test_dense_mlps_requantized_on_request(tmp_path):
    hf = tiny_checkpoint(tmp_path / "hf", "llama")
    q4 = cv.convert(hf, tmp_path / "q4", 4.0, **KW)
    out = rq.requantize(q4, tmp_path / "q3", 3.0, linears="mlp", **KW)
    a, b = _tensors(q4), _tensors(out)
    changed = {k.rsplit(".", 1)[0] for k in a if not torch.equal(a[k], b[k])}
    assert changed == {p for p in _linears(a) if ".mlp." in p} and len(changed) == 2 * 3


def test_bad_requests_are_refused_in_one_line(source, tmp_path, capsys):
    q4, hf = source
    with pytest.raises(cv.ConvertError, match="not an EXL2 model"):
        rq.requantize(hf, tmp_path / "x", 3.0, **KW)
    with pytest.raises(cv.ConvertError, match="--cold-share in \\(0, 1\\]"):
        rq.requantize(q4, tmp_path / "x", 3.0, experts="cold", cold_share=0.0, **KW)
    from runtime.cli import main
    assert main(["requantize", "--model", str(tmp_path / "missing"), "--bpw", "3", "--out", str(tmp_path / "y")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moedesk-cli requantize: ") and "missing" in err[0]
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_qwen35_with_its_mtp_head(tmp_path):
    """Qwen3.5-MoE (DeltaNet and attention layers through our own forward, the MTP head last): every routed
    expert of the 4 layers and of the MTP head requantized, nothing else touched."""
    from tests.test_exl2_convert_qwen35 import tiny_qwen35
    hf = tiny_qwen35(tmp_path / "hf", scale=0.5, mtp=True)
    q4 = cv.convert(hf, tmp_path / "q4", 4.0, **KW)
    out = rq.requantize(q4, tmp_path / "q3", 3.0, **KW)
    a, b = _tensors(q4), _tensors(out)
    assert a.keys() == b.keys()
    changed = {k.rsplit(".", 1)[0] for k in a if not torch.equal(a[k], b[k])}
    assert changed == {p for p in _linears(a) if ".mlp.experts." in p} and len(changed) == (4 + 1) * 6 * 3
