"""Talking to another OpenAI-compatible server (no Qt): every read bounded, every field checked, every error
text redacted and short. `app.serve.remote.RemoteEngine` drives it from the GUI.

    models = list_models("http://gpu-box:8000/v1", api_key)          # blocking; RemoteError in words
    stream = RemoteStream(config, "r1", request_body(config, messages, sampling), post)
    threading.Thread(target=stream.run).start()                       # post("token"|"telemetry"|"finished"|"error", ev)
    stream.cancel()                                                   # from any thread: the socket closes at once

What a server may send is untrusted:
- Size: one server-sent line at most `MAX_LINE_BYTES`, a model list `MAX_MODELS_BYTES` and `MAX_MODELS` ids of
  `MAX_MODEL_ID_CHARS`, an error body `MAX_ERROR_BODY_BYTES` (of which `MAX_SAID_CHARS` are quoted); an answer
  stops at the `max_tokens` it asked for (text chunks counted, at most `MAX_CHARS_PER_TOKEN` characters each).
- Time: `CONNECT_TIMEOUT_S` to connect, `IDLE_TIMEOUT_S` without an event (the wait for the first one, a long
  prefill, included), `ANSWER_DEADLINE_S` for a whole answer, `CHECK_DEADLINE_S` for the model list. Each
  request runs on an asyncio loop of its own thread, so Stop, a deadline or an idle timeout cancel it
  wherever it is (connecting, waiting, in the middle of a line) and the socket is closed.
- Types: `usage`, `finish_reason`, `delta.content`, model ids and counts are checked; a bad one ends the
  answer with an error naming the field (the text so far is kept by the chat).
- Words: a password in the address (`user:pass@host`) and the API key never appear in an error text, even
  when the server echoes them; error texts are at most `MAX_MESSAGE_CHARS`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Sequence
from urllib.parse import unquote, urlsplit

import anyio
import httpx

from runtime import protocol as P
from runtime.options import MAX_TOKENS, SamplingOptions, shown

CONNECT_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 120.0           # the longest wait for the next event (a long prefill included)
ANSWER_DEADLINE_S = 3600.0       # the longest a whole answer may take
CHECK_DEADLINE_S = 30.0          # the longest the model list may take
ERROR_BODY_S = 5.0               # how long an error answer's body is read
TELEMETRY_S = 0.5
MAX_LINE_BYTES = 1 << 20         # one server-sent line
MAX_MODELS_BYTES = 4 << 20       # a /v1/models answer
MAX_MODELS = 4096
MAX_MODEL_ID_CHARS = 512
MAX_ERROR_BODY_BYTES = 64 << 10
MAX_SAID_CHARS = 300             # what an error quotes of the server's words
MAX_MESSAGE_CHARS = 600          # a whole error message
MAX_DETAIL_CHARS = 2000
MAX_CHARS_PER_TOKEN = 256        # an answer's text is at most this many characters per token asked for
MAX_CHOICES = 16
FINISH = {"stop": "eos", "length": "length"}
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]*@")

Post = Callable[[str, Any], None]


class RemoteError(P.WorkerError):
    """A remote server failed; `message` says what happened in words."""


@dataclass(frozen=True)
class RemoteConfig:
    base_url: str                  # up to and including /v1, e.g. http://gpu-box:8000/v1
    model: str
    api_key: Optional[str] = None

    def headers(self) -> dict:
        headers = {"Accept-Encoding": "identity"}        # no compressed bodies: what is read is what is bounded
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    @property
    def host(self) -> str:
        return shown_host(self.base_url)

    def secrets(self) -> tuple[str, ...]:
        """What must never appear in an error text: the key, the address's password and user:password."""
        parts = urlsplit(self.base_url)
        found = [self.api_key or ""]
        if parts.password:
            found += [parts.password, unquote(parts.password), f"{parts.username}:{parts.password}"]
        return tuple(s for s in found if s)


def normalise_url(url: str) -> str:
    """'gpu-box:8000' -> 'http://gpu-box:8000/v1'; a URL ending in /v1 stays as it is."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("enter the server's address, e.g. http://gpu-box:8000/v1")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    try:
        parts.port                          # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ValueError(f"{scrub(url, ())!r} has a port that is not a number") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{scrub(url, ())!r} is not an http:// or https:// address")
    return url if parts.path.endswith("/v1") else url + "/v1"


def shown_host(url: str) -> str:
    """host:port of an address, without a user name or password."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    host = f"[{host}]" if ":" in host else host
    try:
        return f"{host}:{parts.port}" if parts.port else host
    except ValueError:
        return host


def shown_url(url: str) -> str:
    """An address as it may be shown: without a user name or password."""
    return _USERINFO.sub(r"\1", url)


