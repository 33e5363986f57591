"""The generation loop over the engine interface: prefill, decode steps, stop conditions, stats.

No protocol and no I/O here: text deltas and live figures go out through callbacks, cancellation
comes in through `should_stop()` (checked before every decode step and between prefill chunks, so
a cancel takes effect within one step).

Cache contract (shared with runtime/speculative/): between steps the engine's cache holds every
token of the sequence but the last, pending one. A decoder's `step(tokens, max_new) -> new` returns
1..max_new new tokens and leaves the cache holding `tokens + new[:-1]`.

Stop strings (`StopMatcher`) are found in the streamed text, holding back any tail that could still
become one, so a stop string is never emitted even when it arrives split over several deltas.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from runtime.constrained import Steering
from runtime.engine import Engine, offered
from runtime.errors import BadRequest, ContextOverflow
from runtime.options import DraftOptions, SamplingOptions
from runtime.records import DraftStats, GenerationStats
from runtime.sampling import choose

TextFn = Callable[[str, int], None]          # (text delta, tokens it covers)
StepFn = Callable[["LiveStats"], None]       # called after every prefill chunk and decode step


@dataclass
class LiveStats:
    """Figures of the generation in progress (what telemetry shows while it runs)."""
    phase: str = "prefill"                   # "prefill" | "decode" | "done"
    prompt_tokens: int = 0
    prefilled_tokens: int = 0                # prompt tokens actually run (the rest came from the cache)
    generated_tokens: int = 0
    ttft_s: Optional[float] = None
    prefill_tps: Optional[float] = None
    decode_tps: Optional[float] = None
    draft: Optional[DraftStats] = None


@dataclass
class GenerationResult:
    reason: str                              # "eos" | "stop_string" | "length" | "cancelled"
    text: str
    tokens: list[int]                        # generated ids (an end-of-sequence token included)
    stats: GenerationStats
    cache_tokens: list[int] = field(default_factory=list)   # what the engine's cache holds afterwards


class PlainDecoder:
    """One token per step: forward the pending token, sample the next (through the request's steering)."""

    def __init__(self, engine: Engine, opts: SamplingOptions, generator: Any, steer: Optional[Steering] = None):
        self.engine, self.opts, self.generator, self.steer = engine, opts, generator, steer

    def step(self, tokens: list[int], max_new: Optional[int] = None) -> list[int]:
        logits = offered(self.engine, self.engine.forward(tokens[-1:]))   # [1, V]
        return [choose(logits[-1].float(), tokens, self.opts, self.generator, self.steer)]

    def stats(self) -> Optional[DraftStats]:
        return None


class StopMatcher:
    """Stop strings over streamed text: `feed(delta) -> (text safe to emit, stopped)`."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped: Optional[str] = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped is not None:
            return "", True
        buf = self._held + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            at, stop = min(hits)
            self._held, self.stopped = "", stop
            return buf[:at], True
        keep = self._longest_pending(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail when the stream ends without a stop string."""
        out, self._held = self._held, ""
        return "" if self.stopped is not None else out

    def _longest_pending(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best


def make_generator(seed: Optional[int]):
    import torch
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(torch.seed()))
    return gen


def make_decoder(engine: Engine, sampling: SamplingOptions, generator: Any,
                 draft: Optional[DraftOptions] = None, draft_engine: Optional[Engine] = None,
                 steer: Optional[Steering] = None):
    """The plain decoder, or a speculative one when drafting is on."""
    if draft is None or draft.mode == "off":
        return PlainDecoder(engine, sampling, generator, steer)
    if draft.mode == "model" and draft_engine is None:
        raise BadRequest("draft mode 'model' needs a draft model: load one with the model (options.draft.model)")
    from runtime import speculative
    try:
        return speculative.make_decoder(engine, draft, sampling, generator, draft_engine=draft_engine, steer=steer)
    except ValueError as e:
        raise BadRequest(f"speculative decoding: {e}") from None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def generate(engine: Engine, tokenizer: Any, prompt: Sequence[int], sampling: SamplingOptions, *,
             decoder: Any = None, on_text: Optional[TextFn] = None, on_step: Optional[StepFn] = None,
             should_stop: Callable[[], bool] = lambda: False, generator: Any = None,
             cached: Sequence[int] = (), prefill_chunk: int = 512, ignore_eos: bool = False,
             answer_prefix_tokens: int = 0, steer: Optional[Steering] = None,
             skip_special_tokens: bool = True) -> GenerationResult:
    """Generate an answer to `prompt` (token ids). `cached` is what the engine's cache holds now.

    The cache is reused only when the prompt continues it (the next turn of the same conversation);
    any other prompt is prefilled from scratch. `answer_prefix_tokens`: the prompt ends with that many
    tokens of an answer begun earlier (Continue); the text streamed out continues it. Reusing part of a different prompt would make the
    answer depend on what was asked before: logits of a prompt split differently between prefill
    calls differ in the last bits, and near-ties in greedy decoding can flip on that.

    `steer` (runtime/constrained.py): the request's grammar, penalties and logprobs; the decoder must
    sample through the same one. `skip_special_tokens=False` keeps special tokens in the text (Mistral's
    [TOOL_CALLS], which the tool-call parser reads)."""
    prompt = list(prompt)
    context = engine.info.context_length
    if not prompt:
        raise BadRequest("the prompt is empty")
    if len(prompt) >= context:
        raise ContextOverflow(f"the conversation is {len(prompt)} tokens; the context holds {context}: "
                              f"shorten it or load the model with a longer context length",
                              tokens=len(prompt), limit=context)
    generator = generator if generator is not None else make_generator(sampling.seed)
    decoder = decoder or PlainDecoder(engine, sampling, generator, steer)
    live = LiveStats(prompt_tokens=len(prompt))
    step_hook = on_step or (lambda _live: None)
    detok = tokenizer.stream_decoder(skip_special_tokens)
    if answer_prefix_tokens:
        detok.push(prompt[len(prompt) - answer_prefix_tokens:])   # context for the first new token's text
    stops = StopMatcher(sampling.stop)
    eos = frozenset() if ignore_eos else tokenizer.eos_ids
    limit = min(sampling.max_tokens, context - len(prompt))
    out_text: list[str] = []

    def emit(text: str, tokens: int) -> None:
        # Every token is reported as it comes, its text or "" while that is held back (part of a UTF-8
        # character, a possible stop string): a client times the tokens, not the text's release.
        if text:
            out_text.append(text)
        if on_text and (text or tokens):
            on_text(text, tokens)

    # Prefill: reuse the cache if the prompt continues it, run the rest in chunks; the last row gives token 1.
    t0 = time.perf_counter()
    keep = len(cached) if len(cached) < len(prompt) and common_prefix(cached, prompt) == len(cached) else 0
    if engine.position != keep:
        engine.truncate(keep)
    logits = None
    for start in range(keep, len(prompt), prefill_chunk):
        if should_stop():
            return _finish("cancelled", live, t0, None, [], out_text, decoder, prompt[:engine.position])
        logits = engine.prefill(prompt[start:start + prefill_chunk])   # [1, V]
        live.prefilled_tokens = start + len(prompt[start:start + prefill_chunk]) - keep
        step_hook(live)
    t_prefill = time.perf_counter()
    prepare = getattr(engine, "prepare_decode", None)
    if prepare is not None:        # what the answer's decode steps would compile or capture: before token 1
        prepare(limit)
    live.prefill_tps = live.prefilled_tokens / max(t_prefill - t0, 1e-9)

    # First token, from the prefill logits.
    tokens = prompt + [choose(offered(engine, logits)[-1].float(), prompt, sampling, generator, steer)]
    t_first = time.perf_counter()
    live.phase, live.ttft_s = "decode", t_first - t0
    generated: list[int] = []
    reason = _decode(decoder, tokens, generated, limit, eos, lambda tok: stops.feed(detok.push([tok])), emit, live,
                     step_hook, should_stop, t_first)
    if reason != "stop_string":
        emit(stops.feed(detok.flush())[0] + stops.flush(), 0)
    return _finish(reason, live, t0, t_first, generated, out_text, decoder, tokens[:-1])


def _decode(decoder: Any, tokens: list[int], generated: list[int], limit: int, eos: frozenset,
            feed: Callable[[int], tuple[str, bool]], emit: Callable[[str, int], None], live: LiveStats,
            step_hook: StepFn, should_stop: Callable[[], bool], t_first: float) -> str:
    """Decode after the first token (tokens[-1]): account for each new token (into `generated`, its text
    through `feed` to the stop strings and `emit`), then ask the decoder for more; the reason it ended."""
    new = [tokens[-1]]
    while True:
        reason = None
        for tok in new:
            generated.append(tok)
            if tok in eos:
                reason = "eos"
                break
            text, stopped = feed(tok)
            emit(text, 1)
            if stopped:
                reason = "stop_string"
                break
            if len(generated) >= limit:
                reason = "length"
                break
        live.generated_tokens = len(generated)
        if len(generated) > 1:
            live.decode_tps = (len(generated) - 1) / max(time.perf_counter() - t_first, 1e-9)
        live.draft = decoder.stats()
        step_hook(live)
        if reason:
            return reason
        if should_stop():
            return "cancelled"
        new = decoder.step(tokens, max_new=limit - len(generated))   # drafting never runs past the limit
        tokens.extend(new)


def _finish(reason: str, live: LiveStats, t0: float, t_first: Optional[float], generated: list[int],
            out_text: list[str], decoder: Any, cache_tokens: list[int]) -> GenerationResult:
    t_end = time.perf_counter()
    live.phase = "done"
    if t_first is not None and len(generated) > 1:
        live.decode_tps = (len(generated) - 1) / max(t_end - t_first, 1e-9)
    stats = GenerationStats(prompt_tokens=live.prompt_tokens, generated_tokens=len(generated),
                            ttft_s=live.ttft_s, prefill_tps=live.prefill_tps, decode_tps=live.decode_tps,
                            total_s=t_end - t0, draft=decoder.stats() if hasattr(decoder, "stats") else None)
    return GenerationResult(reason, "".join(out_text), generated, stats, cache_tokens)
