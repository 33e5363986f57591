"""The environment of a GPU test's child Python (a worker, a benchmark, a first load in a fresh process)."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH, what was there kept (on a
    machine whose packages come from a folder on PYTHONPATH the child needs them too), `extra` on top."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), **extra}
