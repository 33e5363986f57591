"""The converter's guards: no measured bit allocation on a calibration too small to measure on (unless
asked), a deliberate CPU thread count for the conversion, put back afterwards, and the device it runs on."""
from __future__ import annotations

import json

import pytest
import torch

from runtime import cpu_load
from runtime.exl2 import allocate
from runtime.exl2 import convert as cv
from runtime.options import CONVERT_CALIBRATION_ROWS, CONVERT_CALIBRATION_SEQ_LEN, CONVERT_MEASURE_MIN_TOKENS
from tests.convert_fixtures import TEXT, tiny_checkpoint


def test_the_default_calibration_measures_and_the_threshold_is_below_it():
    assert CONVERT_MEASURE_MIN_TOKENS <= CONVERT_CALIBRATION_ROWS * CONVERT_CALIBRATION_SEQ_LEN
    assert 4 * 256 < CONVERT_MEASURE_MIN_TOKENS             # the calibration that made the demo answer "Béx"
    d = allocate.choose_allocation(CONVERT_CALIBRATION_ROWS * CONVERT_CALIBRATION_SEQ_LEN)
    assert d["widths"] == "measured" and d["requested"] == "auto"


def test_allocation_below_at_and_above_the_threshold_and_when_asked():
    below = allocate.choose_allocation(1023, None, min_tokens=1024)
    assert below == {"widths": "uniform", "requested": "auto", "calibration_tokens": 1023, "min_tokens": 1024,
                     "reason": below["reason"]}
    assert "1023 calibration tokens are fewer than the 1024" in below["reason"] and "--measure" in below["reason"]
    assert allocate.choose_allocation(1024, None, min_tokens=1024)["widths"] == "measured"
    assert allocate.choose_allocation(5000, None, min_tokens=1024)["widths"] == "measured"
    forced = allocate.choose_allocation(256, True, min_tokens=1024)
    assert forced["widths"] == "measured" and forced["requested"] == "measure"
    assert "fewer than the 1024" in forced["reason"]
    off = allocate.choose_allocation(1 << 20, False, min_tokens=1024)
    assert off["widths"] == "uniform" and off["requested"] == "uniform" and off["reason"] == "uniform widths as asked"
    with pytest.raises(ValueError, match="calibration tokens 0"):
        allocate.choose_allocation(0)


def _convert(src, out, measure, rows=4, seq_len=64, **kw):
    said = []
    out = cv.convert(src, out, 4.0, calibration_text=TEXT, rows=rows, seq_len=seq_len, say=said.append,
                     measure=measure, **kw)
    return json.loads((out / "config.json").read_text())["quantization_config"], said


def test_a_small_calibration_converts_with_uniform_widths_and_says_why(tmp_path):
    src = tiny_checkpoint(tmp_path / "hf", "llama", layers=1)
    qc, said = _convert(src, tmp_path / "auto", None)
    assert not qc["measured_allocation"]
    a = qc["allocation"]
    assert (a["widths"], a["requested"], a["calibration_tokens"], a["min_tokens"]) == \
        ("uniform", "auto", 256, CONVERT_MEASURE_MIN_TOKENS)
    assert f"bit allocation: uniform (256 calibration tokens are fewer than the {CONVERT_MEASURE_MIN_TOKENS}" in said[0]
    assert 3.8 <= qc["stored_bits_per_weight"] <= 4.0           # every linear at the target, as with --no-measure
    qc, said = _convert(src, tmp_path / "forced", True)
    assert qc["measured_allocation"] and qc["allocation"]["requested"] == "measure"
    assert said[0].startswith("bit allocation: measured (measured as asked, on 256 calibration tokens")


def test_a_calibration_above_the_threshold_measures(tmp_path, monkeypatch):
    src = tiny_checkpoint(tmp_path / "hf", "llama", layers=1)
    monkeypatch.setattr(allocate, "CONVERT_MEASURE_MIN_TOKENS", 200)                  # threshold lowered
    qc, said = _convert(src, tmp_path / "q", None)
    assert qc["measured_allocation"] and qc["allocation"]["min_tokens"] == 200
    assert said[0] == "bit allocation: measured (256 calibration tokens, at least the 200 the measurement needs)"


@pytest.mark.parametrize("cores, others, requested, want", [
    (2, 0.0, 0, 2), (2, 0.2, 0, 2),          # idle, or a desktop's background: every core
    (2, 1.0, 0, 1),                          # one core busy elsewhere: the case that ran ~12x slower with 2
    (2, 3.5, 0, 1),                          # never fewer than one
    (16, 4.6, 0, 11), (8, None, 0, 8),       # unknown load: the physical cores
    (4, 3.0, 2, 2), (4, 0.0, 9, 4),          # asked: as asked, capped at the physical cores
])
def test_conversion_threads(cores, others, requested, want):
    n, why = cpu_load.conversion_threads(cores, others, requested)
    assert n == want and why.startswith(str(want))
    assert ("capped" in why) == (requested > cores)


