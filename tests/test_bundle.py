"""The Linux bundle, built and run as a user would: `dist/moedesk/moedesk` starts offscreen, spawns
`moedesk-worker` from the same folder, copies the bundled demo model into a fresh models folder, loads it
and answers one question through the real chat path (`--smoke-test`, app/smoke.py).

The bundle is (re)built by packaging/build-linux.sh when it is missing or older than any source file, so
a stale bundle is never tested. Building takes a few minutes on two cores.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import paths

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "dist" / "moedesk"
APP = BUNDLE / "moedesk"
WORKER = BUNDLE / "moedesk-worker"
SOURCE_DIRS = ("app", "runtime", "packaging", "resources")
BUILD_TIMEOUT_S = 1800
RUN_TIMEOUT_S = 900

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S + RUN_TIMEOUT_S),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux bundle")]


def newest_source() -> tuple[float, Path]:
    files = [ROOT / "pyproject.toml"]
    for d in SOURCE_DIRS:
        files += [p for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return max((p.stat().st_mtime, p) for p in files)


def bundle_env(home: Path) -> dict:
    """A user's environment: nothing from this checkout or its Python leaks into the bundle."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "MOEDESK_", "VIRTUAL_ENV", "QT_"))}
    env.update(MOEDESK_HOME=str(home), QT_QPA_PLATFORM="offscreen", HF_HUB_OFFLINE="1",
               XDG_DATA_HOME=str(home / "xdg-data"))
    return env


@pytest.fixture(scope="session")
def bundle(demo_model) -> Path:
    stamp, newest = newest_source()
    if APP.exists() and APP.stat().st_mtime >= stamp:
        return BUNDLE
    env = dict(os.environ, PYTHON=sys.executable, MOEDESK_BUNDLE_DEMO=str(demo_model))
    try:
        r = subprocess.run(["bash", str(ROOT / "packaging" / "build-linux.sh"), "--no-tarball"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"building the bundle took more than {BUILD_TIMEOUT_S} s:\n{(e.stderr or '')[-4000:]}")
    if r.returncode != 0 or not APP.exists():
        pytest.fail(f"packaging/build-linux.sh failed (exit {r.returncode}; rebuilt because {newest} changed):\n"
                    f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return BUNDLE


def test_bundled_app_spawns_its_worker_loads_the_demo_and_answers(bundle, tmp_path):
    home = tmp_path / "user"
    r = subprocess.run([str(APP), "--smoke-test", "What is the capital of France?"], env=bundle_env(home),
                       cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    out = r.stdout + "\n--- stderr ---\n" + r.stderr[-6000:]
    assert r.returncode == 0, out
    assert "Paris" in r.stdout, out
    # The worker is the bundle's own executable, not a Python from this machine.
    assert f"runs {WORKER.resolve()}" in r.stdout, out
    # The demo model came out of the bundle into the user's (empty) models folder.
    copied = home / "data" / "models" / paths.DEMO_MODEL_NAME
    assert (copied / "config.json").is_file(), out


def test_smoke_test_fails_loudly_when_the_worker_cannot_run(bundle, tmp_path):
    """The smoke test must be able to fail: a bundle whose worker is broken exits non-zero with the reason."""
    scratch = ROOT / "build" / "broken-bundle"                 # same file system: hard links, no copy
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    broken = scratch / "moedesk"
    subprocess.run(["cp", "-al", str(bundle), str(broken)], check=True)
    (broken / "moedesk-worker").unlink()
    (broken / "moedesk-worker").write_text("#!/bin/sh\necho 'worker exploded' >&2\nexit 7\n")
    (broken / "moedesk-worker").chmod(0o755)
    r = subprocess.run([str(broken / "moedesk"), "--smoke-test", "Hi"], env=bundle_env(tmp_path / "user"),
                       cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "worker exploded" in r.stderr, r.stdout + r.stderr
    shutil.rmtree(scratch, ignore_errors=True)


def test_gui_program_carries_no_torch(bundle):
    """The GUI executable's module archive has no torch (only the worker's does)."""
    from PyInstaller.archive.readers import CArchiveReader

    def modules(exe: Path) -> set[str]:
        pkg = CArchiveReader(str(exe))
        pyz = next(name for name in pkg.toc if name.endswith("PYZ.pyz") or name.startswith("PYZ"))
        return set(pkg.open_embedded_archive(pyz).toc)

    gui, worker = modules(APP), modules(WORKER)
    assert "app.main" in gui and "runtime.protocol" in gui
    assert not {m for m in gui if m == "torch" or m.startswith("torch.")}, "the GUI program bundles torch"
    assert "torch" in worker and "runtime.reference" in worker and "tokenizers" in worker
    assert "jinja2.sandbox" in worker and "safetensors.torch" in worker
    assert not {m for m in gui | worker if m.split(".")[0] in ("transformers", "triton", "gguf", "numba", "cupy", "sphinx")}


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None,
                    reason="desktop-file-validate not installed (Debian: desktop-file-utils)")
def test_bundled_app_installs_a_valid_desktop_entry(bundle, tmp_path):
    env = bundle_env(tmp_path)
    r = subprocess.run([str(APP), "--install-desktop-entry"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    entry = Path(r.stdout.strip().splitlines()[-1])
    assert entry == tmp_path / "xdg-data" / "applications" / "moedesk.desktop"
    assert f"Exec={APP.resolve()} %U" in entry.read_text()
    v = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True, text=True)
    assert v.returncode == 0 and not v.stdout.strip(), v.stdout + v.stderr


def test_build_stops_at_once_where_the_gui_stack_does_not_import(tmp_path):
    """A build environment whose PySide6 cannot import (say, shiboken6 missing) would give a bundle that
    cannot start, found only after minutes of analysis: the build script refuses before PyInstaller runs."""
    pytest.importorskip("PyInstaller")
    broken = tmp_path / "site" / "PySide6"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError(\"No module named 'shiboken6'\")\n")
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=f"{broken.parent}{os.pathsep}{ROOT}")
    r = subprocess.run(["bash", str(ROOT / "packaging" / "build-linux.sh"), "--no-tarball"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert "the GUI stack does not import here" in r.stderr and "shiboken6" in r.stderr, r.stderr
