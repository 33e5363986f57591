"""The CPU reference engine: the `Engine` interface over the pure-PyTorch forward in model.py."""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from runtime.engine import Engine, ModelInfo
from runtime.errors import BadRequest, ContextOverflow, EngineError, NoModel
from runtime.reference import model, rope
from runtime.reference.weights import Spec, Weights


class ReferenceEngine(Engine):
    backend = "cpu"
    device = torch.device("cpu")               # a GPU where load(device=...) put the weights (parity checks)

    def __init__(self, info: ModelInfo, spec: Spec, weights: Weights, context_length: int,
                 adapts_threads: bool = False):
        self.adapts_threads = adapts_threads     # automatic threads: the worker resizes the team
        self.info = info
        self.spec = spec
        self.weights = weights
        self.context_length = context_length
        self.device = weights.embed.device
        with torch.inference_mode():
            self.cache = model.KVCache(spec, context_length, weights.dtype, self.device)
            cos, sin = rope.tables(spec.rope, spec.head_dim, context_length, weights.dtype)
            self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self._bytes_per_token = weights.nbytes_per_token(spec)

    @property
    def position(self) -> int:
        return self.cache.length if self.cache is not None else 0

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append tokens at the current position; logits [T, vocab] float32, on the CPU."""
        if self.weights is None:
            raise NoModel("the engine was closed")
        ids = torch.as_tensor(tokens, dtype=torch.long).view(-1)             # [T]
        t = ids.shape[0]
        if t == 0:
            raise BadRequest("forward needs at least one token")
        if self.cache.length + t > self.context_length:
            raise ContextOverflow(f"{self.cache.length} cached + {t} new tokens exceed the context length "
                                  f"of {self.context_length} tokens",
                                  tokens=self.cache.length + t, limit=self.context_length)
        lo, hi = (int(ids[0]), int(ids[0])) if t == 1 else (int(ids.min()), int(ids.max()))
        if lo < 0 or hi >= self.spec.vocab:
            bad = lo if lo < 0 else hi
            raise BadRequest(f"token id {bad} is outside the vocabulary (0..{self.spec.vocab - 1})")
        with torch.inference_mode(), _full_float32(self.device):
            return self._forward(ids.to(self.device)).cpu()

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T], checked -> logits [T, vocab] float32."""
        return model.forward(self.weights, self.spec, self.cache, self.cos, self.sin, ids)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.cache.length:
            raise EngineError(f"cannot truncate to {length} tokens: the cache holds {self.cache.length}")
        self.cache.length = length

    def set_cpu_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)

    def telemetry(self) -> dict[str, Any]:
        return {"weights": self.weights.precision if self.weights else None,
                "cpu_kernel": self.weights.lm_head.kernel if self.weights else None,
                "weight_bytes_per_token": self._bytes_per_token,
                "cpu_threads": torch.get_num_threads()}

    def close(self) -> None:
        self.weights = None
        self.cache = None  # type: ignore[assignment]


@contextlib.contextmanager
def _full_float32(device: torch.device):
    """On a GPU: float32 matmuls in full float32 (no TF32, whatever the process set), restored after, and
    attention by torch's math backend (matmuls and a softmax, as on the CPU; no fused kernel's shortcuts)."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
