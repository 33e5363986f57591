"""Turning one row of logits into the next token: the same transforms for plain and speculative decoding.

    transform(logits, history, opts)      -> logits'  [V]  masked tokens are -inf
    probabilities(logits, history, opts)  -> probs    [V]  softmax of transform (one-hot at temperature 0)
    sample(logits, history, opts, gen)    -> int           temperature 0: argmax of the penalised logits
    choose(raw, history, opts, gen, steer) -> int          sample through a request's steering (runtime/constrained.py)

Order, as in Hugging Face transformers' generate: repetition penalty (over the tokens in `history`:
positive logits divided by the penalty, negative ones multiplied), temperature, top-k, top-p (the
smallest set of most likely tokens whose mass reaches p, never empty), min-p (drop tokens below
min_p times the most likely one's probability). The most likely token always survives, so a
distribution is never all masked. Speculative sampling (runtime/speculative/) computes both the
target's p and the draft's q through `probabilities`, which makes it exact over the very
distribution plain decoding samples from.

Shapes: V vocabulary, C candidate tokens (top-k of V, or all V sorted). Works on CPU or GPU tensors.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from runtime.constrained import Steering
from runtime.options import SamplingOptions

History = Union[Sequence[int], torch.Tensor]


class SamplingError(ValueError):
    """Bad input to the sampler: names the argument and what is wrong with it."""


def transform(logits: torch.Tensor, history: History, opts: SamplingOptions) -> torch.Tensor:
    """Apply the sampling transforms to one row of logits [V]; returns float32 [V] with -inf where masked."""
    _check(logits, opts)
    x = penalise(logits, history, opts.repetition_penalty)              # [V] float32

    # Greedy: only the argmax survives (so probabilities() is one-hot and speculation accepts on equality).
    if opts.temperature == 0:
        out = torch.full_like(x, float("-inf"))
        best = torch.argmax(x)
        out[best] = x[best]
        return out

    x = x / opts.temperature
    V = x.shape[0]

    # Candidates, most likely first: top-k (exactly k tokens) or the whole vocabulary sorted.
    if 0 < opts.top_k < V:
        vals, idx = torch.topk(x, opts.top_k)                          # [C], [C]
    else:
        vals, idx = torch.sort(x, descending=True, stable=True)         # [C] = [V]

    # Top-p: keep a candidate while the mass of those before it is still below p.
    if opts.top_p < 1.0:
        probs = torch.softmax(vals, dim=0)                               # [C]
        before = torch.cumsum(probs, dim=0) - probs                      # exclusive prefix mass
        drop = before >= opts.top_p
        drop[0] = False
        vals = vals.masked_fill(drop, float("-inf"))

    # Min-p: drop candidates less likely than min_p times the most likely one (always candidate 0).
    if opts.min_p > 0.0:
        probs = torch.softmax(vals, dim=0)                               # [C]
        vals = vals.masked_fill(probs < opts.min_p * probs[0], float("-inf"))

    out = torch.full_like(x, float("-inf"))
    out[idx] = vals
    return out


def probabilities(logits: torch.Tensor, history: History, opts: SamplingOptions) -> torch.Tensor:
    """The distribution plain decoding samples from: float32 [V] summing to 1 (one-hot at temperature 0)."""
    return torch.softmax(transform(logits, history, opts), dim=0)


def sample(logits: torch.Tensor, history: History, opts: SamplingOptions,
           generator: Optional[torch.Generator] = None) -> int:
    """One token id. Temperature 0 is the argmax of the penalised logits and uses no randomness."""
    if opts.temperature == 0:
        _check(logits, opts)
        return int(torch.argmax(penalise(logits, history, opts.repetition_penalty)))
    return draw(probabilities(logits, history, opts), generator)


def choose(raw: torch.Tensor, history: Sequence[int], opts: SamplingOptions, generator: Any = None,
           steer: Optional[Steering] = None) -> int:
    """One token from a raw row of logits, through the request's steering (a runtime/constrained.py
    `Steering`: grammar, penalties, logprobs; None: plain sampling). Every decoder samples through it."""
    if steer is None:
        return sample(raw, history, opts, generator)
    tok = sample(steer.row(raw, history), history, opts, generator)
    steer.took(raw, tok)
    return tok


def draw(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    """One token id drawn from a distribution [V] (need not be normalised) with `generator`'s stream."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def penalise(logits: torch.Tensor, history: History, penalty: float) -> torch.Tensor:
    """Repetition penalty over the tokens of `history` (each counted once); float32 copy [V]."""
    x = logits.detach().to(torch.float32).clone()
    if penalty == 1.0 or len(history) == 0:
        return x
    seen = torch.as_tensor(history, dtype=torch.long, device=x.device)   # [H], repeats are harmless
    if seen.dim() != 1:
        raise SamplingError(f"history: expected a flat list of token ids, got shape {tuple(seen.shape)}")
    lo, hi = int(seen.min()), int(seen.max())
    if lo < 0 or hi >= x.shape[0]:
        bad = lo if lo < 0 else hi
        raise SamplingError(f"history: token id {bad} is outside the vocabulary of {x.shape[0]}")
    v = x[seen]
    x[seen] = torch.where(v > 0, v / penalty, v * penalty)
    return x


def _check(logits: torch.Tensor, opts: SamplingOptions) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 1 or logits.shape[0] == 0:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise SamplingError(f"logits: expected one row [vocab], got {shape}")
    if not opts.temperature >= 0:
        raise SamplingError(f"sampling.temperature: must be 0 or more, got {opts.temperature}")
    if opts.top_k < 0:
        raise SamplingError(f"sampling.top_k: must be 0 (off) or more, got {opts.top_k}")
    if not 0.0 <= opts.top_p <= 1.0:
        raise SamplingError(f"sampling.top_p: must be between 0 and 1, got {opts.top_p}")
    if not 0.0 <= opts.min_p <= 1.0:
        raise SamplingError(f"sampling.min_p: must be between 0 and 1, got {opts.min_p}")
    if not opts.repetition_penalty > 0:
        raise SamplingError(f"sampling.repetition_penalty: must be above 0, got {opts.repetition_penalty}")
