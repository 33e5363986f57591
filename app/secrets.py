"""Secrets the app keeps (the local server's API key, remote servers' keys): one JSON file readable only by
the user (`secrets.json`, mode 0600, in `runtime.paths.config_dir()`), never in settings.json, never logged.

    set_secret("server_api_key", key)
    get_secret("server_api_key")          # None when unset
    set_secret("remote:https://host/v1", key)

A system keyring is not available everywhere (headless servers, some desktops), so the file is the
one store. Writes are atomic (temporary file created 0600, then `os.replace`).
"""
from __future__ import annotations

import json
import os
import secrets as _secrets
import tempfile
from pathlib import Path
from typing import Optional

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
    path = secrets_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".secrets.", suffix=".tmp", dir=path.parent)   # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def new_api_key() -> str:
    return "md-" + _secrets.token_urlsafe(24)
