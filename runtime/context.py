"""Fitting a conversation into the model's context: the prompt of the next answer, with room for it.

`fit_prompt(tokenizer, messages, context, max_tokens, policy, answer_prefix)` renders the messages
through the chat template and, when the prompt plus room for the answer does not fit, leaves out
whole turns (a user message and the answers after it), never the system prompt and never the last
turn. The policies (`SamplingOptions.context_overflow`):

- `rolling`: the oldest turns go first;
- `keep_first`: the first exchange stays (it often sets the task), the turns after it go first;
- `stop`: nothing is left out; a prompt that does not fit at all is a `context_overflow` error.

Room for the answer: `answer_room(context, max_tokens)`, the answer's limit but at most half the
context, so a long limit never leaves a prompt of nothing. Turns are counted by binary search over how
many to leave out, so a long chat costs a few template renders, not one per turn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from runtime.errors import BadRequest, ContextOverflow


@dataclass(frozen=True)
class FittedPrompt:
    tokens: list[int]              # the prompt, answer prefix included
    prefix_tokens: int             # how many of them are the answer prefix (at the end)
    dropped_messages: int          # messages left out


def answer_room(context: int, max_tokens: int) -> int:
    return max(1, min(max_tokens, context // 2))


def _turn_starts(messages: Sequence[dict]) -> list[int]:
    """Indices where a turn begins: each user message (a system message is never part of a turn)."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return starts or [i for i, m in enumerate(messages) if m["role"] != "system"][:1]


def fit_prompt(tokenizer: Any, messages: Sequence[dict], context: int, max_tokens: int, policy: str,
               answer_prefix: str = "", should_stop: Callable[[], bool] = lambda: False,
               tools: Optional[list] = None) -> FittedPrompt:
    messages = list(messages)
    prefix_ids = tokenizer.encode(answer_prefix) if answer_prefix else []

    def encode(kept: list[dict]) -> list[int]:
        if tools:
            return tokenizer.encode_chat(kept, should_stop=should_stop, tools=tools) + prefix_ids
        return tokenizer.encode_chat(kept, should_stop=should_stop) + prefix_ids

    full = encode(messages)
    room = answer_room(context, max_tokens)
    if len(full) + room <= context or policy == "stop":
        if len(full) >= context:
            raise ContextOverflow(f"the conversation is {len(full)} tokens; the context holds {context}: shorten it, "
                                  f"start a new chat, or let the app leave out the oldest turns",
                                  tokens=len(full), limit=context)
        return FittedPrompt(full, len(prefix_ids), 0)

    starts = _turn_starts(messages)
    keep_head = starts[0]                                  # the system prompt, if any
    if policy == "keep_first" and len(starts) > 2:
        keep_head, starts = starts[1], starts[1:]          # the first exchange stays
    if policy not in ("rolling", "keep_first"):
        raise BadRequest(f"unknown context_overflow policy {policy!r}")

    def without(n: int) -> list[dict]:                     # the first n droppable turns left out
        return messages[:keep_head] + messages[starts[n]:] if n else messages

    # The smallest n (turns left out) that fits: n = len(starts) - 1 keeps only the last turn.
    lo, hi = 1, len(starts) - 1
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        tokens = encode(without(mid))
        if len(tokens) + room <= context:
            best, hi = (mid, tokens), mid - 1
        else:
            lo = mid + 1
    if best is None:                                       # only the last turn left, and still too long
        n = len(starts) - 1
        tokens = encode(without(n)) if n > 0 else full
        if len(tokens) >= context:
            raise ContextOverflow(f"the last message alone is {len(tokens)} tokens; the context holds {context}: "
                                  f"shorten it or load the model with a longer context length",
                                  tokens=len(tokens), limit=context)
        best = (n, tokens)
    n, tokens = best
    return FittedPrompt(tokens, len(prefix_ids), len(messages) - len(without(n)))
