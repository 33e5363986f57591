"""Launch shapes of the split-K GEMVs, timed once per shape on this GPU, and the workspace their finishing
launches share.

A split-K GEMV runs one program per (pair, column block, K slice): `SplitK` is its column block (BN), its K
slices (KSPLIT), its warps, and for the dense GEMV at 2+ rows whether the rows meet in a tensor-core dot.
`choose` times the candidates a kernel offers (the default first: what the interpreter and a capture use)
and keeps the fastest per key, once, before any graph capture. A forced shape (Tuning.splitk, handed over by
whoever built the caller) skips the timing.

A launch that finishes in itself (decode.py's two-launch experts, linear_gemv.py, qkv_prologue.py) adds its
K slices into a float32 workspace and counts them in an int32 counter per output block; the slice that comes
last takes the sums and leaves both at zero (tiles.last_slice, take_sums). One pair per device, shared by
every call: the calls run one after another on the engine's stream, each leaving them as it found them.

Letters: K/N a kernel's input/output features, P (token, expert) pairs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton

from runtime import tuning
from runtime.experts.pack import PackedExperts

SM_TARGET = 528          # programs to aim for in decode (about 4 per multiprocessor of an H200)
CAPTURE_MODE = "relaxed"  # the CUDA graphs' capture error mode: the default "global" failed the hybrid engine's
                          # captures (a library allocating its workspace, a kernel loaded on first launch)


@dataclass(frozen=True)
class SplitK:
    """Launch shape of a split-K GEMV: BN output columns per program, the K range cut in KSPLIT; for the
    dense GEMV at 2+ rows, `dot` (rows padded to 16 for a tensor-core dot) or not (the rows' products
    summed on the CUDA cores, rows padded to a power of two)."""
    bn: int
    ksplit: int
    warps: int = 4
    dot: bool = True


def tile(*packs: PackedExperts, cap: int = 64) -> int:
    """K tile: within one scale group, a whole number of words, at most `cap` rows."""
    bk = min([cap] + [p.group for p in packs])
    for p in packs:
        if p.group % bk or p.in_features % bk or bk % (32 if p.bits == 3 else 32 // p.bits):
            raise ValueError(f"expert layout: group {p.group} / K {p.in_features} do not fit a K tile of {bk}")
    return bk


def ksplit(K: int, bk: int, programs: int) -> int:
    """Largest power-of-two split of K (in whole tiles) that brings the grid near SM_TARGET programs."""
    ks = 1
    while programs * ks * 2 <= SM_TARGET and K % (ks * 2 * bk) == 0:
        ks *= 2
    return ks


def candidates(K: int, N: int, P: int, bk: int, forced: Optional[tuple[int, int]] = None) -> list[SplitK]:
    """The experts' split-K shapes for P pairs: the default first, then the shapes worth timing (each new
    shape is one more compilation on first use: few); `forced` (BN, KSPLIT) alone where K takes it."""
    default = SplitK(64, ksplit(K, bk, P * triton.cdiv(N, 64)))
    if forced:
        bn, ks = forced
        return [SplitK(bn, ks) if K % (ks * bk) == 0 else default]
    out = [default]
    for bn in (32, 64, 128):
        for ks in (1, 2, 3, 4, 6, 8, 12, 16):
            c = SplitK(bn, ks)
            if K % (ks * bk) == 0 and 128 <= P * triton.cdiv(N, bn) * ks <= 4096 and c not in out:
                out.append(c)
    return out


# Launch shapes chosen by timing on this GPU, per (kernel, shapes, pairs); filled on first use.
CHOSEN: dict[tuple, SplitK] = {}


def interpreting() -> bool:
    return tuning.triton_interpret()


def choose(key: tuple, shapes: list[SplitK], launch: Callable[[SplitK], None], graph: bool = False) -> SplitK:
    """Time each shape's launch (CUDA events, after one untimed call that compiles it; a shape that does not
    compile here is passed over, except the default) and keep the fastest for `key`. Not while a graph is
    being captured, and not under the interpreter: there the default runs. The caller's launches write to
    scratch buffers. graph: time ten launches captured in a CUDA graph (best of three replays), as a decode
    graph runs them; a kernel of a few microseconds launched from the host would be timed by its launch cost."""
    if key in CHOSEN:
        return CHOSEN[key]
    if len(shapes) == 1:
        return shapes[0]
    if interpreting() or not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return shapes[0]
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    best, best_t = shapes[0], float("inf")
    for c in shapes:
        try:
            launch(c)
        except (CompilationError, OutOfResources):   # a shape this GPU cannot build (registers, shared memory)
            if c is shapes[0]:
                raise
            continue
        t = _time_graph(lambda: launch(c)) if graph else _time_eager(lambda: launch(c))
        if t < best_t:
            best, best_t = c, t
    CHOSEN[key] = best
    return best


def _time_eager(run) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _time_graph(run) -> float:
    # captured by hand on a side stream: torch.cuda.graph would collect garbage and empty the cache
    # for each of the many small graphs timed at load
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin(capture_error_mode=CAPTURE_MODE)
        try:
            for _ in range(10):
                run()
        finally:
            g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


# per device: (float32 workspace, int32 counters), the newest last; all zero between launches
_WORKSPACES: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def workspace(device: torch.device, floats: int, counters: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """This device's zeroed workspace and counters, at least this large: made (zeroed) when none is, except
    during a graph capture (None then). Earlier ones are kept: graphs captured before hold their addresses."""
    have = _WORKSPACES.setdefault(device, [])
    if have and have[-1][0].numel() >= floats and have[-1][1].numel() >= counters:
        return have[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    floats = max(floats, have[-1][0].numel() if have else 0)
    counters = max(counters, have[-1][1].numel() if have else 0)
    have.append((torch.zeros(floats, dtype=torch.float32, device=device),
                 torch.zeros(counters, dtype=torch.int32, device=device)))
    return have[-1]
