"""The worker's edge for failures: the runtime's exceptions (runtime/errors.py) as protocol error events.

The one place where a failure gets its stable wire code; the runtime below raises domain exceptions
and never names a code. Exceptions that are not the runtime's own (a bug, a library's error) are
`internal`, except memory running out, which is `out_of_memory` whoever noticed it.
"""
from __future__ import annotations

import traceback
from typing import Optional

from runtime import errors as E
from runtime import protocol as P

# An exception's code is that of the nearest class of its MRO listed here.
CODES: dict[type, P.ErrorCode] = {
    E.EngineError: P.ErrorCode.INTERNAL,
    E.BadRequest: P.ErrorCode.BAD_FIELD,
    E.NoModel: P.ErrorCode.NO_MODEL,
    E.Cancelled: P.ErrorCode.BAD_FIELD,
    E.CudaUnavailable: P.ErrorCode.CUDA_UNAVAILABLE,
    E.KernelBuildFailed: P.ErrorCode.KERNEL_BUILD_FAILED,
    E.OutOfMemory: P.ErrorCode.OUT_OF_MEMORY,
    E.ContextOverflow: P.ErrorCode.CONTEXT_OVERFLOW,
    E.ModelFolderError: P.ErrorCode.MODEL_INVALID,
    E.ModelNotFound: P.ErrorCode.MODEL_NOT_FOUND,
    E.InvalidModel: P.ErrorCode.MODEL_INVALID,
    E.UnsupportedArchitecture: P.ErrorCode.UNSUPPORTED_ARCHITECTURE,
}


def code_for(error: E.EngineError) -> P.ErrorCode:
    """The wire code of a runtime failure: that of the nearest class in its MRO."""
    for cls in type(error).__mro__:
        if cls in CODES:
            return CODES[cls]
    return P.ErrorCode.INTERNAL


def error_event(exc: BaseException, request_id: Optional[str] = None) -> P.Error:
    """The error event that reports `exc` (raised while handling the request `request_id`)."""
    if isinstance(exc, E.EngineError):
        return P.Error(code=code_for(exc).value, message=exc.message, detail=exc.detail, request_id=request_id)
    from runtime.triton_cc import launcher_failure
    known = launcher_failure(exc)            # Triton could not compile its launcher: what to install
    if known is not None:
        return error_event(known, request_id)
    if isinstance(exc, MemoryError):
        return P.Error(code=P.ErrorCode.OUT_OF_MEMORY.value, message="host memory ran out",
                       detail=_trace(exc), request_id=request_id)
    oom = "out of memory" in str(exc).lower()
    code = P.ErrorCode.OUT_OF_MEMORY if oom else P.ErrorCode.INTERNAL
    return P.Error(code=code.value, message=f"{type(exc).__name__}: {exc}", detail=_trace(exc), request_id=request_id)


def _trace(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
