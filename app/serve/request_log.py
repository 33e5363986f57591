"""What the local server was asked: every HTTP request as it starts and ends, for the window's server
indicator and its request log.

    history = RequestHistory()                               # on the GUI thread
    app = RequestLog(create_app(backend), history.started, history.ended)    # uvicorn serves `app`
    history.changed.connect(view.refresh)                    # history.records(), history.in_flight

`RequestLog` is plain ASGI around the API: it reports a `RequestRecord` when a request arrives and
again when its response has been sent (the last chunk of a stream included), from the server's
thread. The engine side adds what only it knows: while a request is handled, `current()` is its live
record (a context variable follows the request into the API's handler), and `LiveRequest.watch`
wraps the generation's event sink to note its request id, tokens, speed and how it ended.

`RequestHistory` lives on the GUI thread: `started` and `ended` may be called from any thread (they
cross by queued signals), and it keeps the last `HISTORY_LENGTH` requests.
"""
from __future__ import annotations

import contextvars
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

from PySide6.QtCore import QObject, Signal

from runtime import protocol as P

HISTORY_LENGTH = 500
SHOWN_CHARS = 200            # of a method or path from the network: enough to recognise it, no more


@dataclass(frozen=True)
class RequestRecord:
    seq: int                              # 1, 2, ... in arrival order since the server started
    started: float                        # time.time()
    client: str                           # the caller's address
    method: str
    path: str
    status: Optional[int] = None          # the HTTP status sent (None: not yet, or none was sent)
    duration_s: Optional[float] = None    # None while the request runs
    request_id: str = ""                  # the generation's id, when it reached the engine
    tokens: Optional[int] = None          # generated
    decode_tps: Optional[float] = None
    outcome: str = ""                     # the generation's end: "eos", "length", "cancelled"... or an error code

    @property
    def running(self) -> bool:
        return self.duration_s is None


class LiveRequest:
    """A request being handled: filled in from the server's thread and, for the engine's events, the GUI's."""

    def __init__(self, seq: int, client: str, method: str, path: str):
        self.seq, self.client, self.method, self.path = seq, client, method, path
        self.started = time.time()
        self.status: Optional[int] = None
        self.duration_s: Optional[float] = None
        self.request_id = ""
        self.tokens: Optional[int] = None
        self.decode_tps: Optional[float] = None
        self.outcome = ""

    def record(self) -> RequestRecord:
        return RequestRecord(self.seq, self.started, self.client, self.method, self.path, self.status,
                             self.duration_s, self.request_id, self.tokens, self.decode_tps, self.outcome)

    def watch(self, request_id: str, sink: Callable[[Any], None]) -> Callable[[Any], None]:
        """`sink`, noting on the way how the generation `request_id` ends."""
        self.request_id = request_id

        def noting(ev: Any) -> None:
            if isinstance(ev, P.Finished):
                self.tokens, self.decode_tps, self.outcome = ev.stats.generated_tokens, ev.stats.decode_tps, ev.reason
            elif isinstance(ev, P.Error):
                self.outcome = ev.code
            sink(ev)
        return noting


_CURRENT: contextvars.ContextVar[Optional[LiveRequest]] = contextvars.ContextVar("moedesk_request", default=None)


def current() -> Optional[LiveRequest]:
    """The request being handled by this task (None outside a request)."""
    return _CURRENT.get()


def _shown(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "…"


class RequestLog:
    """ASGI middleware: `on_start(record)` when an HTTP request arrives, `on_end(record)` once its response
    is sent (or the request failed or was abandoned); both on the server's thread."""

    def __init__(self, app, on_start: Callable[[RequestRecord], None], on_end: Callable[[RequestRecord], None]):
        self.app, self._on_start, self._on_end = app, on_start, on_end
        self._seq = itertools.count(1)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        live = LiveRequest(next(self._seq), str(client[0]) if client else "", _shown(str(scope.get("method", ""))),
                           _shown(str(scope.get("path", ""))))
        self._on_start(live.record())
        token = _CURRENT.set(live)
        t0 = time.perf_counter()

        async def sending(message) -> None:
            if message.get("type") == "http.response.start":
                live.status = message.get("status")
            await send(message)
        try:
            await self.app(scope, receive, sending)
        finally:
            live.duration_s = time.perf_counter() - t0
            _CURRENT.reset(token)
            self._on_end(live.record())


class RequestHistory(QObject):
    """The server's recent requests, on the GUI thread; `changed` after each start or end."""
    changed = Signal()
    _arrived = Signal(object)          # from the server's thread: queued to ours
    _done = Signal(object)

    def __init__(self, parent=None, length: int = HISTORY_LENGTH):
        super().__init__(parent)
        self.length = length
        self._records: OrderedDict[int, RequestRecord] = OrderedDict()
        self.served = 0                # requests ended since the server started
        self._arrived.connect(self._put)
        self._done.connect(self._end)

    # -- any thread -------------------------------------------------------------------------------
    def started(self, record: RequestRecord) -> None:
        self._arrived.emit(record)

    def ended(self, record: RequestRecord) -> None:
        self._done.emit(record)

    # -- GUI thread -------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return sum(1 for r in self._records.values() if r.running)

    def records(self) -> list[RequestRecord]:
        """Oldest first."""
        return list(self._records.values())

    def clear(self) -> None:
        """Forget the requests that ended (running ones stay: they are still in flight)."""
        for seq in [s for s, r in self._records.items() if not r.running]:
            del self._records[seq]
        self.changed.emit()

    def reset(self) -> None:
        """The server (re)started: a new count."""
        self._records.clear()
        self.served = 0
        self.changed.emit()

    def _put(self, record: RequestRecord) -> None:
        self._records[record.seq] = record
        self._trim()
        self.changed.emit()

    def _end(self, record: RequestRecord) -> None:
        self._records[record.seq] = record
        self.served += 1
        self._trim()
        self.changed.emit()

    def _trim(self) -> None:
        while len(self._records) > self.length:
            done = next((s for s, r in self._records.items() if not r.running), None)
            if done is None:
                break
            del self._records[done]
