"""`moedesk --smoke-test QUESTION` (or MOEDESK_SMOKE_TEST=QUESTION): the whole app, checked end to end.

The real window opens offscreen, the real engine client spawns the real worker (from the bundle when
frozen), the demo model loads, QUESTION goes through the chat session exactly as if typed, and the answer
is printed. Exit 0 with the answer; non-zero with the error otherwise. The bundle test and packagers use it.

It also prints how long the window and the loaded model took from process start (the start-up figures).
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import psutil
from PySide6.QtCore import QCoreApplication, QTimer

DEFAULT_TIMEOUT_S = 600.0
SMOKE_MAX_TOKENS = 48
EXIT_OK, EXIT_ERROR, EXIT_TIMEOUT = 0, 1, 3


def since_start() -> float:
    """Seconds since this process started (the launcher's start, for a bundle)."""
    return time.time() - psutil.Process().create_time()


def worker_exe(pid: Optional[int]) -> str:
    """The executable the worker process runs (the bundle's moedesk-worker, or a Python)."""
    try:
        return psutil.Process(pid).exe() if pid else "(no worker)"
    except psutil.Error as e:
        return f"(unknown: {e})"


@dataclass
class SmokeTest:
    question: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    exit_code: Optional[int] = None
    timings: dict = field(default_factory=dict)
    sent: bool = False

    def say(self, line: str) -> None:
        print(line, flush=True)

    def finish(self, code: int, line: str) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = code
        (sys.stdout if code == EXIT_OK else sys.stderr).write(line + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        QCoreApplication.quit()


def start(desk, question: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> SmokeTest:
    """Hook the smoke test onto a built, shown Desk whose engine client is about to start."""
    t = SmokeTest(question, timeout_s)
    client, session, window = desk.client, desk.session, desk.window
    # Greedy and short, so the same build gives the same answer every time.
    session.default_sampling = dataclasses.replace(session.default_sampling, temperature=0.0, seed=0,
                                                   max_tokens=SMOKE_MAX_TOKENS)

    def window_up() -> None:
        t.timings["window_s"] = since_start()
        t.say(f"smoke: window shown after {t.timings['window_s']:.2f} s")

    def on_loaded(ev) -> None:
        if t.sent:
            return
        t.timings["loaded_s"] = since_start()
        t.say(f"smoke: model {ev.model} loaded on the {ev.backend} engine after {t.timings['loaded_s']:.2f} s")
        t.say(f"smoke: worker pid {client.pid()} runs {worker_exe(client.pid())}")
        t.sent = True
        session.new_conversation()
        if not session.send(question):
            t.finish(EXIT_ERROR, "smoke: the chat session refused the question")

    def on_busy(busy: bool) -> None:
        if busy or not t.sent:
            return
        items = session.model.items
        last = items[-1] if items else None
        if last is None or last.role != "assistant":
            t.finish(EXIT_ERROR, "smoke: no answer was recorded")
        elif last.state != "done":
            t.finish(EXIT_ERROR, f"smoke: the answer ended as {last.state}: {last.error or '(no message)'}")
        else:
            t.timings["answered_s"] = since_start()
            ttft = getattr(last.stats, "ttft_s", None) if getattr(last, "stats", None) else None
            first = f" (first token after {ttft:.2f} s)" if ttft is not None else ""
            t.finish(EXIT_OK, f"smoke: answered after {t.timings['answered_s']:.2f} s{first}\n{last.content}")

    def on_error(request_id: str, err) -> None:
        detail = f"\n{err.detail}" if getattr(err, "detail", "") else ""
        t.finish(EXIT_ERROR, f"smoke: engine error [{err.code}] {err.message}{detail}")

    def on_died(code: int, words: str, lines: list) -> None:
        t.finish(EXIT_ERROR, f"smoke: the engine process died: {words}\n" + "\n".join(lines[-30:]))

    client.loaded.connect(on_loaded)
    client.error.connect(on_error)
    client.worker_died.connect(on_died)
    session.busy_changed.connect(on_busy)
    QTimer.singleShot(0, window_up)
    QTimer.singleShot(int(timeout_s * 1000),
                      lambda: t.finish(EXIT_TIMEOUT, f"smoke: no answer within {timeout_s:.0f} s "
                                                     f"(engine state: {window.banner.kind})"))
    return t
