"""The first answer after a load is not delayed by the worker's idle work, and every token reaches the
client as it is generated (through the real worker process on the demo model)."""
from __future__ import annotations

import asyncio
import sys
import time

from runtime import protocol as P
from runtime.client import WorkerClient, new_id
from runtime.options import SamplingOptions

STEP_S = 2.0          # one step of the injected idle work
STEPS = 3

# The real worker, its engine's idle work made slow: STEPS steps of STEP_S seconds each (a graph
# capture or a layer's CPU copies on the GPU engine take up to a second or more).
SLOW_IDLE_WORKER = f"""
import sys, time
import runtime.engine as engine

def idle_work(self):
    left = getattr(self, "_slow_steps", {STEPS})
    if left == 0:
        return False
    time.sleep({STEP_S})
    self._slow_steps = left - 1
    return True

engine.Engine.idle_work = idle_work
from runtime.worker import main
sys.exit(main())
"""


def test_the_first_answer_after_a_load_does_not_wait_behind_idle_work(demo_model):
    with WorkerClient(command=[sys.executable, "-c", SLOW_IDLE_WORKER]) as w:
        progress: list[P.Progress] = []
        loaded = w.load(str(demo_model), on_progress=progress.append)
        req = P.Generate(request_id=new_id("chat"), messages=(P.ChatMessage("user", "Hello!"),),
                         sampling=SamplingOptions(temperature=0.0, max_tokens=8))
        t0 = time.perf_counter()
        first = finished = None
        idle = None
        for ev in w.generate(req):
            if isinstance(ev, P.TokenDelta) and first is None:
                first = time.perf_counter() - t0
            elif isinstance(ev, P.Telemetry):
                idle = (ev.extra or {}).get("idle_work", idle)
            elif isinstance(ev, P.Finished):
                finished = ev
        assert finished is not None and first is not None
        # Before: the request waited for the idle step begun as `loaded` went out (STEP_S).
        assert first - finished.stats.ttft_s < STEP_S / 2, (first, finished.stats.ttft_s)
        assert idle is not None and idle["seconds"] < STEP_S / 2, idle
        ahead = [p for p in progress if p.message == "Preparing for the first answer"]
        assert [p.done for p in ahead] == list(range(1, STEPS + 1))        # the idle work ran inside the load
        assert loaded.load_s >= STEPS * STEP_S


def test_a_token_whose_text_is_held_back_sends_no_empty_chunk():
    """The OpenAI stream skips the worker's text-less token deltas (its text comes with a later one)."""
    from app.serve.api import _Shape

    async def rest():
        yield P.TokenDelta("r", "Hé", 1)
        yield P.Finished("r", "length", P.GenerationStats(3, 3, 0.1, 10.0, 10.0, 0.3))

    async def collect():
        shape = _Shape("chat", "r", "m")
        return [chunk async for chunk in shape.sse(P.TokenDelta("r", "", 1), rest(), False)]

    chunks = asyncio.run(collect())
    assert [c for c in chunks if '"delta":{},"finish_reason":null' in c] == []
    assert sum('"content":"Hé"' in c for c in chunks) == 1
