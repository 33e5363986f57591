"""Spawn and talk to a worker process, blocking style (the CLI and tests; the GUI has its own async client).

    with WorkerClient() as w:                 # spawns the worker, hello -> ready
        w.load("demo")                        # progress events go to on_progress; errors raise
        for ev in w.generate(Generate(...)):  # token / telemetry events, then finished (or error)
            ...

`stop()` asks the worker to shut down, terminates it after a grace period, then kills it. The
worker's stderr is kept in a ring buffer of its last lines, to show when something goes wrong.
"""
from __future__ import annotations

import collections
import os
import queue
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Callable, Iterator, Optional

from runtime import protocol as P
from runtime.options import LoadOptions

_EOF = object()


def worker_command() -> list[str]:
    """How to start a worker: the `moedesk-worker` program beside this Python (the bundle's, or the
    install's entry point), else this Python with -m runtime.worker."""
    exe = Path(sys.executable).with_name("moedesk-worker" + (".exe" if os.name == "nt" else ""))
    if getattr(sys, "frozen", False) or exe.is_file():     # the bundle's program, or the install's entry point
        return [str(exe)]
    return [sys.executable, "-m", "runtime.worker"]


def worker_env(base: Optional[dict] = None) -> dict:
    """The environment for a worker: ours, with this copy of the `runtime` package importable first."""
    env = dict(os.environ if base is None else base)
    if not getattr(sys, "frozen", False):
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


WorkerError = P.WorkerError      # what a worker's error event becomes on this side (WorkerDied among them)


class WorkerDied(P.WorkerError):
    """The worker process ended (or never answered). `stderr_tail` holds its last log lines."""

    def __init__(self, message: str, stderr_tail: list[str], returncode: Optional[int] = None):
        tail = "\n".join(stderr_tail[-20:])
        super().__init__("worker_died", message, tail)
        self.stderr_tail = stderr_tail
        self.returncode = returncode


class WorkerClient:
    def __init__(self, command: Optional[list[str]] = None, env: Optional[dict] = None,
                 stderr_lines: int = 200, client_name: str = "moedesk-cli"):
        self.command = command or worker_command()
        self.env = worker_env(env)
        self.client_name = client_name
        self.proc: Optional[subprocess.Popen] = None
        self.ready: Optional[P.Ready] = None
        self._events: "queue.Queue" = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=stderr_lines)
        self._send_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> P.Ready:
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=self.env)
        threading.Thread(target=self._read_events, daemon=True, name="worker-events").start()
        threading.Thread(target=self._read_stderr, daemon=True, name="worker-stderr").start()
        self.send(P.Hello(client=self.client_name))
        ev = self.next_event(timeout)
        if isinstance(ev, P.Error):
            raise P.exception_for(ev)
        if not isinstance(ev, P.Ready):
            raise P.WorkerError(P.ErrorCode.INTERNAL.value, f"the worker answered hello with {ev.type}, not ready")
        self.ready = ev
        return ev

    def stop(self, grace: float = 5.0) -> Optional[int]:
        """shutdown -> wait `grace` -> terminate -> wait -> kill. Returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                self.send(P.Shutdown())
                proc.stdin.close()
            except (OSError, ValueError):
                pass
            for action in (None, proc.terminate, proc.kill):
                if action is not None:
                    action()
                try:
                    proc.wait(grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        return proc.wait()

    def __enter__(self) -> "WorkerClient":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stderr_tail(self, n: int = 20) -> list[str]:
        return list(self._stderr)[-n:]

    # -- channel -----------------------------------------------------------------------------
    def send(self, cmd) -> None:
        if self.proc is None or self.proc.stdin is None:
            raise WorkerDied("the worker is not running", self.stderr_tail())
        self.send_raw(P.encode(cmd))

    def send_raw(self, line: str | bytes) -> None:
        """A raw line, as it is (tests use this to send broken commands)."""
        data = line.encode("utf-8") if isinstance(line, str) else line
        try:
            with self._send_lock:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self._died() from None

    def next_event(self, timeout: Optional[float] = None):
        """The next event; raises TimeoutError when none came in `timeout` s, WorkerDied when it exited."""
        try:
            ev = self._events.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no event from the worker in {timeout} s") from None
        if ev is _EOF:
            self._events.put(_EOF)      # stays dead for later calls
            raise self._died()
        return ev

    def _died(self) -> WorkerDied:
        rc = None
        if self.proc is not None:
            try:
                rc = self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        return WorkerDied(f"the worker process ended (exit code {rc})", self.stderr_tail(), rc)

    def _read_events(self) -> None:
        for raw in self.proc.stdout:
            try:
                self._events.put(P.decode_event(raw))
            except P.ProtocolError as e:
                self._events.put(P.Error(code=P.ErrorCode.INTERNAL.value,
                                         message=f"the worker sent a line that is not an event: {e.message}",
                                         detail=raw[:500].decode("utf-8", "replace")))
        self._events.put(_EOF)

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            self._stderr.append(raw.decode("utf-8", "replace").rstrip("\n"))

    # -- requests ----------------------------------------------------------------------------
    def load(self, model: str, options: LoadOptions = LoadOptions(),
             on_progress: Optional[Callable[[P.Progress], None]] = None, timeout: float = 1800.0) -> P.Loaded:
        rid = new_id("load")
        self.send(P.Load(request_id=rid, model=model, options=options))
        while True:
            ev = self.next_event(timeout)
            if isinstance(ev, P.Progress) and on_progress:
                on_progress(ev)
            elif isinstance(ev, P.Loaded) and ev.request_id == rid:
                return ev
            elif isinstance(ev, P.Error) and ev.request_id in (rid, None):
                raise P.exception_for(ev)

    def generate(self, request: P.Generate, timeout: Optional[float] = 600.0) -> Iterator:
        """Send `request` and yield every event up to and including its finished or error event."""
        self.send(request)
        while True:
            ev = self.next_event(timeout)
            yield ev
            if isinstance(ev, (P.Finished, P.Error)) and ev.request_id == request.request_id:
                return


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
