"""The one boundary between the GUI (or CLI) process and the worker process.

Versioned, frozen dataclasses serialised as JSON lines: one object per line, with `"type"` naming
the message and `"v"` the protocol version. Pure Python (no torch): both sides import it.

The worker reads commands on its stdin and writes events on a dedicated file descriptor that it
duplicates from its original stdout at start-up, before pointing fd 1 at stderr; so libraries that
print (exllamav2 does) can never corrupt the channel. See `runtime/worker.py`.

Commands (client -> worker): hello, load, unload, generate, cancel, stats, count, shutdown.
Events (worker -> client): ready, progress, loaded, unloaded, token, finished, telemetry, token_count, error.

Version 2 added `count` / `token_count` (tokens of a conversation as the model's chat template renders
it), `Generate.answer_prefix` (continue a stopped answer), `GenerationStats.dropped_messages` (turns
left out to fit the context) and `Ready.libraries`.

Version 3 added what the OpenAI-compatible API needs: tool calls in messages (`ChatMessage.tool_calls`,
role "tool" with `tool_call_id`), `Generate.tools` (functions the model may call, and how: auto, none,
required, one named function), `Generate.json_schema` (the answer must be JSON valid for it: enforced
token by token in the worker, runtime/constrained.py), `Generate.logprobs` (each token's log-probability
and its top alternatives, on `TokenDelta.logprobs`), `Generate.penalties` (presence, frequency, logit
bias) and `Loaded.tool_format` (how the model writes tool calls, runtime/tool_format.py).

Errors carry a stable `code` (the `ErrorCode` values below) plus a message in words and a detail
(e.g. the last lines of a compiler log); `exception_for` maps an error event back to an exception.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Union

from runtime import options as _options
from runtime.options import DraftOptions, LoadOptions, OptionError, SamplingOptions
from runtime.records import DraftStats, GenerationStats  # noqa: F401  (records carried inside messages)

PROTOCOL_VERSION = 3


# The longest command line the worker reads (bytes, newline included): far above the longest prompt
# (options.MAX_PROMPT_CHARS, even JSON-escaped), far below what would exhaust memory. A longer line is
# skipped to its end and answered with a bad_json error.
MAX_LINE_BYTES = 1 << 26


class ErrorCode(str, Enum):
    BAD_JSON = "bad_json"                      # a line that is not a JSON object
    UNKNOWN_COMMAND = "unknown_command"        # "type" names no command
    BAD_FIELD = "bad_field"                    # a field is missing, unknown or of the wrong type
    VERSION_MISMATCH = "version_mismatch"      # client and worker speak different protocol versions
    NO_MODEL = "no_model"                      # generate before load
    BUSY = "busy"                              # a generation is already running
    MODEL_NOT_FOUND = "model_not_found"        # no such model name or folder
    MODEL_INVALID = "model_invalid"            # missing/corrupt/truncated file, bad config, missing tensor
    UNSUPPORTED_ARCHITECTURE = "unsupported_architecture"
    OUT_OF_MEMORY = "out_of_memory"            # CUDA or host memory ran out
    CUDA_UNAVAILABLE = "cuda_unavailable"      # asked for the GPU engine where there is none
    KERNEL_BUILD_FAILED = "kernel_build_failed"  # exllamav2's CUDA extension did not compile
    CONTEXT_OVERFLOW = "context_overflow"      # the conversation does not fit the context length
    INTERNAL = "internal"                      # anything else: a bug; detail holds the traceback


class ProtocolError(ValueError):
    """A line could not be turned into a message. Carries the stable code for the error event."""

    def __init__(self, code: ErrorCode, message: str, request_id: Optional[str] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# ----------------------------------------------------------------------------------------------
# Plain-data records carried inside messages (the engine's statistics live in runtime/records.py)

@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str              # JSON text of an object, as the model wrote it (or the client sent it)


@dataclass(frozen=True)
class ChatMessage:
    role: str       # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()    # an assistant's calls
    tool_call_id: str = ""                   # a tool message: the call it answers


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)   # JSON schema of the arguments


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str = "auto"        # "auto" | "none" | "required" | "function" (the one named in `name`)
    name: str = ""
    parallel: bool = True       # more than one call per answer allowed


@dataclass(frozen=True)
class Penalties:
    """OpenAI's: presence and frequency over the answer's tokens so far, and a bias per token id."""
    presence: float = 0.0
    frequency: float = 0.0
    logit_bias: dict[str, float] = field(default_factory=dict)     # token id (as text) -> -100..100


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...] = ()
    top: tuple[TopLogprob, ...] = ()


# ----------------------------------------------------------------------------------------------
# Commands

@dataclass(frozen=True)
class Hello:
    type: typing.ClassVar[str] = "hello"
    protocol_version: int = PROTOCOL_VERSION
    client: str = ""


@dataclass(frozen=True)
class Load:
    type: typing.ClassVar[str] = "load"
    request_id: str
    model: str                          # a model name in the models folder, "demo", or a folder path
    options: LoadOptions = field(default_factory=LoadOptions)


@dataclass(frozen=True)
class Unload:
    type: typing.ClassVar[str] = "unload"
    request_id: str


@dataclass(frozen=True)
class Generate:
    type: typing.ClassVar[str] = "generate"
    request_id: str
    messages: tuple[ChatMessage, ...] = ()   # rendered through the model's chat template
    prompt: Optional[str] = None             # raw text instead of messages (benchmarks)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    draft: Optional[DraftOptions] = None     # None: keep what the load command set
    answer_prefix: str = ""                  # the answer so far: generation continues it (Continue)
    tools: Optional[ToolRequest] = None      # functions the model may call (rendered by its chat template)
    json_schema: Optional[dict[str, Any]] = None   # the answer is JSON valid for this schema (grammar-enforced)
    logprobs: Optional[int] = None           # report each token's logprob with this many alternatives (0-20)
    penalties: Optional[Penalties] = None


@dataclass(frozen=True)
class Cancel:
    type: typing.ClassVar[str] = "cancel"
    request_id: str                          # the generation to stop


@dataclass(frozen=True)
class Stats:
    type: typing.ClassVar[str] = "stats"
    request_id: str = ""


@dataclass(frozen=True)
class CountTokens:
    """How many tokens `messages` take as the prompt of the next answer (chat template applied)."""
    type: typing.ClassVar[str] = "count"
    request_id: str
    messages: tuple[ChatMessage, ...] = ()


@dataclass(frozen=True)
class Shutdown:
    type: typing.ClassVar[str] = "shutdown"


# ----------------------------------------------------------------------------------------------
# Events

@dataclass(frozen=True)
class Ready:
    type: typing.ClassVar[str] = "ready"
    protocol_version: int
    worker_version: str
    pid: int
    engine: str                  # "cuda" or "cpu": what a load with backend "auto" would use
    engine_note: str             # in words, e.g. "No CUDA device: using the CPU reference engine."
    device: str                  # GPU name, or "cpu"
    libraries: dict[str, str] = field(default_factory=dict)   # e.g. {"torch": "2.11.0"}: the engine's own


@dataclass(frozen=True)
class Progress:
    type: typing.ClassVar[str] = "progress"
    request_id: str
    stage: str                   # e.g. "reading", "building_kernels", "loading", "warmup"
    message: str                 # in words, e.g. "Building GPU kernels, one time"
    done: int = 0
    total: int = 0


@dataclass(frozen=True)
class Loaded:
    type: typing.ClassVar[str] = "loaded"
    request_id: str
    model: str
    path: str
    architecture: str
    backend: str                 # "cuda" | "cpu"
    context_length: int
    vocab_size: int
    load_s: float
    applied: dict[str, str] = field(default_factory=dict)  # option path -> "applied" | "ignored: why"
    tool_format: str = ""        # how the model writes tool calls (runtime/tool_format.FORMATS), "" unknown


@dataclass(frozen=True)
class Unloaded:
    type: typing.ClassVar[str] = "unloaded"
    request_id: str


@dataclass(frozen=True)
class TokenDelta:
    type: typing.ClassVar[str] = "token"
    request_id: str
    text: str                    # never splits a UTF-8 character; "" while the tokens' text is held back
    tokens: int = 1              # tokens this delta covers (each token is sent as it is generated)
    logprobs: tuple[TokenLogprob, ...] = ()   # of those tokens, when the generate asked for them


@dataclass(frozen=True)
class Finished:
    type: typing.ClassVar[str] = "finished"
    request_id: str
    reason: str                  # "eos" | "stop_string" | "length" | "cancelled"
    stats: GenerationStats


@dataclass(frozen=True)
class Telemetry:
    type: typing.ClassVar[str] = "telemetry"
    request_id: str = ""
    decode_tps: Optional[float] = None
    ttft_s: Optional[float] = None
    prefill_tps: Optional[float] = None
    draft_acceptance: Optional[float] = None
    expert_hit_rate: Optional[float] = None
    pcie_bytes_per_token: Optional[float] = None
    cpu_expert_ms_per_token: Optional[float] = None
    rss_bytes: Optional[int] = None
    vram_allocated_bytes: Optional[int] = None
    cpu_threads: Optional[int] = None            # the engine's CPU compute team
    cpu_busy_others: Optional[float] = None      # CPUs other programs keep busy (runtime.cpu_load)
    generating: bool = False
    extra: dict[str, Any] = field(default_factory=dict)   # engine specifics, e.g. per-layer paths


@dataclass(frozen=True)
class TokenCount:
    type: typing.ClassVar[str] = "token_count"
    request_id: str
    tokens: int
    context_length: int          # of the loaded model


@dataclass(frozen=True)
class Error:
    type: typing.ClassVar[str] = "error"
    code: str
    message: str
    detail: str = ""
    request_id: Optional[str] = None


Command = Union[Hello, Load, Unload, Generate, Cancel, Stats, CountTokens, Shutdown]
Event = Union[Ready, Progress, Loaded, Unloaded, TokenDelta, Finished, Telemetry, TokenCount, Error]

COMMANDS: dict[str, type] = {c.type: c for c in (Hello, Load, Unload, Generate, Cancel, Stats, CountTokens, Shutdown)}
EVENTS: dict[str, type] = {e.type: e for e in (Ready, Progress, Loaded, Unloaded, TokenDelta, Finished, Telemetry,
                                               TokenCount, Error)}


# ----------------------------------------------------------------------------------------------
# JSON lines

def encode(msg: Any) -> str:
    """One message as one JSON line (with the trailing newline), always encodable as UTF-8: text that
    holds lone surrogates (from a hostile line echoed back) is written with JSON's \\u escapes instead."""
    body = {"v": PROTOCOL_VERSION, "type": msg.type}
    body.update(_options.json_ready(dataclasses.asdict(msg)))
    line = json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n"
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(body, ensure_ascii=True, separators=(",", ":")) + "\n"
    return line


