"""Where the app's resources (icons, desktop entry) are: beside the code in a checkout or an editable
install, or inside the bundle (PyInstaller's unpack folder) when frozen."""
from __future__ import annotations

import sys
from pathlib import Path


def resources_dir() -> Path:
    frozen = getattr(sys, "_MEIPASS", None)
    if frozen:
        return Path(frozen) / "resources"
    return Path(__file__).resolve().parents[1] / "resources"


def resource(*parts: str) -> Path:
    p = resources_dir().joinpath(*parts)
    if not p.exists():
        raise FileNotFoundError(f"resource missing: {p} (is the installation complete?)")
    return p
