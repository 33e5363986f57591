"""Load options remembered per model: `model-options.json` in `runtime.paths.config_dir()`, validated as
the settings are.

    remembered = ModelOptions.load()             # never raises for a bad file: `.warning` says what was wrong
    options = remembered.get("demo")             # LoadOptions, or None: the Settings' defaults apply
    remembered.put("demo", LoadOptions(...))     # written at once (atomically)
    remembered.forget("demo")

The file holds `{"version": 1, "models": {"<folder>": {"offload": {...}, "draft": {...}}}}`. A model is
known by its folder's absolute path, so "demo", a name in the models folder and a path to the same
folder are one model (as `runtime.paths.same_model` has it). Every entry is checked by
`runtime.options.from_dict` (unknown keys are errors); a file that is not JSON or fails the checks is
set aside as `model-options.json.bak-<time>` and nothing is remembered, with a warning in words.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from app.settings import set_aside, write_atomic
from runtime import paths
from runtime.options import LoadOptions, OptionError, check_text, from_dict, shown, to_dict

FILE_NAME = "model-options.json"
VERSION = 1
MAX_MODELS = 1000            # entries read from the file: more is not a file this app wrote
MAX_KEY_CHARS = 4096         # a folder path


def model_key(model: str) -> str:
    """The one name of a model reference ("demo", a name, a folder): its folder's absolute path."""
    return os.path.abspath(paths.resolve_model(model))


def options_path() -> Path:
    return paths.config_dir() / FILE_NAME


def parse(data: Any) -> dict[str, LoadOptions]:
    """Plain data (from JSON) to {folder: LoadOptions}; raises OptionError naming the bad entry."""
    if not isinstance(data, dict):
        raise OptionError("model options", f"expected an object, got {type(data).__name__}")
    unknown = sorted(set(data) - {"version", "models"})
    if unknown:
        raise OptionError("model options", f"unknown key(s) {', '.join(map(shown, unknown))}")
    if data.get("version", VERSION) != VERSION:
        raise OptionError("version", f"model options version {data.get('version')!r}; this app reads version {VERSION}")
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise OptionError("models", f"expected an object, got {type(models).__name__}")
    if len(models) > MAX_MODELS:
        raise OptionError("models", f"{len(models)} entries; at most {MAX_MODELS}")
    out = {}
    for key, value in models.items():
        if not key or len(key) > MAX_KEY_CHARS or not os.path.isabs(key):
            raise OptionError("models", f"{shown(key[:80])!r} is not a model folder's absolute path")
        check_text(key, "models")
        out[key] = from_dict(LoadOptions, value, f"models[{shown(key)}]")
    return out


@dataclass
class ModelOptions:
    entries: dict[str, LoadOptions] = field(default_factory=dict)
    path: Path = field(default_factory=options_path)
    warning: Optional[str] = None        # the file was damaged: what was wrong and where it went

    @classmethod
    def load(cls, path: Optional[Path] = None) -> "ModelOptions":
        path = Path(path) if path is not None else options_path()
        try:
            return cls(parse(json.loads(path.read_text(encoding="utf-8"))), path)
        except FileNotFoundError:
            return cls({}, path)
        except (OSError, UnicodeDecodeError) as e:
            problem = f"it could not be read ({e})"
        except ValueError as e:          # not JSON, or an OptionError naming the bad entry
            problem = (f"the entry {e.path} is wrong: {e.problem}" if isinstance(e, OptionError)
                       else f"it is not valid JSON ({e})")
        except (RecursionError, MemoryError) as e:
            problem = f"it is nested too deeply or too large to read ({type(e).__name__})"
        _backup, where = set_aside(path)
        return cls({}, path, f"The models' load options file {path} was damaged: {problem}. Every model loads "
                             f"with the default options from Settings. {where}")

    def get(self, model: str) -> Optional[LoadOptions]:
        return self.entries.get(model_key(model))

    def put(self, model: str, options: LoadOptions) -> None:
        self.entries[model_key(model)] = options
        self.save()

    def forget(self, model: str) -> None:
        if self.entries.pop(model_key(model), None) is not None:
            self.save()

    def save(self) -> None:
        """Raises OSError when the folder is not writable."""
        data = {"version": VERSION, "models": {k: to_dict(v) for k, v in sorted(self.entries.items())}}
        write_atomic(self.path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
