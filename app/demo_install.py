"""The demo model for "Chat with the demo model": already in the models folder, copied there from the
bundle (which ships the imported EXL2 demo as `demo-model/`, so users need no converter), or imported by
the app itself (`DemoImport`: `moedesk-cli import-demo --json` in a child process, with progress) where
this installation has what that takes (`status`). Torch-free; Qt only in `DemoImport`.
"""
from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Optional

from runtime import paths


class DemoMissing(RuntimeError):
    """The demo model is not in the models folder and this installation cannot provide it."""


def demo_dir() -> Path:
    return paths.resolve_model(paths.DEMO_ALIAS)


def bundled_demo() -> Optional[Path]:
    """The demo model folder inside the bundle, or None when not frozen or the bundle has none."""
    base = getattr(sys, "_MEIPASS", None)
    if not getattr(sys, "frozen", False) or not base:
        return None
    p = Path(base) / "demo-model"
    return p if (p / "config.json").is_file() else None


def is_installed() -> bool:
    return (demo_dir() / "config.json").is_file()


def ensure_demo_model(source: Optional[Path] = None) -> Path:
    """Return the demo model's folder, copying it from the bundle first when it is missing.

    `source` overrides the bundle's copy (tests). The copy goes to a hidden folder beside the target and is
    renamed into place in one step, so an interrupted copy never leaves a half model that looks whole.
    """
    target = demo_dir()
    if (target / "config.json").is_file():
        return target
    src = source or bundled_demo()
    if src is None:
        raise DemoMissing(f"The demo model is not in {target.parent}: choose a model to download instead.")
    if not (src / "config.json").is_file():
        raise DemoMissing(f"The bundled demo model at {src} has no config.json: the installation is incomplete.")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".demo-copy-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(src, tmp)
        if target.exists():          # a broken folder (no config.json): keep it aside, never delete it
            os.replace(target, target.parent / f".{target.name}-broken-{uuid.uuid4().hex[:8]}")
        os.replace(tmp, target)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DemoMissing(f"Could not copy the demo model into {target.parent}: {e.strerror or e}") from e
    return target


def status() -> tuple[str, str]:
    """("ready", ""), ("importable", "") or ("blocked", why in words): what "Chat with the demo model" can do."""
    if is_installed() or bundled_demo() is not None:
        return "ready", ""
    from runtime.demo import blocker
    why = blocker()
    return ("blocked", why) if why else ("importable", "")


def import_command() -> list[str]:
    return [sys.executable, "-m", "runtime.cli", "import-demo", "--json"]


def start_import(parent, command: Optional[list[str]] = None):
    """The demo's import, started now in a child process (app.child_job.ChildJob): progress(done, total) per
    tensor written, step(words), done(seconds), failed(message, detail). `parent` keeps it alive."""
    from app.child_job import ChildJob
    job = ChildJob(command or import_command(), "Preparing the demo model", parent)
    job.start()
    return job
