"""A scripted worker for fast GUI tests: speaks the real protocol, answers with canned text.

The answer to a user message is "You said: <message>." followed by numbered filler words, one token
every FAKE_WORKER_DELAY seconds (default 0.02) up to max_tokens; with an answer prefix (Continue) the
words go on after the prefix's. Cancel ends it with reason "cancelled". `count` answers 4 tokens per
message plus one per word; the context is 2048. Used only by tests; the end-to-end tests use the real worker and the demo model.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time

from runtime import paths, protocol
from runtime.protocol import (Cancel, CountTokens, Error, Finished, GenerationStats, Generate, Hello, Load, Loaded,
                              Progress, Ready, Shutdown, Telemetry, TokenCount, TokenDelta, Unload, Unloaded)

CONTEXT = 2048

DELAY = float(os.environ.get("FAKE_WORKER_DELAY", "0.02"))
out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
os.dup2(2, 1)


def send(ev) -> None:
    out.write(protocol.encode(ev))
    out.flush()


def reader(q: "queue.Queue") -> None:
    for line in sys.stdin:
        q.put(line)
    q.put(None)


def answer_tokens(g: Generate) -> list[str]:
    last = next((m.content for m in reversed(g.messages) if m.role == "user"), "")
    words = [f"You said: {last}."] + [f" word{i}" for i in range(1, 10_000)]
    if g.answer_prefix:
        words = words[1 + g.answer_prefix.count(" word"):]
    return words[:g.sampling.max_tokens]


def count(cmd: CountTokens) -> int:
    return sum(4 + len(m.content.split()) for m in cmd.messages)


def main() -> None:
    q: "queue.Queue" = queue.Queue()
    threading.Thread(target=reader, args=(q,), daemon=True).start()
    model = None
    pending: list = []
    while True:
        line = pending.pop(0) if pending else q.get()
        if line is None:
            return
        cmd = protocol.decode_command(line)
        if isinstance(cmd, Hello):
            send(Ready(protocol.PROTOCOL_VERSION, "fake", os.getpid(), "cpu", "Scripted test worker.", "cpu"))
        elif isinstance(cmd, Load):
            send(Progress(cmd.request_id, "loading", "Reading weights", 1, 2))
            model = cmd.model
            send(Loaded(cmd.request_id, cmd.model, str(paths.resolve_model(cmd.model)), "LlamaForCausalLM", "cpu",
                        CONTEXT, 100, 0.1))
        elif isinstance(cmd, Unload):
            model = None
            send(Unloaded(cmd.request_id))
        elif isinstance(cmd, CountTokens):
            if model is None:
                send(Error("no_model", "No model is loaded.", request_id=cmd.request_id))
            else:
                send(TokenCount(cmd.request_id, count(cmd), CONTEXT))
        elif isinstance(cmd, Generate):
            if model is None:
                send(Error("no_model", "No model is loaded.", request_id=cmd.request_id))
                continue
            start, n, reason = time.time(), 0, "length"
            for tok in answer_tokens(cmd):
                send(TokenDelta(cmd.request_id, tok))
                n += 1
                if n % 10 == 0:
                    send(Telemetry(cmd.request_id, decode_tps=1 / DELAY if DELAY else None, generating=True))
                time.sleep(DELAY)
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    continue
                waiting = protocol.decode_command(nxt) if nxt is not None else None
                if isinstance(waiting, Cancel):
                    reason = "cancelled"
                    break
                if isinstance(waiting, CountTokens):        # answered at once, as the real worker does
                    send(TokenCount(waiting.request_id, count(waiting), CONTEXT))
                    continue
                pending.append(nxt)
            total = time.time() - start
            send(Finished(cmd.request_id, reason, GenerationStats(len(cmd.messages) * 5, n, DELAY, 500.0,
                                                                  n / total if total else None, total)))
        elif isinstance(cmd, Shutdown):
            return


if __name__ == "__main__":
    main()
