"""The reference engine for Qwen3.5-MoE: a KV cache for the full-attention layers, a convolution and a
recurrent state for each Gated DeltaNet layer, and rollback of both.

A KV cache rolls back by moving its length; a recurrent state cannot (it folds every token in). The
choice here is recompute, not per-position copies: `HybridState` keeps a checkpoint of every
DeltaNet layer's states (at position P0) and, for each token since, that layer's inputs to its
recurrence (the projected q/k/v channels before the convolution, the decay and the write strength:
C + 2*HV numbers a token, not the HV*dk*dv of a state). `truncate(n)` for any n in P0..position re-runs
the convolution and the delta rule from the checkpoint over the first n - P0 logged tokens; no
projection, attention or expert runs again. A truncate back by up to ROLLBACK_WINDOW tokens (a verify of
K drafts, a drafter's K single-token steps) never needs more: checkpoints move forward in segments of
that many tokens, the last two kept. A forward longer than the window (a prefill chunk) is not logged:
the checkpoint moves to its end. A truncate to before the oldest checkpoint (rare: generation reuses a
cache only when it is a prefix of the new prompt) runs the kept tokens again from the start.
"""
from __future__ import annotations


import torch

from runtime.engine import ModelInfo
from runtime.errors import BadRequest
from runtime.reference import qwen35 as q35
from runtime.reference import mtp, rope
from runtime.reference.engine import ReferenceEngine

ROLLBACK_WINDOW = 64         # tokens of DeltaNet inputs logged since the checkpoint (at least)
REPLAY_CHUNK = 512           # tokens per forward when a truncate runs the kept tokens again

class KV:
    """Keys and values of the full-attention layers: [L_full, KVH, S_max, D] each."""

    def __init__(self, spec: q35.Spec, length: int, dtype: torch.dtype):
        shape = (spec.full_layers, spec.kv_heads, length, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

class Segment:
    """A checkpoint of every DeltaNet layer's states at position `base`, and each layer's logged inputs
    since: `log[i]` a list of (mixed [t, C], g [t, HV], beta [t, HV]), one entry per forward."""

    def __init__(self, base: int, conv: list, recurrent: list):
        self.base, self.conv, self.recurrent = base, list(conv), list(recurrent)
        self.log: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in conv]

