"""Where the CUDA engine keeps the expert-path decisions (runtime/experts/path_judge.py) and what one
is valid for; read by the placement before it copies experts for the CPU (exl2_offload.start) and by
the judge after the warm-up (exl2_placement.settle_cpu_path)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from runtime.experts.path_judge import read_decision

DECISIONS_FILE = "expert-path-decisions.json"     # in the user cache (runtime.paths.cache_dir)


def key_for(model_path, budget) -> str:
    """What a saved decision is valid for: the model folder, the VRAM budget (to 1/4 GiB), the CPU
    threads asked for, the CPU split ("cut": one since the whole-experts switch went, kept so that saved
    decisions stay found), and the machine (host, cores, GPU)."""
    vram = round(budget.vram.total_bytes / (1 << 28)) / 4 if budget is not None else None
    threads = budget.cpu_threads if budget is not None else 0
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (f"{Path(model_path).resolve()}|vram {vram} GiB|threads {threads or 'auto'}|split "
            f"cut|{platform.node()}|{os.cpu_count()} cpus|{gpu}")


def decisions_file() -> Path:
    from runtime.paths import cache_dir
    return cache_dir() / DECISIONS_FILE


def saved_off(model_path, budget) -> str:
    """Where "auto" placement will run the GPU-only path anyway: the reason a decision saved by an
    earlier load gives (the judge reuses it untimed), else "" (nothing saved, or the CPU path)."""
    if budget is None or getattr(budget, "policy", "auto") != "auto":
        return ""
    prior = read_decision(decisions_file(), key_for(model_path, budget))
    if prior is None or prior.get("path") != "stream":
        return ""
    return f"as measured on an earlier load ({prior.get('reason', '')})"
