"""The app's settings: one validated JSON file, `settings.json` in `runtime.paths.config_dir()`.

    result = load_settings()            # never raises for a bad file
    if result.warning:
        window.show_warning(result.warning)   # words for the user; the file was backed up
    settings = result.settings           # a frozen `Settings`
    save_settings(dataclasses.replace(settings, app=dataclasses.replace(settings.app, theme="dark")))

The file holds `{"version": 1, "app": {...}, "load": {...}, "sampling": {...}, "server": {...}}`: app-level
settings (`AppSettings`), the model options (`runtime.options.LoadOptions`: offload and draft groups), the
default sampling for new conversations (`runtime.options.SamplingOptions`) and the local OpenAI-compatible
server (`runtime.options.ServeOptions`; its API key lives in `app.secrets`, never here). Every value is validated
by `runtime.options.from_dict`; unknown keys are errors too.

A missing file means defaults (no warning). A file that is not JSON (or nested too deep to parse), that
fails validation, or that makes parsing fail in any other way, is renamed to
`settings.json.bak-<YYYYmmdd-HHMMSS>`, the defaults are used, and `LoadResult.warning` says
what was wrong and where the old file went. Writes are atomic: a temporary file in the same folder,
fsync, then `os.replace`, so a crash mid-write leaves the old file whole.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from runtime import paths
from runtime.options import LoadOptions, OptionError, SamplingOptions, ServeOptions, from_dict, opt, to_dict

SETTINGS_VERSION = 1
FILE_NAME = "settings.json"


@dataclass(frozen=True)
class AppSettings:
    last_model: Optional[str] = opt(None, "The model loaded at start-up (name or folder); empty = none.")
    theme: str = opt("system", "Colours: follow the system, or always light or dark.",
                     choices=("system", "light", "dark"))
    show_gauges: bool = opt(True, "Show the VRAM / RAM / speed gauges under the chat.")
    unload_idle_minutes: float = opt(0.0, "Unload the model after this many minutes without a request from a chat or "
                                          "the local server, freeing its memory; the next request loads it again "
                                          "(0 = never).", min=0.0, max=10080.0)
    remote_url: Optional[str] = opt(None, "The remote OpenAI-compatible server last chatted with (its key is kept "
                                          "in secrets.json).")
    remote_model: Optional[str] = opt(None, "The model chosen on that server.")


@dataclass(frozen=True)
class Settings:
    app: AppSettings = field(default_factory=AppSettings)
    load: LoadOptions = field(default_factory=LoadOptions)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    server: ServeOptions = field(default_factory=ServeOptions)


@dataclass(frozen=True)
class LoadResult:
    settings: Settings
    warning: Optional[str] = None      # in words, for the user; None when all went well
    backup: Optional[Path] = None      # where a broken file was moved


def settings_path() -> Path:
    return paths.config_dir() / FILE_NAME


def parse_settings(data: Any) -> Settings:
    """Plain data (from JSON) to `Settings`; raises `OptionError` naming the bad field."""
    if not isinstance(data, dict):
        raise OptionError("settings", f"expected an object, got {type(data).__name__}")
    data = dict(data)
    version = data.pop("version", SETTINGS_VERSION)
    if version != SETTINGS_VERSION:
        raise OptionError("version", f"settings version {version!r}; this app reads version {SETTINGS_VERSION}")
    return from_dict(Settings, data)


def settings_to_data(settings: Settings) -> dict:
    return {"version": SETTINGS_VERSION, **to_dict(settings)}


def load_settings(path: Optional[Path] = None) -> LoadResult:
    """Read and validate the settings file; a broken one is backed up and the defaults used."""
    path = Path(path) if path is not None else settings_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return LoadResult(Settings())
    except (OSError, UnicodeDecodeError) as e:
        return _recover(path, f"it could not be read ({e})")
    try:
        data = json.loads(text)
    except ValueError as e:
        return _recover(path, f"it is not valid JSON ({e})")
    except (RecursionError, MemoryError) as e:
        return _recover(path, f"it is nested too deeply or too large to read ({type(e).__name__})")
    try:
        return LoadResult(parse_settings(data))
    except OptionError as e:
        return _recover(path, f"the setting {e.path} is wrong: {e.problem}")
    except Exception as e:            # any other failure on a file we did not write: never stop the app
        return _recover(path, f"it could not be understood ({type(e).__name__}: {e})")


def save_settings(settings: Settings, path: Optional[Path] = None) -> Path:
    """Write atomically (temp file, fsync, rename). Raises OSError if the folder is not writable."""
    path = Path(path) if path is not None else settings_path()
    write_atomic(path, json.dumps(settings_to_data(settings), indent=2, ensure_ascii=False) + "\n")
    return path


def write_atomic(path: Path, text: str) -> None:
    """A temporary file in the same folder (created readable only by the user), fsync, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _recover(path: Path, problem: str) -> LoadResult:
    backup, where = set_aside(path)
    warning = f"Your settings file {path} was damaged: {problem}. Default settings are in use. {where}"
    return LoadResult(Settings(), warning, backup)


def set_aside(path: Path) -> tuple[Optional[Path], str]:
    """Rename a damaged file to `<name>.bak-<YYYYmmdd-HHMMSS>`: (the backup or None, where it went in words)."""
    backup = _backup_path(path)
    try:
        os.replace(path, backup)
        return backup, f"The old file was kept as {backup.name}."
    except OSError as e:
        return None, f"It could not be backed up ({e}) and will be overwritten on the next save."


def _backup_path(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = path.with_name(f"{path.name}.bak-{stamp}")
    n = 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.bak-{stamp}-{n}")
    return candidate


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass   # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)
