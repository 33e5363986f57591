"""The headless server's engine: a worker process driven through `runtime.client.WorkerClient` (no Qt).

One pump thread reads the worker's events and hands each generation's TokenDelta / Finished / Error
to the sink of its request. If the worker process ends, every open request gets an error and the
served model is gone (the API answers 503) — `moedesk serve` then exits so that a supervisor can
restart it.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Optional

from app.serve.api import ServedModel, Sink
from runtime import paths
from runtime import protocol as P
from runtime.client import WorkerClient, WorkerDied


def served_model(loaded: P.Loaded, created: Optional[int] = None) -> ServedModel:
    """The API's name for a loaded model: its folder's name, however it was loaded (by name, "demo" or a
    path), so that a client's model id stays valid across reloads. Aliases: the name or path it was loaded
    by, and "demo" for the demo model."""
    name = Path(loaded.path).name or loaded.model
    names = [loaded.model, Path(loaded.model).name]
    if name == paths.DEMO_MODEL_NAME:
        names.append(paths.DEMO_ALIAS)
    aliases = tuple(sorted({a for a in names if a and a != name}))
    return ServedModel(name, loaded.context_length, created or int(time.time()), aliases,
                       loaded.tool_format or "generic")


class WorkerBackend:
    def __init__(self, client: WorkerClient, loaded: P.Loaded, on_death: Optional[Callable[[str], None]] = None):
        self.client = client
        self._model: Optional[ServedModel] = served_model(loaded)
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self._on_death = on_death
        self._closing = False
        threading.Thread(target=self._pump, name="serve-events", daemon=True).start()

    def close(self) -> None:
        """The server is stopping (Ctrl+C): the engine process ends next, and that is no death to report."""
        self._closing = True

    def served_model(self) -> Optional[ServedModel]:
        return self._model

    def start(self, request: P.Generate, sink: Sink) -> None:
        with self._lock:
            self._sinks[request.request_id] = sink
        try:
            self.client.send(request)
        except P.WorkerError as e:
            self._end(request.request_id, P.Error(code=e.code, message=e.message, request_id=request.request_id))

    def cancel(self, request_id: str) -> None:
        try:
            self.client.send(P.Cancel(request_id=request_id))
        except P.WorkerError:
            pass                 # the worker is gone: the pump has failed the request already

    def _end(self, rid: str, ev) -> None:
        with self._lock:
            sink = self._sinks.pop(rid, None)
        if sink is not None:
            sink(ev)

    def _pump(self) -> None:
        while True:
            try:
                ev = self.client.next_event(None)
            except WorkerDied as e:
                self._model = None
                if self._closing:
                    return
                words = f"the engine process ended ({e.message}); restart the server"
                with self._lock:
                    rids = list(self._sinks)
                for rid in rids:
                    self._end(rid, P.Error(code="worker_died", message=words, request_id=rid))
                if self._on_death is not None:
                    self._on_death(words)
                return
            rid = getattr(ev, "request_id", None)
            if isinstance(ev, (P.Finished, P.Error)):
                self._end(rid, ev)
            elif isinstance(ev, P.TokenDelta):
                with self._lock:
                    sink = self._sinks.get(rid)
                if sink is not None:
                    sink(ev)
