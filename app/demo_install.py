"""The demo model for "Chat with the demo model": already in the models folder, or copied there from the
bundle (which ships the imported EXL2 demo as `demo-model/`, so users need no converter).

From a checkout or a pip install the demo comes from `moedesk-cli import-demo` (needs the `demo` extra);
this module only says so. Torch-free, Qt-free.
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
        raise DemoMissing(f"The demo model is not in {target.parent}. Import it with `moedesk-cli import-demo` "
                          "(needs: pip install 'moedesk[demo]').")
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
