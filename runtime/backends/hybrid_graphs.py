"""CUDA graphs of the hybrid engine's short forwards (runtime/backends/hybrid.py): one graph per
(bucket L, rows T), T <= the rollback window (decode: 1 row; a verify of K drafts: K + 1 rows), as
the exllamav2 engine's (runtime/backends/exl2_graph.py, whose bucket arithmetic and plans these share).

The full-attention layers of a step attend over the cache's first L rows, L = `bucket` of the step's
last row (a multiple of BUCKET = 512, capped at the context), masked by position within them: one
graph serves every position of its bucket, and a step reads the K/V its conversation holds (rounded
up to 512), not the whole context's. The DeltaNet layers have no length.

What makes a forward capturable (HybridModel.forward with static=True, runtime/backends/hybrid_layers.py):
every tensor it reads or writes has a fixed address (the weights, the cache with its `positions` and
`slots` buffers, which HybridCache.begin fills before each forward, the token buffer here); no shape
depends on the position within the bucket (L is a Python int fixed per graph: views of the cache and
a mask over L positions); nothing is read back on the host; no Python value of one step (the
position) is used by the kernels.

Per (L, T):
- its first forward runs eagerly on the capture stream: that run is the step's result, and it warms
  up what must not happen inside a capture (Triton compiling and loading kernels, the expert kernels'
  launch-shape timing, exllamav2's GEMM tuning outside the settled shapes, cuBLAS's workspace for that
  stream);
- then the same forward is captured on that stream into one private memory pool shared by every
  graph (`torch.cuda.graph`), in the "relaxed" capture mode (as the exllamav2 engine's graphs).
  A capture records kernels and runs none: the cache stays as the eager run left it;
- later forwards of T rows in bucket L: the token buffer filled, the graph replayed on the current
  stream, its output copied out (the next replay of another graph may reuse the pool's free memory).

Memory: what a capture frees goes back to the shared pool for the next capture; each graph keeps only
its outputs, the logits [T, V] float32 and the final hidden states [T, H] (and its kernels' parameters). At most `max_graphs` (exl2_graph.MAX_GRAPHS)
are held, the least recently used dropped before a capture (its output's memory returns to the pool),
so the pool is bounded by the largest capture's temporaries plus max_graphs outputs. Which graphs
are captured ahead of need (at load, before an answer's first token, while idle) is the engine's.

A failed capture turns the graphs off (the engine's `graph_error` names the first layer that broke
the capture); the eager result of that step stands and later steps run eagerly.

`cuda` is the torch.cuda API the graphs use, plus `capture_is_valid(stream)` (`CudaApi`; the CPU
tests pass a stand-in).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from runtime.experts.shapes import CAPTURE_MODE
from runtime.backends.exl2_graph import MAX_GRAPHS, bucket

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
    max_graphs = MAX_GRAPHS

    def __init__(self, engine, cuda: Any = None):
        self.engine = engine
        self.cuda = cuda if cuda is not None else CudaApi()
        self.window = engine.cache.window
        self.capacity = engine.cache.capacity
        dev = engine.model.device
        self.tokens = torch.zeros(self.window, dtype=torch.long, device=dev)
        # (L, T) -> (graph, its output buffer), least recently used first
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.pool = None
        self.stream = self.cuda.Stream(device=dev)                    # warm-up and capture

    def span(self, position: int, t: int) -> int:
        """The attended length L of t rows from `position`: the bucket of the last row."""
        return bucket(position, t, self.capacity)

    def _forward(self, L: int, t: int, probe=None, keep: Optional[list] = None) -> torch.Tensor:
        e = self.engine
        return e.model.forward(self.tokens[:t], e.cache, e.cache.length, True, static=True, probe=probe, span=L,
                               keep=keep)

    def step(self, ids: list[int], position: int, keep: Optional[list] = None) -> torch.Tensor:
        """The forward of these rows at `position` (the cache's begin() done, its positions buffer from
        there): the graph of their bucket replayed, or the forward run and then captured. keep: receives
        the rows' final hidden states (every graph holds them beside its logits: the MTP head reads them)."""
        e, t = self.engine, len(ids)
        if not 1 <= t <= self.window or not 0 <= position <= self.capacity - t:
            raise ValueError(f"decode graphs: {t} rows at position {position} (graphs cover 1..{self.window} "
                             f"rows within the {self.capacity}-token cache)")
        L = self.span(position, t)
        self.tokens[:t].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        if (L, t) in self.graphs:
            graph, out, hidden = self.graphs[(L, t)] = self.graphs.pop((L, t))      # now the most recently used
            graph.replay()
            if keep is not None:
                keep.append(hidden.clone())
            return out.clone()
        cur, s = self.cuda.current_stream(), self.stream
        s.wait_stream(cur)                     # the token buffer and the cache's positions/slots are written
        try:
            with self.cuda.stream(s):
                out = self._forward(L, t, keep=keep)
        finally:
            cur.wait_stream(s)                 # also before a failed forward's rollback, on the current stream
        # `out` was allocated on s: its block goes back to s's free list, and s's next use (a warm-up
        # here) waits for everything queued on the current stream first.
        try:
            self._capture(L, t)
        except Exception as err:              # the eager result stands; later steps run eagerly
            where = self._find_capture_breaker(L, t)
            e.graph_error = f"capture of {t} rows over {L} failed ({where}): {type(err).__name__}: {err}"[:1000]
            log.warning("decode graphs off: %s", e.graph_error)
            e.graphs = None
        return out

    def _capture(self, L: int, t: int) -> None:
        self.cuda.synchronize()                # no replay in flight: a dropped graph's memory is free
        while len(self.graphs) >= max(1, self.max_graphs):
            del self.graphs[next(iter(self.graphs))]
        graph, hidden = self.cuda.CUDAGraph(), []
        with self.cuda.graph(graph, pool=self.pool, stream=self.stream,
                             capture_error_mode=CAPTURE_MODE):
            out = self._forward(L, t, keep=hidden)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(L, t)] = (graph, out, hidden[0])

    def _find_capture_breaker(self, L: int, t: int) -> str:
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
            with self.cuda.graph(graph, stream=self.stream, capture_error_mode=CAPTURE_MODE):
                self._forward(L, t, probe=probe)
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

    def full_of(self, wanted) -> bool:
        """No room, and the graph the next capture would drop is one of `wanted`: capturing another
        ahead of need would drop a wanted one (and idle time could capture in a circle)."""
        return len(self.graphs) >= self.max_graphs and next(iter(self.graphs)) in wanted

    def captured(self) -> list[tuple[int, int]]:
        """The (bucket L, rows T) pairs captured and held."""
        return sorted(self.graphs)
