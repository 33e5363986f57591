"""A remote engine: chats stream from another OpenAI-compatible server (vLLM, SGLang, TabbyAPI, llama.cpp's
server, or another `moedesk serve`) instead of the local worker.

    engine = RemoteEngine(RemoteConfig("http://gpu-box:8000/v1", "Qwen/Qwen3-30B-A3B", api_key))
    engine.start()                               # checks /v1/models: ready + loaded, or error in words
    engine.generate("r1", [ChatMessage("user", "Hi")], SamplingOptions())
    engine.cancel("r1")
    engine.count("c1", messages)                 # `error` (no count): the server does not say
    engine.generate("r2", messages, answer_prefix="So far")   # `error`: Continue needs the local engine
    engine.unload()                              # stop using the server's model; `unloaded` follows

`RemoteEngine` has the signals and methods of `app.engine_client.EngineClient` that the window uses (the
second implementation of that interface), so the chat session cannot tell them apart. Each request
streams on a thread of its own (`app.serve.remote_http.RemoteStream`: every read bounded, every field
checked); its events reach the GUI thread through one queued signal. Speed figures come from the stream's
timing (time to first token; decode tokens/s from the usage the server reports, else from the chunks).
Failures (unreachable host, TLS, 401, timeouts, a hostile or broken server) become errors in plain words
without credentials (`describe`); the partial answer stays with the chat, and the engine goes back to idle.
"""
from __future__ import annotations

import threading
import uuid
from typing import Any, Optional, Sequence

from PySide6.QtCore import QObject, QTimer, Signal

from app.engine_client import EngineSignals
from app.serve.remote_http import (RemoteConfig, RemoteError, RemoteStream, describe, list_models,  # noqa: F401
                                   normalise_url, request_body, shown_url)
from runtime import protocol as P
from runtime.options import DraftOptions, SamplingOptions

SHOWN_MODELS = 10              # model names quoted when the chosen one is missing
NO_COUNT = "This server counts no tokens on request (the OpenAI API has no such call)."
NO_CONTINUE = ("Continue works with the local engine only: a remote server may not carry on a given answer. "
               "The text so far is kept; Regenerate asks the server for a new answer.")


