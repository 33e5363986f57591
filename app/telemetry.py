"""The gauges' pure logic, free of widgets: history buffers, value formatting, and the samplers.

- `History`: a fixed-length ring of floats for a sparkline (None = "no value at that tick").
- `fmt_*`: one place that turns a figure into the short text a gauge shows; None is always "—".
- `NvmlMonitor`: VRAM used/total through NVML (`pynvml` from nvidia-ml-py) as a small state
  machine. No NVIDIA GPU, no driver or no library is a state (`NvmlState.NO_GPU`), never an
  exception; an NVML error during a query shuts NVML down and re-initialises it on a later poll.
- `RamSampler`: system RAM used/total and a process's resident memory (psutil).

Nothing here imports Qt or torch; `app/gauges.py` draws what these return.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable, Optional

import psutil

DASH = "—"


# ----------------------------------------------------------------------------------------------
# History for sparklines

class History:
    """The last `size` samples of one gauge, oldest first. None marks a tick without a value."""

    def __init__(self, size: int = 120):
        if size < 2:
            raise ValueError(f"History size must be at least 2, got {size}")
        self._values: deque[Optional[float]] = deque(maxlen=size)
        self.size = size

    def append(self, value: Optional[float]) -> None:
        self._values.append(None if value is None else float(value))

    def values(self) -> list[Optional[float]]:
        return list(self._values)

    def known(self) -> list[float]:
        return [v for v in self._values if v is not None]

    def last(self) -> Optional[float]:
        return self._values[-1] if self._values else None

    def span(self) -> Optional[tuple[float, float]]:
        """(lowest, highest) of the known values, or None when there is none."""
        known = self.known()
        return (min(known), max(known)) if known else None

    def clear(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)


# ----------------------------------------------------------------------------------------------
# Formatting: short texts for gauges

def fmt_bytes(n: Optional[float]) -> str:
    """1536 -> "1.5 KiB"; binary units as memory is counted; None -> "—"."""
    if n is None:
        return DASH
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(units) - 1:
        value /= 1024
        unit += 1
    return f"{int(value)} B" if unit == 0 else f"{value:.1f} {units[unit]}"


def fmt_used_total(used: Optional[float], total: Optional[float]) -> str:
    """"3.2 / 16.0 GiB" (both in the unit of the total)."""
    if used is None or total is None or total <= 0:
        return DASH
    gib = 1024 ** 3
    if total >= gib:
        return f"{used / gib:.1f} / {total / gib:.1f} GiB"
    mib = 1024 ** 2
    return f"{used / mib:.0f} / {total / mib:.0f} MiB"


def fmt_rate(tps: Optional[float]) -> str:
    """Tokens per second: "42.3 T/s", "1,234 T/s"."""
    if tps is None:
        return DASH
    return f"{tps:,.0f} T/s" if tps >= 1000 else f"{tps:.1f} T/s"


def fmt_seconds(s: Optional[float]) -> str:
    """"850 ms" under a second, "2.35 s" above."""
    if s is None:
        return DASH
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def fmt_fraction(f: Optional[float]) -> str:
    """0.734 -> "73%"."""
    if f is None:
        return DASH
    return f"{f * 100:.0f}%"


def fmt_bytes_per_token(n: Optional[float]) -> str:
    return DASH if n is None else f"{fmt_bytes(n)}/tok"


# ----------------------------------------------------------------------------------------------
# VRAM through NVML

class NvmlState(str, Enum):
    UNINITIALISED = "uninitialised"
    OK = "ok"
    NO_GPU = "no_gpu"        # no library, no driver, or no device: the CPU engine is in use
    ERROR = "error"          # NVML failed after working; re-initialised on a later poll


NO_GPU_TEXT = "No NVIDIA GPU — CPU engine"


@dataclass(frozen=True)
class VramSample:
    used: int
    total: int
    name: str
    device_count: int


class NvmlMonitor:
    """VRAM of one NVIDIA device, polled; never raises. `nvml` is the pynvml module (injectable).

    States: UNINITIALISED -> OK on a successful init; -> NO_GPU when the library or driver is
    missing or there is no device; OK -> ERROR when a query fails (NVML is shut down). From
    NO_GPU and ERROR a poll re-tries the init once `retry_s` seconds have passed.
    """

    def __init__(self, nvml=None, device_index: int = 0, retry_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        if nvml is None:
            try:
                import pynvml as nvml  # nvidia-ml-py
            except ImportError:
                nvml = None
        self._nvml = nvml
        self._index = device_index
        self._retry_s = retry_s
        self._clock = clock
        self._handle = None
        self._count = 0
        self._name = ""
        self._failed_at: Optional[float] = None
        self.state = NvmlState.UNINITIALISED
        self.reason = ""           # in words, why there is no reading
        self.inits = 0             # successful initialisations (tests, diagnostics)

    # The one public call: a sample, or None with `state` and `reason` saying why.
    def poll(self) -> Optional[VramSample]:
        if self.state in (NvmlState.NO_GPU, NvmlState.ERROR, NvmlState.UNINITIALISED):
            if self._failed_at is not None and self._clock() - self._failed_at < self._retry_s:
                return None
            if not self._init():
                return None
        try:
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception as e:  # pynvml.NVMLError and anything a broken driver throws
            self._fail(NvmlState.ERROR, f"NVML stopped answering ({e}); retrying")
            return None
        return VramSample(used=int(mem.used), total=int(mem.total), name=self._name,
                          device_count=self._count)

    def status_text(self) -> str:
        if self.state == NvmlState.NO_GPU:
            return NO_GPU_TEXT
        if self.state == NvmlState.OK:
            more = f" (+{self._count - 1} more)" if self._count > 1 else ""
            return f"{self._name}{more}"
        return self.reason or "Reading the GPU…"

    def driver_version(self) -> Optional[str]:
        """The NVIDIA driver's version while NVML is open, else None."""
        if self.state != NvmlState.OK:
            return None
        try:
            v = self._nvml.nvmlSystemGetDriverVersion()
        except Exception:
            return None
        return v.decode() if isinstance(v, bytes) else str(v)

    def close(self) -> None:
        if self.state == NvmlState.OK:
            self._shutdown()
        self.state = NvmlState.UNINITIALISED

    # -- internals --------------------------------------------------------------------------
    def _init(self) -> bool:
        nvml = self._nvml
        if nvml is None:
            self._fail(NvmlState.NO_GPU, "the nvidia-ml-py package is not installed")
            return False
        try:
            nvml.nvmlInit()
        except Exception as e:
            self._fail(NvmlState.NO_GPU, no_driver_words(e))
            return False
        try:
            self._count = int(nvml.nvmlDeviceGetCount())
            if self._count <= self._index:
                self._shutdown()
                self._fail(NvmlState.NO_GPU, f"{self._count} NVIDIA device(s), none at index {self._index}")
                return False
            self._handle = nvml.nvmlDeviceGetHandleByIndex(self._index)
            name = nvml.nvmlDeviceGetName(self._handle)
            self._name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception as e:
            self._shutdown()
            self._fail(NvmlState.ERROR, f"NVML error while opening the GPU: {e}")
            return False
        self.state, self.reason, self._failed_at = NvmlState.OK, "", None
        self.inits += 1
        return True

    def _fail(self, state: NvmlState, reason: str) -> None:
        if self.state == NvmlState.OK:
            self._shutdown()
        self.state, self.reason, self._failed_at = state, reason, self._clock()
        self._handle = None

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass   # already gone: nothing left to release


