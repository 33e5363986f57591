"""Speculative decoding over the engine interface: works the same on every backend and with offload.

    make_decoder(engine, draft, sampling, generator, draft_engine=None) -> SpeculativeDecoder

Modes (DraftOptions.mode): "model" (a small draft model with the target's vocabulary, in
`draft_engine`), "mtp" (the target's own multi-token-prediction head, Qwen3.5-MoE), "ngram" (prompt lookup in the tokens so far, no model), "off" (plain steps, with the
same stats). The step itself is `core.speculative_step`; `adaptive.DraftPolicy` picks the draft
length; `bench/spec.py` (outside the runtime) measures it.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

from runtime.engine import Engine
from runtime.options import DraftOptions, SamplingOptions
from runtime.speculative.adaptive import DraftPolicy
from runtime.speculative.decoder import Drafter, SpeculativeDecoder
from runtime.speculative.drafters import ModelDrafter, MtpDrafter, NgramDrafter

__all__ = ["make_decoder", "SpeculativeDecoder"]


def make_decoder(engine: Engine, draft: DraftOptions, sampling: SamplingOptions, generator=None,
                 draft_engine: Optional[Engine] = None, steer=None) -> SpeculativeDecoder:
    """A decoder for one request. Raises ValueError naming the problem for an unusable combination.
    `steer`: the request's grammar, penalties and logprobs (runtime/constrained.py), or None."""
    if draft.mode not in ("off", "model", "mtp", "ngram"):
        raise ValueError(f"draft.mode: {draft.mode!r} is not one of off, model, mtp, ngram")
    if draft.mode == "model" and draft_engine is None:
        raise ValueError("draft.mode is 'model' but no draft model is loaded (set draft.model)")
    if draft.mode == "mtp" and not getattr(engine, "has_mtp", False):
        raise ValueError(f"draft.mode is 'mtp' but {engine.info.name} has no multi-token-prediction head "
                         f"(mtp.* tensors; Qwen3.5-MoE checkpoints have one)")
    if draft.draft_tokens < 1:
        raise ValueError(f"draft.draft_tokens: must be at least 1, got {draft.draft_tokens}")
    most = getattr(engine, "max_draft_tokens", None)
    if most is not None and draft.draft_tokens > most:
        # an engine that rolls back only so many rows (the Qwen3.5 GPU engine's snapshot ring, sized at
        # load): a longer verify could not be taken back but by running the whole conversation again
        draft = dataclasses.replace(draft, draft_tokens=max(1, most))
    policy = _policy(engine, draft, draft_engine)
    drafter: Optional[Drafter] = None
    if draft.mode == "model":
        drafter = ModelDrafter(draft_engine, sampling, generator, steer)
    elif draft.mode == "mtp":
        drafter = MtpDrafter(engine, sampling, generator, steer)
    elif draft.mode == "ngram":
        drafter = NgramDrafter()
    return SpeculativeDecoder(engine, drafter, draft, sampling, generator, policy, steer=steer)


_POLICIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # engine -> {(mode, K, adaptive, draft engine): policy}


def _policy(engine: Engine, draft: DraftOptions, draft_engine: Optional[Engine]) -> DraftPolicy:
    """The engine's draft policy for these options, kept from request to request (its windows
    measure the machine; per request they were measured anew, right after each prefill), told that
    a new request begins."""
    key = (draft.mode, draft.draft_tokens, draft.adaptive, id(draft_engine) if draft.mode == "model" else None)
    try:
        policies = _POLICIES.setdefault(engine, {})
    except TypeError:                                   # an engine that cannot be weakly referenced
        policies = {}
    policy = policies.get(key)
    if policy is None:
        policy = policies[key] = DraftPolicy(draft.draft_tokens, adaptive=draft.adaptive)
    policy.new_request()
    return policy