def decode_command(line: Union[str, bytes]) -> Command:
    return _decode(line, COMMANDS, "command")


def decode_event(line: Union[str, bytes]) -> Event:
    return _decode(line, EVENTS, "event")


def _decode(line: Union[str, bytes], table: dict[str, type], kind: str) -> Any:
    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(ErrorCode.BAD_JSON, f"not valid JSON: {e}") from None
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_JSON, "not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.BAD_JSON, f"expected a JSON object, got {type(data).__name__}")
    rid = data.get("request_id") if isinstance(data.get("request_id"), str) else None
    if rid is not None and rid != _options.shown(rid):
        rid = None        # not valid Unicode: the error says so, and cannot be addressed to it
    name = data.pop("type", None)
    version = data.pop("v", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.VERSION_MISMATCH,
                            f"protocol version {version!r}, this side speaks {PROTOCOL_VERSION}", rid)
    cls = table.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_COMMAND if kind == "command" else ErrorCode.BAD_FIELD,
                            f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}", rid)
    try:
        return _build(cls, data, name)
    except OptionError as e:
        raise ProtocolError(ErrorCode.BAD_FIELD, str(e), rid) from None


def from_plain(cls: type, data: Any) -> Any:
    """A protocol record (e.g. GenerationStats) from plain JSON data, every field checked.
    Raises OptionError naming the bad field."""
    return _build(cls, data, cls.__name__)


