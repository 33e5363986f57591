"""How busy other programs keep the CPU, and how many compute threads the engine should run beside them.

A team of N threads on N cores stalls at each of its barriers when another program holds one of the
cores (the team waits a scheduler time slice for its last member): on a 2-core machine with one
`yes >/dev/null` running, the demo model decoded ~1 token/s with 2 threads against ~30 with 1. So an
automatic thread count is the physical cores less the CPUs other processes keep busy.

The measure costs no waiting: the system's busy CPU time less this process's own, between two samples
(`CpuSample`), divided by the wall time between them. The worker samples at load, between answers (the
engine idle: the others' demand in full) and while an answer streams, and `ThreadGovernor` turns the
readings into a team size. `choose_threads` is the whole decision, tested with injected readings.
"""
from __future__ import annotations

import math
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

# Readings over less wall time than this are noise (the kernel counts CPU time in ticks of 1-10 ms).
MIN_WINDOW_S = 0.25
# Other programs may keep this much of a CPU busy before the team gives a core up: a desktop's
# background (a browser tab, the compositor) should not halve the engine on a 2-core machine.
SLACK_CPUS = 0.3
# The machine is "contended" (said in the gauges) from this much of a CPU used by others.
CONTENDED_CPUS = 0.5


@dataclass(frozen=True)
class CpuSample:
    wall: float        # monotonic seconds
    busy: float        # CPU-seconds every CPU spent busy (all processes, the kernel, a hypervisor's steal)
    own: float         # CPU-seconds this process spent (all its threads)


def physical_cores() -> int:
    import psutil
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def on_cores(threads: int, fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a thread of its own whose torch thread team has at least `threads` threads
    (a process started with OMP_NUM_THREADS=1 keeps it for its own work, but a load runs on every core);
    its result, or its exception raised here. The caller's grad and inference modes, CUDA device and
    stream carry over.

    Why a thread of its own: libgomp (torch's OpenMP, shared with the CPU expert kernel) keeps a grown
    team's threads docked for the thread that grew it until that thread exits, and while more OpenMP
    threads are alive than the machine has CPUs, every team waits at its barriers for 100 spins
    instead of 300,000 before it sleeps in the kernel: the CPU expert path's team, between two layers'
    calls, then sleeps and is woken again. Grown on the calling (the engine's) thread, the team stayed
    for the process's life; here it ends with the helper thread."""
    import torch
    want = max(1, int(threads))
    before = torch.get_num_threads()
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device, stream = (torch.cuda.current_device(), torch.cuda.current_stream()) if cuda else (None, None)
    box: dict = {}

    def body() -> None:
        try:
            if cuda:
                torch.cuda.set_device(device)
            fix_thread_count(max(want, before))          # held while the load's own threads set theirs
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), \
                    (torch.cuda.stream(stream) if cuda else nullcontext()):
                box["value"] = fn(*args, **kwargs)
        except BaseException as e:                     # raised again on the caller's thread
            box["error"] = e
        finally:
            torch.set_num_threads(before)              # torch keeps the count for threads made later too

    helper = threading.Thread(target=body, name="every core", daemon=True)
    helper.start()
    helper.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def fix_thread_count(threads: int) -> None:
    """torch's intra-op thread count of the calling thread set to `threads`, for good. torch sets a
    thread's OpenMP count once more on its first parallel operation, to the count last set on any
    thread (one value for the process): set only before that, a new thread's count became whatever
    another thread had set since (in the tests, a load's 4 on a copy thread meant to use 1), and it grew
    a team of that size. get_num_threads makes that first setting happen now, before ours."""
    import torch
    torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))


@contextmanager
def torch_threads_set(threads: int):
    """torch's intra-op thread count of the calling thread set to `threads` inside, put back after."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def conversion_threads(cores: int, others: Optional[float], requested: int = 0) -> tuple[int, str]:
    """torch's thread count for a CPU conversion, and why: `requested` (> 0) capped at the physical cores,
    else `choose_threads` (GPTQ's barriers stall like the engine's: on a busy 2-core machine two threads
    ran it ~12x slower than one). -> (threads, reason for the log)."""
    if requested < 0:
        raise ValueError(f"threads {requested}: must be 0 (automatic) or more")
    if requested:
        n = min(requested, max(cores, 1))
        return n, (f"{n} as asked" if n == requested else f"{n}: {requested} asked, capped at the physical cores")
    n = choose_threads(cores, others)
    busy = "unknown" if others is None else f"{others:.1f}"
    return n, f"{n} of {cores} physical cores (other programs keep {busy} CPUs busy)"


def sample() -> CpuSample:
    import psutil
    t = psutil.cpu_times()
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)   # guest time is in user too
    idle = t.idle + getattr(t, "iowait", 0.0)
    mine = psutil.Process().cpu_times()
    return CpuSample(wall=time.monotonic(), busy=total - idle, own=mine.user + mine.system)


def others_busy(before: CpuSample, after: CpuSample) -> Optional[float]:
    """CPUs other processes kept busy on average between two samples; None when too close together."""
    wall = after.wall - before.wall
    if wall < MIN_WINDOW_S:
        return None
    return max(0.0, (after.busy - before.busy) - (after.own - before.own)) / wall


def choose_threads(cores: int, others: Optional[float]) -> int:
    """The team size for `cores` cores when other programs keep `others` CPUs busy (None: unknown):
    one core fewer for each CPU of theirs beyond SLACK_CPUS, never fewer than 1."""
    if cores < 1:
        raise ValueError(f"cores {cores}: must be at least 1")
    if others is None:
        return cores
    return max(1, min(cores, cores - math.ceil(others - SLACK_CPUS)))


def measure_others(window_s: float = MIN_WINDOW_S) -> Optional[float]:
    """Others' CPUs over a short wait (for a one-off decision at load, where no earlier sample exists)."""
    first = sample()
    time.sleep(window_s)
    return others_busy(first, sample())


class ThreadGovernor:
    """The engine's thread count when it is automatic: `observe()` after each window (load, the idle time
    between answers, half a second of an answer) returns the new count when it should change.

    With `fixed` threads (the user's setting) it only reports the readings. `sampler` is injectable:
    tests give it readings instead of the machine's."""

    def __init__(self, cores: int, fixed: int = 0, sampler: Callable[[], CpuSample] = sample):
        self.cores, self.fixed, self._sampler = cores, fixed, sampler
        self.threads = fixed or cores
        self.others: Optional[float] = None      # the last reading, CPUs
        self._last = sampler()

    def observe(self) -> Optional[int]:
        now = self._sampler()
        reading = others_busy(self._last, now)
        if reading is None:
            return None
        self._last, self.others = now, reading
        if self.fixed:
            return None
        threads = choose_threads(self.cores, reading)
        if threads == self.threads:
            return None
        self.threads = threads
        return threads

    def restart_window(self) -> None:
        """Start the next reading from now (e.g. after a stretch that should not count)."""
        self._last = self._sampler()

    @property
    def contended(self) -> bool:
        return self.others is not None and self.others >= CONTENDED_CPUS

    def figures(self) -> dict:
        """For the telemetry event."""
        return {"cpu_threads": self.threads, "cpu_cores": self.cores,
                "cpu_busy_others": None if self.others is None else round(self.others, 2)}
