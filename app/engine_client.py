"""The GUI's handle on the worker process: a QObject that owns it as a QProcess and speaks the protocol.

    client = EngineClient()                  # command: runtime.client.worker_command()
    client.ready.connect(...)                # runtime.protocol.Ready
    client.start()                           # spawns the worker and sends hello
    rid = client.load("demo", LoadOptions())
    client.generate("r1", [ChatMessage("user", "Hi")], SamplingOptions())
    client.cancel("r1")
    client.restart()                         # respawn, then reload the last model
    client.shutdown()                        # shutdown command, terminate, kill: never an orphan

Signals carry the protocol's own dataclasses: ready(Ready), progress(Progress), loaded(Loaded),
unloaded(Unloaded), token(TokenDelta), finished(Finished), telemetry(Telemetry), token_count(TokenCount);
error(request_id, WorkerError) where the exception comes from `runtime.protocol.exception_for` (code,
message, detail); worker_died(exit_code, description in words, last stderr lines) when the process
ends without being asked to; state_changed(state) with one of the `State` values.
A request made while no worker runs is not sent: `error` follows (code "not_running") with its id.
A generate made while another generation runs waits in the client (in order) and is sent when that one
ends, so the chat and the local server share one worker; cancelling a waiting one ends it at once
(`finished` with reason "cancelled").

Nothing here blocks the GUI thread: output is read from QProcess's readyRead signals (partial lines
are buffered until their newline), commands are written without waiting, restart and shutdown
proceed on signals and timers. The only blocking call is the last resort on application quit
(`shutdown(wait=True)`, wired to `aboutToQuit`).
"""
from __future__ import annotations

import logging
import os
import signal as _signal
import sys
import uuid
from collections import deque
from pathlib import Path
from typing import Optional, Sequence

from PySide6.QtCore import QCoreApplication, QObject, QProcess, QProcessEnvironment, QTimer, Signal

from runtime import paths, protocol
from runtime.options import DraftOptions, LoadOptions, SamplingOptions
from runtime.protocol import ChatMessage

log = logging.getLogger("moedesk.worker")   # the worker's stderr, line by line

STDERR_LINES = 50
SHUTDOWN_GRACE_MS = 3000     # after the shutdown command, before terminate
TERMINATE_GRACE_MS = 2000    # after terminate (SIGTERM), before kill
NOT_RUNNING = "not_running"  # error code (client side) for a request made while no worker runs


class State:
    STOPPED = "stopped"      # no process (never started, or shut down)
    STARTING = "starting"    # spawned, waiting for ready
    IDLE = "idle"            # ready, nothing running
    LOADING = "loading"
    GENERATING = "generating"
    STOPPING = "stopping"
    DEAD = "dead"            # ended without being asked to; restart() brings it back


def worker_command() -> list[str]:
    """The worker's command line: the runtime's own choice when it provides one."""
    try:
        from runtime.client import worker_command as runtime_worker_command
    except ImportError:
        return [sys.executable, "-m", "runtime.worker"]
    return list(runtime_worker_command())


def worker_environment() -> dict[str, str]:
    """The worker's environment: ours, with this copy of `runtime` importable and unbuffered output."""
    try:
        from runtime.client import worker_env
    except ImportError:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env
    return dict(worker_env())


def oom_kills() -> Optional[int]:
    """How many processes the kernel's out-of-memory killer has killed since boot (Linux's /proc/vmstat
    `oom_kill`, which counts container limits too); None where the system does not say."""
    try:
        with open("/proc/vmstat", encoding="ascii") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def describe_exit(exit_code: int, crashed: bool, oom_killed: Optional[bool] = None) -> str:
    """How the worker ended, in words: only what is known. `crashed`: killed by signal number `exit_code`;
    `oom_killed`: whether the system's out-of-memory killer acted meanwhile (None: not known)."""
    if not crashed:
        if exit_code == 0:
            return "The engine stopped unexpectedly (exit code 0)."
        return f"The engine exited with an error (exit code {exit_code})."
    try:
        name = _signal.Signals(exit_code).name
    except ValueError:
        name = f"signal {exit_code}"
    if exit_code == getattr(_signal, "SIGKILL", -1):
        if oom_killed:
            return (f"The system's out-of-memory killer stopped the engine (signal {exit_code}, {name}): "
                    "RAM ran out.")
        if oom_killed is False:
            return (f"The engine was killed (signal {exit_code}, {name}) by another program or a user; "
                    "the system's out-of-memory killer did not act.")
        return f"The engine was killed (signal {exit_code}, {name})."
    if exit_code == getattr(_signal, "SIGSEGV", -1):
        return f"The engine crashed with a segmentation fault (signal {exit_code}, {name})."
    if exit_code == getattr(_signal, "SIGABRT", -1):
        return f"The engine aborted (signal {exit_code}, {name}), usually a failed check in a GPU library."
    if exit_code == getattr(_signal, "SIGBUS", -1):
        return f"The engine crashed with a bus error (signal {exit_code}, {name}), e.g. a model file changed while mapped."
    if exit_code in (getattr(_signal, "SIGTERM", -1), getattr(_signal, "SIGINT", -1)):
        return f"The engine was stopped from outside (signal {exit_code}, {name})."
    return f"The engine was killed by signal {exit_code} ({name})."


