"""What this machine can run, checked once at first start: NVIDIA GPU and driver (NVML), VRAM, RAM,
free disk, and where the GPU engine's kernels stand (runtime.gpu_setup: prebuilt, built, buildable without
a CUDA toolkit, or what is missing).

Pure Python, no torch, no Qt: the welcome screen turns a `MachineReport` into words.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from app.telemetry import NvmlMonitor
from runtime import tuning
from runtime.gpu_setup import KernelStatus, kernel_status

GB = 1024 ** 3                # the app speaks GiB everywhere (app/telemetry.fmt_bytes)
MIN_GPU_VRAM_GB = 8          # below this even small MoE quants leave little room for experts
MIN_OFFLOAD_RAM_GB = 32      # cold experts of a 100B-class model at ~3 bpw need tens of GB
MIN_FREE_DISK_GB = 20        # one mid-size EXL2 quant


@dataclass(frozen=True)
class Finding:
    level: str      # "ok" | "warn" | "fail"
    title: str
    advice: str = ""


@dataclass(frozen=True)
class MachineReport:
    gpu_name: Optional[str]
    driver_version: Optional[str]
    vram_total_bytes: Optional[int]
    ram_total_bytes: int
    ram_available_bytes: int
    disk_free_bytes: int
    nvcc: Optional[str]
    findings: tuple[Finding, ...] = field(default_factory=tuple)
    kernels: Optional[KernelStatus] = None      # with a GPU: where the GPU engine's kernels stand

    @property
    def gpu_engine(self) -> bool:
        return self.gpu_name is not None

    @property
    def summary(self) -> str:
        if not self.gpu_engine:
            return "CPU demo only: no NVIDIA GPU was found, so MoE Desk will run the small demo model on the CPU."
        return f"GPU engine: {self.gpu_name} with {self.vram_total_bytes / GB:.0f} GiB of VRAM."


def probe_gpu() -> tuple[Optional[str], Optional[str], Optional[int], str]:
    """(name, driver, vram bytes, problem in words) of the first NVIDIA GPU, through the gauges' NVML reader."""
    monitor = NvmlMonitor()
    try:
        sample = monitor.poll()
        if sample is None:
            return None, None, None, monitor.reason
        return sample.name, monitor.driver_version(), sample.total, ""
    finally:
        monitor.close()


def find_nvcc() -> Optional[str]:
    for home in tuning.cuda_homes():
        if home and (Path(home) / "bin" / ("nvcc.exe" if os.name == "nt" else "nvcc")).exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


# Kernel states the welcome screen only reports; "buildable" and "building" show the build's own panel.
KERNEL_LEVEL = {"prebuilt": "ok", "cached": "ok", "buildable": "ok", "building": "ok", "no_gpu": "ok"}


def kernel_finding(k: KernelStatus) -> Finding:
    level = "warn" if k.ready and k.advice else KERNEL_LEVEL.get(k.state, "warn")   # ready, but no C compiler
    return Finding(level, k.title, k.advice)


def check_machine(models_dir: Path) -> MachineReport:
    name, driver, vram, gpu_problem = probe_gpu()
    vm = psutil.virtual_memory()
    probe_dir = models_dir
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    disk_free = shutil.disk_usage(probe_dir).free
    nvcc = find_nvcc()
    kernels = None
    findings = []
    if name is None:
        findings.append(Finding("fail", f"No NVIDIA GPU found ({gpu_problem}).",
                                "The GPU engine needs an NVIDIA GPU with a recent driver (R535 or newer). "
                                "Until then MoE Desk runs the demo model on the CPU."))
    else:
        findings.append(Finding("ok", f"NVIDIA GPU: {name}, driver {driver}, {vram / GB:.0f} GiB VRAM."))
        if vram / GB < MIN_GPU_VRAM_GB:
            findings.append(Finding("warn", f"Only {vram / GB:.0f} GiB of VRAM.",
                                    "Large MoE models will keep most experts in RAM; expect lower speed."))
        kernels = kernel_status()
        findings.append(kernel_finding(kernels))
    ram_gb = vm.total / GB
    level = "ok" if ram_gb >= MIN_OFFLOAD_RAM_GB else "warn"
    findings.append(Finding(level, f"{ram_gb:.0f} GiB of RAM ({vm.available / GB:.0f} GiB free).",
                            "" if level == "ok" else
                            f"Expert offload of 100B-class models wants {MIN_OFFLOAD_RAM_GB} GiB or more."))
    level = "ok" if disk_free / GB >= MIN_FREE_DISK_GB else "warn"
    findings.append(Finding(level, f"{disk_free / GB:.0f} GiB free on the disk that holds models.",
                            "" if level == "ok" else
                            f"Model downloads are large; free at least {MIN_FREE_DISK_GB} GiB."))
    return MachineReport(name, driver, vram, vm.total, vm.available, disk_free, nvcc, tuple(findings), kernels)
