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


def spec_list(name: str) -> list[str]:
    tree = ast.parse(SPEC.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{SPEC}: no {name} list")


def test_packages_finding_plugins_by_entry_points_ship_their_metadata():
    """A package that reads its own plugin group from importlib.metadata (Triton's `triton.backends`)
    finds nothing in a bundle without its dist-info: the GPU bundle's first Triton launch failed with
    "0 active drivers" on the H200. Every such package installed here is in ENTRY_POINT_PACKAGES, whose
    metadata the spec copies; Triton always is (the CUDA worker's kernels)."""
    from importlib import metadata
    listed = spec_list("ENTRY_POINT_PACKAGES")
    assert "triton" in listed
    wanted = set()
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("-", "_")
        if name in ("pytest", "pyinstaller", "setuptools"):      # build and test tools, not in the bundle
            continue
        if any(ep.group.startswith(f"{name}.") for ep in dist.entry_points):
            wanted.add(name)
    worker_side = {p for p in wanted if p in ("triton", "torch", "exllamav2", "safetensors", "tokenizers", "jinja2")}
    assert worker_side <= set(listed), f"add to ENTRY_POINT_PACKAGES in {SPEC.name}: {sorted(worker_side - set(listed))}"