# What to do about each of the engine's error codes (runtime.protocol.ErrorCode), in words: shown under its message.
ERROR_ADVICE = {
    "model_not_found": "There is no model by that name or in that folder on this computer: choose one of your "
                       "models, or download one.",
    "model_invalid": "The model's folder is incomplete or damaged: download or import it again, or choose another.",
    "unsupported_architecture": "MoE Desk cannot run this kind of model: choose another one.",
    "out_of_memory": "The model does not fit in memory with these settings: lower the context length or the memory "
                     "budgets in Settings, or choose a smaller model.",
    "cuda_unavailable": "The GPU engine cannot run on this computer: models run on the CPU engine instead (Settings, "
                        "Engine).",
    "kernel_build_failed": "The GPU engine's kernels did not build: the engine's log below says why.",
    "context_overflow": "The conversation is longer than the model's context: start a new chat, or load the model "
                        "with a longer context (Settings).",
    "busy": "The engine is still writing an answer: wait for it, or press Stop.",
    "no_model": "No model is loaded: choose one in the chat's model list.",
    "version_mismatch": "The engine and the app come from different versions: install MoE Desk again.",
}


def error_advice(code: str) -> str:
    """What the user can do about an engine error, in words (never its code)."""
    return ERROR_ADVICE.get(code, "This is a fault in MoE Desk, not in what you did: the engine's log below has "
                                  "the details, and Restart engine starts afresh.")


