"""Models to suggest before any search: the list in resources/recommended-models.json, ranked for this machine.

`recommend(vram, ram, context)` keeps, per model, the quant with the most bits per weight that fits
(in VRAM first; for an MoE, with its experts offloaded to RAM next, from `fit.estimate_fit`), drops
models with none, and puts the largest model first. Without an NVIDIA GPU the CPU engine runs only
small models: those up to `CPU_MAX_PARAMS` whose weights fit in RAM, smallest first. No network.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from app.hub.fit import GB, FitError, FitEstimate, ModelShape, Verdict, estimate_fit, exl2_size_bytes
from app.resources import resource

LIST = "recommended-models.json"
CPU_MAX_PARAMS = 4e9          # the CPU engine's int8 weights: larger models answer too slowly to suggest
SHOWN = 5


@dataclass(frozen=True)
class Candidate:
    repo: str
    name: str
    shape: ModelShape
    branch: str
    bpw: float
    head_bits: float

    @property
    def size_bytes(self) -> int:
        return exl2_size_bytes(self.shape, self.bpw, self.head_bits)


@dataclass(frozen=True)
class Recommendation:
    candidate: Candidate
    verdict: str                         # in words, e.g. "fits in VRAM"
    estimate: Optional[FitEstimate]      # None on the CPU engine

    @property
    def text(self) -> str:
        c = self.candidate
        return f"{c.name} — {c.branch}, {c.size_bytes / GB:.1f} GB: {self.verdict}"


def load_candidates(path: Optional[Path] = None) -> list[Candidate]:
    """Every (model, branch) of the list; a malformed list raises ValueError naming the entry."""
    path = path or resource(LIST)
    data = json.loads(path.read_text(encoding="utf-8"))
    out = []
    for i, m in enumerate(data.get("models", [])):
        where = f"{path.name}: models[{i}]"
        try:
            shape = ModelShape.from_config(m["shape"])
            for b in m["branches"]:
                out.append(Candidate(m["repo"], m["name"], shape, b["branch"], float(b["bpw"]),
                                     float(b.get("head_bits", 6.0))))
        except (KeyError, TypeError, FitError) as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def recommend(vram: float, ram: float, context: int = 8192, kv_cache: str = "fp16",
              candidates: Optional[list[Candidate]] = None, limit: int = SHOWN) -> list[Recommendation]:
    candidates = load_candidates() if candidates is None else candidates
    best: dict[str, tuple[tuple, Recommendation]] = {}
    for c in candidates:
        if vram <= 0:
            params = c.shape.total_params()
            if params > CPU_MAX_PARAMS or params + 4 * GB > ram:
                continue
            rank = (0, -params, c.bpw)           # smallest first: the CPU engine is slow
            rec = Recommendation(c, f"runs on the CPU engine (about {params / GB:.1f} GB of RAM)", None)
        else:
            est = estimate_fit(c.shape, c.bpw, context, kv_cache, vram, ram, c.head_bits)
            if est.verdict is Verdict.DOES_NOT_FIT:
                continue
            rank = (1 if est.verdict is Verdict.FITS_VRAM else 0, c.shape.total_params(), c.bpw)
            rec = Recommendation(c, est.text, est)
        if c.repo not in best or rank > best[c.repo][0]:
            best[c.repo] = (rank, rec)
    ranked = sorted(best.values(), key=lambda r: (r[0][1], r[0][0]) if vram > 0 else r[0][1:], reverse=True)
    return [rec for _, rec in ranked[:limit]]
