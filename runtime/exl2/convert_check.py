"""The converter's untrusted inputs and outputs, checked where they are read, opened or written, with the loader's
own checks (runtime/modelfolder.py); every failure is a one-line ConvertError naming the file and what is wrong.

- The source folder: no entry of it links outside it (a `chat_template.jinja` or `model.safetensors` pointing at
  another file is refused, not copied into the converted model); config.json bounded in size and nesting and its
  sizes bounded as the loader bounds them (CONFIG_BOUNDS: no zero heads, no hidden_size of 10^7); every
  safetensors header parsed by hand; the index naming only shards in the folder (no path, no `../`); and every
  tensor the config implies stored with the shape it implies, so no layer is built from sizes the weights lack.
- The output: neither the output path, nor the staging folder `.NAME.partial` next to it, nor anything inside
  that folder is a link, so nothing is written through one.
- An interrupted conversion's `state.json` and the files it vouches for: each field typed and in range.
"""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from runtime import modelfolder
from runtime.errors import ModelFolderError
from runtime.options import CONVERT_ARCHITECTURES

from . import convert_dbrx

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
STATE = "state.json"


class ConvertError(RuntimeError):
    """A conversion that cannot go on; the message says what is wrong and where."""


@dataclass(frozen=True)
class Source:
    path: Path
    config: dict                      # config.json as stored (written back, adapted, into the converted model)
    sizes: dict                       # the same, flattened and bounded by the loader (modelfolder.read_config)
    arch: str
    shard_of: dict[str, Path]         # tensor name -> its safetensors file


def check_source(path: str | os.PathLike) -> Source:
    """The source folder, checked as the module's docstring says, before any tensor is read."""
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not folder.is_dir() or not (cfg_file.exists() or cfg_file.is_symlink()):
        raise ConvertError(f"{folder}: no config.json; expected a Hugging Face model folder")
    try:
        modelfolder.check_links(folder)
        config = modelfolder.read_json(cfg_file)
        if not isinstance(config, dict):
            raise ConvertError(f"{cfg_file}: expected a JSON object at the top level, got {type(config).__name__}")
        archs = config.get("architectures")
        arch = next((a for a in archs if a in CONVERT_ARCHITECTURES), None) if isinstance(archs, list) else None
        if arch is None:
            raise ConvertError(f"{cfg_file}: architecture {_short(archs)} is not supported; the converter handles "
                               f"{', '.join(CONVERT_ARCHITECTURES)}")
        quantized = config.get("quantization_config")
        if quantized:
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
            raise ConvertError(f"{cfg_file}: the checkpoint is already quantized ({str(method)[:80]}); convert the "
                               f"original fp16/bf16 weights")
        sizes = modelfolder.read_config(folder)
        shard_of, headers = _weights(folder)
        if arch == convert_dbrx.ARCH:             # stored as the Hub holds it, not as the loader reads it
            modelfolder.check_weights(folder, sizes, shard_of, headers, convert_dbrx.original_layout(sizes))
        else:
            modelfolder.check_weights(folder, sizes, shard_of, headers)
    except ModelFolderError as e:
        raise ConvertError(e.message) from None
    return Source(folder, config, sizes, arch, {name: folder / shard for name, shard in shard_of.items()})


def _weights(folder: Path) -> tuple[dict[str, str], dict[str, dict]]:
    """(tensor -> shard file name, shard file name -> header): the index's shards, or model.safetensors."""
    index = folder / INDEX
    if index.is_file():
        data = modelfolder.read_json(index, "JSON index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if isinstance(weight_map, dict):
            missing = sorted({f for f in weight_map.values() if isinstance(f, str) and Path(f).name == f
                              and f.endswith(".safetensors") and not (folder / f).exists()})
            if missing:
                raise ConvertError(f"{folder}: missing shards {', '.join(missing)} named in {INDEX}; download "
                                   f"them first")
        return modelfolder.weight_files(folder)          # shard names: plain files of the folder, headers checked
    if (folder / SINGLE).is_file():
        header = modelfolder.read_header(folder / SINGLE)
        return {name: SINGLE for name in header}, {SINGLE: header}
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in modelfolder.PICKLE_SUFFIXES)
    if pickles:
        raise ConvertError(f"{folder}: weights are pickle files ({', '.join(pickles)}), which can run code "
                           f"when loaded and are refused; use a safetensors copy of the model")
    raise ConvertError(f"{folder}: no {SINGLE} or {INDEX}")


