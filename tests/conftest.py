"""Shared fixtures. Tests never touch the user's real folders: MOEDESK_HOME points at a temp dir.

The demo model is imported by `make test` into the real models folder before pytest starts;
`demo_model` hands tests its path (captured before MOEDESK_HOME is redirected).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime import paths

DEMO_DIR = paths.resolve_model(paths.DEMO_ALIAS)


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


# The files that take longest under `make test` (seconds of test time with two workers on the 2-core machine, a
# clean clone's run of 2026-12-06; the bundle's with its PyInstaller build). Files are handed to the workers in
# collection order (the Makefile turns xdist's reordering by test count off), so these go first and the run
# does not end on one worker still building the bundle while the other idles. A file missing here only starts
# in its usual place.
SLOW_FILES = {
    "test_bundle.py": 215, "test_experts_kernels.py": 105, "test_serve_tools.py": 103,
    "test_qwen35_hybrid_mtp.py": 83, "test_qwen35_hybrid_graphs.py": 73, "test_exl2_convert_demo.py": 70,
    "test_e2e_demo.py": 59, "test_gui_e2e.py": 55, "test_speculative_demo.py": 54, "test_qwen35_mtp.py": 51,
    "test_convert_app.py": 47, "test_demo_import_gui.py": 42, "test_constrained.py": 37, "test_linear_gemv.py": 36,
    "test_bench_worker.py": 33, "test_qkv_prologue.py": 33, "test_serve_hostile.py": 32, "test_exl2_convert.py": 27,
}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))       # stable: a file's own order is kept
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run on the GPU test machine (make test-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MOEDESK_MODELS", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield


@pytest.fixture(scope="session")
def tiny_qwen35(tmp_path_factory) -> Path:
    """A synthetic tiny Qwen3.5-MoE at 4 bpw (seed 3), written once per session; tests only read it."""
    from runtime.exl2 import synth
    out = tmp_path_factory.mktemp("q35") / "tiny-qwen3.5"
    synth.write_synthetic("tiny-qwen3.5", 4.0, out, seed=3)
    return out


@pytest.fixture(scope="session")
def demo_model() -> Path:
    if not (DEMO_DIR / "config.json").exists():
        pytest.fail(f"demo model missing at {DEMO_DIR}: run `make test` (it imports it) or `moedesk-cli import-demo`")
    return DEMO_DIR


def pytest_configure(config):
    """Under pytest-xdist (`make test`) each worker's torch gets its share of the cores, not all of them:
    two workers' teams of two threads on two cores wait at every barrier for the other's (a small
    operation then costs many times its work). Processes the tests start choose their own threads."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and workers.isdigit() and int(workers) > 1:
        import torch

        from runtime import cpu_load
        share = max(1, (os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(share)
        # An engine loaded in this process sizes its team from the machine's cores (reference.load, the
        # conversions): it gets the worker's share too. Set before any test module imports the name: two
        # workers' in-process engines at two threads each ran 3-4x slower on two cores than alone.
        cpu_load.physical_cores = lambda: share
