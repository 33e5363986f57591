"""Open a model: resolve its name, validate its folder, pick the backend, load it.

    open_engine(model, options, progress) -> (Engine, applied)

`applied` maps option paths to "applied" or "ignored: why" (from the backend), plus the backend
choice itself under "offload.backend". Backends are imported lazily: the CUDA one imports
exllamav2, which on a machine without CUDA fails at import (it compiles its extension then).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime import modelfolder, paths
from runtime.engine import Engine, ProgressFn
from runtime.errors import CudaUnavailable, ModelNotFound
from runtime.options import LoadOptions

NO_CUDA_NOTE = "No NVIDIA GPU found: models run on the CPU."
# Qwen3.5-MoE has its own GPU engine (runtime/backends/hybrid.py) for its EXL2 folders.
HYBRID = modelfolder.qwen35.ARCHITECTURES


@dataclass(frozen=True)
class BackendChoice:
    backend: str      # "cuda" | "cpu"
    note: str         # in words, for the user
    device: str       # GPU name, or "cpu"


def cuda_device() -> str | None:
    """The name of CUDA device 0, or None where torch sees no CUDA device."""
    import torch
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def kernels_building() -> bool:
    """The GPU kernels are being built right now (by `moedesk-cli setup-gpu` or the welcome screen)."""
    from runtime import gpu_setup
    return gpu_setup.kernel_status().state == "building"


def choose_backend(requested: str = "auto") -> BackendChoice:
    gpu = cuda_device()
    if requested == "cpu":
        return BackendChoice("cpu", "Models run on the CPU (as the settings ask).", "cpu")
    if gpu is not None and requested == "auto" and kernels_building():
        return BackendChoice("cpu", "The GPU kernels are being built in the background: the CPU reference "
                                    "engine runs until they are ready.", "cpu")
    if gpu is not None:
        return BackendChoice("cuda", f"Using the GPU engine on {gpu}.", gpu)
    if requested == "cuda":
        raise CudaUnavailable("The GPU engine was asked for, but torch sees no CUDA device on this machine.",
                              "Choose the backend 'auto' or 'cpu' to use the CPU reference engine.")
    return BackendChoice("cpu", NO_CUDA_NOTE, "cpu")


def model_path(model: str) -> Path:
    path = paths.resolve_model(model)
    if not path.exists():
        hint = " (import it with `moedesk-cli import-demo`)" if model == paths.DEMO_ALIAS else ""
        raise ModelNotFound(path, f"no such model folder{hint}")
    return path


def open_engine(model: str, options: LoadOptions, progress: ProgressFn,
                require_tokenizer: bool = True) -> tuple[Engine, dict[str, str]]:
    path = model_path(model)
    progress("reading", f"Checking the model folder {path.name}", 0, 0)
    info = modelfolder.validate(path, require_tokenizer=require_tokenizer)
    choice = choose_backend(options.offload.backend)
    if (choice.backend == "cuda" and options.offload.backend == "auto" and info.architecture in HYBRID
            and not info.is_exl2):
        choice = BackendChoice("cpu", f"The GPU engine runs {info.architecture} from EXL2 folders only: the CPU "
                                      "reference engine runs this one.", "cpu")
    if choice.backend == "cuda" and info.architecture in HYBRID:
        from runtime.backends import hybrid as backend
    elif choice.backend == "cuda":
        try:
            from runtime.backends import exl2 as backend
        except ImportError as e:
            raise CudaUnavailable(f"The GPU engine cannot start: {e}",
                                  "Install exllamav2 0.3.2, or use the CPU backend.") from None
    else:
        from runtime import reference as backend
    engine, applied = backend.load(path, options, progress)
    return engine, {**applied, "offload.backend": f"applied: {choice.backend} ({choice.note})"}
