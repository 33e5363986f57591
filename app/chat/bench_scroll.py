"""Benchmark: open a long conversation and scroll through it; report open time and frame stalls.

    QT_QPA_PLATFORM=offscreen python -m app.chat.bench_scroll --messages 2000

A conversation of N messages (Markdown, code blocks, lists; every 2nd one the user's) is written to a
temporary store, then opened in a ChatView the size of a window. A 4 ms heartbeat timer measures
the longest gap between its ticks (a "frame stall": time the event loop could not run) while the
view opens (and for SETTLE_MS after, while it pre-renders), and while it scrolls from the end to the
top one page per frame.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from PySide6.QtCore import QElapsedTimer, QEventLoop, QTimer
from PySide6.QtWidgets import QApplication

from app.chat.session import ChatSession
from app.chat.view import ChatView
from app.store import Store

SAMPLE_ANSWER = """Here is how to read a file line by line in **Python**:

```python
with open("notes.txt", encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
        print(n, line.rstrip())
```

- `open` with a `with` block closes the file for you.
- `enumerate(f, 1)` numbers the lines from one.

Message {i}: that is all there is to it."""


SETTLE_MS = 2000


@dataclass
class Result:
    messages: int
    open_s: float                # open until the first frame (the end of the conversation) is painted
    open_max_stall_ms: float     # longest event-loop gap from opening until SETTLE_MS later
    scroll_pages: int
    scroll_max_stall_ms: float   # longest event-loop gap while scrolling up, one page per frame
    scroll_mean_frame_ms: float
    open_cpu_s: float            # CPU time of this process for the open (robust on a busy machine)
    scroll_cpu_ms_per_frame: float


class Heartbeat:
    """Longest gap between ticks of a fast timer: how long the GUI could not respond."""

    def __init__(self, interval_ms: int = 4):
        self.clock = QElapsedTimer()
        self.timer = QTimer(interval=interval_ms, timeout=self._tick)
        self.max_gap_ms = 0.0

    def start(self) -> None:
        self.max_gap_ms = 0.0
        self.clock.start()
        self.timer.start()

    def _tick(self) -> None:
        self.max_gap_ms = max(self.max_gap_ms, self.clock.nsecsElapsed() / 1e6)
        self.clock.restart()

    def stop(self) -> float:
        self.timer.stop()
        return self.max_gap_ms


def fill(store: Store, n: int) -> int:
    conv = store.create_conversation("Benchmark")
    with store._write():     # one transaction: filling is not what is measured
        for i in range(n):
            role = "user" if i % 2 == 0 else "assistant"
            text = f"Question {i}: how do I read a file line by line?" if role == "user" else SAMPLE_ANSWER.format(i=i)
            store.db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (?, ?, ?, ?)",
                             (conv.id, role, text, time.time()))
    return conv.id


def spin(ms: int) -> None:
    loop = QEventLoop()
    QTimer.singleShot(ms, loop.quit)
    loop.exec()


def run(n: int = 2000, width: int = 900, height: int = 700) -> Result:
    app = QApplication.instance() or QApplication([])
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "bench.sqlite3")
        cid = fill(store, n)
        session = ChatSession(store)
        view = ChatView()
        view.resize(width, height)
        view.setModel(session.model)
        view.show()
        spin(50)
        beat = Heartbeat()
        beat.start()
        t0, c0 = time.perf_counter(), time.process_time()
        session.open(cid)
        app.processEvents()
        view.scroll_to_end()
        view.viewport().repaint()          # the first frame: the end of the conversation, exact
        open_s, open_cpu = time.perf_counter() - t0, time.process_time() - c0
        spin(SETTLE_MS)                    # rows around the screen are pre-rendered meanwhile
        open_stall = beat.stop()

        # Scroll up through the whole history, one page per frame, letting the loop run between.
        bar = view.verticalScrollBar()
        beat.start()
        frames, t1, c1 = 0, time.perf_counter(), time.process_time()
        while bar.value() > 0 and frames < 5000:
            bar.setValue(bar.value() - bar.pageStep())
            view.viewport().repaint()
            app.processEvents()
            frames += 1
        scroll_s, scroll_cpu = time.perf_counter() - t1, time.process_time() - c1
        scroll_stall = beat.stop()
        view.close()
        store.close()
    return Result(n, round(open_s, 3), round(open_stall, 1), frames, round(scroll_stall, 1),
                  round(1000 * scroll_s / max(1, frames), 2), round(open_cpu, 3),
                  round(1000 * scroll_cpu / max(1, frames), 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps(asdict(run(args.messages)), indent=2))


if __name__ == "__main__":
    main()
