"""A request's own steering of the sampler: a grammar its tokens must follow, OpenAI's penalties and
logit bias, and the log-probabilities it reports. Applied to each row of logits before runtime/sampling.py.

    steer = steering_for(cmd, tokenizer, vocab, prompt_len, tool_format)   # None when the request asks nothing
    tok = sampling.choose(raw_row, history, opts, generator, steer)         # what every decoder samples through

`Steering.row(raw, history)` is the row the sampler sees: logit bias, then presence and frequency penalties
over the answer's tokens so far, then the grammar's mask (tokens the grammar refuses at -inf). Whoever takes
a token reports it with `took(raw, token)`: the grammar advances, and its logprob (of the raw row: the
model's own distribution) is kept for the text that carries it.

The grammar is enforced here, in the worker, token by token: a refused token never leaves the sampler.
Speculative decoding (runtime/speculative/core.py) masks each verified row with the grammar's state after
the drafts before it, so a draft the grammar refuses has probability 0 and is rejected by the usual rule,
which stays exact; draft models draft through a copy of the grammar (`fork`), so their drafts are
grammatical too. llguidance does the grammar (runtime/grammars.py says why that library).

Shapes: V vocabulary (the logits' width), W = ceil(V / 32) words of the grammar's bit mask.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from runtime import grammars
from runtime.errors import BadRequest, EngineError

MAX_TOP_LOGPROBS = 20
_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # Tokenizer -> {vocab: LLTokenizer}


class ConstraintError(EngineError):
    """The grammar refused a token that was sampled under its own mask, or failed itself (a bug or a limit)."""


def grammar_tokenizer(tokenizer: Any, vocab: int):
    """llguidance's view of the model's tokenizer (built once per loaded tokenizer and logits width: ~0.2 s
    for 49k tokens), its end-of-sequence ids those that end an answer."""
    from llguidance import LLTokenizer
    per = _TOKENIZERS.setdefault(tokenizer, {})
    if vocab not in per:
        eos = sorted(tokenizer.eos_ids) or None
        per[vocab] = LLTokenizer(tokenizer.to_json(), n_vocab=max(vocab, tokenizer.vocab_size), eos_token=eos)
    return per[vocab]


class Constraint:
    """One request's grammar state over the model's tokens (an llguidance matcher)."""

    def __init__(self, matcher: Any, vocab: int):
        self.matcher = matcher
        self.vocab = vocab
        self._bits = np.zeros((vocab + 31) // 32, dtype=np.int32)                 # [W], bit i of word j: token 32j+i
        self._check()

    @classmethod
    def compile(cls, grammar: str, gtok: Any, vocab: int, where: str = "grammar") -> "Constraint":
        from llguidance import LLMatcher
        problem = LLMatcher.validate_grammar(grammar, gtok)
        if problem:
            raise BadRequest(f"{where}: the grammar library cannot use it: {' '.join(problem.split())}")
        return cls(LLMatcher(gtok, grammar, log_level=0), vocab)

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ConstraintError(f"the answer's grammar failed: {self.matcher.get_error()}")

    def _unpacked(self) -> np.ndarray:
        """Which tokens the grammar takes next: bool [V], unpacked by numpy."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab].view(np.bool_)

    def allowed(self, device: torch.device) -> torch.Tensor:
        """Which tokens the grammar takes next: bool [V] on `device`."""
        ok = torch.from_numpy(self._unpacked())
        return ok if device.type == "cpu" else ok.to(device, non_blocking=True)

    def mask(self, row: torch.Tensor) -> torch.Tensor:
        """`row` [V'] with the tokens the grammar refuses at -inf (a float32 copy); ids past its vocabulary
        refused. A CPU row is masked by numpy on one thread: torch's element-wise ops over a vocabulary
        wake its whole thread team, which on a busy machine took 8 ms where one thread takes 40 us
        (bench/grammar_cost.py)."""
        ok = self._unpacked()
        n = min(row.shape[0], ok.shape[0])
        if row.device.type == "cpu":
            x = row.detach().float().numpy()
            out = np.full(x.shape, -np.inf, dtype=np.float32)
            np.copyto(out[:n], x[:n], where=ok[:n])
            return torch.from_numpy(out)
        okd = torch.zeros(row.shape[0], dtype=torch.bool, device=row.device)
        okd[:n] = torch.from_numpy(ok[:n]).to(row.device, non_blocking=True)
        return torch.where(okd, row.float(), torch.tensor(float("-inf"), device=row.device))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"the answer's grammar refused token {token} after allowing it: "
                                  f"{self.matcher.get_error() or 'no reason given'}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar would take in a row from here (nothing is consumed)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def fork(self) -> "Constraint":
        other = Constraint.__new__(Constraint)
        other.matcher, other.vocab, other._bits = self.matcher.deep_copy(), self.vocab, np.zeros_like(self._bits)
        return other


