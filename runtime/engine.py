"""The engine interface: what every backend (CUDA `exl2`, CPU `reference`) gives the generation loop.

One primitive does prefill, single-token decode and verify-K: `forward(tokens)` appends the tokens to
the KV cache at the current position and returns the logits of every position it was given
(`[T, vocab]`, float32, on the CPU... or on the engine's device; callers use `.float()` rows).
`truncate(n)` rolls the cache back to its first n tokens, which is all speculation needs.

Speculation, sampling, stop strings and streaming live above this interface (runtime/generate.py,
runtime/speculative/), so they work identically on both backends and with expert offload.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

ProgressFn = Callable[[str, str, int, int], None]   # (stage, message, done, total)


@dataclass
class ModelInfo:
    name: str
    path: str
    architecture: str          # e.g. "LlamaForCausalLM", "Qwen3MoeForCausalLM"
    vocab_size: int
    context_length: int
    num_layers: int
    num_experts: int = 0       # 0 for dense models
    experts_per_token: int = 0
    bits_per_weight: Optional[float] = None
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(abc.ABC):
    """A loaded model with its KV cache, for one sequence (batch 1)."""

    info: ModelInfo
    backend: str               # "cpu" | "cuda"
    adapts_threads = False     # True: its CPU team size follows other programs' load (set_cpu_threads)
    refused_tokens: tuple[int, ...] = ()   # ids `forward` refuses as input: never sampled (`offered`)

    @abc.abstractmethod
    def forward(self, tokens: Sequence[int]):
        """Append `tokens` at the current position; return logits for each of them, shape [T, vocab]."""

    def prefill(self, tokens: Sequence[int]):
        """Append `tokens` like `forward`, returning the last row's logits only, shape [1, vocab]. An
        engine may skip the other rows' logits (the CUDA engine does: for a 2048-token chunk they are
        hundreds of MB of VRAM that the offload budget would otherwise keep for them)."""
        return self.forward(tokens)[-1:]

    @abc.abstractmethod
    def truncate(self, length: int) -> None:
        """Roll the cache back so that it holds only the first `length` tokens."""

    @property
    @abc.abstractmethod
    def position(self) -> int:
        """Number of tokens in the cache."""

    def reset(self) -> None:
        self.truncate(0)

    def idle_work(self) -> bool:
        """One bounded step of work done ahead of need while the worker waits for a command (the
        CUDA engine captures decode graphs); False when nothing is left to do."""
        return False

    def prepare_decode(self, max_new_tokens: int = 1) -> None:
        """Called after a prefill, before the first token is sent: whatever the decode steps of an
        answer of up to `max_new_tokens` would otherwise compile or capture between two of its tokens."""

    def telemetry(self) -> dict[str, Any]:
        """Engine figures for the gauges (expert cache hit rate, bytes per token, ...); {} when none."""
        return {}

    def set_cpu_threads(self, threads: int) -> None:
        """Resize the CPU compute team between two forwards (engines with `adapts_threads` only)."""
        raise NotImplementedError(f"the {self.backend} engine keeps its CPU threads")

    def close(self) -> None:
        """Free what the engine holds (GPU memory, pinned buffers)."""


def offered(engine: Engine, logits):
    """`logits` [..., vocab] as the decoders sample from them: the engine's refused tokens (Qwen3.5's
    image and video placeholders) at -inf, in a copy; the engine's own logits stay as they are."""
    ids = [t for t in getattr(engine, "refused_tokens", ()) if t < logits.shape[-1]]
    if not ids:
        return logits
    out = logits.clone()
    out[..., ids] = float("-inf")
    return out


def random_tokens(engine: Engine, n: int, generator, vocab: Optional[int] = None) -> list[int]:
    """n ids drawn uniformly from the vocabulary (`vocab`, else the model's) less the engine's refused
    tokens: the random streams a trial or a benchmark feeds the engine."""
    import torch
    vocab = engine.info.vocab_size if vocab is None else vocab
    refused = sorted({t for t in getattr(engine, "refused_tokens", ()) if 0 <= t < vocab})
    ids = torch.randint(0, vocab - len(refused), (n,), generator=generator)
    for t in refused:                   # ascending: each id moves past the refused ids at or below it
        ids += (ids >= t).to(ids.dtype)
    return ids.tolist()