def test_conversion_threads_refuses_a_negative_count():
    with pytest.raises(ValueError, match="threads -1"):
        cpu_load.conversion_threads(4, 0.0, -1)


def test_the_thread_count_is_logged_retuned_per_layer_and_put_back(tmp_path, monkeypatch):
    src = tiny_checkpoint(tmp_path / "hf", "llama", layers=2)
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_load, "physical_cores", lambda: 3)
    monkeypatch.setattr(cpu_load, "measure_others", lambda: 0.1)

    class Governor:                          # the load rises during layer 1: 2 CPUs busy elsewhere
        def __init__(self, cores):
            self.cores, self.others, self.readings = cores, None, [2.0, 2.0]

        def observe(self):
            self.others = self.readings.pop(0)
            n = cpu_load.choose_threads(self.cores, self.others)
            changed, self.threads = (n if n != self.threads else None), n
            return changed
    monkeypatch.setattr(cpu_load, "ThreadGovernor", Governor)
    reports = []
    _, said = _convert(src, tmp_path / "q", False, progress=reports.append)
    assert "CPU threads: 3 of 3 physical cores (other programs keep 0.1 CPUs busy)" in said
    assert said.count("CPU threads: 1 of 3 physical cores (other programs keep 2.0 CPUs busy)") == 1
    assert [r["cpu_threads"] for r in reports] == [3, 1]
    assert torch.get_num_threads() == before

    _, said = _convert(src, tmp_path / "asked", False, threads=1)
    assert "CPU threads: 1 as asked" in said and torch.get_num_threads() == before
    with pytest.raises(cv.ConvertError, match="threads must be 0 .automatic. or a positive count, got -2"):
        _convert(src, tmp_path / "bad", False, threads=-2)


def test_auto_device_takes_the_gpu_with_room_else_the_cpu_and_resumes_where_it_started(tmp_path, monkeypatch):
    """The CLI's and the model manager's default: CUDA when a GPU has room for a layer beside what else holds
    it, the CPU otherwise; an interrupted conversion resumes on the device it started on (the other rounds
    differently: its settings record the device)."""
    src = tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=2)
    out = tmp_path / "q"
    assert cv.choose_device("cpu", src, out, 1 << 30) == ("cpu", "as asked")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cv.choose_device("auto", src, out, 1 << 30) == ("cpu", "no CUDA GPU is visible")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    layer = cv.Checkpoint(src).total_bytes() * 3 // 2            # bf16 -> float32 and a half more, per layer
    need = layer + (1 << 30) + cv.AUTO_MARGIN
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (need, 80 << 30))
    device, why = cv.choose_device("auto", src, out, 1 << 30)
    assert device == "cuda" and "free" in why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (need - 1, 80 << 30))  # a model loaded beside it
    device, why = cv.choose_device("auto", src, out, 1 << 30)
    assert device == "cpu" and "a layer needs about" in why
    # resuming: the device the staging folder's settings record, whatever the GPU has free now
    staging = cv.staging_dir(out)
    staging.mkdir()
    (staging / "state.json").write_text(json.dumps({"settings": {"bits": 4.0}, "layers_done": 1}))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 << 30, 80 << 30))
    assert cv.choose_device("auto", src, out, 1 << 30)[0] == "cpu"
    (staging / "state.json").write_text(json.dumps({"settings": {"device": "cuda"}, "layers_done": 1}))
    assert cv.choose_device("auto", src, out, 1 << 30)[0] == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cv.ConvertError, match="started on cuda and resumes only there"):
        cv.choose_device("auto", src, out, 1 << 30)


def test_the_cli_converts_on_the_auto_device_and_says_which(tmp_path, monkeypatch, capsys):
    from runtime.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    src = tiny_checkpoint(tmp_path / "hf", "llama", layers=1)
    cal = tmp_path / "cal.txt"
    cal.write_text(TEXT)
    assert main(["convert", "--model", str(src), "--bpw", "4", "--out", str(tmp_path / "q"), "--calibration",
                 str(cal), "--rows", "2", "--seq-len", "64"]) == 0
    assert "device: cpu (no CUDA GPU is visible)" in capsys.readouterr().out


def test_auto_device_takes_qwen35_to_a_gpu_with_room_and_a_gpu_out_of_memory_says_what_to_do(tmp_path, monkeypatch):
    from tests.test_exl2_convert_qwen35 import tiny_qwen35
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 << 30, 80 << 30))
    device, why = cv.choose_device("auto", tiny_qwen35(tmp_path / "q35"), tmp_path / "o", 1 << 30)
    assert device == "cuda" and "80.0 GiB free" in why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1 << 20, 80 << 30))
    device, why = cv.choose_device("auto", tiny_qwen35(tmp_path / "q35b"), tmp_path / "o", 1 << 30)
    assert device == "cpu" and "a layer needs about" in why

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(cv, "_convert", oom)
    with pytest.raises(cv.ConvertError, match="ran out of memory .*Tried to allocate 2.00 GiB.*resume"):
        cv.convert(tmp_path / "hf", tmp_path / "x", 4.0, calibration_text=TEXT, device="cuda")
