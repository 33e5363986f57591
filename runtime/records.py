"""Plain-data records the engine produces and the protocol carries: statistics of one generation.

Frozen dataclasses of plain values, no torch and no wire: runtime/generate.py fills them,
runtime/protocol.py sends them inside `finished` (and checks every field when reading them back).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DraftStats:
    mode: str                          # "model" | "mtp" | "ngram" | "off"
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: Optional[float] = None
    mean_accepted_length: Optional[float] = None  # accepted drafts per target forward
    tokens_per_forward: Optional[float] = None    # tokens produced per target forward
    speedup: Optional[float] = None               # vs plain decoding measured in the same request
    draft_tokens_now: Optional[int] = None        # current K (adaptive)
    acceptance_histogram: tuple[int, ...] = ()     # [i]: speculative steps that kept i drafts
    # Where the time went (wall time of whole steps: drafting, forward, acceptance), for diagnosis
    verify_forwards: int = 0                      # steps that verified drafts (one target forward each)
    verify_rows_mean: Optional[float] = None      # rows per verify forward (drafts + 1)
    verify_step_s_mean: Optional[float] = None    # mean wall time of those steps
    plain_steps: int = 0                          # steps that decoded one token without drafts
    plain_step_s_mean: Optional[float] = None     # mean wall time of those steps
    decisions: tuple[str, ...] = ()               # what the draft policy decided, "step N: ..." in order


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: Optional[float]            # time to first token
    prefill_tps: Optional[float]       # prompt tokens per second
    decode_tps: Optional[float]        # generated tokens per second after the first
    total_s: float
    draft: Optional[DraftStats] = None
    dropped_messages: int = 0          # oldest messages left out so the conversation fits the context
