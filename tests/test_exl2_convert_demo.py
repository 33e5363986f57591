"""The demo model (SmolLM2-135M-Instruct, Llama) converted at 4 bpw with a small calibration still answers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]     # ~2 minutes on two idle CPU cores


def test_demo_converted_at_4_bpw_answers_paris(tmp_path):
    pytest.importorskip("gguf")
    from bench.convert_quality import export_demo
    from runtime.exl2.convert import DEFAULT_CALIBRATION, convert
    hf = tmp_path / "hf"
    hf.mkdir()
    export_demo(hf)
    # with this small calibration (4 x 256 tokens of one prose text) the measured allocation fits the text and
    # the model answered "Béx" at 4 bpw; the default falls back to uniform widths there, which answer "Paris"
    out = convert(hf, tmp_path / "demo-4bpw", 4.0, calibration_text=DEFAULT_CALIBRATION.read_text(),
                  rows=4, seq_len=256, say=lambda m: None)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["method"] == "gptq" and qc["allocation"]["widths"] == "uniform"
    assert qc["allocation"]["calibration_tokens"] == 1024
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    answer = subprocess.run([sys.executable, "-m", "runtime.cli", "chat", "--model", str(out), "--temperature", "0",
                             "--max-tokens", "32", "What is the capital of France?"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert answer.returncode == 0, answer.stderr
    assert "Paris" in answer.stdout, answer.stdout
