"""How a decode step's stream signals the CPU path's worker thread (runtime/cpu/path.py), and
back: stream memory operations on a page-locked doorbell ("memops"), or host nodes ("hostfunc"), chosen
once per process (`signal_kind`); the CUDA driver calls behind them, through ctypes.
"""
from __future__ import annotations

import ctypes
import functools
import time
from typing import Optional

import torch

from runtime.cpu import experts as ce

CU_STREAM_WAIT_VALUE_EQ = 0x1
SIGNAL_KINDS = ("memops", "hostfunc")


class Doorbell:
    """Three 32-bit words of page-locked memory, on separate cache lines: `bell` (the stream writes a
    context's doorbell value, the worker reads and clears it), `done` (the worker writes 1 when
    that context is computed, the stream waits for it and writes 0) and `arrive` (the stream writes
    the context's value on reaching its wait, so the worker can count which side finished first).
    One per process: a step's layers run one after the other on one stream, so one set serves them all."""

    def __init__(self):
        self.mem = torch.zeros(48, dtype=torch.int32, pin_memory=True)
        self.bell = self.mem.data_ptr()
        self.done = self.mem.data_ptr() + 64
        self.arrive = self.mem.data_ptr() + 128

    def ring(self, stream: "torch.cuda.Stream", value: int) -> None:
        _memop("cuStreamWriteValue32", stream, self.bell, value, 0)

    def wait(self, stream: "torch.cuda.Stream", value: int = 0) -> None:
        if value:
            _memop("cuStreamWriteValue32", stream, self.arrive, value, 0)
        _memop("cuStreamWaitValue32", stream, self.done, 1, CU_STREAM_WAIT_VALUE_EQ)
        _memop("cuStreamWriteValue32", stream, self.done, 0, 0)


_DOORBELL: Optional[Doorbell] = None
_SIGNAL: Optional[tuple[str, str]] = None         # (kind, why), decided once per process


def doorbell() -> Optional[Doorbell]:
    """The process's doorbell ("memops" signalling, after `signal_kind` chose it), else None."""
    return _DOORBELL


def signal_kind(device: torch.device) -> tuple[str, str]:
    """("memops" or "hostfunc", why): "memops" where `memops_work` passes on this device, else "hostfunc"
    (host nodes: 29.8 against 37.0 tok/s for the doorbell at q125-a11's 24 GB on the H200)."""
    global _SIGNAL, _DOORBELL
    if device.type != "cuda":                     # CPU-only contexts (tests, the throughput probe)
        return ("hostfunc", "no GPU")
    if _SIGNAL is None:
        ok, why = memops_work(device)
        _SIGNAL = ("memops", why) if ok else ("hostfunc", f"stream memory operations fail here: {why}")
        if _SIGNAL[0] == "memops":
            _DOORBELL = Doorbell()
            ce.load_kernel().set_doorbell(_DOORBELL.bell, _DOORBELL.done, _DOORBELL.arrive)
    return _SIGNAL


def memops_work(device: torch.device, timeout_s: float = 2.0) -> tuple[bool, str]:
    """Whether a stream's write and wait on page-locked words work here, eagerly and replayed from a
    captured CUDA graph, with this thread playing the worker on two probe words."""
    probe = Doorbell()
    words = probe.mem
    stream = torch.cuda.Stream(device)

    def enqueue():
        probe.ring(stream, 7)
        probe.wait(stream)

    def answer(what: str) -> Optional[str]:
        t0 = time.perf_counter()
        while int(words[0]) != 7:
            if time.perf_counter() - t0 > timeout_s:
                words[16] = 1                                   # release the stream if it is waiting
                return f"{what}: the stream's write never arrived"
        words[0] = 0
        words[16] = 1
        ev = torch.cuda.Event()
        ev.record(stream)
        t0 = time.perf_counter()
        while not ev.query():
            if time.perf_counter() - t0 > timeout_s:
                return f"{what}: the stream did not see the answer"
        return None if int(words[16]) == 0 else f"{what}: the stream did not clear the answer"

    try:
        torch.cuda.synchronize(device)
        with torch.cuda.stream(stream):
            enqueue()
        bad = answer("eager")
        if bad:
            return False, bad
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            enqueue()
        for i in range(2):
            with torch.cuda.stream(stream):          # replay() launches on the current stream: the one
                graph.replay()                       # answer()'s event follows
            bad = answer(f"graph replay {i + 1}")
            if bad:
                return False, bad
        return True, "stream memory operations checked, eagerly and in a captured graph"
    except Exception as e:                   # a driver without them, a capture that refuses them
        return False, f"{type(e).__name__}: {e}"[:300]


@functools.lru_cache(maxsize=1)
def _host_fn_type():
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _call_host(fn: int, ctx: int) -> None:
    _host_fn_type()(fn)(ctypes.c_void_p(ctx))


@functools.lru_cache(maxsize=1)
def _libcuda():
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    cu.cuLaunchHostFunc.restype = ctypes.c_int
    cu.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return cu


def signal_status() -> Optional[str]:
    """How decode steps signal the worker in this process ("memops: why" / "hostfunc: why"), or None
    before the first CPU path on a device."""
    return None if _SIGNAL is None else f"{_SIGNAL[0]}: {_SIGNAL[1]}"


def kick() -> None:
    """A forward is starting: the worker polls the doorbell continuously again."""
    if _SIGNAL is not None and _SIGNAL[0] == "memops":
        ce.load_kernel().kick()


@functools.lru_cache(maxsize=None)
def _memop_fn(name: str):
    """The driver's entry for a stream memory operation: the _v2 symbol (CUDA 11.7+, always
    available), else the original one."""
    cu = _libcuda()
    for sym in (name + "_v2", name):
        fn = getattr(cu, sym, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    raise RuntimeError(f"the CUDA driver has no {name}")


def _memop(name: str, stream: "torch.cuda.Stream", addr: int, value: int, flags: int) -> None:
    """cuStreamWriteValue32 / cuStreamWaitValue32 (stream, address, value, flags); capturable."""
    r = _memop_fn(name)(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(addr), ctypes.c_uint32(value),
                        ctypes.c_uint(flags))
    if r != 0:
        raise RuntimeError(f"{name} failed: {_cuda_error(r)}")


def _cuda_error(r: int) -> str:
    name = ctypes.c_char_p()
    _libcuda().cuGetErrorName(r, ctypes.byref(name))
    return f"CUDA error {r} ({(name.value or b'?').decode()})"


def launch_host_func(stream: "torch.cuda.Stream", fn: int, ctx: int) -> None:
    """cuLaunchHostFunc(stream, fn, ctx): the GPU glue, on its own (capturable as a graph host node)."""
    cu = _libcuda()
    r = cu.cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(fn), ctypes.c_void_p(ctx))
    if r != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed: {_cuda_error(r)}")
