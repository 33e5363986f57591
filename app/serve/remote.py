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
streams on a thread of its own through httpx; its events reach the GUI thread through one queued signal.
Speed figures come from the stream's timing (time to first token; decode tokens/s from the usage the
server reports, else from the chunks). Failures (unreachable host, TLS, 401, timeouts, a server that
drops mid-answer) become errors in plain words (`describe`); the partial answer stays with the chat.
"""
from __future__ import annotations

import json
import ssl
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

import httpx
from PySide6.QtCore import QObject, QTimer, Signal

from app.engine_client import EngineSignals
from runtime import protocol as P
from runtime.options import DraftOptions, SamplingOptions

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0         # the longest silence allowed between two chunks (a long prefill included)
TELEMETRY_S = 0.5
FINISH = {"stop": "eos", "length": "length"}
NO_COUNT = "This server counts no tokens on request (the OpenAI API has no such call)."
NO_CONTINUE = ("Continue works with the local engine only: a remote server may not carry on a given answer. "
               "The text so far is kept; Regenerate asks the server for a new answer.")


@dataclass(frozen=True)
class RemoteConfig:
    base_url: str                  # up to and including /v1, e.g. http://gpu-box:8000/v1
    model: str
    api_key: Optional[str] = None

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class RemoteError(P.WorkerError):
    """A remote server failed; `message` says what happened in words."""


def normalise_url(url: str) -> str:
    """'gpu-box:8000' -> 'http://gpu-box:8000/v1'; a URL ending in /v1 stays as it is."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("enter the server's address, e.g. http://gpu-box:8000/v1")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// address")
    return url if parts.path.endswith("/v1") else url + "/v1"


def describe(exc: BaseException, url: str, partial: bool = False) -> RemoteError:
    """The one place that turns a client-side failure into words."""
    host = urlsplit(url).netloc or url
    kept = " The answer was interrupted; the text so far is kept." if partial else ""
    if isinstance(exc, RemoteError):
        return RemoteError(exc.code, exc.message + kept, exc.detail)
    if isinstance(exc, httpx.ConnectTimeout):
        return RemoteError("remote_timeout", f"{host} did not answer within {CONNECT_TIMEOUT_S:.0f} s.")
    if isinstance(exc, httpx.TimeoutException):
        return RemoteError("remote_timeout", f"The server at {host} sent nothing for {READ_TIMEOUT_S:.0f} s." + kept)
    if isinstance(exc, httpx.ConnectError):
        if _is_tls(exc):
            return RemoteError("remote_tls", f"The secure (TLS) connection to {host} failed: {_reason(exc)}. Check "
                                             "http:// versus https:// and the server's certificate.", str(exc))
        return RemoteError("remote_unreachable", f"Cannot reach {host}: {_reason(exc)}. Check the address and "
                                                 "that the server is running.", str(exc))
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return RemoteError("remote_dropped", f"The server at {host} closed the connection." + kept, str(exc))
    if isinstance(exc, httpx.HTTPError):
        return RemoteError("remote_failed", f"Talking to {host} failed: {exc}." + kept, repr(exc))
    return RemoteError("remote_failed", f"{type(exc).__name__}: {exc}" + kept, repr(exc))


def _is_tls(exc: BaseException) -> bool:
    seen = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError) or "SSL" in str(seen) or "CERTIFICATE" in str(seen).upper():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.rstrip(".")


def _status_error(response: httpx.Response, url: str) -> RemoteError:
    host = urlsplit(url).netloc or url
    try:
        said = response.json()["error"]["message"]
    except Exception:     # noqa: BLE001 - any body that is not OpenAI's error shape
        said = response.text[:200].strip()
    said = f": {said}" if said else ""
    code = response.status_code
    if code in (401, 403):
        return RemoteError("remote_auth", f"The server at {host} refused the API key (HTTP {code}){said}. "
                                          "Check the key in Engine → Models → Remote server.")
    if code == 404:
        return RemoteError("remote_not_found", f"The server at {host} answered 'not found' (HTTP 404){said}.")
    return RemoteError("remote_http", f"The server at {host} answered HTTP {code}{said}.")


