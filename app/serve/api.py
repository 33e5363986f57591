"""The OpenAI-compatible HTTP API over an engine `Backend`: Starlette routes, one generation at a time.

    app = create_app(backend, api_key="...", max_queue=8)     # an ASGI app; uvicorn serves it

Routes: GET /v1/models, POST /v1/chat/completions and /v1/completions (plain JSON, or server-sent
events with `"stream": true`). The engine runs one generation at a time (batch 1): requests wait
for it in arrival order, at most `max_queue` of them; one more is refused with 503 at once.

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request
(bad or too deeply nested JSON, a bad or unsupported field, max_tokens over the context, a conversation
longer than the context: code `context_length_exceeded`; a Host name the server does not serve), 401 for a
missing or wrong key, 403 for a web page (Origin) not allowed, 404 for an unknown model or route, 413 for a
request body over `MAX_BODY_BYTES`, 503 when the queue is full or no model is loaded, 500 for anything else.

A client that goes away cancels its request wherever it is, queued or generating, streaming or not
(`app.serve.disconnect`; the protocol's `cancel`); the slot is released once the engine has confirmed the
end, so the next request finds the worker free. Before any route, `app.serve.guard` refuses foreign Host
names and web pages (Origins) the user did not allow. The key is compared in constant time and never logged.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import logging
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Protocol, Sequence

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.serve import guard
from runtime import protocol as P
from runtime.options import OptionError, SamplingOptions, from_dict

MAX_BODY_BYTES = 4 * 1024 * 1024
CANCEL_WAIT_S = 30.0          # how long a cancelled generation may take to confirm its end
MAX_STOP_STRINGS = 4
# OpenAI's documented defaults where a request leaves a field out (the app's own defaults are for chats).
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "cancelled": "stop"}
# Fields accepted only at their neutral value (the engine has no such feature).
NEUTRAL = {"presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "logprobs": (False, None),
           "top_logprobs": (0, None), "logit_bias": (None,), "tools": (None,), "tool_choice": (None, "none"),
           "functions": (None,), "echo": (False, None), "suffix": (None, ""), "best_of": (1, None)}

Sink = Callable[[Any], None]
log = logging.getLogger("moedesk.serve")


@dataclass(frozen=True)
class ServedModel:
    id: str                       # what /v1/models lists and requests name
    context_length: int
    created: int
    aliases: tuple[str, ...] = ()  # other names a request may use (the folder path it was loaded from)


class Backend(Protocol):
    """The engine behind the API. Both methods are thread-safe and return at once."""

    def served_model(self) -> Optional[ServedModel]: ...

    def start(self, request: P.Generate, sink: Sink) -> None:
        """Send `request`; call `sink` (from any thread) with its TokenDelta events, then one Finished or Error."""

    def cancel(self, request_id: str) -> None: ...


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


class QueueFull(ApiError):
    def __init__(self, waiting: int):
        super().__init__(503, f"the server is busy: {waiting} requests are already waiting for the engine; "
                              "try again shortly", type="server_error", code="queue_full")


class EngineQueue:
    """Batch 1: one generation at a time, at most `max_waiting` requests waiting behind it."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self.waiting = 0
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def slot(self):
        if self._lock.locked() and self.waiting >= self.max_waiting:
            raise QueueFull(self.waiting)
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._lock.release()


# ----------------------------------------------------------------------------------------------
# Requests: JSON -> protocol Generate

def _sampling(body: dict, model: ServedModel) -> SamplingOptions:
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported (one answer per request)", param="n")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral and body[name] != {} and body[name] != []:
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    fields = dict(API_DEFAULTS)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
        if body.get(name) is not None:
            fields[name] = body[name]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > model.context_length:
        raise ApiError(400, f"max_tokens: {max_tokens} is more than this model's context of {model.context_length} "
                            "tokens (prompt and answer together)", param="max_tokens")
    fields["max_tokens"] = model.context_length if max_tokens is None else max_tokens
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS:
            raise ApiError(400, f"stop: a string or a list of at most {MAX_STOP_STRINGS} strings", param="stop")
        fields["stop"] = stop
    try:
        return from_dict(SamplingOptions, fields)
    except OptionError as e:
        raise ApiError(400, f"{e.path}: {e.problem}", param=e.path) from None


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):        # content parts: only text ones
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}[{i}]: only text content parts are supported", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}: expected text", param=where)


