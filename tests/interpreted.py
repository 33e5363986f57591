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


def run_child_pytest(test_file: str, passed: int, timeout: float = 600, stop_first: bool = True) -> None:
    """Runs `test_file`'s tests in a child pytest with TRITON_INTERPRET=1 (its kernel tests are skipped in the
    parent); asserts it exits 0 and that `passed` tests passed, so that none was skipped by mistake."""
    args = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"] + (["-x"] if stop_first else [])
    r = subprocess.run(args, cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert f"{passed} passed" in r.stdout, r.stdout[-2000:]                   # every kernel test ran
