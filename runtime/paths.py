"""Where the app keeps its files: platformdirs' user dirs, overridable with MOEDESK_HOME (tests, portable installs).

No torch here: the GUI imports it too.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import platformdirs

from runtime import tuning

APP = "moedesk"


def _home() -> Path | None:
    return tuning.home()


def data_dir() -> Path:
    h = _home()
    return (h / "data") if h else Path(platformdirs.user_data_dir(APP, appauthor=False))


def config_dir() -> Path:
    h = _home()
    return (h / "config") if h else Path(platformdirs.user_config_dir(APP, appauthor=False))


def cache_dir() -> Path:
    h = _home()
    return (h / "cache") if h else Path(platformdirs.user_cache_dir(APP, appauthor=False))


def models_dir() -> Path:
    """Downloaded and imported models, one folder each."""
    return tuning.models_folder() or data_dir() / "models"


DEMO_MODEL_NAME = "SmolLM2-135M-Instruct-exl2-8.0bpw"
DEMO_ALIAS = "demo"


def resolve_model(name_or_dir: str) -> Path:
    """A model name (folder in the models dir), the alias "demo", or a path to a folder."""
    if name_or_dir == DEMO_ALIAS:
        return models_dir() / DEMO_MODEL_NAME
    p = Path(name_or_dir).expanduser()
    if p.is_dir() or os.sep in name_or_dir or name_or_dir.startswith("."):
        return p
    return models_dir() / name_or_dir


def same_model(a: Optional[str], b: Optional[str]) -> bool:
    """Whether two model references (names, "demo", folders) name the same folder; a link is a name of its own."""
    if not a or not b:
        return False
    return os.path.abspath(resolve_model(a)) == os.path.abspath(resolve_model(b))


def display_name(model: str) -> str:
    """The one name the app shows for a model: its folder's name ('demo' is the demo model's folder)."""
    if model == DEMO_ALIAS:
        return DEMO_MODEL_NAME
    return Path(model).name or model