def scrub(text: str, secrets: Sequence[str], limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` without credentials (user:pass@ in addresses, each of `secrets`), at most `limit` characters."""
    text = _USERINFO.sub(r"\1", text)
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 4:                 # shorter ones would blot out ordinary words
            text = text.replace(secret, "***")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def describe(exc: BaseException, config: RemoteConfig, partial: bool = False) -> RemoteError:
    """The one place that turns a failure into words: credentials removed, the text bounded."""
    err = _words(exc, config.host, " The answer was interrupted; the text so far is kept." if partial else "")
    secrets = config.secrets()
    return RemoteError(err.code, scrub(err.message, secrets), scrub(err.detail, secrets, MAX_DETAIL_CHARS))


def _words(exc: BaseException, host: str, kept: str) -> RemoteError:
    if isinstance(exc, RemoteError):
        return RemoteError(exc.code, exc.message + kept, exc.detail)
    if isinstance(exc, httpx.ConnectTimeout):
        return RemoteError("remote_timeout", f"{host} did not answer within {CONNECT_TIMEOUT_S:.0f} s.")
    if isinstance(exc, httpx.TimeoutException):
        return RemoteError("remote_timeout", f"The server at {host} sent nothing for {IDLE_TIMEOUT_S:g} s." + kept)
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


def _kind(value: Any) -> str:
    """What a JSON value is, in words (never the value itself: it may be huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return {int: "a number", float: "a number", str: "text", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__)


# ----------------------------------------------------------------------------------------------
# Bounded reads

async def read_bounded(response: httpx.Response, limit: int, into: Optional[bytearray] = None) -> tuple[bytes, bool]:
    """At most `limit` bytes of a body (gathered in `into` as they come), and whether there was more (the rest
    is never read)."""
    data = bytearray() if into is None else into
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > limit:
            del data[limit:]
            return bytes(data), True
    return bytes(data), False


async def lines(response: httpx.Response, host: str) -> AsyncIterator[bytes]:
    """The lines of a body (without their end), each at most `MAX_LINE_BYTES`: a longer one is an error."""
    buf = bytearray()
    async for chunk in response.aiter_bytes():
        buf += chunk
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            yield bytes(buf[start:end]).rstrip(b"\r")
            start = end + 1
        del buf[:start]
        if len(buf) > MAX_LINE_BYTES:
            raise RemoteError("remote_protocol", f"The server at {host} sent a line of over {MAX_LINE_BYTES >> 20} MiB "
                                                 "without an end; the answer was stopped.")
    if buf:
        yield bytes(buf)


async def status_error(response: httpx.Response, config: RemoteConfig) -> RemoteError:
    """An answer other than 200 in words: the server's own message when it gives one (bounded, redacted)."""
    body = bytearray()
    try:
        with anyio.move_on_after(ERROR_BODY_S):
            await read_bounded(response, MAX_ERROR_BODY_BYTES, body)
    except httpx.HTTPError:
        pass                                  # what came is enough to quote
    said = ""
    try:
        error = json.loads(body)["error"]
        said = error["message"] if isinstance(error, dict) else error
    except Exception:     # noqa: BLE001 - any body that is not OpenAI's error shape
        pass
    if not isinstance(said, str) or not said.strip():
        said = body.decode("utf-8", "replace")
    said = scrub(" ".join(said.split()), config.secrets(), MAX_SAID_CHARS)
    said = f": {said}" if said else ""
    host, code = config.host, response.status_code
    if code in (401, 403):
        return RemoteError("remote_auth", f"The server at {host} refused the API key (HTTP {code}){said}. "
                                          "Check the key in Engine → Models → Remote server.")
    if code == 404:
        return RemoteError("remote_not_found", f"The server at {host} answered 'not found' (HTTP 404){said}.")
    return RemoteError("remote_http", f"The server at {host} answered HTTP {code}{said}.")


# ----------------------------------------------------------------------------------------------
# The model list

def list_models(base_url: str, api_key: Optional[str] = None, deadline_s: float = CHECK_DEADLINE_S) -> list[str]:
    """The model ids a server lists at /v1/models (blocking, at most `deadline_s`; raises RemoteError in words)."""
    config = RemoteConfig(normalise_url(base_url), "", api_key)
    try:
        return asyncio.run(_list_models(config, deadline_s))
    except Exception as e:  # noqa: BLE001 - every failure is shown in words
        raise describe(e, config) from None


async def _list_models(config: RemoteConfig, deadline_s: float) -> list[str]:
    try:
        with anyio.fail_after(deadline_s):
            async with httpx.AsyncClient(timeout=httpx.Timeout(deadline_s, connect=CONNECT_TIMEOUT_S)) as http, \
                    http.stream("GET", f"{config.base_url}/models", headers=config.headers()) as r:
                if r.status_code != 200:
                    raise await status_error(r, config)
                body, more = await read_bounded(r, MAX_MODELS_BYTES)
    except TimeoutError:
        raise RemoteError("remote_timeout", f"The server at {config.host} did not send its model list within "
                                            f"{deadline_s:g} s.") from None
    if more:
        raise RemoteError("remote_protocol", f"The model list of {config.host} is over {MAX_MODELS_BYTES >> 20} MiB; "
                                             "it was not read.")
    return parse_models(body, config.host)


def parse_models(body: bytes, host: str) -> list[str]:
    def bad(what: str) -> RemoteError:
        return RemoteError("remote_protocol", f"The model list of {host} is not OpenAI's: {what}.")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise bad("it is not JSON") from None
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list):
        raise bad(f"'data' is {_kind(models)}, not a list")
    if len(models) > MAX_MODELS:
        raise bad(f"it lists {len(models)} models, more than the {MAX_MODELS} this app reads")
    ids = []
    for i, m in enumerate(models):
        mid = m.get("id") if isinstance(m, dict) else None
        if not isinstance(mid, str) or not mid.strip():
            raise bad(f"data[{i}].id is {_kind(mid)}, not a model name")
        if len(mid) > MAX_MODEL_ID_CHARS or not mid.isprintable() or mid != shown(mid):
            raise bad(f"data[{i}].id is not a model name (over {MAX_MODEL_ID_CHARS} characters, or not printable)")
        ids.append(mid)
    return ids


# ----------------------------------------------------------------------------------------------
# An answer

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


@dataclass
class Chunk:
    """One server-sent chunk, its fields checked."""
    text: str = ""
    finish: Optional[str] = None
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None


def parse_event(data: bytes, host: str) -> Chunk:
    """A `data:` payload of the stream as a Chunk; RemoteError naming a field of the wrong type."""
    def bad(field: str, value: Any, expected: str) -> RemoteError:
        return RemoteError("remote_protocol", f"The server at {host} sent {field} as {_kind(value)}, not {expected}; "
                                              "the answer was stopped.")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        raise RemoteError("remote_protocol", f"The server at {host} sent an event that is not JSON; the answer "
                                             "was stopped.") from None
    if not isinstance(obj, dict):
        raise bad("an event", obj, "an object")
    if obj.get("error") is not None:
        error = obj["error"]
        said = error.get("message") if isinstance(error, dict) else error
        said = " ".join(said.split())[:MAX_SAID_CHARS] if isinstance(said, str) else "no reason given"
        raise RemoteError("remote_error", f"The server stopped the answer: {said}")
    ev = Chunk()
    usage = obj.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            raise bad("usage", usage, "an object")
        for name in ("prompt_tokens", "completion_tokens"):
            n = usage.get(name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOKENS):
                raise bad(f"usage.{name}", n, f"a count of tokens (0 to {MAX_TOKENS})")
            setattr(ev, name, n)
    choices = obj.get("choices")
    if choices is None:
        choices = []
    if not isinstance(choices, list) or len(choices) > MAX_CHOICES:
        raise bad("choices", choices, f"a list of at most {MAX_CHOICES}")
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict):
            raise bad(f"choices[{i}]", choice, "an object")
        if choice.get("index", 0) != 0:
            continue                                  # one answer was asked for: others are not ours
        delta = choice.get("delta")
        if delta is not None and not isinstance(delta, dict):
            raise bad(f"choices[{i}].delta", delta, "an object")
        content = (delta or {}).get("content")
        if content is not None and not isinstance(content, str):
            raise bad(f"choices[{i}].delta.content", content, "text")
        finish = choice.get("finish_reason")
        if finish is not None and (not isinstance(finish, str) or len(finish) > 64):
            raise bad(f"choices[{i}].finish_reason", finish, "a short text")
        ev.text += content or ""
        ev.finish = finish or ev.finish
    return ev


class RemoteStream:
    """One answer, streamed on the thread that calls `run`; `post(kind, event)` gets "token", "telemetry", then
    one "finished" or "error" (nothing more once cancelled)."""

    def __init__(self, config: RemoteConfig, request_id: str, body: dict, post: Post):
        self.config, self.rid, self.body, self._post = config, request_id, body, post
        self.max_tokens = body.get("max_tokens") or MAX_TOKENS
        self.cancelled = threading.Event()
        self.text = False                  # whether any text came (an error then says the text is kept)
        self.ended = False                 # a finished or error event was posted
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None

    def post(self, kind: str, ev: Any) -> None:
        if not self.cancelled.is_set():    # a stopped answer says nothing more
            self.ended = self.ended or kind in ("finished", "error")
            self._post(kind, ev)

    def cancel(self) -> None:
        """Stop now, from any thread: the request is cancelled wherever it is and its socket closed."""
        self.cancelled.set()
        with self._lock:
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:
                pass                       # the loop has closed: the stream has ended already

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - the engine must never stay "generating"
            self.post("error", describe(e, self.config, partial=self.text))
        if not self.ended:
            self.post("error", RemoteError("remote_failed", "The answer ended without a final word from the server."))

    async def _main(self) -> None:
        with self._lock:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        if self.cancelled.is_set():
            return
        try:
            await self._answer()
        except asyncio.CancelledError:
            return                         # Stop: the answer has ended as cancelled already
        except Exception as e:  # noqa: BLE001 - every failure becomes an error event in words
            self.post("error", describe(e, self.config, partial=self.text))

    async def _answer(self) -> None:
        host, t0 = self.config.host, time.perf_counter()
        try:
            with anyio.fail_after(ANSWER_DEADLINE_S):
                async with httpx.AsyncClient(timeout=httpx.Timeout(IDLE_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)) as http:
                    with anyio.CancelScope(deadline=anyio.current_time() + IDLE_TIMEOUT_S) as idle:
                        got = await self._read(http, idle, t0)
                    if idle.cancelled_caught:
                        raise RemoteError("remote_timeout", f"The server at {host} sent no event for "
                                                            f"{IDLE_TIMEOUT_S:g} s; the answer was stopped.")
        except TimeoutError:
            raise RemoteError("remote_timeout", f"The answer from {host} took over {ANSWER_DEADLINE_S:g} s; "
                                                "it was stopped.") from None
        if got.finish is None:
            raise RemoteError("remote_dropped", f"The server at {host} ended the stream before the answer was "
                                                "complete.")
        self.post("finished", P.Finished(self.rid, FINISH.get(got.finish, "eos"), self._stats(t0, got)))

    async def _read(self, http: httpx.AsyncClient, idle: anyio.CancelScope, t0: float) -> "_Got":
        """Post the answer's tokens as they come; `idle`'s deadline moves on with each event."""
        host, got = self.config.host, _Got(last_tick=t0)
        async with http.stream("POST", f"{self.config.base_url}/chat/completions", json=self.body,
                               headers=self.config.headers()) as r:
            if r.status_code != 200:
                raise await status_error(r, self.config)
            async with contextlib.aclosing(lines(r, host)) as events:
                async for line in events:
                    if not line.startswith(b"data:"):
                        continue                  # comments, event names, blank separators
                    idle.deadline = anyio.current_time() + IDLE_TIMEOUT_S
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    ev = parse_event(data, host)
                    got.usage.prompt_tokens = _first(ev.prompt_tokens, got.usage.prompt_tokens)
                    got.usage.completion_tokens = _first(ev.completion_tokens, got.usage.completion_tokens)
                    if ev.text and not self._token(ev.text, got, t0):
                        got.finish = "length"     # the server streams on past what was asked: stop here
                        break
                    got.finish = ev.finish or got.finish
        return got

    def _token(self, text: str, got: "_Got", t0: float) -> bool:
        """Post one piece of the answer; False (nothing posted) once the answer is as long as was asked."""
        if got.chunks >= self.max_tokens or got.chars + len(text) > self.max_tokens * MAX_CHARS_PER_TOKEN:
            return False
        now = time.perf_counter()
        got.t_first = got.t_first or now
        got.chunks, got.chars, self.text = got.chunks + 1, got.chars + len(text), True
        self.post("token", P.TokenDelta(self.rid, text, 1))
        if now - got.last_tick >= TELEMETRY_S:
            got.last_tick = now
            decode = (got.chunks - 1) / (now - got.t_first) if got.chunks > 1 and now > got.t_first else None
            self.post("telemetry", P.Telemetry(request_id=self.rid, decode_tps=decode, ttft_s=got.t_first - t0,
                                               generating=True))
        return True

    def _stats(self, t0: float, got: "_Got") -> P.GenerationStats:
        t_end, t_first = time.perf_counter(), got.t_first
        generated = min(got.usage.completion_tokens or got.chunks, max(self.max_tokens, got.chunks))
        decode = (generated - 1) / (t_end - t_first) if t_first is not None and generated > 1 and t_end > t_first else None
        return P.GenerationStats(got.usage.prompt_tokens or 0, generated, None if t_first is None else t_first - t0,
                                 None, decode, t_end - t0)


@dataclass
class _Got:
    """What an answer's stream has brought so far."""
    finish: Optional[str] = None
    chunks: int = 0
    chars: int = 0
    t_first: Optional[float] = None
    last_tick: float = 0.0
    usage: Chunk = field(default_factory=Chunk)


def _first(*values: Optional[int]) -> Optional[int]:
    return next((v for v in values if v is not None), None)
