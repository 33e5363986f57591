"""Every user-facing option, with its default and a one-line description: the one place for defaults.

Grouped as the settings panel groups them. Pure Python (no torch): the GUI imports this module
to build its panel, and the same dataclasses travel to the worker inside protocol commands.

`from_dict` validates plain data (from JSON) and raises `OptionError` naming the field and the
problem; unknown keys are errors too, so a typo never silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar


class OptionError(ValueError):
    """A setting has a bad value. `path` names it, e.g. "sampling.top_p"."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def opt(default: Any, help: str, *, choices: tuple | None = None, min: float | None = None,
        max: float | None = None, reload: bool = False):
    """A dataclass field with its description, allowed range and whether changing it needs a reload."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "reload": reload}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# Upper bounds: every number arrives from an untrusted line, so each has a sane ceiling (checked in from_dict).
MAX_TOKENS = 1 << 22                  # longest answer and longest context, in tokens (4,194,304)
MAX_SEED = (1 << 63) - 1              # a signed 64-bit integer: what torch's generator and SQLite both hold
MAX_CPU_THREADS = 512                 # beyond any CPU's physical cores today
MAX_MEMORY_GB = 16384.0               # 16 TB of GPU or host memory
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1000                 # one stop string's length

# Chat templates (code from untrusted model folders) run under these bounds: see runtime/chat_template.py.
TEMPLATE_TIMEOUT_S = 5.0              # to compile or render once (MOEDESK_TEMPLATE_TIMEOUT_S overrides it)
MAX_PROMPT_CHARS = 1 << 23            # a rendered or raw prompt, before it reaches the tokenizer (8,388,608)


# EXL2 conversion (moedesk-cli convert, runtime/exl2/convert.py).
CONVERT_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",    # what convert handles
                         "MixtralForCausalLM", "DbrxForCausalLM",
                         "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
CONVERT_HEAD_BITS = 6                 # bits of lm_head
CONVERT_CALIBRATION_ROWS = 32         # calibration sequences (fewer when the text is short)
CONVERT_CALIBRATION_SEQ_LEN = 512     # tokens per calibration sequence
CONVERT_GROUP_SIZE = 32               # input rows per scale group (exllamav2's kernels take multiples of 32)
# Calibration tokens (rows x seq_len) below which the measured bit allocation is not used: every linear gets the
# target width instead (convert --measure forces the measurement). The allocation ranks each linear's candidate
# widths by their output error on the calibration Hessian H = 2 X^T X (exl2/allocate.py); with fewer tokens than a
# linear has inputs H is singular, GPTQ hides each width's error where the text never goes and the ranking
# follows the text, not the model. 4096 tokens (8 of the default sequences) give every input up to 2048 wide two
# tokens, what the experts' Hessians need before their fallback (MIN_EXPERT_TOKENS_PER_INPUT). Measured on the
# demo (SmolLM2-135M, inputs up to 1536 wide): 4 x 256 tokens of one text made the allocation answer "Béx"
# where uniform widths answer "Paris"; the default 32 x 512 = 16,384 lowered the perplexity from 100.5 to 80.5
# at 3 bpw. Counts between the two are not measured.
CONVERT_MEASURE_MIN_TOKENS = 4096

# Import of GPTQ-family builds (moedesk-cli import, runtime/exl2/gptq_import.py).
IMPORT_BPW = 6.0                      # stored bits per weight of the linears a build kept in 16 bits
IMPORT_WIDTHS = (4, 5, 6, 8)          # EXL2 code widths the imported linears may take (at least the build's bits)
IMPORT_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                        "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")     # what import handles

@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = opt(0.7, "Randomness of sampling; 0 always picks the most likely token.", min=0.0, max=5.0)
    top_p: float = opt(0.9, "Sample only from the most likely tokens whose probabilities add up to this.", min=0.0, max=1.0)
    top_k: int = opt(40, "Sample only from this many most likely tokens (0 = no limit).", min=0, max=MAX_TOKENS)
    min_p: float = opt(0.0, "Drop tokens less likely than this fraction of the most likely one.", min=0.0, max=1.0)
    repetition_penalty: float = opt(1.0, "Penalise tokens already in the conversation (1 = off).", min=0.5, max=3.0)
    max_tokens: int = opt(1024, "Longest answer, in tokens.", min=1, max=MAX_TOKENS)
    seed: Optional[int] = opt(None, "Random seed for reproducible sampling (empty = random).", min=0, max=MAX_SEED)
    stop: tuple[str, ...] = opt((), "Extra strings that end the answer.")
    context_overflow: str = opt("rolling", "When the chat no longer fits the context: drop the oldest turns (rolling), "
                                "keep the first exchange and drop the turns after it (keep_first), or stop and say so.",
                                choices=("rolling", "keep_first", "stop"))


@dataclass(frozen=True)
class OffloadOptions:
    vram_budget_gb: Optional[float] = opt(None, "GPU memory the engine may use, in GiB (empty = all free VRAM).", min=0.5,
                                          max=MAX_MEMORY_GB, reload=True)
    ram_budget_gb: Optional[float] = opt(None, "Host memory for offloaded experts, in GiB (empty = what is free).", min=0.5,
                                         max=MAX_MEMORY_GB, reload=True)
    cpu_threads: int = opt(0, "CPU threads the engine computes with: the whole model on the CPU engine, cold experts beside a GPU (0 = automatic: the physical cores less those other programs keep busy, two fewer beside a GPU).", min=0,
                      max=MAX_CPU_THREADS, reload=True)
    kv_cache: str = opt("fp16", "Precision of the attention cache; lower fits longer context.", choices=("fp16", "q8", "q6", "q4"), reload=True)
    context_length: int = opt(4096, "Longest conversation the model can see, in tokens.", min=256, max=MAX_TOKENS,
                              reload=True)
    placement: str = opt("auto", "Where cold experts go: auto, all in VRAM, computed on the CPU, or streamed to the GPU.",
                         choices=("auto", "vram", "cpu", "stream"), reload=True)
    backend: str = opt("auto", "Engine: auto (the NVIDIA GPU when there is one), the GPU (CUDA), or the CPU.",
                       choices=("auto", "cuda", "cpu"), reload=True)


@dataclass(frozen=True)
class DraftOptions:
    mode: str = opt("off", "Speculative decoding: off, a small draft model, the model's own multi-token-prediction "
                           "head (Qwen3.5-MoE), or n-gram lookup in the conversation.",
                    choices=("off", "model", "mtp", "ngram"))
    model: Optional[str] = opt(None, "Draft model (name or folder); needs the target's vocabulary.", reload=True)
    draft_tokens: int = opt(4, "Tokens drafted ahead per step.", min=1, max=16)
    adaptive: bool = opt(True, "Adjust the draft length, and switch drafting off when it does not pay.")


@dataclass(frozen=True)
class LoadOptions:
    offload: OffloadOptions = field(default_factory=OffloadOptions, metadata={"help": "Memory and placement."})
    draft: DraftOptions = field(default_factory=DraftOptions, metadata={"help": "Speculative decoding."})


@dataclass(frozen=True)
class ServeOptions:
    """The OpenAI-compatible local server (`moedesk serve`, and Settings → Local server in the app)."""
    enabled: bool = opt(False, "Run the OpenAI-compatible server while the app is open.")
    port: int = opt(8642, "TCP port of the server.", min=1, max=65535)
    allow_other_devices: bool = opt(False, "Listen on every network address (needs an API key), not only this computer.")
    max_queue: int = opt(8, "Requests that may wait for the engine; one more is refused with 503.", min=0, max=1024)
    allowed_origins: tuple[str, ...] = opt((), "Web pages and browser extensions that may use the server, by origin "
                                               "(e.g. chrome-extension://ID, http://localhost:3000; * for any); "
                                               "empty = none, only programs.")
    allowed_hosts: tuple[str, ...] = opt((), "Other names the server answers to besides localhost and its own "
                                             "addresses (e.g. a reverse proxy's or a LAN name; * for any).")


T = TypeVar("T")


def describe(cls: type) -> list[tuple[str, Any, dict]]:
    """(name, default, metadata) for each field of an options group, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append((f.name, default, dict(f.metadata)))
    return out


def to_dict(obj: Any) -> dict:
    """Plain JSON-ready data (tuples become lists)."""
    return json_ready(dataclasses.asdict(obj))


def json_ready(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build and validate an options dataclass from plain data; missing keys take their defaults."""
    where = path or cls.__name__
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise OptionError(where, f"expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise OptionError(where, f"unknown option(s) {', '.join(map(shown, unknown))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        fpath = f"{path}.{f.name}" if path else f.name
        kwargs[f.name] = _coerce(hints[f.name], data[f.name], fpath, f.metadata)
    return cls(**kwargs)


def check_text(value: str, path: str) -> str:
    """Text from JSON may hold lone surrogates ("\\udcff" escapes): valid JSON, but not Unicode that
    UTF-8 (the tokenizer, the event channel, SQLite) can carry. Refuse them by name."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OptionError(path, f"not valid Unicode text: a lone surrogate {value[e.start]!a} "
                                f"at character {e.start}") from None
    return value


def shown(name: str) -> str:
    """A name from untrusted data, safe to put into a message (lone surrogates escaped)."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _coerce(tp: Any, value: Any, path: str, meta: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        if value is None:
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise OptionError(path, "expected a list of strings")
        if len(value) > MAX_STOP_STRINGS or any(len(v) > MAX_STOP_CHARS for v in value):
            raise OptionError(path, f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each")
        for i, v in enumerate(value):
            check_text(v, f"{path}[{i}]")
        return tuple(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise OptionError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise OptionError(path, f"expected a whole number, got {value!r}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise OptionError(path, f"expected a number, got {value!r}")
        value = float(value)
        if value != value:
            raise OptionError(path, "expected a number, got NaN")
    elif tp is str:
        if not isinstance(value, str):
            raise OptionError(path, f"expected text, got {value!r}")
        check_text(value, path)
    if meta:
        if meta.get("choices") and value not in meta["choices"]:
            raise OptionError(path, f"{value!r} is not one of {', '.join(meta['choices'])}")
        if meta.get("min") is not None and value < meta["min"]:
            raise OptionError(path, f"{value} is below the minimum {meta['min']}")
        if meta.get("max") is not None and value > meta["max"]:
            raise OptionError(path, f"{value} is above the maximum {meta['max']}")
    return value
