"""Run a check script in a fresh Python under Triton's interpreter (TRITON_INTERPRET is read at import, so
the kernels' tests on a machine without a GPU run their code in a child process)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(code: str, says: str, timeout: float = 300) -> str:
    """Runs `code` from the repository's root with TRITON_INTERPRET=1; asserts it exits 0 and prints `says`;
    returns its output."""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert says in r.stdout, r.stdout
    return r.stdout
