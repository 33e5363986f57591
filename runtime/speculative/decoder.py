"""The speculative decoder the generation loop drives: `step(tokens) -> new tokens`, `stats()`."""
from __future__ import annotations

import time
from typing import Optional, Union

import torch

from runtime.engine import Engine
from runtime.options import DraftOptions, SamplingOptions
from runtime.records import DraftStats
from runtime.speculative.adaptive import DraftPolicy
from runtime.speculative.core import StepResult, plain_step, speculative_step
from runtime.speculative.drafters import ModelDrafter, MtpDrafter, NgramDrafter

Drafter = Union[ModelDrafter, MtpDrafter, NgramDrafter]
MAX_DECISIONS = 32          # policy verdicts kept per request (stats travel in every telemetry event)


class SpeculativeDecoder:
    """One request's decoder. Before `step` the target's cache holds `tokens[:-1]`; after it,
    `tokens + new[:-1]` (the contract of runtime/generate.py's plain decoder)."""

    def __init__(self, target: Engine, drafter: Optional[Drafter], draft: DraftOptions,
                 opts: SamplingOptions, generator: Optional[torch.Generator], policy: DraftPolicy, steer=None):
        self.target = target
        self.steer = steer                    # the request's grammar, penalties, logprobs (or None)
        self.drafter = drafter
        self.opts = opts
        self.generator = generator
        self.policy = policy                  # the engine's, kept across requests (make_decoder)
        # Figures for stats()
        self.histogram = [0] * (draft.draft_tokens + 1)   # speculative steps by accepted drafts
        self.drafted = self.accepted = 0
        self.forwards = self.produced = 0
        self.plain_s = 0.0
        self.plain_tokens = 0
        self.all_s = 0.0
        self.verify_forwards = self.verify_rows = 0
        self.verify_s = 0.0
        self.steps = 0
        # The policy's verdicts over this request, the one it starts from (kept from earlier requests) first
        self.decisions: list[str] = []
        self._reason: Optional[str] = None
        self._note_decision()

    def step(self, tokens: list[int], max_new: Optional[int] = None) -> list[int]:
        """Decode at least one token after `tokens`; `max_new` (optional) caps drafting."""
        if not tokens:
            raise ValueError("step: tokens is empty; the prompt must hold at least one token")
        t0 = time.perf_counter()

        # How many tokens to draft: the policy's choice, within the context and the caller's limit.
        k = self.policy.choose() if self.drafter is not None else 0
        k = min(k, self._room(tokens), (max_new or k + 1) - 1)

        # Draft and verify; or decode plainly (asking lookup, for free, what it would have drafted).
        if k > 0:
            result = speculative_step(self.target, self.drafter, tokens, k, self.opts, self.generator, self.steer)
        else:
            lookup = self._shadow_proposal(tokens)
            result = plain_step(self.target, tokens, self.opts, self.generator, self.steer)
            if lookup is not None:
                self.policy.shadow(lookup == result.new[0])

        # Learn and count.
        step_s = time.perf_counter() - t0
        self.policy.observe(result.drafted, result.accepted, result.rows, step_s - result.draft_s, step_s)
        if isinstance(self.drafter, (ModelDrafter, MtpDrafter)):
            self.policy.set_draft_cost(self.drafter.cost_per_token())
        self._count(result, step_s)
        self._note_decision()
        return result.new

    def stats(self) -> DraftStats:
        spec_steps = sum(self.histogram)
        return DraftStats(
            mode=self.drafter.mode if self.drafter is not None else "off",
            drafted_tokens=self.drafted,
            accepted_tokens=self.accepted,
            acceptance_rate=self.accepted / self.drafted if self.drafted else None,
            mean_accepted_length=self.accepted / spec_steps if spec_steps else None,
            tokens_per_forward=self.produced / self.forwards if self.forwards else None,
            speedup=self._speedup(),
            draft_tokens_now=0 if self.policy.off else self.policy.k_now,
            acceptance_histogram=tuple(self.histogram),
            verify_forwards=self.verify_forwards,
            verify_rows_mean=self.verify_rows / self.verify_forwards if self.verify_forwards else None,
            verify_step_s_mean=self.verify_s / self.verify_forwards if self.verify_forwards else None,
            plain_steps=self.plain_tokens,
            plain_step_s_mean=self.plain_s / self.plain_tokens if self.plain_tokens else None,
            decisions=tuple(self.decisions),
        )

    # -- helpers -------------------------------------------------------------------------------

    def _room(self, tokens: list[int]) -> int:
        """Drafts that still fit the context of the target (and of the draft model)."""
        limits = [self.target.info.context_length]
        if isinstance(self.drafter, ModelDrafter):
            limits.append(self.drafter.engine.info.context_length)
        return max(min(limits) - len(tokens) - 1, 0)

    def _shadow_proposal(self, tokens: list[int]) -> Optional[int]:
        """What lookup would have drafted first, when asking costs nothing (n-gram drafting)."""
        if not isinstance(self.drafter, NgramDrafter) or not self.policy.adaptive:
            return None
        first = self.drafter.propose(tokens, 1).tokens
        return first[0] if first else None

    def _note_decision(self) -> None:
        """Keep the policy's verdict when it changed (step 0: the one this request starts from)."""
        reason = self.policy.reason if self.policy.adaptive else f"fixed K = {self.policy.k_max}"
        if reason != self._reason and len(self.decisions) < MAX_DECISIONS:
            self.decisions.append(f"step {self.steps}: {reason} (K {self.policy.k_now})")
        self._reason = reason

    def _count(self, result: StepResult, step_s: float) -> None:
        self.steps += 1
        self.forwards += 1
        self.produced += len(result.new)
        self.all_s += step_s
        if result.drafted:
            self.drafted += result.drafted
            self.accepted += result.accepted
            self.histogram[result.accepted] += 1
            self.verify_forwards += 1
            self.verify_rows += result.rows
            self.verify_s += step_s
        else:
            self.plain_s += step_s
            self.plain_tokens += 1

    def _speedup(self) -> Optional[float]:
        """Plain decoding's wall time per token / drafting's, from the policy's windows of recent
        steps (stalls left out); without them (a fixed K), plain steps of this request against all."""
        measured = self.policy.measured()["measured_speedup"]
        if measured is not None:
            return measured
        if not self.plain_tokens or not self.produced or self.all_s <= 0:
            return None
        return (self.plain_s / self.plain_tokens) / (self.all_s / self.produced)
