"""The bundle's excluded modules (packaging/moedesk.spec's EXCLUDES) must be ones nothing imports
unconditionally: the frozen worker raises ModuleNotFoundError for each. On the H200 the GPU bundle's
first load failed this way — exllamav2's embedding called torch.nn.init, which imported torch._dynamo,
whose sympy imports sympy.plotting at its top level, excluded then."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SPEC = Path(__file__).resolve().parents[1] / "packaging" / "moedesk.spec"


def excludes() -> list[str]:
    tree = ast.parse(SPEC.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "EXCLUDES":
            return ast.literal_eval(node.value)
    raise AssertionError(f"{SPEC}: no EXCLUDES list")


# What the worker imports on its way to a first answer beyond the runtime's own modules: torch's
# compiler stack (reached through torch.nn.init and CUDA graphs), safetensors, tokenizers, jinja2.
WORKER_IMPORTS = ["torch", "torch._dynamo", "torch.nn", "safetensors.torch", "tokenizers", "jinja2.sandbox",
                  "runtime.worker", "runtime.loader"]


@pytest.mark.parametrize("module", WORKER_IMPORTS)
def test_the_worker_imports_with_the_excluded_modules_missing(module):
    blocked = [e for e in excludes() if e not in ("torch",)]
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        BLOCKED = {blocked!r}
        class Frozen(importlib.abc.MetaPathFinder):       # what a PyInstaller bundle without them does:
            def __init__(self, finders):                  # find_spec None, import ModuleNotFoundError
                self.finders = finders
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                    return None
                for f in self.finders:
                    spec = f.find_spec(name, path, target) if hasattr(f, "find_spec") else None
                    if spec is not None:
                        return spec
                return None
        sys.meta_path[:] = [Frozen(list(sys.meta_path))]
        import {module}
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=SPEC.parents[1])
    assert run.returncode == 0, f"import {module} with EXCLUDES missing: {run.stderr[-1500:]}"
