"""The fused expert kernels equal the plain-PyTorch oracle, run on the CPU under Triton's interpreter.

Small shapes only (the interpreter is slow); the GPU tests run the same check at real sizes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [
    ["--experts", "8", "--hidden", "64", "--inter", "64", "--top-k", "4", "--bits", "4", "--rows", "1,2,5,17"],
    ["--experts", "6", "--hidden", "64", "--inter", "96", "--top-k", "2", "--bits", "5,4", "--rows", "3,40"],
    ["--experts", "5", "--hidden", "96", "--inter", "64", "--top-k", "5", "--bits", "3", "--rows", "1,13"],
])
def test_kernels_match_oracle_in_interpreter(args):
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "runtime.experts.check", "--device", "cpu", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.count(" ok") == len(args[-1].split(",")) + 1        # + the routing check
