"""Secrets the app keeps (the local server's API key, remote servers' keys): one JSON file readable only by
the user (`secrets.json`, mode 0600, in `runtime.paths.config_dir()`), never in settings.json, never logged.

    set_secret("server_api_key", key)
    get_secret("server_api_key")          # None when unset
    set_secret("remote:https://host/v1", key)

A system keyring is not available everywhere (headless servers, some desktops), so the file is the
one store. Writes are atomic (`app.settings.write_atomic`: a temporary file created 0600, then a rename).
"""
from __future__ import annotations

import json
import secrets as _secrets
from pathlib import Path
from typing import Optional

from app.settings import write_atomic
from runtime import paths

FILE_NAME = "secrets.json"


def secrets_path() -> Path:
    return paths.config_dir() / FILE_NAME


def _read() -> dict:
    try:
        data = json.loads(secrets_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def get_secret(name: str) -> Optional[str]:
    value = _read().get(name)
    return value if isinstance(value, str) and value else None


def set_secret(name: str, value: Optional[str]) -> None:
    """Store `value` under `name` (None or "" removes it)."""
    data = _read()
    if value:
        data[name] = value
    else:
        data.pop(name, None)
    write_atomic(secrets_path(), json.dumps(data))     # mkstemp's file is mode 0600 from the start


def new_api_key() -> str:
    return "md-" + _secrets.token_urlsafe(24)
