"""One speculative step, and one plain step, over the engine interface.

Cache contract (shared with runtime/generate.py): before a step the target's cache holds every token
of `tokens` but the last (pending) one; a step returns the new tokens (at least one) and leaves the
cache holding `tokens + new[:-1]`. Shapes: V vocabulary, K drafted tokens, R = K + 1 verified rows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from runtime import sampling
from runtime.constrained import Steering
from runtime.engine import Engine, offered
from runtime.options import SamplingOptions
from runtime.sampling import choose


@dataclass
class Proposal:
    """What a drafter offers: K tokens, and the draft distribution each was drawn from.

    `q` is None for deterministic drafters (n-gram lookup): then q is one-hot on each drafted token,
    and the general rule below stays exact (accept with probability p(d), else resample from p
    without d).
    """
    tokens: list[int]
    q: Optional[torch.Tensor] = None        # [K, V] float32, rows sum to 1


@dataclass
class StepResult:
    new: list[int]                          # accepted drafts + one token from the target
    drafted: int                            # K
    accepted: int                           # how many of the K drafts were kept
    rows: int                               # rows the target verified in its one forward
    forward_s: float                        # time of that forward (synchronised)
    draft_s: float = 0.0                    # time spent drafting


class Drafter(Protocol):
    mode: str

    def propose(self, tokens: list[int], k: int) -> Proposal:
        """Up to k draft tokens to follow `tokens` (resynchronising any draft cache first)."""

    def rollback(self, length: int) -> None:
        """Forget drafts beyond the first `length` tokens (the target's new cache length)."""


def timed_forward(engine: Engine, tokens: Sequence[int]) -> tuple[torch.Tensor, float]:
    """engine.forward with its wall time, waiting for the stream that computed the logits (as reading
    a token from them does in plain decoding), so the time is real. The logits as the decoders sample
    from them (runtime/engine.offered: tokens the engine refuses as input never drafted nor chosen).

    Not the whole device: under offload, copies run on side streams beside the decode (the next
    layers' predicted experts, promotions, staging pages lent after a prefill) and overlap the next
    step in plain decoding; waiting for them here made every step of a drafting request, plain ones
    included, slower than plain decoding's, and the policy compared drafting against that."""
    t0 = time.perf_counter()
    logits = offered(engine, engine.forward(tokens))                     # [T, V]
    if logits.is_cuda:
        torch.cuda.current_stream(logits.device).synchronize()
    return logits, time.perf_counter() - t0


def plain_step(target: Engine, tokens: list[int], opts: SamplingOptions,
               generator: Optional[torch.Generator], steer: Optional[Steering] = None) -> StepResult:
    """Ordinary decoding: feed the pending token, sample the next one."""
    logits, dt = timed_forward(target, tokens[-1:])                      # [1, V]
    tok = choose(logits[0], tokens, opts, generator, steer)
    return StepResult([tok], drafted=0, accepted=0, rows=1, forward_s=dt)


def speculative_step(target: Engine, drafter: "Drafter", tokens: list[int], k: int, opts: SamplingOptions,
                     generator: Optional[torch.Generator], steer: Optional[Steering] = None) -> StepResult:
    """Draft up to k tokens, verify them with one target forward over K+1 rows, keep the longest
    valid prefix, and roll both caches back to it. With no draft (lookup found nothing) this is
    exactly a plain step.

    Acceptance rule (Leviathan et al. 2023; Chen et al. 2023), for draft token d_i drawn from q_i:
        - accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
        - on the first rejection, emit one token drawn from normalise(max(0, p_i - q_i)) and stop;
        - if all K are accepted, emit a bonus token drawn from p_{K+1}.
    The emitted tokens are then distributed exactly as plain sampling from p. p_i and q_i are both
    `sampling.probabilities` of their model's logits with the history so far (tokens + d_1..d_{i-1}),
    so they include the same repetition penalty, temperature, top-k, top-p and min-p. At temperature
    0 both are one-hot on the argmax, and the rule reduces to: accept while d_i equals the target's
    argmax, then emit the target's argmax.

    With a request's steering (a grammar, penalties), p_i is computed from row i as steered after
    tokens + d_1..d_{i-1}: a draft the grammar refuses has p_i(d_i) = 0 and is rejected by the rule,
    and the token emitted in its place comes from the grammar's own mask. Drafts from lookup (q one-hot)
    are cut at the first one the grammar refuses before the verify: rejecting d_j for sure and drawing
    from normalise(max(0, p_j - onehot(d_j))) = p_j is what the bonus draw from row j does, so the cut
    is exact and spares the rows after it.
    """
    # Draft: K <= k tokens, with the distributions they were drawn from.
    t0 = time.perf_counter()
    proposal = drafter.propose(tokens, k)
    draft_s = time.perf_counter() - t0
    drafts = proposal.tokens
    if steer is not None and proposal.q is None:
        drafts = drafts[:steer.valid_prefix(drafts)]
    K = len(drafts)

    # Verify: row i holds the target's logits after tokens + d_1..d_i.
    logits, dt = timed_forward(target, tokens[-1:] + drafts)              # [K+1, V]

    # Accept or reject each draft in turn. Greedy without a penalty: every row's choice in one read
    # of the device (one wait, not one per row).
    plain = opts.temperature == 0 and opts.repetition_penalty == 1.0 and steer is None
    greedy = _argmax_rows(logits[:K + 1]) if plain else None
    history = list(tokens)
    new: list[int] = []
    for i, d in enumerate(drafts):
        row = steer.row(logits[i], history) if steer is not None else logits[i]
        if opts.temperature == 0:
            best = greedy[i] if greedy is not None else sampling.sample(row, history, opts)
            if best != d:
                _took(steer, logits[i], best)
                new.append(best)
                break
        else:
            p = sampling.probabilities(row, history, opts)               # [V]
            q = proposal.q[i] if proposal.q is not None else _one_hot(d, p)
            p, q = _same_size(p, q)
            if not _accepts(p[d].item(), q[d].item(), generator):
                tok = sampling.draw(_residual(p, q), generator)
                _took(steer, logits[i], tok)
                new.append(tok)
                break
        _took(steer, logits[i], d)
        new.append(d)
        history.append(d)
    else:
        # All K accepted: the target's last row gives one more token for free.
        new.append(greedy[K] if greedy is not None else choose(logits[K], history, opts, generator, steer))

    # Roll back both caches: keep tokens + the accepted drafts; the last new token stays pending.
    accepted = len(new) - 1
    target.truncate(len(tokens) + accepted)
    drafter.rollback(len(tokens) + accepted)
    return StepResult(new, drafted=K, accepted=accepted, rows=K + 1, forward_s=dt, draft_s=draft_s)


def _took(steer: Optional[Steering], raw: torch.Tensor, token: int) -> None:
    if steer is not None:
        steer.took(raw, token)


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax [R, V] -> R ids, as sampling.sample at temperature 0 without a penalty picks
    (float32, the first of tied maxima)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise sampling.SamplingError(f"logits: expected rows [R, vocab], got {tuple(logits.shape)}")
    return torch.argmax(logits.to(torch.float32), dim=-1).tolist()


def _accepts(p_d: float, q_d: float, generator: Optional[torch.Generator]) -> bool:
    """True with probability min(1, p_d / q_d)."""
    u = torch.rand((), generator=generator, device=_device(generator)).item()
    return u * q_d < p_d


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)); where p <= q everywhere (only by rounding) p itself is exact enough."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    return r / total if total > 0 else p


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    if token < q.shape[0]:
        q[token] = 1.0
    else:
        q = torch.cat([q, torch.zeros(token + 1 - q.shape[0], dtype=q.dtype, device=q.device)])
        q[token] = 1.0
    return q


def _same_size(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the shorter distribution with zeros (draft and target vocabularies may differ in padding)."""
    q = q.to(p.device)
    if p.shape[0] < q.shape[0]:
        p = torch.cat([p, p.new_zeros(q.shape[0] - p.shape[0])])
    elif q.shape[0] < p.shape[0]:
        q = torch.cat([q, q.new_zeros(p.shape[0] - q.shape[0])])
    return p, q


def _device(generator: Optional[torch.Generator]) -> str:
    return generator.device.type if generator is not None else "cpu"