class RemoteEngine(EngineSignals):
    """The EngineClient interface over a remote OpenAI-compatible server."""
    _post = Signal(str, str, object)        # (kind, request id, event) from a stream thread

    def __init__(self, config: RemoteConfig, parent: Optional[QObject] = None):
        super().__init__(parent)
        self.config = RemoteConfig(normalise_url(config.base_url), config.model, config.api_key)
        self.state = "stopped"
        self.ready_event: Optional[P.Ready] = None
        self.loaded_event: Optional[P.Loaded] = None
        self.last_load = None
        self.generating: Optional[str] = None
        self._streams: dict[str, RemoteStream] = {}
        self._post.connect(self._deliver)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Check that the server answers and lists the model; `ready` and `loaded`, or `error`, follow."""
        self._set_state("starting")
        threading.Thread(target=self._check, name="remote-check", daemon=True).start()

    def restart(self) -> None:
        self.start()

    def shutdown(self, wait: bool = False) -> None:
        for rid in list(self._streams):
            self.cancel(rid)
        self._set_state("stopped")

    def pid(self) -> None:
        return None

    def is_running(self) -> bool:
        return self.state in ("idle", "generating")

    def _check(self) -> None:
        c = self.config
        try:
            models = list_models(c.base_url, c.api_key)
            if c.model not in models:
                shown = ", ".join(models[:SHOWN_MODELS]) + (f" and {len(models) - SHOWN_MODELS} more"
                                                            if len(models) > SHOWN_MODELS else "")
                raise RemoteError("remote_not_found", f"The server at {c.host} does not list the model "
                                                      f"{c.model[:200]!r}; it lists: {shown or 'none'}.")
        except Exception as e:  # noqa: BLE001 - whatever happens, the engine leaves "starting"
            self._post.emit("check-failed", "", describe(e, c))
            return
        self._post.emit("checked", "", None)

    # -- requests ---------------------------------------------------------------------------------
    def load(self, model: str, options=None, request_id: Optional[str] = None) -> str:
        """A remote server's model is chosen by name: switching is a fresh check."""
        self.config = RemoteConfig(self.config.base_url, model, self.config.api_key)
        self.start()
        return request_id or ""

    def unload(self, request_id: Optional[str] = None) -> str:
        """Stop using the server's model (the server itself is untouched): answers in flight end, `unloaded` follows."""
        request_id = request_id or f"unload-{uuid.uuid4().hex[:8]}"
        for rid in list(self._streams):
            self.cancel(rid)
        self.loaded_event = None
        QTimer.singleShot(0, self, lambda: self.unloaded.emit(P.Unloaded(request_id)))
        return request_id

    def count(self, request_id: str, messages: Sequence[P.ChatMessage]) -> None:
        """An OpenAI-compatible server counts no tokens on request: the answer is "unknown" (an error, no count)."""
        self._refuse(request_id, RemoteError("remote_no_count", NO_COUNT))

    def generate(self, request_id: str, messages: Sequence[P.ChatMessage],
                 sampling: Optional[SamplingOptions] = None, draft: Optional[DraftOptions] = None,
                 answer_prefix: str = "") -> str:
        if answer_prefix:            # servers differ on a trailing assistant message: no guessing
            self._refuse(request_id, RemoteError("remote_no_continue", NO_CONTINUE))
            return request_id
        stream = RemoteStream(self.config, request_id,
                              request_body(self.config, messages, sampling or SamplingOptions()),
                              lambda kind, ev: self._post.emit(kind, request_id, ev))
        self._streams[request_id] = stream
        self.generating = request_id
        self._set_state("generating")
        threading.Thread(target=stream.run, name="remote-stream", daemon=True).start()
        return request_id

    def cancel(self, request_id: Optional[str] = None) -> None:
        """Stop at once: the answer ends as cancelled now; the stream thread closes the connection."""
        rid = request_id or self.generating
        stream = self._streams.pop(rid, None) if rid else None
        if stream is None:
            return
        stream.cancel()                 # the request ends wherever it is, its socket closed
        ev = P.Finished(rid, "cancelled", P.GenerationStats(0, 0, None, None, None, 0.0))
        QTimer.singleShot(0, self, lambda: self._deliver("finished", rid, ev, cancelled=True))

    def stats(self, request_id: str = "") -> None:
        pass                 # figures come with the stream

    def _refuse(self, request_id: str, err: RemoteError) -> None:
        QTimer.singleShot(0, self, lambda: self.error.emit(request_id, err))

    # -- GUI thread -------------------------------------------------------------------------------
    def _deliver(self, kind: str, rid: str, ev: Any, cancelled: bool = False) -> None:
        if kind == "checked":
            url = shown_url(self.config.base_url)            # never a password in the address
            self.ready_event = P.Ready(P.PROTOCOL_VERSION, "remote", 0, "remote", f"Answers come from {url}.", url)
            self.loaded_event = P.Loaded("", self.config.model, url, "remote server", "remote", 0, 0, 0.0)
            self._set_state("idle")
            self.ready.emit(self.ready_event)
            self.loaded.emit(self.loaded_event)
        elif kind == "check-failed":
            self.loaded_event = None
            self._set_state("idle")
            self.error.emit("", ev)
        elif rid not in self._streams and not cancelled:
            return                                           # a cancelled stream's late events
        elif kind == "token":
            self.token.emit(ev)
        elif kind == "telemetry":
            self.telemetry.emit(ev)
        elif kind in ("finished", "error"):
            self._streams.pop(rid, None)
            if self.generating == rid:
                self.generating = None
                self._set_state("idle")
            self.finished.emit(ev) if kind == "finished" else self.error.emit(rid, ev)

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.state_changed.emit(state)
