"""One sequence's cache for the hybrid engine (Qwen3.5-MoE), preallocated whole at load.

- The full-attention layers: a flat KV cache [L_full, KVH, S, D] (positions index it directly).
- Each Gated DeltaNet layer: its convolution state (the last K-1 inputs [K-1, C]) and its recurrent
  state [HV, dk, dv] float32, updated in place.
- Rollback: a recurrent state cannot move back, so every forward of up to `window` rows (decode,
  a verify of K drafts: window >= K + 1) writes the states after each of its tokens into a ring of
  window + 1 snapshots: slot s holds the states after position `base + s`, slot 0 those at `base`.
  A truncate to any n in base..length copies slot n - base back (exact: the very states the forward
  computed). `base` moves to the current position before a forward that would run past the ring
  (the states there are copied into slot 0), and to the end of a longer forward (a prefill chunk,
  not snapshotted). A truncate to before `base` is the engine's to serve (it replays the kept tokens).

Every tensor a forward reads or writes has a fixed shape and address: the positions and snapshot
slots of a forward of T <= window rows are device buffers (`positions`, `slots`) filled before it,
so a decode or verify step can be captured as a CUDA graph and replayed at any position of its
bucket (the attention reads the first L rows: runtime/backends/hybrid_graphs.py).

Letters: T rows, S capacity (tokens), W window, C convolution channels, K kernel.
"""
from __future__ import annotations

from typing import Optional

import torch

from runtime.errors import EngineError


class HybridCache:
    def __init__(self, spec, capacity: int, window: int, dtype: torch.dtype, device: torch.device):
        if window < 1:
            raise EngineError(f"the rollback window must be at least 1 row, got {window}")
        s = spec
        linear = s.layers - s.full_layers
        self.capacity, self.window, self.device = capacity, window, device
        self.k = torch.zeros((s.full_layers, s.kv_heads, capacity, s.head_dim), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.conv = torch.zeros((linear, s.conv_kernel - 1, s.conv_channels), dtype=dtype, device=device)
        self.rec = torch.zeros((linear, s.lin_value_heads, s.lin_key_dim, s.lin_value_dim), dtype=torch.float32,
                               device=device)
        self.hist_conv = torch.zeros((linear, window + 1, *self.conv.shape[1:]), dtype=dtype, device=device)
        self.hist_rec = torch.zeros((linear, window + 1, *self.rec.shape[1:]), dtype=torch.float32, device=device)
        self.positions = torch.zeros(window, dtype=torch.long, device=device)   # of the rows of a short forward
        self.slots = torch.zeros(window, dtype=torch.long, device=device)       # their snapshot slots
        self.length = 0
        self.base = 0

    def reset(self) -> None:
        self.conv.zero_()
        self.rec.zero_()
        self.length = self.base = 0
        self._rebase()

    def _rebase(self) -> None:
        self.base = self.length
        self.hist_conv[:, 0].copy_(self.conv)
        self.hist_rec[:, 0].copy_(self.rec)

    def begin(self, t: int, at: Optional[int] = None) -> bool:
        """Before a forward of t rows at `length`: True when it is snapshotted (t <= window); then
        `positions[:t]` and `slots[:t]` hold its rows' positions and snapshot slots. at: the rows'
        positions start there instead (>= length: a graph captured ahead of need for a later bucket,
        whose K/V rows past the end are overwritten before they are attended; the caller rolls back)."""
        at = self.length if at is None else at
        if not self.length <= at <= self.capacity - t:
            raise EngineError(f"{t} tokens at position {at} do not fit the cache's {self.capacity} "
                              f"from its length {self.length}")
        if t > self.window:
            if at != self.length:
                raise EngineError(f"a forward of {t} rows (> the window of {self.window}) must start at the "
                                  f"cache's length {self.length}, not {at}")
            return False
        if self.length - self.base + t > self.window:
            self._rebase()
        first = self.length - self.base + 1
        host = torch.stack([torch.arange(at, at + t), torch.arange(first, first + t)])
        self.positions[:t].copy_(host[0], non_blocking=True)
        self.slots[:t].copy_(host[1], non_blocking=True)
        return True

    def end(self, t: int, logged: bool) -> None:
        self.length += t
        if not logged:                  # a long forward: only its end is a point to roll back to
            self._rebase()

    def rollback(self, length: int, force: bool = False) -> bool:
        """Back to the states after the first `length` tokens; False when that is before `base`.
        force: copy even when `length` is the current length (a forward failed half-way through)."""
        if not 0 <= length <= self.length:
            raise EngineError(f"cannot roll back to {length} tokens: the cache holds {self.length}")
        if length == self.length and not force:
            return True
        if length < self.base:
            return False
        s = length - self.base
        self.conv.copy_(self.hist_conv[:, s])
        self.rec.copy_(self.hist_rec[:, s])
        self.length = length
        return True

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the DeltaNet states at the current length (one per layer), for `restore`."""
        return self.conv.clone(), self.rec.clone()

    def restore(self, length: int, states: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Back to `length` with the states `states()` copied there, forwards run since left no trace; the
        ring starts at `length` again (the snapshots of earlier rows are gone: a truncate before it
        replays). What a forward wrote to the attention cache past `length` is overwritten before read."""
        if not 0 <= length <= self.length:
            raise EngineError(f"cannot restore to {length} tokens: the cache holds {self.length}")
        self.conv.copy_(states[0])
        self.rec.copy_(states[1])
        self.length = length
        self._rebase()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.conv, self.rec, self.hist_conv,
                                                           self.hist_rec))
