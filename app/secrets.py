"""Secrets the app keeps (the local server's API key, remote servers' keys): one JSON file readable only by
the user (`secrets.json`, mode 0600, in `runtime.paths.config_dir()`), never in settings.json, never logged.

    set_secret("server_api_key", key)
    get_secret("server_api_key")          # None when unset
    set_secret("remote:https://host/v1", key)

A system keyring is not available everywhere (headless servers, some desktops), so the file is the
one store. Writes are atomic (`app.settings.write_atomic`: a temporary file created 0600, then a rename).

A damaged file (not UTF-8, not JSON, nested too deeply, too large, not an object of names and texts) never stops
the app: it is set aside as `secrets.json.damaged-<time>` (still 0600), every name and text that can be read from
it at the top level is kept in a fresh file, and `check_file()` gives the words the user is shown once. A file
that cannot be read at all (permissions) is never overwritten: `set_secret` raises `SecretsError` instead.
"""
from __future__ import annotations

import json
import os
import re
import secrets as _secrets
import time
from pathlib import Path
from typing import Optional

from app.settings import write_atomic
from runtime import paths

FILE_NAME = "secrets.json"
MAX_BYTES = 1 << 20                  # far above any set of keys
_SPACE = re.compile(r"\s*")
_UNDECODED = re.compile("[\udc80-\udcff]")     # bytes that were not UTF-8, after decoding with surrogateescape


class SecretsError(OSError):
    """The secrets file cannot be read, so it is not written either (its keys would be lost)."""


_notices: list[str] = []


def secrets_path() -> Path:
    return paths.config_dir() / FILE_NAME


def check_file() -> Optional[str]:
    """Read the file (setting it aside when damaged); what the user should be told about it since the last call,
    or None."""
    _read()
    words = " ".join(_notices)
    _notices.clear()
    return words or None


def _read(for_write: bool = False) -> dict[str, str]:
    path = secrets_path()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as e:
        if for_write:
            raise SecretsError(f"{path} cannot be read ({e.strerror or e}), so it is not rewritten: fix its "
                               f"permissions and try again") from None
        return {}
    data, problem = _parse(raw)
    if problem:
        _set_aside(path, data, problem)
    return data


def _parse(raw: bytes) -> tuple[dict[str, str], str]:
    """(every name -> text the file holds, what is wrong with it or "")."""
    if len(raw) > MAX_BYTES:
        problem = f"more than {MAX_BYTES} bytes"
    else:
        try:
            data = json.loads(raw.decode("utf-8"))
            kept = {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}
            if isinstance(data, dict) and len(kept) == len(data):
                return kept, ""
            problem = "not an object of names and texts"
        except UnicodeDecodeError as e:
            problem = f"not valid UTF-8 (at byte {e.start})"
        except RecursionError:
            problem = "nested too deeply"
        except ValueError as e:
            problem = f"not valid JSON ({e})"
    return _salvage(raw[:MAX_BYTES].decode("utf-8", "surrogateescape")), problem


def _salvage(text: str) -> dict[str, str]:
    """The `"name": "text"` pairs at the top level of a JSON object, read past whatever else is broken; a pair
    holding bytes that were not UTF-8 (decoded as lone surrogates) is left out."""
    decoder, out, depth, i = json.JSONDecoder(strict=False), {}, 0, 0
    while i < len(text):
        c = text[i]
        if c != '"':
            depth += 1 if c in "{[" else -1 if c in "}]" else 0
            i += 1
            continue
        try:
            key, i = decoder.raw_decode(text, i)
            colon = _SPACE.match(text, i).end()
            start = _SPACE.match(text, colon + 1).end()
            if depth == 1 and text.startswith(":", colon) and text.startswith('"', start):
                value, i = decoder.raw_decode(text, start)
                if not _UNDECODED.search(key + value):
                    out[key] = value
        except ValueError:                          # a string that does not end: nothing more to read
            break
    return out


def _set_aside(path: Path, kept: dict[str, str], problem: str) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup, n = path.with_name(f"{path.name}.damaged-{stamp}"), 1
    while backup.exists():
        n += 1
        backup = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    try:
        os.replace(path, backup)
        write_atomic(path, json.dumps(kept))
    except OSError as e:
        _notices.append(f"Your secrets file {path} is damaged ({problem}) and could not be set aside ({e}); "
                        f"{len(kept)} key(s) could be read from it.")
        return
    _notices.append(f"Your secrets file {path} was damaged ({problem}). It was kept as {backup.name}; "
                    f"{len(kept)} key(s) could be read from it and are in use: enter any other key again.")


def get_secret(name: str) -> Optional[str]:
    value = _read().get(name)
    return value if isinstance(value, str) and value else None


def set_secret(name: str, value: Optional[str]) -> None:
    """Store `value` under `name` (None or "" removes it); SecretsError when the file cannot be read."""
    data = _read(for_write=True)
    if value:
        data[name] = value
    else:
        data.pop(name, None)
    write_atomic(secrets_path(), json.dumps(data))     # mkstemp's file is mode 0600 from the start


def new_api_key() -> str:
    return "md-" + _secrets.token_urlsafe(24)