def _build(cls: type, data: Any, path: str) -> Any:
    """Construct a message dataclass from plain data, checking every field's type."""
    if not isinstance(data, dict):
        raise OptionError(path, f"expected an object, got {type(data).__name__}")
    if cls in (SamplingOptions, LoadOptions, DraftOptions) or cls.__module__ == _options.__name__:
        return _options.from_dict(cls, data, path)
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls)]
    names = {f.name for f in fields}
    unknown = sorted(set(data) - names)
    if unknown:
        raise OptionError(path, f"unknown field(s) {', '.join(map(_options.shown, unknown))}")
    kwargs = {}
    for f in fields:
        fpath = f"{path}.{f.name}"
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                raise OptionError(fpath, "missing")
            continue
        kwargs[f.name] = _value(hints[f.name], data[f.name], fpath)
    return cls(**kwargs)


def _value(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _value(inner[0], value, path)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise OptionError(path, f"expected a list, got {type(value).__name__}")
        return tuple(_value(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise OptionError(path, f"expected an object, got {type(value).__name__}")
        return {_options.check_text(k, f"{path} key"): _value(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise OptionError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise OptionError(path, f"expected a whole number, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise OptionError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise OptionError(path, f"expected text, got {value!r}")
        return _options.check_text(value, path)
    raise OptionError(path, f"unsupported field type {tp!r}")


# ----------------------------------------------------------------------------------------------
# Errors across the boundary

class WorkerError(RuntimeError):
    """An error event turned back into an exception on the client side."""

    def __init__(self, code: str, message: str, detail: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail


class ModelLoadError(WorkerError):
    """The model could not be loaded: not found, invalid, unsupported, or no room."""


class OutOfMemoryError(WorkerError):
    pass


class GenerationRefused(WorkerError):
    """generate was refused: no model loaded, busy, or the conversation is too long."""


_EXCEPTIONS = {
    ErrorCode.MODEL_NOT_FOUND.value: ModelLoadError,
    ErrorCode.MODEL_INVALID.value: ModelLoadError,
    ErrorCode.UNSUPPORTED_ARCHITECTURE.value: ModelLoadError,
    ErrorCode.CUDA_UNAVAILABLE.value: ModelLoadError,
    ErrorCode.KERNEL_BUILD_FAILED.value: ModelLoadError,
    ErrorCode.OUT_OF_MEMORY.value: OutOfMemoryError,
    ErrorCode.NO_MODEL.value: GenerationRefused,
    ErrorCode.BUSY.value: GenerationRefused,
    ErrorCode.CONTEXT_OVERFLOW.value: GenerationRefused,
}


def exception_for(event: Error) -> WorkerError:
    """The one place that maps a stable error code back to an exception."""
    return _EXCEPTIONS.get(event.code, WorkerError)(event.code, event.message, event.detail)