class LineBuffer:
    """Splits a byte stream into complete lines; a partial line waits for the rest."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, data: bytes) -> list[bytes]:
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        return lines

    def flush(self) -> list[bytes]:
        """What is left when the stream ends (a last line without its newline)."""
        rest, self._partial = self._partial, b""
        return [rest] if rest else []


class EngineSignals(QObject):
    """What the window, the chat and the gauges hear from an engine: this client's local worker, or a remote
    server (`app.serve.remote.RemoteEngine`). Both also offer start, load, generate, cancel, restart and
    shutdown, and the attributes state, ready_event, loaded_event and generating."""
    ready = Signal(object)
    progress = Signal(object)
    loaded = Signal(object)
    unloaded = Signal(object)
    token = Signal(object)
    finished = Signal(object)
    telemetry = Signal(object)
    token_count = Signal(object)           # runtime.protocol.TokenCount
    error = Signal(str, object)            # request_id ("" when none), protocol.WorkerError
    worker_died = Signal(int, str, list)   # exit code or signal number, words, last stderr lines
    state_changed = Signal(str)


class EngineClient(EngineSignals):

    def __init__(self, command: Optional[Sequence[str]] = None, parent: Optional[QObject] = None,
                 client_name: str = "moedesk-gui"):
        super().__init__(parent)
        self._command = list(command) if command else worker_command()
        self._client_name = client_name
        self._proc: Optional[QProcess] = None
        self._out, self._err = LineBuffer(), LineBuffer()
        self.stderr_lines: deque[str] = deque(maxlen=STDERR_LINES)
        self.state = State.STOPPED
        self.ready_event: Optional[protocol.Ready] = None
        self.last_load: Optional[tuple[str, LoadOptions]] = None   # what restart() reloads
        self._previous_load: Optional[tuple[str, LoadOptions]] = None
        self._loading: Optional[str] = None       # request id of the load in flight
        self.loaded_event: Optional[protocol.Loaded] = None
        self.generating: Optional[str] = None     # request id of the running generation
        self._asked_to_stop = False
        self._restarting = False
        self._pending: list[str] = []
        self._queued: deque[protocol.Generate] = deque()   # generates waiting for the running one
        self._oom_kills_at_start: Optional[int] = None
        app = QCoreApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(self._on_about_to_quit)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the worker (if not running) and greet it; `ready` follows."""
        if self._proc is not None and self._proc.state() != QProcess.ProcessState.NotRunning:
            return
        self._out, self._err = LineBuffer(), LineBuffer()
        self.stderr_lines.clear()       # a later death reports this process's own lines
        self.ready_event, self.loaded_event, self.generating, self._loading = None, None, None, None
        self._fail_queued()
        if self._proc is not None:
            self._proc.deleteLater()
        self._asked_to_stop = False
        self._oom_kills_at_start = oom_kills()
        proc = self._proc = QProcess(self)
        proc.setProgram(self._command[0])
        proc.setArguments(self._command[1:])
        env = QProcessEnvironment()
        for key, value in worker_environment().items():
            env.insert(key, value)
        proc.setProcessEnvironment(env)
        proc.readyReadStandardOutput.connect(lambda p=proc: self._read_stdout(p))
        proc.readyReadStandardError.connect(lambda p=proc: self._read_stderr(p))
        proc.started.connect(lambda p=proc: self._on_started(p))
        proc.finished.connect(lambda code, status, p=proc: self._on_finished(p, code, status))
        proc.errorOccurred.connect(lambda err, p=proc: self._on_error(p, err))
        self._pending = [protocol.encode(protocol.Hello(client=self._client_name))]
        self._set_state(State.STARTING)
        proc.start()

    def restart(self) -> None:
        """Stop the worker if it runs (kill), start a fresh one, and reload the last model if any."""
        if self._restarting:
            return
        old = self._proc
        if old is not None and old.state() != QProcess.ProcessState.NotRunning:
            self._asked_to_stop = self._restarting = True
            old.finished.connect(lambda *_: self._respawn())   # runs after _on_finished for it
            old.kill()
            return
        self._respawn()

    def _respawn(self) -> None:
        self._restarting = False
        self.start()
        if self.last_load is not None:
            model, options = self.last_load
            self.load(model, options)

    def shutdown(self, wait: bool = False) -> None:
        """Ask the worker to exit; terminate after a grace period, then kill. `wait`: block until gone."""
        proc = self._proc
        if proc is None or proc.state() == QProcess.ProcessState.NotRunning:
            self._set_state(State.STOPPED)
            return
        first = not self._asked_to_stop
        self._asked_to_stop = True
        self._set_state(State.STOPPING)
        if first and proc.state() == QProcess.ProcessState.Running:
            proc.write(protocol.encode(protocol.Shutdown()).encode())
            proc.closeWriteChannel()     # EOF on stdin: a second reason to leave
        if wait:
            if not proc.waitForFinished(SHUTDOWN_GRACE_MS):
                proc.terminate()
                if not proc.waitForFinished(TERMINATE_GRACE_MS):
                    proc.kill()
                    proc.waitForFinished(TERMINATE_GRACE_MS)
            return
        if first:
            QTimer.singleShot(SHUTDOWN_GRACE_MS, self, lambda p=proc: self._escalate(p, terminate=True))

    def pid(self) -> Optional[int]:
        if self._proc is None or self._proc.state() == QProcess.ProcessState.NotRunning:
            return None
        return int(self._proc.processId()) or None

    def is_running(self) -> bool:
        return self.pid() is not None

    # -- commands ---------------------------------------------------------------------------
    def holds(self, model: str, options: Optional[LoadOptions] = None) -> bool:
        """Whether `model` (a name, 'demo' or a folder) with `options` is loaded or being loaded now."""
        if self.last_load is None or (self.loaded_event is None and self._loading is None):
            return False
        current, current_options = self.last_load
        return current_options == (options or LoadOptions()) and paths.same_model(current, model)

    def load(self, model: str, options: Optional[LoadOptions] = None,
             request_id: Optional[str] = None) -> Optional[str]:
        """Ask for `model`; None (and nothing sent) when it is loaded, or loading, with these options already."""
        options = options or LoadOptions()
        if self.holds(model, options):
            return None
        request_id = request_id or f"load-{uuid.uuid4().hex[:8]}"
        if not self._send(protocol.Load(request_id=request_id, model=model, options=options)):
            self.last_load = (model, options)     # what a restart will load
            return request_id
        if self._loading is None:
            self._previous_load = self.last_load
        self.last_load, self._loading = (model, options), request_id
        self._set_state(State.LOADING)
        return request_id

    @property
    def loading(self) -> bool:
        """A load was sent and its answer has not come yet (the state may say idle meanwhile: an earlier
        load's `loaded` came first)."""
        return self._loading is not None

    def unload(self, request_id: Optional[str] = None) -> str:
        request_id = request_id or f"unload-{uuid.uuid4().hex[:8]}"
        self.last_load = None
        self._send(protocol.Unload(request_id=request_id))
        return request_id

    def generate(self, request_id: str, messages: Sequence[ChatMessage],
                 sampling: Optional[SamplingOptions] = None, draft: Optional[DraftOptions] = None,
                 answer_prefix: str = "") -> str:
        for i, m in enumerate(messages):
            if not isinstance(m, ChatMessage):
                raise TypeError(f"messages[{i}] is a {type(m).__name__}, expected runtime.protocol.ChatMessage")
        return self.submit(protocol.Generate(request_id=request_id, messages=tuple(messages),
                                             sampling=sampling or SamplingOptions(), draft=draft,
                                             answer_prefix=answer_prefix))

    def submit(self, command: protocol.Generate) -> str:
        """Send a generate command, or keep it until the running generation ends."""
        if self.generating is not None and self.is_running():
            self._queued.append(command)
        elif self._send(command):
            self.generating = command.request_id
            self._set_state(State.GENERATING)
        return command.request_id

    def cancel(self, request_id: Optional[str] = None) -> None:
        """Stop a generation (the running one when `request_id` is None); `finished` follows."""
        rid = request_id or self.generating
        waiting = next((c for c in self._queued if c.request_id == rid), None)
        if waiting is not None:
            self._queued.remove(waiting)
            ev = protocol.Finished(rid, "cancelled", protocol.GenerationStats(0, 0, None, None, None, 0.0))
            QTimer.singleShot(0, self, lambda: self.finished.emit(ev))
        elif rid and self.is_running():
            self._send(protocol.Cancel(request_id=rid))

    def count(self, request_id: str, messages: Sequence[ChatMessage]) -> None:
        """Ask how many tokens `messages` take as a prompt; `token_count` (or `error`) answers."""
        self._send(protocol.CountTokens(request_id=request_id, messages=tuple(messages)))

    def _send_queued(self) -> None:
        if self._queued and self.generating is None:
            self.submit(self._queued.popleft())

    def _fail_queued(self) -> None:
        waiting, self._queued = list(self._queued), deque()
        for cmd in waiting:
            self.error.emit(cmd.request_id, protocol.WorkerError(
                NOT_RUNNING, "The engine stopped before this request's turn came; send it again."))

    def stats(self, request_id: str = "") -> None:
        """Ask for one telemetry event now."""
        self._send(protocol.Stats(request_id=request_id))

    # -- internals --------------------------------------------------------------------------
    def _send(self, command) -> bool:
        """Write one command; when there is no worker, `error` says so (queued) and False is returned."""
        line = protocol.encode(command)
        proc = self._proc
        if proc is None or proc.state() == QProcess.ProcessState.NotRunning or self._asked_to_stop:
            rid = getattr(command, "request_id", "") or ""
            exc = protocol.WorkerError(NOT_RUNNING, f"The engine is not running, so the {command.type} "
                                       "request was not sent. Restart the engine and try again.")
            QTimer.singleShot(0, self, lambda: self.error.emit(rid, exc))
            return False
        if proc.state() == QProcess.ProcessState.Starting:
            self._pending.append(line)
        else:
            proc.write(line.encode())
        return True

    def _on_started(self, proc: QProcess) -> None:
        if proc is not self._proc:
            return
        for line in self._pending:
            proc.write(line.encode())
        self._pending = []

    def _read_stdout(self, proc: QProcess) -> None:
        if proc is not self._proc:
            return
        for raw in self._out.feed(bytes(proc.readAllStandardOutput())):
            self._handle_line(raw)

    def _read_stderr(self, proc: QProcess) -> None:
        if proc is not self._proc:
            return
        for raw in self._err.feed(bytes(proc.readAllStandardError())):
            line = raw.decode("utf-8", "replace").rstrip("\r")
            self.stderr_lines.append(line)
            log.info("worker: %s", line)

    def _handle_line(self, raw: bytes) -> None:
        if not raw.strip():
            return
        try:
            ev = protocol.decode_event(raw)
        except protocol.ProtocolError as e:
            text = raw.decode("utf-8", "replace")[:200]
            self.stderr_lines.append(f"[unreadable protocol line: {e.message}] {text}")
            self.error.emit(e.request_id or "", protocol.WorkerError(
                e.code.value, f"The engine sent a message this app cannot read: {e.message}", text))
            return
        kind = ev.type
        if kind == "ready":
            self.ready_event = ev
            if self.state == State.STARTING:
                self._set_state(State.IDLE)
            self.ready.emit(ev)
        elif kind == "progress":
            self.progress.emit(ev)
        elif kind == "loaded":
            self.loaded_event = ev
            if ev.request_id == self._loading:
                self._loading = None
            self._set_state(State.GENERATING if self.generating else State.IDLE)
            self.loaded.emit(ev)
        elif kind == "unloaded":
            self.loaded_event = None
            self.unloaded.emit(ev)
        elif kind == "token":
            if ev.text:          # "" only counts a token whose text is held back: nothing to show yet
                self.token.emit(ev)
        elif kind == "finished":
            if ev.request_id == self.generating:
                self.generating = None
                self._set_state(State.IDLE)
            self.finished.emit(ev)
            self._send_queued()
        elif kind == "telemetry":
            self.telemetry.emit(ev)
        elif kind == "token_count":
            self.token_count.emit(ev)
        elif kind == "error":
            self._on_error_event(ev)

    def _on_error_event(self, ev: protocol.Error) -> None:
        rid = ev.request_id or ""
        if rid and rid == self.generating:
            self.generating = None
        if rid and rid == self._loading:
            self._loading = None
            self.last_load = self._previous_load     # restart() must not retry a load that failed
            self.loaded_event = None                 # the worker let the old model go before trying
        if self.state in (State.LOADING, State.GENERATING) and not (self.generating or self._loading):
            self._set_state(State.IDLE)
        self.error.emit(rid, protocol.exception_for(ev))
        self._send_queued()

    def _on_finished(self, proc: QProcess, code: int, status: QProcess.ExitStatus) -> None:
        if proc is not self._proc:
            return
        for raw in self._out.flush():
            self._handle_line(raw)
        self._read_stderr(proc)
        for raw in self._err.flush():
            self.stderr_lines.append(raw.decode("utf-8", "replace"))
        self.generating, self._loading, self.loaded_event = None, None, None     # nothing is loaded any more
        self._fail_queued()
        if self._asked_to_stop:
            self._set_state(State.STOPPED)
            return
        crashed = status == QProcess.ExitStatus.CrashExit
        before, now = self._oom_kills_at_start, oom_kills()
        oom_killed = None if before is None or now is None else now > before
        self._set_state(State.DEAD)
        self.worker_died.emit(int(code), describe_exit(int(code), crashed, oom_killed), list(self.stderr_lines))

    def _on_error(self, proc: QProcess, err: QProcess.ProcessError) -> None:
        if proc is not self._proc or err != QProcess.ProcessError.FailedToStart:
            return     # crashes arrive through finished
        self._set_state(State.DEAD)
        words = f"The engine could not be started ({' '.join(self._command)}): {proc.errorString()}"
        self.worker_died.emit(-1, words, list(self.stderr_lines))

    def _escalate(self, proc: QProcess, terminate: bool) -> None:
        if proc.state() == QProcess.ProcessState.NotRunning:
            return
        if terminate:
            proc.terminate()
            QTimer.singleShot(TERMINATE_GRACE_MS, self, lambda p=proc: self._escalate(p, terminate=False))
        else:
            proc.kill()

    def _on_about_to_quit(self) -> None:
        self.shutdown(wait=True)

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.state_changed.emit(state)