def list_models(base_url: str, api_key: Optional[str] = None, timeout: float = CONNECT_TIMEOUT_S) -> list[str]:
    """The model ids a server lists at /v1/models (blocking; raises RemoteError in words)."""
    url = normalise_url(base_url)
    try:
        r = httpx.get(f"{url}/models", headers=RemoteConfig(url, "", api_key).headers(), timeout=timeout)
    except Exception as e:  # noqa: BLE001 - every failure is shown in words
        raise describe(e, url) from None
    if r.status_code != 200:
        raise _status_error(r, url)
    try:
        return [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise RemoteError("remote_protocol", f"{url}/models did not answer with OpenAI's model list") from None


def request_body(config: RemoteConfig, messages: Sequence[P.ChatMessage], sampling: SamplingOptions) -> dict:
    body: dict[str, Any] = {"model": config.model, "stream": True, "stream_options": {"include_usage": True},
                            "messages": [{"role": m.role, "content": m.content} for m in messages],
                            "temperature": sampling.temperature, "top_p": sampling.top_p,
                            "max_tokens": sampling.max_tokens}
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    return body


class _Stream:
    """One request's stream, on its own thread. Posts ("token"|"telemetry"|"finished"|"error", event)."""

    def __init__(self, config: RemoteConfig, request_id: str, body: dict, post):
        self.config, self.rid, self.body, self._post = config, request_id, body, post
        self.cancelled = threading.Event()

    def post(self, kind: str, ev) -> None:
        if not self.cancelled.is_set():       # a stopped answer says nothing more
            self._post(kind, ev)

    def run(self) -> None:
        t0 = time.perf_counter()
        t_first: Optional[float] = None
        chunks, usage, finish, text = 0, None, None, False
        last_tick = t0
        try:
            timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
            with httpx.Client(timeout=timeout) as http, \
                    http.stream("POST", f"{self.config.base_url}/chat/completions", json=self.body,
                                headers=self.config.headers()) as r:
                if r.status_code != 200:
                    r.read()
                    raise _status_error(r, self.config.base_url)
                for line in r.iter_lines():
                    if self.cancelled.is_set():
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if isinstance(obj.get("error"), dict):
                        raise RemoteError("remote_error", f"The server stopped the answer: {obj['error'].get('message')}")
                    usage = obj.get("usage") or usage
                    for choice in obj.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            now = time.perf_counter()
                            t_first = t_first or now
                            chunks += 1
                            text = True
                            self.post("token", P.TokenDelta(self.rid, piece, 1))
                            if now - last_tick >= TELEMETRY_S:
                                last_tick = now
                                self.post("telemetry", self._telemetry(t0, t_first, chunks, now))
                        finish = choice.get("finish_reason") or finish
            if finish is None:
                raise RemoteError("remote_dropped", f"The server at {urlsplit(self.config.base_url).netloc} ended "
                                                    "the stream before the answer was complete.")
        except Exception as e:  # noqa: BLE001 - every failure becomes an error event in words
            self.post("error", describe(e, self.config.base_url, partial=text))
            return
        t_end = time.perf_counter()
        prompt = int((usage or {}).get("prompt_tokens") or 0)
        generated = int((usage or {}).get("completion_tokens") or chunks)
        decode = (generated - 1) / (t_end - t_first) if t_first is not None and generated > 1 and t_end > t_first else None
        stats = P.GenerationStats(prompt, generated, None if t_first is None else t_first - t0, None, decode, t_end - t0)
        self.post("finished", P.Finished(self.rid, FINISH.get(finish, "eos"), stats))

    def _telemetry(self, t0: float, t_first: float, chunks: int, now: float) -> P.Telemetry:
        decode = (chunks - 1) / (now - t_first) if chunks > 1 and now > t_first else None
        return P.Telemetry(request_id=self.rid, decode_tps=decode, ttft_s=t_first - t0, generating=True)


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
        self._streams: dict[str, _Stream] = {}
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
                raise RemoteError("remote_not_found", f"The server at {urlsplit(c.base_url).netloc} does not list the "
                                                      f"model {c.model!r}; it lists: {', '.join(models) or 'none'}.")
        except RemoteError as e:
            self._post.emit("check-failed", "", e)
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
        stream = _Stream(self.config, request_id, request_body(self.config, messages, sampling or SamplingOptions()),
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
        stream.cancelled.set()
        ev = P.Finished(rid, "cancelled", P.GenerationStats(0, 0, None, None, None, 0.0))
        QTimer.singleShot(0, self, lambda: self._deliver("finished", rid, ev, cancelled=True))

    def stats(self, request_id: str = "") -> None:
        pass                 # figures come with the stream

    def _refuse(self, request_id: str, err: RemoteError) -> None:
        QTimer.singleShot(0, self, lambda: self.error.emit(request_id, err))

    # -- GUI thread -------------------------------------------------------------------------------
    def _deliver(self, kind: str, rid: str, ev: Any, cancelled: bool = False) -> None:
        if kind == "checked":
            self.ready_event = P.Ready(P.PROTOCOL_VERSION, "remote", 0, "remote", f"Answers come from {self.config.base_url}.",
                                       self.config.base_url)
            self.loaded_event = P.Loaded("", self.config.model, self.config.base_url, "remote server", "remote", 0, 0, 0.0)
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
