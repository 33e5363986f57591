"""What can go wrong in the runtime, as exceptions that carry their data.

The engine, the loaders, the tokenizer and the chat template raise these; none of them knows the
wire. The worker's edge (runtime/worker_errors.py) is the one place that turns each class into the
protocol's error code, so that a new failure is a new class here plus one line there.

Every exception has `message` (in words, shown to the user) and `detail` (a compiler log, a byte
count: for the log and the report), and the data its class names (a path, byte counts, lengths).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional


class EngineError(RuntimeError):
    """The base of the runtime's failures. Raised as it is, it means a broken invariant (a bug)."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.message = message
        self.detail = detail


class BadRequest(EngineError):
    """A request that cannot be served as asked (an empty prompt, an unknown policy, draft options that clash)."""


class NoModel(EngineError):
    """No model to serve the request: none loaded yet, or the engine was closed."""


class Cancelled(EngineError):
    """The request was cancelled before it produced anything (e.g. while its chat template rendered)."""


class CudaUnavailable(EngineError):
    """The GPU engine was asked for where there is no CUDA device."""


class KernelBuildFailed(EngineError):
    """GPU kernels could not be built or imported, or do not compute what they should; `detail` holds the log."""


class OutOfMemory(EngineError):
    """GPU or host memory ran out. `needed_bytes` / `free_bytes`: what was asked and what was left, when known."""

    def __init__(self, message: str, detail: str = "", *, needed_bytes: Optional[int] = None,
                 free_bytes: Optional[int] = None):
        super().__init__(message, detail)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class ContextOverflow(EngineError):
    """The conversation (or a forward) does not fit the context. `tokens` / `limit`, when known."""

    def __init__(self, message: str, detail: str = "", *, tokens: Optional[int] = None,
                 limit: Optional[int] = None):
        super().__init__(message, detail)
        self.tokens = tokens
        self.limit = limit


class ModelFolderError(EngineError):
    """A model folder is missing, malformed or unsupported. `file` is the offending path, `problem` what is wrong."""

    def __init__(self, file: Path | str, problem: str, detail: str = ""):
        super().__init__(f"{file}: {problem}", detail)
        self.file = str(file)
        self.problem = problem


class ModelNotFound(ModelFolderError):
    """No model folder at that name or path."""


class InvalidModel(ModelFolderError):
    """A missing, corrupt or truncated file, a bad config, a missing tensor."""


class UnsupportedArchitecture(ModelFolderError):
    """A well-formed model of an architecture (or a variant of one) this engine does not run."""


class TemplateError(InvalidModel):
    """The model's chat template is broken: it does not compile, loops, crashes or writes too much.
    `file` is the template's source (a file of the model folder)."""


class TemplateRefused(BadRequest):
    """The chat template refused these messages (its own raise_exception): the conversation is at fault."""

    def __init__(self, source: str, problem: str):
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem
