"""Local models: the table of folders in the models folder, last-used times, import, delete, draft pairing.

Every folder is validated by `runtime.modelfolder.validate` (torch-free); a folder that fails is still listed,
with the reason, so the user can delete it, but it is never offered for loading. Hidden folders (`.staging`,
downloads in progress) are never listed.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from app.hub.errors import LocalModelError
from app.hub.staging import SOURCE
from app.telemetry import fmt_bytes
from runtime import paths
from runtime.modelfolder import FolderInfo, ModelFolderError, config_int, inside, read_json, validate
from runtime.errors import InvalidModel

LAST_USED_FILE = "models-last-used.json"



@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    architecture: str = ""
    num_params: int = 0
    bits_per_weight: float = 0.0
    size_bytes: int = 0
    vocab_size: int = 0
    is_exl2: bool = False
    last_used: float | None = None      # seconds since the epoch
    source: str = ""                    # "owner/repo @ branch" for downloads
    error: str = ""                     # non-empty: not loadable, and why

    @property
    def loadable(self) -> bool:
        return not self.error


def _models_dir(models_dir: Path | None) -> Path:
    return Path(models_dir) if models_dir else paths.models_dir()


# -- last used: a small JSON in the data dir, {folder name: time}

def _last_used_path() -> Path:
    return paths.data_dir() / LAST_USED_FILE


def last_used_map() -> dict[str, float]:
    try:
        data = json.loads(_last_used_path().read_text())
        return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}                       # missing or damaged: start afresh rather than fail the table


def _write_last_used(data: dict[str, float]) -> None:
    path = _last_used_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def mark_used(folder: Path, when: float | None = None) -> None:
    data = last_used_map()
    data[Path(folder).name] = time.time() if when is None else when
    _write_last_used(data)


# -- the table

def describe(folder: Path, last_used: dict[str, float] | None = None) -> LocalModel:
    folder = Path(folder)
    used = (last_used if last_used is not None else last_used_map()).get(folder.name)
    source = ""
    try:
        src = json.loads((folder / SOURCE).read_text())
        source = f"{src['repo_id']} @ {src['branch']}"
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    try:
        info: FolderInfo = validate(folder)
    except Exception as exc:       # whatever is wrong with one folder, the table (and its Delete button) stays
        reason = str(exc) if isinstance(exc, ModelFolderError) else f"{folder}: cannot be checked: {exc!r}"
        return LocalModel(folder.name, folder, size_bytes=_size(folder), last_used=used, source=source, error=reason)
    return LocalModel(folder.name, folder, info.architecture, info.num_params, info.bits_per_weight,
                      info.size_bytes, info.vocab_size, info.is_exl2, used, source)


def _size(folder: Path) -> int:
    """Bytes of the folder's own files (links not followed)."""
    try:
        return sum(p.lstat().st_size for p in folder.rglob("*") if not p.is_symlink() and p.is_file())
    except OSError:
        return 0


def _links_out(src: Path) -> list[str]:
    """Links under `src` that lead outside it, or to a folder (which a copy would follow)."""
    root, bad = src.resolve(), []
    for dirpath, dirnames, filenames in os.walk(src):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(root):
                    bad.append(f"{path.relative_to(src)} -> {target} (outside the folder)")
                elif target.is_dir():
                    bad.append(f"{path.relative_to(src)} -> {target} (a link to a folder)")
    return bad


