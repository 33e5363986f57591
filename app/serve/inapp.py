"""The local server inside the app: uvicorn on its own thread, in front of the app's own engine client.

    server = LocalServer(client)                 # client: app.engine_client.EngineClient
    server.status.connect(label.setText)         # words: "Serving demo at http://127.0.0.1:8642/v1", errors
    problem = server.apply(ServeOptions(enabled=True), api_key)   # None, or why it could not start
    server.history.changed.connect(...)          # its requests: in flight and ended (app.serve.request_log)
    server.stop()

Threads: the HTTP side runs on the server thread's asyncio loop; the engine client lives on the GUI
thread. `QtBackend` crosses between them with queued signals (server thread -> GUI thread) and the
loop's `call_soon_threadsafe` (GUI thread -> server thread). The engine client sends one generate at
a time: an API request made while the chat writes an answer waits for it, and a chat message sent
while an API answer streams waits for that (each behind at most `max_queue` API requests).
"""
from __future__ import annotations

import threading
from typing import Optional

from PySide6.QtCore import QObject, Signal

from app.serve.api import ServedModel, Sink, create_app
from app.serve.cli import bind, is_loopback, make_server, url_of
from app.serve.request_log import RequestHistory, RequestLog, current
from app.serve.worker_backend import served_model
from runtime import protocol as P
from runtime.options import ServeOptions


class QtBackend(QObject):
    """The API's engine backend over the GUI's EngineClient (see `app.serve.api.Backend`)."""
    _start = Signal(object, object)      # Generate, sink: from the server thread
    _cancel = Signal(str)
    model_changed = Signal()             # served_model() changed (loaded, unloaded, engine gone)

    def __init__(self, client, parent=None):
        super().__init__(parent)
        self.client = client
        self._sinks: dict[str, Sink] = {}
        self._model: Optional[ServedModel] = None
        # app.idle_unload.IdleUnloader: a model unloaded for idleness is still served, and loaded again first
        self.waker = None
        self._start.connect(self._on_start)          # queued: emitted from another thread
        self._cancel.connect(self._on_cancel)
        client.loaded.connect(self._on_loaded)
        client.unloaded.connect(self._on_unloaded)
        client.worker_died.connect(self._on_died)
        client.token.connect(self._on_token)
        client.finished.connect(lambda ev: self._end(ev.request_id, ev))
        client.error.connect(self._on_error)
        if client.loaded_event is not None:
            self._on_loaded(client.loaded_event)

    # -- Backend (any thread) ---------------------------------------------------------------------
    def served_model(self) -> Optional[ServedModel]:
        return self._model

    def start(self, request: P.Generate, sink: Sink) -> None:
        live = current()                 # the HTTP request this generation serves: its log notes the end
        self._start.emit(request, live.watch(request.request_id, sink) if live is not None else sink)

    def cancel(self, request_id: str) -> None:
        self._cancel.emit(request_id)

    # -- GUI thread -------------------------------------------------------------------------------
    def _set_model(self, model: Optional[ServedModel]) -> None:
        self._model = model
        self.model_changed.emit()

    def _on_loaded(self, ev: P.Loaded) -> None:
        self._set_model(served_model(ev))

    def _on_unloaded(self, _ev) -> None:
        if self.waker is None or self.waker.asleep is None:
            self._set_model(None)

    def _on_start(self, request: P.Generate, sink: Sink) -> None:
        self._sinks[request.request_id] = sink
        if self.waker is not None:
            self.waker.wake()
        self.client.submit(request)

    def _on_cancel(self, request_id: str) -> None:
        if request_id in self._sinks:
            self.client.cancel(request_id)

    def _on_token(self, ev: P.TokenDelta) -> None:
        sink = self._sinks.get(ev.request_id)
        if sink is not None:
            sink(ev)

    def _on_error(self, request_id: str, err: P.WorkerError) -> None:
        self._end(request_id, P.Error(code=err.code, message=err.message, request_id=request_id))

    def _on_died(self, _code: int, words: str, _lines: list) -> None:
        self._set_model(None)
        for rid in list(self._sinks):
            self._end(rid, P.Error(code="worker_died", message=words, request_id=rid))

    def _end(self, request_id: str, ev) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink(ev)

    def close(self, words: str) -> None:
        """End every open request now (the engine is told to stop them), so the server can shut down
        without waiting on this (GUI) thread."""
        for rid in list(self._sinks):
            self.client.cancel(rid)
            self._end(rid, P.Error(code="server_stopped", message=words, request_id=rid))


class LocalServer(QObject):
    status = Signal(str)          # the address, or what went wrong, in words

    def __init__(self, client, parent=None):
        super().__init__(parent)
        self.backend = QtBackend(client, self)
        self.history = RequestHistory(self)
        self.url: Optional[str] = None
        self._server = None
        self._thread: Optional[threading.Thread] = None
        self._running: Optional[tuple] = None       # (options, key) it runs with
        self.words = "The local server is off."     # the last status, for a settings page opened later
        self.status.connect(lambda words: setattr(self, "words", words))

    def apply(self, options: ServeOptions, api_key: Optional[str]) -> Optional[str]:
        """Start, restart or stop the server to match the settings; returns why it cannot run, or None."""
        if self._running == (options, api_key) and (self._thread is not None) == options.enabled:
            return None
        self.stop()
        if not options.enabled:
            self.status.emit("The local server is off.")
            return None
        host = "0.0.0.0" if options.allow_other_devices else "127.0.0.1"
        if not is_loopback(host) and not api_key:
            return self._refuse("Allowing other devices needs an API key: create one first.")
        try:
            app = create_app(self.backend, api_key=api_key, max_queue=options.max_queue,
                             allowed_origins=options.allowed_origins, allowed_hosts=options.allowed_hosts)
        except ValueError as e:
            return self._refuse(f"The local server cannot start: {e}.")
        try:
            sock = bind(host, options.port)
        except OSError as e:
            return self._refuse(f"The local server cannot listen on port {options.port}: {e.strerror or e}. "
                                "Pick another port.")
        self._server = make_server(RequestLog(app, self.history.started, self.history.ended), log_level="warning")
        self.history.reset()
        self.url = url_of(sock, "127.0.0.1" if is_loopback(host) else _lan_address())
        self._thread = threading.Thread(target=self._serve, args=(self._server, sock), name="local-server",
                                        daemon=True)
        self._thread.start()
        self._running = (options, api_key)
        self.status.emit(f"{self.url}" if is_loopback(host) else f"{self.url} (other devices: use this address)")
        return None

    def _serve(self, server, sock) -> None:
        try:
            server.run(sockets=[sock])
        finally:
            sock.close()

    def _refuse(self, words: str) -> str:
        self.status.emit(words)
        return words

    def stop(self) -> None:
        if self._server is not None:
            self.backend.close("The local server was stopped.")
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self._server = self._thread = self.url = self._running = None


def _lan_address() -> str:
    """This computer's address on its network (what other devices use), or 0.0.0.0 when unknown."""
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))          # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
    except OSError:
        return "0.0.0.0"