def copy_extras(source: Path, names: tuple[str, ...], dest: Path) -> None:
    """Copy the files `names` of the source folder that exist into `dest`, each checked again as it is copied
    (a link out of the folder planted during the conversion is refused, not followed)."""
    for name in names:
        src = source / name
        try:
            modelfolder.inside(source, src)
        except ModelFolderError as e:
            raise ConvertError(e.message) from None
        if src.is_file():
            shutil.copy2(src, dest / name)


# ---------------------------------------------------------------------------------------------
# The output and its staging folder

def staging_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.partial"


def check_output(out_dir: Path) -> Path:
    """The staging folder of `out_dir` (which may not exist yet), once neither it, nor anything in it, nor
    `out_dir` is a link and `out_dir` does not exist."""
    if out_dir.is_symlink():
        raise ConvertError(f"{out_dir}: is a link (to {os.readlink(out_dir)}); the output must be a new folder, "
                           f"not a link")
    if out_dir.exists():
        raise ConvertError(f"{out_dir}: already exists; choose another output folder or remove it")
    staging = staging_dir(out_dir)
    if staging.is_symlink() or (staging.exists() and not staging.is_dir()):
        raise ConvertError(f"{staging}: the conversion's staging folder is a link or not a folder; nothing is "
                           f"written through it: remove it and run again")
    for root, dirs, files in os.walk(staging):             # links are listed, never followed
        for name in dirs + files:
            if (Path(root) / name).is_symlink():
                raise ConvertError(f"{Path(root) / name}: a link in the conversion's staging folder; nothing is "
                                   f"written through it: remove {staging} to start over")
    return staging


def make_staging(staging: Path) -> None:
    try:
        staging.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir(exist_ok=True)
    except OSError as e:
        raise ConvertError(f"{staging}: cannot create the conversion's staging folder ({e.strerror or e})") from None
    if staging.is_symlink():                                  # planted since check_output
        raise ConvertError(f"{staging}: the conversion's staging folder is a link; nothing is written through it")


# ---------------------------------------------------------------------------------------------
# The state of an interrupted conversion

def read_state(staging: Path, settings: dict, n_layers: int, hidden_size: int) -> dict | None:
    """The state an interrupted conversion left in `staging` (None when there is none), every field checked, the
    finished layers' files and the next layer's inputs there with valid headers."""
    path = staging / STATE
    if not path.exists():
        return None
    try:
        state = modelfolder.read_json(path)
    except ModelFolderError as e:
        raise ConvertError(f"{e.message}; remove {staging} to start over") from None
    if not isinstance(state, dict):
        _damaged(path, staging, f"expected a JSON object, got {type(state).__name__}")
    if state.get("settings") != settings:
        raise ConvertError(f"{staging}: an interrupted conversion with other settings is there; run it again "
                           f"with the same settings to resume, or remove that folder to start over")
    done, rows = state.get("layers_done"), state.get("rows_used")
    if type(done) is not int or not 0 <= done <= n_layers:
        _damaged(path, staging, f"'layers_done' must be a layer count of 0 to {n_layers}, got {_short(done)}")
    if type(rows) is not int or not 0 <= rows <= settings["rows"] or (done and not rows):
        _damaged(path, staging, f"'rows_used' must be a count of 1 to {settings['rows']} calibration rows, got "
                                f"{_short(rows)}")
    stats = state.get("stats")
    if not isinstance(stats, dict) or not all(isinstance(k, str) and _count(v) for k, v in stats.items()):
        _damaged(path, staging, f"'stats' must map names to counts, got {_short(stats)}")
    for key in ("experts_routed", "experts_all_token_fallback"):
        if type(stats.get(key)) is not int:
            _damaged(path, staging, f"'stats.{key}' must be a whole count, got {_short(stats.get(key))}")
    try:
        for i in range(done):
            modelfolder.read_header(staging / f"layer-{i:05d}.safetensors")
        if done:
            hidden = staging / f"hidden-{done:05d}.safetensors"
            entry = modelfolder.read_header(hidden).get("hidden")
            want = [rows, settings["seq_len"], hidden_size]
            if entry is None or entry["dtype"] != "F32" or entry["shape"] != want:
                _damaged(hidden, staging, f"expected the tensor 'hidden' of F32{want}, got "
                                          f"{_short(entry and (entry['dtype'], entry['shape']))}")
    except ModelFolderError as e:
        raise ConvertError(f"{e.message}; remove {staging} to start over") from None
    return state


def _count(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _damaged(path: Path, staging: Path, problem: str):
    raise ConvertError(f"{path}: the interrupted conversion's state is damaged: {problem}; remove {staging} to "
                       f"start over")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