def list_local_models(models_dir: Path | None = None) -> list[LocalModel]:
    """Every model folder, most recently used first; broken ones included with `error` set."""
    root = _models_dir(models_dir)
    if not root.is_dir():
        return []
    used = last_used_map()
    models = [describe(p, used) for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(models, key=lambda m: (-(m.last_used or 0.0), m.name.lower()))


def delete_model(folder: Path, models_dir: Path | None = None) -> None:
    """Delete a model folder; only folders directly inside the models folder (the caller confirms first)."""
    root, folder = _models_dir(models_dir).resolve(), Path(folder)
    if folder.is_symlink() or folder.resolve().parent != root or folder.name.startswith("."):
        raise LocalModelError(f"{folder} is not a model folder inside {root}: refusing to delete it")
    shutil.rmtree(folder)
    data = last_used_map()
    if data.pop(folder.name, None) is not None:
        _write_last_used(data)


def import_folder(src: Path, move: bool = False, models_dir: Path | None = None) -> LocalModel:
    """Validate `src`, then copy (or move) it into the models folder; it appears there only when complete."""
    src, root = Path(src).expanduser(), _models_dir(models_dir)
    try:
        info = validate(src)
    except ModelFolderError as exc:
        raise LocalModelError(f"Cannot import {src}: {exc.problem} ({exc.file})") from exc
    links = _links_out(src)
    if links:      # a copy would bring in what they point at
        raise LocalModelError(f"Cannot import {src}: it holds links that a copy would follow: {'; '.join(links[:3])}"
                              + (f" and {len(links) - 3} more" if len(links) > 3 else ""))
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in src.resolve().name).lstrip("._-") or "model"
    dest = root / name
    if dest.exists():
        raise LocalModelError(f"Cannot import {src}: a model named {name} already exists in {root}")
    if src.resolve() == dest.resolve() or root.resolve().is_relative_to(src.resolve()):
        raise LocalModelError(f"Cannot import {src}: it is the models folder or contains it")
    root.mkdir(parents=True, exist_ok=True)
    staging = root / ".staging" / f"import-{name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        if move:
            shutil.move(str(src), str(staging))
        else:
            free = shutil.disk_usage(root).free
            if free < info.size_bytes:
                raise LocalModelError(f"Cannot import {src}: it needs {fmt_bytes(info.size_bytes)} and "
                                      f"{root} has {fmt_bytes(free)} free")
            shutil.copytree(src, staging)
        staging.rename(dest)
    except OSError as exc:
        if not move:
            shutil.rmtree(staging, ignore_errors=True)
        raise LocalModelError(f"Cannot import {src}: {exc.strerror or exc}") from exc
    return describe(dest)


# -- draft models: same vocabulary as the loaded target

@functools.lru_cache(maxsize=64)
def _fingerprint(path: str, mtime: float, size: int) -> str:
    data = read_json(Path(path))
    if not isinstance(data, dict):
        raise InvalidModel(path, "not a tokenizer (expected a JSON object)")
    model = data.get("model") or {}
    vocab = model.get("vocab")
    vocab = sorted(vocab.items()) if isinstance(vocab, dict) else vocab
    added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
    blob = json.dumps([model.get("type"), vocab, model.get("merges"), added], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def tokenizer_fingerprint(folder: Path) -> str:
    """sha256 over tokenizer.json's vocabulary, merges and added tokens (what decides token ids)."""
    path = inside(Path(folder), Path(folder) / "tokenizer.json")
    st = path.stat()
    return _fingerprint(str(path), st.st_mtime, st.st_size)


def _vocab_size(folder: Path) -> int:
    config = read_json(inside(folder, folder / "config.json"))
    return config_int(config, "vocab_size", folder / "config.json") if isinstance(config, dict) else 0


def draft_compatibility(target: Path, draft: Path) -> tuple[bool, str]:
    """Can `draft` speculate for `target`? Only with the same vocabulary: same vocab size, same tokenizer."""
    target, draft = Path(target), Path(draft)
    if target.resolve() == draft.resolve():
        return False, "it is the loaded model itself"
    try:
        t_vocab, d_vocab = _vocab_size(target), _vocab_size(draft)
    except ModelFolderError as exc:
        return False, f"config.json cannot be used ({exc.problem})"
    if t_vocab != d_vocab:
        return False, f"vocabulary of {d_vocab} tokens, the loaded model has {t_vocab}"
    try:
        same = tokenizer_fingerprint(target) == tokenizer_fingerprint(draft)
    except FileNotFoundError as exc:
        return False, f"no tokenizer.json in {Path(exc.filename).parent.name}"
    except ModelFolderError as exc:
        return False, f"{Path(exc.file).name} cannot be used ({exc.problem})"
    except OSError as exc:
        return False, f"tokenizer.json cannot be read ({exc.__class__.__name__})"
    if not same:
        return False, "same vocabulary size but different tokens or merges (another tokenizer)"
    return True, f"same tokenizer ({t_vocab} tokens)"


def draft_candidates(target: Path, models: list[LocalModel] | None = None) -> list[tuple[LocalModel, bool, str]]:
    """Every loadable local model with (compatible, reason); the settings panel offers the compatible ones."""
    models = list_local_models() if models is None else models
    return [(m, *draft_compatibility(target, m.path)) for m in models if m.loadable]
