"""Routing statistics: how often each expert of each layer is chosen, counted while the model runs.

Counts decay with a half-life measured in tokens, so the statistics follow what the user does now
(re-placement when they drift) while remembering enough to place experts well at the next load.
Persisted per model as JSON in the cache dir; a corrupt or mismatched file is ignored with a warning.

Shapes: L layers, E experts per layer. The GPU side accumulates an [L, E] count tensor on the device
(no host sync per layer) and hands it here every few hundred tokens through `absorb`.
Pure numpy; no torch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


@dataclass
class RoutingStats:
    counts: np.ndarray             # [L, E] float64, decayed selection counts
    tokens: float = 0.0            # decayed number of tokens behind the counts
    half_life_tokens: float = 8192.0

    @classmethod
    def empty(cls, num_layers: int, num_experts: int, half_life_tokens: float = 8192.0) -> "RoutingStats":
        return cls(np.zeros((num_layers, num_experts), dtype=np.float64), 0.0, half_life_tokens)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.counts.shape)  # type: ignore[return-value]

    def absorb(self, counts: np.ndarray, tokens: int) -> None:
        """Add the selection counts of `tokens` new tokens ([L, E]), decaying what was there."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != self.counts.shape:
            raise ValueError(f"counts of shape {counts.shape} for statistics of shape {self.counts.shape}")
        decay = 0.5 ** (tokens / self.half_life_tokens)
        self.counts = self.counts * decay + counts
        self.tokens = self.tokens * decay + tokens

    def record(self, layer: int, expert_ids: np.ndarray) -> None:
        """Count one layer's choices for a batch of rows ([T, A] expert indices), without decay."""
        ids = np.asarray(expert_ids).reshape(-1)
        self.counts[layer] += np.bincount(ids, minlength=self.counts.shape[1])[: self.counts.shape[1]]

    def frequencies(self) -> np.ndarray:
        """[L, E] share of each layer's selections per expert; uniform where nothing is known yet."""
        total = self.counts.sum(axis=1, keepdims=True)
        uniform = np.full_like(self.counts, 1.0 / self.counts.shape[1])
        return np.where(total > 0, self.counts / np.maximum(total, 1e-30), uniform)

    # -- persistence --------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"version": FORMAT_VERSION, "tokens": self.tokens, "half_life_tokens": self.half_life_tokens,
                "counts": np.round(self.counts, 4).tolist()}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body), encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, num_layers: int, num_experts: int) -> tuple[Optional["RoutingStats"], Optional[str]]:
        """(statistics, None), or (None, warning in words) when the file is missing, corrupt or mismatched."""
        if not path.exists():
            return None, None
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
            if body.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {body.get('version')!r}, expected {FORMAT_VERSION}")
            counts = np.asarray(body["counts"], dtype=np.float64)
            if counts.shape != (num_layers, num_experts):
                raise ValueError(f"shape {counts.shape}, the model has {(num_layers, num_experts)}")
            if not np.all(np.isfinite(counts)) or np.any(counts < 0):
                raise ValueError("negative or non-finite counts")
            stats = cls(counts, float(body["tokens"]), float(body.get("half_life_tokens", 8192.0)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            warning = f"Ignoring routing statistics in {path}: {e}. Experts are placed as if routing were uniform."
            log.warning(warning)
            return None, warning
        return stats, None


def stats_path(cache_dir: Path, model_dir: Path) -> Path:
    """Where a model's statistics live: keyed by its folder and its config, so a changed model starts afresh."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    cfg = model_dir / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    return cache_dir / "routing" / f"{model_dir.name}-{h.hexdigest()[:16]}.json"


def drift(old_freq: np.ndarray, new_freq: np.ndarray, resident: list[list[int]]) -> float:
    """How much routing share the resident set has lost since it was planned (0 = none)."""
    before = np.mean([old_freq[layer, ids].sum() if len(ids) else 0.0 for layer, ids in enumerate(resident)])
    after = np.mean([new_freq[layer, ids].sum() if len(ids) else 0.0 for layer, ids in enumerate(resident)])
    return float(max(0.0, before - after))
