"""What the GPU tests share for their figures: the relative error they compare, and the report they append
to (MOEDESK_GPU_REPORT=FILE: every measured figure as a JSON line)."""
from __future__ import annotations

import json
import os


def record(**kw) -> None:
    path = os.environ.get("MOEDESK_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(kw) + "\n")


def rel(a, b) -> float:
    """Relative error of `a` against `b` (norm of the difference / norm of `b`), in float32 on the CPU."""
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm()).item()
