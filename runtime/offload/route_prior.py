"""A routing prior measured at load, for a model with no saved routing statistics.

Without statistics the hot experts are placed as if routing were uniform, and re-placement learns the
real hot set only while the first answer decodes (on the H200, q125-a11 at 24 GB: the first answer
after a fresh load decoded at 0.58x the steady state). So a load without usable statistics
(`prior_reason`) runs one prefill of a built-in calibration conversation (`calibration.json` beside
this module, written for the project: a system prompt, a user question and the start of an answer,
rendered through the model's own chat template; never a user's conversation), counts where its tokens
route into the statistics as a prior (`absorb_prior`), and places the hot experts again before the
load ends. runtime/backends/routing_prior.py runs it; the manager keeps the books
(`OffloadManager.learn_prior`).

Weight: the prior enters the statistics as `PRIOR_TOKENS` tokens of traffic whatever the calibration's
length: each layer's counts are scaled to `PRIOR_TOKENS * top_k` picks. The statistics decay with a
half-life of 8192 tokens, so after n tokens of the user's own prompts and answers their counts weigh
n against the prior's ~256: a 256-token prompt already weighs as much, and re-placement follows the
user from there. The prior is saved with the statistics at close; the next load uses them as saved
statistics (no prefill).

Pure numpy (the tokenizer only where one is asked for); no torch.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import numpy as np

from runtime.offload.routing_stats import RoutingStats

log = logging.getLogger(__name__)

PRIOR_TOKENS = 256.0            # the weight of the prior, in tokens of traffic
MIN_SAVED_TOKENS = 64.0         # saved statistics weighing less are too few to place by: a prior is measured
MAX_TOKENS = 512                # calibration tokens at most (the warm-up's largest prefill chunk)
MIN_TOKENS = 64                 # no prior from fewer (a context with less room left measures none)
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


def prior_reason(stats: Optional[RoutingStats], warning: Optional[str] = None) -> Optional[str]:
    """Why a prior is measured at this load, in words; None when the saved statistics are used."""
    if stats is None:
        return "the saved routing statistics are invalid" if warning else "no saved routing statistics"
    if stats.tokens < MIN_SAVED_TOKENS:
        return f"the saved routing statistics cover {stats.tokens:.0f} tokens (fewer than {MIN_SAVED_TOKENS:.0f})"
    empty = np.flatnonzero(stats.counts.sum(axis=1) <= 0)
    if empty.size:
        return f"the saved routing statistics have no counts for MoE layer {int(empty[0])}"
    return None


def prior_counts(window: np.ndarray, top_k: int, weight_tokens: float = PRIOR_TOKENS) -> np.ndarray:
    """[L, E] counts of the calibration's routing scaled so each layer holds `weight_tokens * top_k`
    picks (a layer that routed nothing stays zero: the placement treats it as uniform)."""
    window = np.asarray(window, dtype=np.float64)
    if window.ndim != 2:
        raise ValueError(f"routing counts of shape {window.shape}, expected [layers, experts]")
    if np.any(window < 0) or not np.all(np.isfinite(window)):
        raise ValueError("routing counts must be finite and non-negative")
    if top_k < 1 or weight_tokens <= 0:
        raise ValueError(f"top_k {top_k} and weight {weight_tokens} must be positive")
    total = window.sum(axis=1, keepdims=True)
    return np.where(total > 0, window * (weight_tokens * top_k / np.maximum(total, 1e-30)), 0.0)


def absorb_prior(stats: RoutingStats, window: np.ndarray, top_k: int, weight_tokens: float = PRIOR_TOKENS) -> None:
    """Count the calibration's routing (`window`, [L, E] picks) into `stats` as `weight_tokens` tokens."""
    stats.absorb(prior_counts(window, top_k, weight_tokens), int(round(weight_tokens)))


def calibration_messages(path: Path = CALIBRATION_FILE) -> tuple[list[dict], str]:
    """(system and user messages, the start of the answer) of the calibration conversation."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        parts = [body[k] for k in ("system", "user", "answer")]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"the calibration conversation {path.name} cannot be read: {e}") from None
    if not all(isinstance(p, str) and p.strip() for p in parts):
        raise ValueError(f"{path.name}: 'system', 'user' and 'answer' must be non-empty text")
    return [{"role": "system", "content": parts[0]}, {"role": "user", "content": parts[1]}], parts[2]


def calibration_ids(folder: Optional[Path], vocab: int, limit: int = MAX_TOKENS,
                    seed: int = 0) -> tuple[list[int], str]:
    """(token ids, where they came from) for the calibration prefill, at most `limit` of them: the
    conversation rendered through the model's chat template and the answer's start after it; plain
    text through the tokenizer where the template fails or there is none; random ids in 0..vocab-1
    only where the folder has no usable tokenizer."""
    if limit < 1 or vocab < 1:
        raise ValueError(f"no room for a calibration prompt (limit {limit}, vocabulary {vocab})")
    messages, answer = calibration_messages()
    why = "the model has no folder"
    if folder is not None:
        from runtime.tokenizer import Tokenizer
        try:                            # a prior is worth no failed load: what goes wrong is logged
            tok = Tokenizer.from_folder(folder)
            ids, source = _encode(tok, messages, answer)
        except Exception as e:
            ids, why = [], f"no usable tokenizer ({e})"
        if ids and max(ids) < vocab:
            return ids[:limit], source
        if ids:
            why = f"the tokenizer's ids reach {max(ids)}, the model has {vocab}"
    log.info("routing prior from random ids: %s", why)
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=min(limit, MAX_TOKENS)).tolist(), f"random ids ({why})"


def _encode(tok, messages: list[dict], answer: str) -> tuple[list[int], str]:
    from runtime.errors import EngineError
    try:
        return tok.encode_chat(messages) + tok.encode(answer), "a calibration prompt in the model's chat template"
    except EngineError as e:            # no template, a broken one, one that refuses these messages: the text
        log.info("routing prior without the chat template: %s", e)
    text = "\n\n".join(m["content"] for m in messages) + "\n\n" + answer
    return tok.encode(text, add_special_tokens=True), "a calibration prompt as plain text (no usable chat template)"
