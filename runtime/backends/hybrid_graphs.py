"""CUDA graphs of the hybrid engine's short forwards (runtime/backends/hybrid.py): one graph per row
count T <= the rollback window (decode: 1 row; a verify of K drafts: K + 1 rows), each serving every
position.

What makes a forward capturable (HybridModel.forward with static=True, runtime/backends/hybrid_layers.py):
every tensor it reads or writes has a fixed address (the weights, the cache with its `positions` and
`slots` buffers, which HybridCache.begin fills before each forward, the token buffer here); no shape
depends on the position (attention over the whole cache, masked by position); nothing is read back
on the host; no Python value of one step (the position) is used by the kernels.

Per row count T:
- its first forward runs eagerly on the capture stream: that run is the step's result, and it warms
  up what must not happen inside a capture (Triton compiling and loading kernels, the expert kernels'
  launch-shape timing, exllamav2's GEMM tuning outside the settled shapes, cuBLAS's workspace for that
  stream);
- then the same forward is captured on that stream into one private memory pool shared by every row
  count (`torch.cuda.graph`), in tuning's capture mode ("relaxed", as the exllamav2 engine's graphs).
  A capture records kernels and runs none: the cache stays as the eager run left it;
- later forwards of T rows: the token buffer filled, the graph replayed on the current stream, its
  output copied (the pool's memory is reused by the next replay of another graph).

A failed capture turns the graphs off (the engine's `graph_error` names the first layer that broke
the capture); the eager result of that step stands and later steps run eagerly.

`cuda` is the torch.cuda API the graphs use, plus `capture_is_valid(stream)` (`CudaApi`; the CPU
tests pass a stand-in).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from runtime import tuning

log = logging.getLogger(__name__)


class _Stop(Exception):
    pass


class CudaApi:
    """torch.cuda, plus whether a stream's capture is still valid (torch's is_current_stream_capturing
    is also true for an invalidated capture): the driver's cuStreamIsCapturing, through ctypes."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def capture_is_valid(stream) -> bool:
        import ctypes
        try:
            cu = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return True                          # unknown: the search then names no part
        status = ctypes.c_int(0)                 # CUstreamCaptureStatus: 0 none, 1 active, 2 invalidated
        cu.cuStreamIsCapturing(ctypes.c_void_p(stream.cuda_stream), ctypes.byref(status))
        return status.value == 1


class StepGraphs:
    def __init__(self, engine, cuda: Any = None):
        self.engine = engine
        self.cuda = cuda if cuda is not None else CudaApi()
        self.window = engine.cache.window
        dev = engine.model.device
        self.tokens = torch.zeros(self.window, dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}        # rows -> (graph, its output buffer)
        self.pool = None
        self.stream = self.cuda.Stream(device=dev)                    # warm-up and capture

    def _forward(self, t: int, probe=None) -> torch.Tensor:
        e = self.engine
        return e.model.forward(self.tokens[:t], e.cache, e.cache.length, True, static=True, probe=probe)

    def step(self, ids: list[int]) -> torch.Tensor:
        """The forward of these rows (the cache's begin() done): replayed, or run and then captured."""
        e, t = self.engine, len(ids)
        if not 1 <= t <= self.window:
            raise ValueError(f"decode graphs: {t} rows (graphs cover 1..{self.window})")
        self.tokens[:t].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        if t in self.graphs:
            graph, out = self.graphs[t]
            graph.replay()
            return out.clone()
        cur, s = self.cuda.current_stream(), self.stream
        s.wait_stream(cur)                     # the token buffer and the cache's positions/slots are written
        try:
            with self.cuda.stream(s):
                out = self._forward(t)
        finally:
            cur.wait_stream(s)                 # also before a failed forward's rollback, on the current stream
        # `out` was allocated on s: its block goes back to s's free list, and s's next use (a warm-up
        # here) waits for everything queued on the current stream first.
        try:
            self._capture(t)
        except Exception as err:              # the eager result stands; later steps run eagerly
            where = self._find_capture_breaker(t)
            e.graph_error = f"capture of {t} rows failed ({where}): {type(err).__name__}: {err}"[:1000]
            log.warning("decode graphs off: %s", e.graph_error)
            e.graphs = None
        return out

    def _capture(self, t: int) -> None:
        self.cuda.synchronize()
        graph = self.cuda.CUDAGraph()
        with self.cuda.graph(graph, pool=self.pool, stream=self.stream,
                             capture_error_mode=tuning.current().capture_mode):
            out = self._forward(t)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[t] = (graph, out)

    def _find_capture_breaker(self, t: int) -> str:
        """After a failed capture: capture again, asking after every part of every layer whether the
        capture is still valid; names the first part after which it is not."""
        done: list[str] = []

        def probe(label: str) -> None:          # called after the part `label` was recorded
            if not self.cuda.capture_is_valid(self.stream):
                raise _Stop(label)
            done.append(label)

        try:
            self.cuda.synchronize()
            graph = self.cuda.CUDAGraph()
            with self.cuda.graph(graph, stream=self.stream, capture_error_mode=tuning.current().capture_mode):
                self._forward(t, probe=probe)
            found = "a second capture succeeded"
        except _Stop as stop:
            found = f"invalidated by {stop.args[0]}"
        except Exception as err:
            if err.__context__ is not None and isinstance(err.__context__, _Stop):
                found = f"invalidated by {err.__context__.args[0]}"
            else:
                found = f"{type(err).__name__} in the part after {done[-1] if done else 'the start'}"
        try:
            self.cuda.synchronize()
        except Exception:
            pass
        return found

    def captured(self) -> list[int]:
        return sorted(self.graphs)


def idle_rows(window: int, captured) -> list[int]:
    """The row counts captured ahead of need, most urgent first: the decode step, then a full verify."""
    return [t for t in dict.fromkeys((1, window)) if t not in captured]

