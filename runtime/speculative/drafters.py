"""Where draft tokens come from: a small draft model, the model's own multi-token-prediction head, or
n-gram lookup in the tokens so far.

A drafter offers `propose(tokens, k) -> Proposal` (up to k tokens, possibly none). Each call
resynchronises from `tokens` itself, so plain steps in between, rejected drafts and a new
conversation need no bookkeeping outside the drafter.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from runtime import sampling
from runtime.engine import Engine
from runtime.options import SamplingOptions
from runtime.speculative.core import Proposal, timed_forward



def _pick(row: torch.Tensor, history: list[int], opts: SamplingOptions, generator: Optional[torch.Generator],
          qs: list[torch.Tensor], steer=None) -> Optional[int]:
    """One draft token from a row of logits: greedy at temperature 0, else drawn from
    `sampling.probabilities` (kept in `qs` for the acceptance test); appended to `history`. `steer`: a
    fork of the request's steering (its grammar's copy advances with the drafts); None when it allows
    no token at all (the grammar's answer is complete): drafting stops there."""
    raw = row
    if steer is not None:
        row = steer.row(raw, history)
        if bool(torch.isinf(row).all()):
            return None
    if opts.temperature == 0:
        d = sampling.sample(row, history, opts)
    else:
        q = sampling.probabilities(row, history, opts)                    # [V]
        d = sampling.draw(q, generator)
        qs.append(q)
    if steer is not None:
        steer.took(raw, d)
    history.append(d)
    return d

class ModelDrafter:
    """A small model with the target's vocabulary drafts K tokens autoregressively.

    Its own cache mirrors a prefix of the target's: `cached` lists the tokens in it. Before drafting
    it rolls back to the longest common prefix with `tokens` (dropping rejected drafts) and feeds the
    rest, so the last fed row gives the distribution of the first draft.
    """

    mode = "model"

    def __init__(self, engine: Engine, opts: SamplingOptions, generator: Optional[torch.Generator], steer=None):
        self.engine = engine
        self.opts = opts
        self.generator = generator
        self.steer = steer                # the request's steering: drafts follow a copy of its grammar
        self.cached: list[int] = []
        self.forward_s = 0.0          # time spent in draft forwards (for the cost model)
        self.forwards = 0

    def propose(self, tokens: list[int], k: int) -> Proposal:
        # Resync: keep the common prefix (at least one token must be fed to get logits).
        keep = _common_prefix(self.cached, tokens, limit=min(len(tokens) - 1, self.engine.position))
        if self.engine.position != keep:
            self.engine.truncate(keep)
        self.cached = tokens[:keep]
        feed = tokens[keep:]                                              # >= 1 token

        # Draft: sample d_i from q_i, feed it, repeat; d_K is never fed (it may be rejected anyway).
        history = list(tokens)
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        fork = self.steer.fork() if self.steer is not None else None
        for i in range(k):
            logits, dt = timed_forward(self.engine, feed)                 # [len(feed), V]
            self.forward_s += dt
            self.forwards += 1
            self.cached += feed
            d = _pick(logits[-1], history, self.opts, self.generator, qs, fork)
            if d is None:
                break
            drafts.append(d)
            feed = [d]
        q = torch.stack(qs) if qs else None                               # [K, V] or None at temperature 0
        return Proposal(drafts, q)

    def rollback(self, length: int) -> None:
        if len(self.cached) > length:
            self.engine.truncate(length)
            del self.cached[length:]

    def cost_per_token(self) -> Optional[float]:
        return self.forward_s / self.forwards if self.forwards else None


class MtpDrafter:
    """The target's multi-token-prediction head drafts (Qwen3.5-MoE: `engine.mtp_draft`). The head's cache
    lives in the target engine and follows the target's own forwards and truncates, so a rejection needs
    nothing here. Each draft is picked from the head's logits by the same rule as a draft model's:
    greedy at temperature 0, else drawn from `sampling.probabilities` (returned as q for the acceptance test).
    """

    mode = "mtp"

    def __init__(self, engine: Engine, opts: SamplingOptions, generator: Optional[torch.Generator], steer=None):
        engine.mtp_enable()                      # before the prefill: the head sees the whole conversation
        self.engine = engine
        self.opts = opts
        self.generator = generator
        self.steer = steer
        self.draft_s = 0.0
        self.drafted = 0

    def propose(self, tokens: list[int], k: int) -> Proposal:
        history = list(tokens)
        qs: list[torch.Tensor] = []
        fork = self.steer.fork() if self.steer is not None else None

        def choose(row: torch.Tensor) -> int:
            d = _pick(row, history, self.opts, self.generator, qs, fork)
            if d is None:                    # the grammar's answer is complete: its end-of-sequence then
                d = _pick(row, history, self.opts, self.generator, qs)
            return d

        t0 = time.perf_counter()
        drafts = self.engine.mtp_draft(tokens, k, choose)
        self.draft_s += time.perf_counter() - t0
        self.drafted += len(drafts)
        return Proposal(drafts, torch.stack(qs) if qs else None)

    def rollback(self, length: int) -> None:
        pass                             # the head's cache is the target's: its truncate trimmed it

    def cost_per_token(self) -> Optional[float]:
        return self.draft_s / self.drafted if self.drafted else None


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the longest suffix (n = n_max..n_min) of the
    tokens so far and propose the tokens that followed it. No model, so drafting costs ~nothing.

    The copy runs on into its own drafts where the occurrence lies closer to the end than k tokens
    (`_copy_on`): in text that repeats with a short period (a list, a table, a looping answer) the
    latest occurrence is one period back, and stopping at the end offered only `period` drafts per
    step, so every verify paid a wide forward's fixed cost for one or two tokens.

    `index` maps each n-gram to the position right after its latest occurrence that has a follower;
    it grows incrementally as tokens are appended and is rebuilt if the token list changes otherwise.
    """

    mode = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes: need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.seen: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}

    def propose(self, tokens: list[int], k: int) -> Proposal:
        self._sync(tokens)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            after = self.index.get(tuple(tokens[-n:]))
            if after is not None:
                return Proposal(_copy_on(tokens, after, k))
        return Proposal([])

    def _sync(self, tokens: list[int]) -> None:
        if tokens[:len(self.seen)] != self.seen:                         # not an extension: start over
            self.seen, self.index = [], {}
        # Index n-grams ending at `end` for every end that has a follower (end <= len(tokens) - 1).
        for end in range(max(len(self.seen), 1), len(tokens)):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.index[tuple(tokens[end - n:end])] = end
        self.seen = list(tokens)

    def rollback(self, length: int) -> None:
        pass                             # nothing cached beyond the token list itself

    def cost_per_token(self) -> Optional[float]:
        return 0.0


def _copy_on(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens copied from `start` on, where a copy that reaches the end continues with the tokens it
    copied itself (as LZ77 does): the continuation of the repetition the match found."""
    out: list[int] = []
    n = len(tokens)
    for i in range(k):
        j = start + i
        out.append(tokens[j] if j < n else out[j - n])
    return out


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