class HybridState:
    """One sequence's cache: `kv`, and per DeltaNet layer `conv[i]` [K-1, C] and `recurrent[i]` [HV, dk, dv]
    float32. State tensors are replaced, never written in place, so a checkpoint holds references.
    At most two segments are kept: a new one starts at the current position when the newest would pass
    ROLLBACK_WINDOW tokens, so the older one still reaches ROLLBACK_WINDOW tokens back."""

    def __init__(self, spec: q35.Spec, capacity: int, dtype: torch.dtype):
        self.spec, self.dtype, self.capacity = spec, dtype, capacity
        self.kv = KV(spec, capacity, dtype)
        self.linear_layers = spec.layers - spec.full_layers
        self.length = 0
        self.reset()

    def reset(self) -> None:
        s = self.spec
        self.conv = [torch.zeros(s.conv_kernel - 1, s.conv_channels, dtype=self.dtype) for _ in range(self.linear_layers)]
        self.recurrent = [torch.zeros(s.lin_value_heads, s.lin_key_dim, s.lin_value_dim)
                          for _ in range(self.linear_layers)]
        self.length = 0
        self.segments = [Segment(0, self.conv, self.recurrent)]
        self.logging = True

    @property
    def base(self) -> int:
        """The oldest position a truncate reaches without a replay."""
        return self.segments[0].base

    def begin(self, t: int) -> None:
        """Before a forward of t tokens: keep the window bounded (see the module docstring)."""
        self.logging = t <= ROLLBACK_WINDOW
        if self.length - self.segments[-1].base + t > ROLLBACK_WINDOW:
            self.segments = self.segments[-1:] + [Segment(self.length, self.conv, self.recurrent)]

    def record(self, i: int, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        if self.logging:
            self.segments[-1].log[i].append((mixed.clone(), g, beta))

    def end(self) -> None:
        if not self.logging:                  # a long forward, not logged: only its end is a checkpoint
            self.segments = [Segment(self.length, self.conv, self.recurrent)]
            self.logging = True

    def rollback(self, length: int, layers: list) -> bool:
        """Return the DeltaNet states to those after the first `length` tokens; False when `length` is
        before the oldest checkpoint (the caller replays). The KV cache needs nothing: its length moves."""
        if length == self.length:
            return True
        found = [k for k, seg in enumerate(self.segments) if seg.base <= length]
        if not found or length > self.length:
            return False
        self.segments = self.segments[:found[-1] + 1]
        seg = self.segments[-1]
        n = length - seg.base
        linear = [layer for layer in layers if layer.conv_weight is not None]
        for i, layer in enumerate(linear):
            if n:
                mixed, g, beta = (torch.cat(parts)[:n] for parts in zip(*seg.log[i]))
                seg.log[i] = [(mixed, g, beta)]
                _, self.conv[i], self.recurrent[i] = q35.mix(layer, self.spec, mixed, g, beta,
                                                             seg.conv[i], seg.recurrent[i])
            else:
                seg.log[i] = []
                self.conv[i], self.recurrent[i] = seg.conv[i], seg.recurrent[i]
        self.length = length
        return True

    def nbytes(self) -> int:
        states = sum(t.numel() * t.element_size() for t in self.conv + self.recurrent)
        return self.kv.k.numel() * self.kv.k.element_size() * 2 + states

class HybridEngine(mtp.MtpDrafting, ReferenceEngine):
    """`ReferenceEngine` over Qwen3.5-MoE's hybrid stack: same checks and errors, its own cache."""

    def __init__(self, info: ModelInfo, spec: q35.Spec, weights: q35.Weights, context_length: int,
                 adapts_threads: bool = False):
        self.adapts_threads = adapts_threads
        self.info = info
        self.spec = spec
        self.refused_tokens = spec.media_tokens      # refused as input (`_forward`), so never sampled
        self.weights = weights
        self.context_length = context_length
        with torch.inference_mode():
            self.cache = HybridState(spec, context_length, weights.dtype)
            self.cos, self.sin = rope.tables(spec.rope, spec.rotary_dim, context_length, weights.dtype)
            self.mtp = mtp.MtpCache(spec, context_length, weights.dtype) if weights.mtp is not None else None
        self.mtp_on = False                    # the MTP head follows the forwards (a drafter asked for it)
        self.tokens: list[int] = []            # what the cache holds, to replay a truncate before the checkpoint
        self._bytes_per_token = weights.nbytes_per_token(spec)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        media = [i for i in ids.tolist() if i in self.spec.media_tokens] if self.spec.media_tokens else []
        if media:
            raise BadRequest(f"token {media[0]} is an image or video placeholder: images and video are not "
                              f"supported (this engine runs {self.info.name}'s language model only)")
        start = self.cache.length
        self.cache.begin(ids.shape[0])
        hidden = q35.forward_hidden(self.weights, self.spec, self.cache, self.cos, self.sin, ids)
        self.cache.end()
        self.tokens += ids.tolist()
        if self.mtp is not None and self.mtp_on:
            self._mtp_follow(start, ids.tolist(), hidden)
        return self.weights.lm_head(hidden).float()

    def _truncate(self, length: int) -> None:
        """The cache and its tokens back to `length`: by the checkpoint, else the kept tokens run again
        (`truncate`, mtp.MtpDrafting's, keeps the MTP head in step)."""
        if length == 0:
            self.cache.reset()
        elif not self.cache.rollback(length, self.weights.layers):
            keep = self.tokens[:length]
            self.cache.reset()
            self.tokens = []
            self._mtp_forward(keep)
        del self.tokens[length:]

    # -- the MTP head (mtp.py: the drafting side shared with the GPU engine, these its hooks) ------

    def _mtp_run(self, hidden: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
        return mtp.run(self.weights, self.spec, self.mtp, self.cos, self.sin, hidden,
                       torch.as_tensor(tokens, dtype=torch.long), start)

    def _mtp_logits(self, m: torch.Tensor) -> torch.Tensor:
        return self.weights.lm_head(m).float()[0]

    def _mtp_forward(self, tokens: list[int]) -> None:
        for s in range(0, len(tokens), REPLAY_CHUNK):
            self._forward(torch.as_tensor(tokens[s:s + REPLAY_CHUNK], dtype=torch.long))

    def telemetry(self) -> dict:
        out = super().telemetry()
        out["cache_bytes"] = self.cache.nbytes() if self.cache is not None else 0
        if self.mtp is not None:
            out["cache_bytes"] += self.mtp.nbytes()
        return out
