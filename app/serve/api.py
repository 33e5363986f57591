"""The OpenAI-compatible HTTP API over an engine `Backend`: Starlette routes, one generation at a time.

    app = create_app(backend, api_key="...", max_queue=8)     # an ASGI app; uvicorn serves it

Routes: GET /v1/models and /v1/models/{id}, POST /v1/chat/completions and /v1/completions (plain JSON,
or server-sent events with `"stream": true`). The engine runs one generation at a time (batch 1):
requests wait for it in arrival order, at most `max_queue` of them; one more is refused with 503 at once.
A long answer takes turns with waiting requests (app/serve/fair.py), so a short one is not stuck behind it.

Fields sent as null count as absent. Tool calls (app/serve/tools.py), response_format, logprobs,
penalties and logit_bias (app/serve/fields.py) travel to the worker, which renders tools through the
model's chat template and enforces schemas token by token (runtime/constrained.py). A conversation
over the context is a 400 `context_length_exceeded` unless the request allows turns to be left out
(the extension field `context_overflow`); a left-out max_tokens means up to the end of the context.

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
from app.serve import fields as F
from app.serve.fair import turns
from app.serve.tools import Call, CallParser, Text, chat_messages, tool_request
from runtime import protocol as P
from runtime.options import OptionError, SamplingOptions, from_dict

MAX_BODY_BYTES = 4 * 1024 * 1024
CANCEL_WAIT_S = 30.0          # how long a cancelled generation may take to confirm its end
MAX_STOP_STRINGS = 4
# OpenAI's documented defaults where a request leaves a field out (the app's own defaults are for chats).
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "cancelled": "stop"}
# Fields accepted only at their neutral value (the engine has no such feature).
NEUTRAL = {"functions": (None,), "function_call": (None, "none"), "echo": (False, None), "suffix": (None, ""),
           "best_of": (1, None), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,)}

Sink = Callable[[Any], None]
log = logging.getLogger("moedesk.serve")


@dataclass(frozen=True)
class ServedModel:
    id: str                       # what /v1/models lists and requests name: the model folder's name
    context_length: int
    created: int
    aliases: tuple[str, ...] = ()  # other names a request may use (the name or path it was loaded by, "demo")
    tool_format: str = "generic"   # how the model writes tool calls (runtime/tool_format.py)


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
    fields["context_overflow"] = F.context_policy(body)
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


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt: expected one non-empty string", param="prompt")
    return prompt


def _generate(body: dict, kind: str, rid: str, sampling: SamplingOptions) -> P.Generate:
    """The protocol's generate for a request (BadField names a bad field)."""
    extras = dict(json_schema=F.json_schema(body), logprobs=F.logprobs(body, kind), penalties=F.penalties(body))
    if kind != "chat":
        if body.get("tools"):
            raise F.BadField("tools: only /v1/chat/completions takes tools", "tools")
        return P.Generate(request_id=rid, prompt=_prompt(body), sampling=sampling, **extras)
    tools = tool_request(body)
    if tools is not None and extras["json_schema"] is not None and tools.choice != "none":
        raise F.BadField("response_format: a JSON answer and tool calls cannot both shape one answer; "
                         "give one of them (or tool_choice \"none\")", "response_format")
    return P.Generate(request_id=rid, messages=chat_messages(body), sampling=sampling, tools=tools, **extras)


# ----------------------------------------------------------------------------------------------
# Responses: protocol events -> OpenAI objects

