"""A background job in a child process that reports as JSON lines (`moedesk-cli setup-gpu --json`,
`moedesk-cli import-demo --json`): each event becomes a signal on the GUI thread.

Events: {"event": "progress", "done", "total", "message"?}, {"event": "done", "seconds"?} and
{"event": "failed", "message", "detail"}. Other lines are kept (the last 40) as a failure's detail; a
process that ends without a final event has failed (or, with exit status 0, is done).
"""
from __future__ import annotations

import json

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, Signal


class ChildJob(QObject):
    """One child process. Signals: progress(done, total), step(message), done(seconds), failed(message, detail).
    `what` names it in a failure's words ("The GPU kernel build")."""

    progress = Signal(int, int)
    step = Signal(str)
    done = Signal(float)
    failed = Signal(str, str)

    def __init__(self, command: list[str], what: str, parent: QObject | None = None):
        super().__init__(parent)
        self.command, self.what = command, what
        self.proc = QProcess(self)
        self.proc.setProcessChannelMode(QProcess.MergedChannels)
        self.proc.readyReadStandardOutput.connect(self._read)
        self.proc.finished.connect(self._finished)
        self._buffer = b""
        self._ended = False
        self._lines: list[str] = []

    def start(self) -> None:
        from app.engine_client import worker_environment
        env = QProcessEnvironment()
        for k, v in worker_environment().items():
            env.insert(k, v)
        self.proc.setProcessEnvironment(env)
        self.proc.start(self.command[0], self.command[1:])

    def running(self) -> bool:
        return self.proc.state() != QProcess.NotRunning

    def _read(self) -> None:
        self._buffer += bytes(self.proc.readAllStandardOutput())
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            self.handle_line(raw.decode("utf-8", "replace"))

    def handle_line(self, line: str) -> None:
        """One line of the child's output: an event, or stray output kept for a failure's detail."""
        try:
            ev = json.loads(line)
        except ValueError:
            self._lines = (self._lines + [line])[-40:]
            return
        kind = ev.get("event") if isinstance(ev, dict) else None
        if kind == "progress":
            if ev.get("message"):
                self.step.emit(str(ev["message"]))
            self.progress.emit(int(ev["done"]), int(ev["total"]))
        elif kind == "done":
            self._ended = True
            self.done.emit(float(ev.get("seconds", 0.0)))
        elif kind == "failed":
            self._ended = True
            self.failed.emit(ev.get("message", f"{self.what} failed."), ev.get("detail", ""))

    def _finished(self, code: int, _status) -> None:
        self._read()
        if not self._ended:
            self._ended = True
            if code == 0:
                self.done.emit(0.0)
            else:
                self.failed.emit(f"{self.what} stopped (exit status {code}).", "\n".join(self._lines))

    def stop(self) -> None:
        if self.running():
            self.proc.kill()
            self.proc.waitForFinished(3000)
