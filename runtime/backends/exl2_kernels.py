"""exllamav2's CUDA side made ready for a load: its extension imported (built when no cached build
exists) and its quantized GEMM's autotuning run to the end, so neither happens inside an answer.
"""
from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch

from runtime.build_lock import one_build
from runtime.engine import ProgressFn
from runtime.errors import KernelBuildFailed


def build_kernels(progress: ProgressFn) -> float:
    """Import exllamav2's CUDA extension; returns the seconds it took. A prebuilt or cached build
    (runtime.gpu_setup: `moedesk-cli setup-gpu`, the welcome screen's background build) is imported as it is;
    without one, exllamav2 builds it here, at import, into the same cache (the slow fallback)."""
    from runtime import gpu_setup, triton_cc
    from runtime.paths import cache_dir
    triton_cc.prepare(cache_dir())       # a C compiler for Triton's launchers where the machine has none
    archs = gpu_setup.gpu_archs()
    cached, folder = gpu_setup.prepare_import(archs)
    progress("kernels", "Loading GPU kernels" if cached else "Building GPU kernels, one time", 0, 1)
    t0 = time.perf_counter()
    try:
        with one_build(folder) if folder is not None else contextlib.nullcontext():   # a stopped build's lock
            from exllamav2.ext import exllamav2_ext  # noqa: F401  (compiles on first import)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] not in ("exllamav2", "exllamav2_ext"):
            # a package exllamav2 imports is missing from this install (not a build problem)
            raise KernelBuildFailed(f"exllamav2 cannot be imported: the package '{e.name}' it needs is missing from "
                                    "this install. Install MoE Desk again (pip install moedesk), or report the bundle.",
                                    str(e)) from None
        raise _kernel_failure(e, archs) from None
    except Exception as e:  # the JIT build raises RuntimeError/OSError/ImportError with the compiler's log
        raise _kernel_failure(e, archs) from None
    dt = time.perf_counter() - t0
    progress("kernels", f"GPU kernels ready ({dt:.0f} s)", 1, 1)
    return dt


def _kernel_failure(e: Exception, archs) -> KernelBuildFailed:
    """kernel_build_failed for a failed import of exllamav2's extension, with the compiler's last lines."""
    from runtime import gpu_setup
    status = gpu_setup.kernel_status(archs)
    err = gpu_setup.failure_message(str(e).splitlines(), status.toolchain)
    if status.build_dir is not None and status.build_dir.is_dir():
        (status.build_dir / "failed.log").write_text(str(e), encoding="utf-8")
    return KernelBuildFailed(err.message, err.detail)


# exllamav2's quantized GEMM times its first AT_NUM_MEASURE (200) calls of every (rows, in, out) shape
# with cudaEventSynchronize before settling on a block size (exllamav2_ext/cuda/q_gemm.cu). A host
# synchronisation inside a CUDA graph capture invalidates it ("operation failed due to a previous
# error during capture"), and the lm_head shape is called once per token: 200 tokens would have to be
# decoded before a capture could succeed. Settling every shape at load, for the row counts decode and
# verify use, removes the timing calls from both the capture and the verify-cost measurements.
AUTOTUNE_CALLS = 201
AUTOTUNE_ROWS = 8          # EXL2_BLOCK_M_SIZE_MAX: larger row counts reuse the 8-row choice


def settle_gemm_autotune(model, rows: Sequence[int] = tuple(range(1, AUTOTUNE_ROWS + 1))) -> int:
    """Run exllamav2's GEMM past its autotuning for every distinct quantized matrix shape; returns
    the number of shapes settled."""
    from exllamav2.ext import exllamav2_ext as ext_c
    from exllamav2.linear import ExLlamaV2Linear
    seen: dict[tuple[int, int], ExLlamaV2Linear] = {}

    def visit(m):
        if isinstance(m, ExLlamaV2Linear) and isinstance(m.q_handle, int):
            seen.setdefault((m.in_features, m.out_features), m)
        for sub in getattr(m, "submodules", []) or []:
            visit(sub)

    for m in model.modules:
        visit(m)
    for (k, n), lin in seen.items():
        dev = lin.device()
        for r in rows:
            a = torch.zeros((r, k), dtype=torch.float16, device=dev)
            c = torch.empty((r, n), dtype=torch.float16, device=dev)
            for _ in range(AUTOTUNE_CALLS):
                ext_c.gemm_half_q_half(a, lin.q_handle, c, False)
    torch.cuda.synchronize()
    return len(seen)