def no_driver_words(e: Exception) -> str:
    """NVML's refusal in a user's words ("NVML Shared Library Not Found" means no NVIDIA driver)."""
    text = str(e)
    if "Library Not Found" in text or "Function Not Found" in text:
        return "no NVIDIA driver is installed"
    if "Driver Not Loaded" in text:
        return "the NVIDIA driver is installed but not running"
    if "Insufficient Permissions" in text or "No Permission" in text:
        return "this user may not read the NVIDIA GPU"
    return f"the NVIDIA driver did not answer ({text})"


# ----------------------------------------------------------------------------------------------
# RAM through psutil

@dataclass(frozen=True)
class RamSample:
    used: int            # total - available: memory the system cannot hand out right now
    total: int
    process_rss: Optional[int]    # the watched process's resident memory; None when none/gone


class RamSampler:
    """System RAM and, when `pid` is set, that process's resident memory (children included)."""

    def __init__(self, pid: Optional[int] = None):
        self._proc: Optional[psutil.Process] = None
        self.set_pid(pid)

    def set_pid(self, pid: Optional[int]) -> None:
        self._proc = None
        if pid:
            try:
                self._proc = psutil.Process(pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                self._proc = None

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    def sample(self) -> RamSample:
        vm = psutil.virtual_memory()
        return RamSample(used=int(vm.total - vm.available), total=int(vm.total), process_rss=self._rss())

    def _rss(self) -> Optional[int]:
        if self._proc is None:
            return None
        try:
            if not self._proc.is_running():
                self._proc = None
                return None
            return int(self._proc.memory_info().rss) + _children_rss(self._proc.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            self._proc = None
            return None


def _children_rss(children: Iterable[psutil.Process]) -> int:
    total = 0
    for c in children:
        try:
            total += int(c.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return total