def _messages(body: dict) -> tuple[P.ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: expected a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}]: expected an object", param="messages")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role: {m.get('role')!r} is not supported "
                                "(system, developer, user or assistant)", param="messages")
        out.append(P.ChatMessage(role, _content(m.get("content"), f"messages[{i}].content")))
    return tuple(out)


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt: expected one non-empty string", param="prompt")
    return prompt


# ----------------------------------------------------------------------------------------------
# Responses: protocol events -> OpenAI objects

def _usage(stats: P.GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def _error_for(ev: P.Error) -> ApiError:
    if ev.code == P.ErrorCode.CONTEXT_OVERFLOW.value:
        return ApiError(400, ev.message, code="context_length_exceeded", param="messages")
    if ev.code in (P.ErrorCode.BAD_FIELD.value, P.ErrorCode.BAD_JSON.value):
        return ApiError(400, ev.message, code=ev.code)
    if ev.code in (P.ErrorCode.NO_MODEL.value, P.ErrorCode.BUSY.value, "worker_died", "not_running"):
        return ApiError(503, ev.message, type="server_error", code=ev.code)
    return ApiError(500, ev.message, type="server_error", code=ev.code)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Api:
    def __init__(self, backend: Backend, api_key: Optional[str], max_queue: int):
        self.backend = backend
        self.api_key = api_key or None
        self.queue = EngineQueue(max_queue)

    # -- the engine ------------------------------------------------------------------------------
    async def _generation(self, request: P.Generate) -> AsyncIterator[Any]:
        """Hold the engine slot, run `request`, yield its events up to Finished or Error. Closing it early
        (the client left) cancels the generation and waits for the engine to confirm."""
        async with self.queue.slot():
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            self.backend.start(request, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
            ended = False
            try:
                while not ended:
                    ev = await events.get()
                    ended = isinstance(ev, (P.Finished, P.Error))
                    yield ev
            finally:
                if not ended:
                    log.info("%s: the client went away; cancelling its generation", request.request_id)
                    self.backend.cancel(request.request_id)
                    with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_WAIT_S):
                        ev = None
                        while not isinstance(ev, (P.Finished, P.Error)):
                            ev = await events.get()
                        if isinstance(ev, P.Finished):
                            log.info("%s: the engine stopped (%s) after %d tokens", request.request_id, ev.reason,
                                     ev.stats.generated_tokens)

    async def _run(self, raw: Request, kind: str) -> Response:
        self._check_key(raw)
        body = await self._json(raw)
        model = self._model(body)
        sampling = _sampling(body, model)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if kind == "chat":
            gen = P.Generate(request_id=rid, messages=_messages(body), sampling=sampling)
        else:
            gen = P.Generate(request_id=rid, prompt=_prompt(body), sampling=sampling)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "stream: expected true or false", param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options: expected an object", param="stream_options")
        include_usage = stream and options.get("include_usage") is True
        events = self._generation(gen)
        first = await events.__anext__()          # waits for the queue and the prefill
        if isinstance(first, P.Error):
            await events.aclose()
            raise _error_for(first)
        shape = _Shape(kind, rid, model.id)
        if stream:
            return StreamingResponse(shape.sse(first, events, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, last = [], first
        try:
            async for ev in _chain(first, events):
                last = ev
                if isinstance(ev, P.TokenDelta):
                    text.append(ev.text)
        finally:
            await events.aclose()
        if isinstance(last, P.Error):
            raise _error_for(last)
        return JSONResponse(shape.whole("".join(text), last))

    # -- checks ----------------------------------------------------------------------------------
    def _check_key(self, raw: Request) -> None:
        if self.api_key is None:
            return
        header = raw.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if not header:
            raise ApiError(401, "this server needs an API key: send it as 'Authorization: Bearer KEY'",
                           code="missing_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "the API key is not valid for this server", code="invalid_api_key")

    async def _json(self, raw: Request) -> dict:
        size = raw.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is {int(size)} bytes; this server takes at most {MAX_BODY_BYTES}",
                           code="request_too_large")
        data = bytearray()
        async for chunk in raw.stream():
            data += chunk
            if len(data) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
        try:
            body = json.loads(data)
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the request body is JSON nested too deeply to read", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}",
                           code="invalid_json")
        return body

    def _model(self, body: dict) -> ServedModel:
        served = self.backend.served_model()
        name = body.get("model")
        if served is None:
            raise ApiError(503, "no model is loaded in the engine yet", type="server_error", code="no_model")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"model: required; this server serves {served.id!r}", param="model")
        if name != served.id and name not in served.aliases:
            raise ApiError(404, f"the model {name!r} does not exist here; this server serves {served.id!r}",
                           code="model_not_found", param="model")
        return served

    # -- routes ----------------------------------------------------------------------------------
    async def models(self, raw: Request) -> Response:
        self._check_key(raw)
        served = self.backend.served_model()
        data = [] if served is None else [{"id": served.id, "object": "model", "created": served.created,
                                           "owned_by": "moedesk", "context_length": served.context_length}]
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, raw: Request) -> Response:
        return await self._run(raw, "chat")

    async def completions(self, raw: Request) -> Response:
        return await self._run(raw, "completion")


