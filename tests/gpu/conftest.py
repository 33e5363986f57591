"""GPU test fixtures: synthetic EXL2 models written once per session by `moedesk-cli synth`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def synth(shape: str, bpw: float, out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "synth", "--shape", shape, "--bpw", str(bpw),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(f"synth {shape} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return out


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    return synth("tiny-moe", 4.0, tmp_path_factory.mktemp("models") / "tiny-moe")


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory) -> Path:
    return synth("tiny-dense", 4.0, tmp_path_factory.mktemp("models") / "tiny-dense")