@dataclass
class Steering:
    constraint: Optional[Constraint] = None
    presence: float = 0.0
    frequency: float = 0.0
    bias: dict[int, float] = field(default_factory=dict)
    prompt_len: int = 0                   # history beyond this is the answer (what penalties count)
    top_logprobs: Optional[int] = None    # None: no logprobs
    records: list = field(default_factory=list)     # (token, logprob, [(id, logprob), ...]) per token taken
    _bias_row: Optional[torch.Tensor] = None

    def row(self, raw: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """The row the sampler sees (float32 [V]); `raw` itself is left as it is."""
        x = raw.float()
        if self.bias:
            if self._bias_row is None or self._bias_row.device != x.device or self._bias_row.shape != x.shape:
                b = torch.zeros_like(x)
                for tok, value in self.bias.items():
                    if tok < b.shape[0]:
                        b[tok] = value
                self._bias_row = b
            x = x + self._bias_row
        answer = history[self.prompt_len:] if len(history) > self.prompt_len else []
        if (self.presence or self.frequency) and len(answer):
            seen = torch.as_tensor(list(answer), dtype=torch.long, device=x.device)
            counts = torch.bincount(seen, minlength=x.shape[0])[:x.shape[0]].to(x.dtype)       # [V]
            x = x - self.frequency * counts - self.presence * (counts > 0).to(x.dtype)
        if self.constraint is not None:
            x = self.constraint.mask(x)
        return x

    def took(self, raw: torch.Tensor, token: int) -> None:
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.top_logprobs is not None:
            lp = torch.log_softmax(raw.float(), dim=0)                       # [V]
            top = []
            if self.top_logprobs:
                vals, idx = torch.topk(lp, self.top_logprobs)
                top = list(zip(idx.tolist(), vals.tolist()))
            self.records.append((token, float(lp[token]), top))

    def fork(self) -> "Steering":
        """What a drafter drafts through: a copy of the grammar, the same penalties, no logprobs kept."""
        return Steering(self.constraint.fork() if self.constraint is not None else None, self.presence,
                        self.frequency, self.bias, self.prompt_len, None, [], self._bias_row)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return len(tokens) if self.constraint is None else self.constraint.valid_prefix(tokens)

    def pop_records(self, n: int) -> list:
        out, self.records = self.records[:n], self.records[n:]
        return out


def steering_for(cmd: Any, tokenizer: Any, vocab: int, prompt: Sequence[int], prefix_tokens: int,
                 tool_format: str) -> Optional[Steering]:
    """The steering a protocol Generate asks for (None when it asks nothing). BadRequest names a grammar
    llguidance cannot compile or a token id outside the vocabulary. The last `prefix_tokens` of `prompt`
    are an answer begun earlier (`answer_prefix`): the grammar reads them first, and penalties count them
    as the answer's."""
    grammar, where = None, ""
    if cmd.json_schema is not None and cmd.tools is not None and cmd.tools.choice in ("required", "function"):
        raise BadRequest("generate: json_schema and a forced tool call cannot both shape the answer")
    try:
        if cmd.tools is not None:
            grammar, where = grammars.tool_grammar(tool_format, cmd.tools, tokenizer.special_id), "tools"
        if grammar is None and cmd.json_schema is not None:
            grammar, where = grammars.schema_grammar(cmd.json_schema), "json_schema"
    except grammars.GrammarError as e:
        raise BadRequest(str(e)) from None
    pen = cmd.penalties
    if grammar is None and pen is None and cmd.logprobs is None:
        return None
    if cmd.logprobs is not None and not 0 <= cmd.logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"generate.logprobs: between 0 and {MAX_TOP_LOGPROBS} alternatives, got {cmd.logprobs}")
    bias = {}
    for key, value in (pen.logit_bias.items() if pen is not None else ()):
        if not key.isdigit() or int(key) >= vocab:
            raise BadRequest(f"logit_bias: {key!r} is not a token id of this model (0 to {vocab - 1})")
        bias[int(key)] = float(value)
    constraint = None
    answer_start = len(prompt) - prefix_tokens
    if grammar is not None:
        constraint = Constraint.compile(grammar, grammar_tokenizer(tokenizer, vocab), vocab, where)
        begun = list(prompt[answer_start:])
        if constraint.valid_prefix(begun) != len(begun):
            raise BadRequest("answer_prefix: the answer begun so far does not follow the request's grammar")
        for tok in begun:
            constraint.advance(tok)
    return Steering(constraint, pen.presence if pen else 0.0, pen.frequency if pen else 0.0, bias, answer_start,
                    cmd.logprobs)


def logprob_events(records: list, tokenizer: Any, vocab: int) -> tuple:
    """Kept records as plain tuples (token text, logprob, bytes, alternatives as (text, logprob, bytes)); the
    worker turns them into the protocol's TokenLogprob values (only the edge imports the protocol)."""
    gtok = grammar_tokenizer(tokenizer, vocab)

    def piece(tok: int) -> tuple[str, tuple[int, ...]]:
        raw = gtok.decode_bytes([tok])
        return raw.decode("utf-8", "replace"), tuple(raw)
    out = []
    for tok, lp, top in records:
        text, raw = piece(tok)
        alts = tuple(_named(piece(t), v) for t, v in top)
        out.append((text, _finite(lp), raw, alts))
    return tuple(out)


def _named(piece: tuple[str, tuple[int, ...]], value: float) -> tuple[str, float, tuple[int, ...]]:
    return piece[0], _finite(value), piece[1]


def _finite(value: float) -> float:
    """JSON has no -inf: a token the model gives no chance gets OpenAI's floor, -9999."""
    return value if value > -9999.0 else -9999.0