def _usage(stats: P.GenerationStats) -> dict:
    usage = {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
             "total_tokens": stats.prompt_tokens + stats.generated_tokens}
    if stats.dropped_messages:               # only where the request allowed it (context_overflow)
        usage["dropped_messages"] = stats.dropped_messages
    return usage


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
        body = F.present(await self._json(raw))
        model = self._model(body)
        sampling = _sampling(body, model)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        try:
            gen = _generate(body, kind, rid, sampling)
        except F.BadField as e:
            raise ApiError(400, str(e), param=e.param) from None
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "stream: expected true or false", param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options: expected an object", param="stream_options")
        include_usage = stream and options.get("include_usage") is True
        events = turns(self, gen)                 # fair turns on the engine (app/serve/fair.py)
        first = await events.__anext__()          # waits for the queue and the prefill
        if isinstance(first, P.Error):
            await events.aclose()
            raise _error_for(first)
        shape = _Shape(kind, rid, model.id, model.tool_format if gen.tools and gen.tools.choice != "none" else None,
                       gen.logprobs is not None)
        if stream:
            return StreamingResponse(shape.sse(first, events, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        deltas, last = [], first
        try:
            async for ev in _chain(first, events):
                last = ev
                if isinstance(ev, P.TokenDelta):
                    deltas.append(ev)
        finally:
            await events.aclose()
        if isinstance(last, P.Error):
            raise _error_for(last)
        return JSONResponse(shape.whole(deltas, last))

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
        return JSONResponse({"object": "list", "data": [] if served is None else [_model_object(served)]})

    async def model(self, raw: Request) -> Response:
        """GET /v1/models/{id}: the served model by its id or an alias (its object names the id)."""
        self._check_key(raw)
        name = raw.path_params["model"]
        served = self.backend.served_model()
        if served is None or (name != served.id and name not in served.aliases):
            known = f"; this server serves {served.id!r}" if served is not None else ""
            raise ApiError(404, f"the model {name!r} does not exist here{known}", code="model_not_found",
                           param="model")
        return JSONResponse(_model_object(served))

    async def chat(self, raw: Request) -> Response:
        return await self._run(raw, "chat")

    async def completions(self, raw: Request) -> Response:
        return await self._run(raw, "completion")


def _model_object(served: ServedModel) -> dict:
    return {"id": served.id, "object": "model", "created": served.created, "owned_by": "moedesk",
            "context_length": served.context_length, "aliases": list(served.aliases)}


@dataclass
class _Shape:
    """The OpenAI objects of one request: chat.completion(.chunk) or text_completion. With `tool_format`
    the answer's text is read into content and tool calls (app/serve/tools.py); with `logprobs` each
    token's log-probabilities go with the text that carries them."""
    kind: str
    id: str
    model: str
    tool_format: Optional[str] = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self.offset = 0                           # characters of completion text sent (logprobs' text_offset)

    def _obj(self, chunk: bool, choice: dict, **extra) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [choice] if choice else [], **extra}

    def _lp(self, items: list) -> Optional[dict]:
        if not self.logprobs:
            return None
        out = F.shaped(self.kind, items, self.offset)
        self.offset += sum(len(t.token) for t in items)
        return out

    def whole(self, deltas: list[P.TokenDelta], fin: P.Finished) -> dict:
        text = "".join(d.text for d in deltas)
        lps = self._lp([lp for d in deltas for lp in d.logprobs])
        finish = FINISH_REASONS[fin.reason]
        if self.kind != "chat":
            return self._obj(False, {"index": 0, "text": text, "logprobs": lps, "finish_reason": finish},
                             usage=_usage(fin.stats))
        message: dict = {"role": "assistant", "content": text}
        if self.tool_format:
            parser = CallParser(self.tool_format)
            pieces = parser.feed(text) + parser.finish()
            calls = [p.whole() for p in pieces if isinstance(p, Call)]
            if calls:
                content = "".join(p.text for p in pieces if isinstance(p, Text)).strip()
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
        return self._obj(False, {"index": 0, "message": message, "logprobs": lps, "finish_reason": finish},
                         usage=_usage(fin.stats))

    def _chunk(self, delta: dict, lps: list, finish: Optional[str] = None) -> str:
        if self.kind == "chat":
            return _sse(self._obj(True, {"index": 0, "delta": delta, "logprobs": self._lp(lps),
                                         "finish_reason": finish}))
        return _sse(self._obj(True, {"index": 0, "text": delta.get("content", ""), "logprobs": self._lp(lps),
                                     "finish_reason": finish}))

    def _pieces(self, pieces: list, lps: list) -> list[str]:
        """Chunks for parsed pieces; the pending logprobs go with the first of them (and are then spent)."""
        out = []
        for piece in pieces:
            if isinstance(piece, Call):
                for d in piece.deltas():
                    out.append(self._chunk({"tool_calls": [d]}, lps))
                    lps = []
            elif piece.text:
                out.append(self._chunk({"content": piece.text}, lps))
                lps = []
        return out

    async def sse(self, first: Any, events: AsyncIterator[Any], include_usage: bool) -> AsyncIterator[str]:
        parser = CallParser(self.tool_format) if self.tool_format and self.kind == "chat" else None
        pending: list = []                       # logprobs of text not sent yet (held back by the parser)
        called = False
        try:
            if self.kind == "chat":
                yield self._chunk({"role": "assistant", "content": ""}, [])
            async for ev in _chain(first, events):
                if isinstance(ev, P.TokenDelta):
                    pending += ev.logprobs
                    pieces = parser.feed(ev.text) if parser else [Text(ev.text)]
                    called = called or any(isinstance(p, Call) for p in pieces)
                    for chunk in self._pieces(pieces, pending):
                        pending = []
                        yield chunk
                elif isinstance(ev, P.Finished):
                    pieces = parser.finish() if parser else []
                    called = called or any(isinstance(p, Call) for p in pieces)
                    for chunk in self._pieces(pieces, pending):
                        pending = []
                        yield chunk
                    finish = FINISH_REASONS[ev.reason]
                    yield self._chunk({}, pending, "tool_calls" if called and finish == "stop" else finish)
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
              Route("/v1/models/{model:path}", api.model, methods=["GET"]),
              Route("/v1/chat/completions", api.chat, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"])]
    app = Starlette(routes=routes, middleware=guard.middleware(allowed_origins, allowed_hosts),
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                        Exception: _internal_error})
    app.state.api = api
    return app
