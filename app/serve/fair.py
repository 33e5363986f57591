"""Fair turns on a batch-1 engine: a long answer yields the engine to waiting requests every `TURN_S` seconds.

    events = turns(api, generate)      # the events of one answer, as Api._generation yields them

The engine decodes one sequence at a time, so two clients cannot stream at once; what can be fair is the
order. A generation that has held the engine for `TURN_S` while another request waits is stopped (the
protocol's cancel), goes to the back of the queue, and when its turn comes again continues its answer
from the text so far (`Generate.answer_prefix`; a raw prompt gets the text appended). The client sees
one unbroken answer: its text, logprobs and usage (prompt tokens of the first turn, completion tokens of
all). A short request so waits at most one turn of a long one, not the whole of it.

The price of a turn: the engine prefills the conversation again (its cache held the other request's),
and a sampled (temperature > 0) answer draws from a fresh random stream after each turn, so a seed
reproduces it only when no other request interleaved. Greedy answers are the same, turns or not (but
for the rare token whose text was cut at a turn's boundary and tokenized again).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator

from runtime import protocol as P

TURN_S = 2.0          # seconds a generation keeps the engine while others wait


async def turns(api: Any, gen: P.Generate) -> AsyncIterator[Any]:
    request, text, produced, first_stats, n = gen, "", 0, None, 0
    # A raw prompt under a grammar cannot be continued: its grammar would start the answer over.
    can_yield = gen.prompt is None or gen.json_schema is None
    while True:
        events = api._generation(request)
        started, yielding = time.monotonic(), False
        try:
            async for ev in events:
                if isinstance(ev, P.TokenDelta):
                    text += ev.text
                    produced += ev.tokens
                    yield ev
                    if can_yield and not yielding and api.queue.waiting and time.monotonic() - started >= TURN_S \
                            and produced < gen.sampling.max_tokens:
                        yielding = True                  # read on to the engine's Finished
                        api.backend.cancel(request.request_id)
                elif isinstance(ev, P.Finished):
                    first_stats = first_stats or ev.stats
                    if not (yielding and ev.reason == "cancelled"):
                        stats = dataclasses.replace(ev.stats, prompt_tokens=first_stats.prompt_tokens,
                                                    generated_tokens=produced)
                        yield dataclasses.replace(ev, request_id=gen.request_id, stats=stats)
                        return
                else:
                    yield ev
                    return
        finally:
            await events.aclose()
        n += 1
        request = _continued(gen, f"{gen.request_id}-turn{n}", text, produced)


def _continued(gen: P.Generate, rid: str, text: str, produced: int) -> P.Generate:
    sampling = dataclasses.replace(gen.sampling, max_tokens=gen.sampling.max_tokens - produced)
    if gen.prompt is not None:
        return dataclasses.replace(gen, request_id=rid, prompt=gen.prompt + text, sampling=sampling)
    return dataclasses.replace(gen, request_id=rid, answer_prefix=gen.answer_prefix + text, sampling=sampling)