@dataclass
class _Shape:
    """The OpenAI objects of one request: chat.completion(.chunk) or text_completion."""
    kind: str
    id: str
    model: str

    def __post_init__(self) -> None:
        self.created = int(time.time())

    def _obj(self, chunk: bool, choice: dict, **extra) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [choice] if choice else [], **extra}

    def whole(self, text: str, fin: P.Finished) -> dict:
        body = ({"message": {"role": "assistant", "content": text}} if self.kind == "chat"
                else {"text": text, "logprobs": None})
        return self._obj(False, {"index": 0, **body, "finish_reason": FINISH_REASONS[fin.reason]},
                         usage=_usage(fin.stats))

    def _delta(self, text: Optional[str], finish: Optional[str], first: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return self._obj(True, {"index": 0, "delta": delta, "finish_reason": finish})
        return self._obj(True, {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish})

    async def sse(self, first: Any, events: AsyncIterator[Any], include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.kind == "chat":
                yield _sse(self._delta("", None, first=True))
            async for ev in _chain(first, events):
                if isinstance(ev, P.TokenDelta):
                    if ev.text:          # a token whose text is held back adds nothing to send yet
                        yield _sse(self._delta(ev.text, None))
                elif isinstance(ev, P.Finished):
                    yield _sse(self._delta(None, FINISH_REASONS[ev.reason]))
                    if include_usage:
                        yield _sse(self._obj(True, {}, usage=_usage(ev.stats)))
                elif isinstance(ev, P.Error):        # after the headers went out: an error event in the stream
                    err = _error_for(ev)
                    yield _sse({"error": {"message": err.message, "type": err.type, "param": None, "code": err.code}})
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    if not isinstance(first, (P.Finished, P.Error)):
        async for ev in rest:
            yield ev


async def _api_error(_request: Request, exc: Exception) -> Response:
    return exc.response()


async def _http_error(_request: Request, exc: Exception) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return ApiError(exc.status_code, exc.detail or "error", code=code).response()


async def _internal_error(_request: Request, exc: Exception) -> Response:
    log.error("a request failed: %s: %s", type(exc).__name__, str(exc)[:300])
    return ApiError(500, "the server failed on this request (see its log)", type="server_error",
                    code="internal_error").response()


def create_app(backend: Backend, api_key: Optional[str] = None, max_queue: int = 8,
               allowed_origins: Sequence[str] = (), allowed_hosts: Sequence[str] = ()) -> Starlette:
    """The API; `allowed_origins` / `allowed_hosts` extend what `app.serve.guard` accepts (ValueError in words)."""
    api = Api(backend, api_key, max_queue)
    routes = [Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/chat/completions", api.chat, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"])]
    app = Starlette(routes=routes, middleware=guard.middleware(allowed_origins, allowed_hosts),
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                        Exception: _internal_error})
    app.state.api = api
    return app
