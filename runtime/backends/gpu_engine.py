"""What the two GPU engines share: one load sequence, one failure mapping, and the engine's side of the experts.

Both engines (runtime/backends/exl2.py on exllamav2, hybrid.py for Qwen3.5-MoE) load as a `Loading`: named
steps run in order (`steps()`, a load's table of contents: its methods' names), `step` saying which; the step that
places the experts calls `start_offload` (gpu_offload.start: the VRAM ledger, the offload manager, its first
placement), the last makes the engine. `run` is the sequence: a failure at any step goes through the
load's one cleanup (`close`: the engine, or the parts the steps opened) and comes out as the error the user
reads (`failure`: out of memory saying what did not fit at which step, a budget that is short, a model
folder that cannot be read), holding none of the step's frames (their tensors).

`GpuEngine` is what both engines do around their experts, the same way: an experiment (benchmarks), a
placement by hand, another VRAM budget, the expert path decided again (runtime/backends/expert_path.py),
and the offload's telemetry. An engine provides `expert_layers()` and `_drop_graphs()`; it holds `offload`
(the offload manager, or None) and `setup` (gpu_offload.OffloadSetup, or None).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch

from runtime.budget import BudgetError
from runtime.engine import ProgressFn
from runtime.errors import EngineError, InvalidModel, OutOfMemory
from runtime.offload.experiment import NO_EXPERIMENT

GiB = 1024 ** 3
# The steps that read the model folder into memory (both loads name theirs so): a bad tensor or header there is
# a model that cannot be loaded, and host memory running out there is said as such.
READING_STEPS = ("read_config", "build_model", "allocate_cache", "place_experts")


# -- the load --------------------------------------------------------------------------------------

class Loading(Protocol):
    """One load in progress (each engine's `_Loading`): what `run` needs of it."""
    path: Path
    applied: dict[str, str]
    step: str                       # the step running: says what an out-of-memory meant
    engine: Any                     # the engine, once the last step made it

    def steps(self) -> list[str]:
        """The names of the load's steps (its methods), in order."""

    def run_step(self, name: str) -> None:
        """Run one step (the exllamav2 engine's heavy ones on every core)."""

    def what(self, step: str) -> str:
        """What a step allocates on the GPU, in words ("the model's weights and a 4096-token cache")."""

    def vram_cap(self) -> Optional[int]:
        """The VRAM budget the allocator is held to (bytes), where the load has one."""

    def close(self) -> None:
        """The one cleanup: free what the steps opened, the engine or its parts."""


def run(loading: Loading) -> tuple[Any, dict[str, str]]:
    """Run the load's steps; the engine and what each option came to, or the load's error after its cleanup."""
    try:
        for name in loading.steps():
            loading.step = name
            loading.run_step(name)
        return loading.engine, loading.applied
    except BaseException as e:
        error = failure(loading, e)
        if error is None:                       # not a failure the load knows: re-raised as it is, after the cleanup
            loading.close()
            raise
    loading.close()                             # outside the except: its traceback no longer pins tensors
    raise error() from None


def failure(loading: Loading, e: BaseException) -> Optional[Callable[[], EngineError]]:
    """The error a failed step reports, made after the cleanup (free memory is measured then) and holding
    none of the step's frames; None: not a failure the load knows, re-raise `e`."""
    from runtime.backends.gpu_offload import budget_error
    if isinstance(e, BudgetError):
        err = budget_error(e)
    elif isinstance(e, EngineError):
        err = e
    elif loading.step in READING_STEPS and isinstance(e, MemoryError) and not is_oom(e):   # page-locking experts
        err = OutOfMemory(str(e) or "out of host memory while loading experts")
    elif loading.step in READING_STEPS and isinstance(e, (ValueError, KeyError, AssertionError, OSError)):
        err = InvalidModel(loading.path, f"could not load the model: {type(e).__name__}: {e}")
    elif is_oom(e):                             # at any step: with the GPU nearly full, even a first check's kernels
        what, cap = loading.what(loading.step), loading.vram_cap()
        return lambda text=str(e), context=oom_context(e): oom(what, RuntimeError(text), cap, context)
    else:
        return None
    err.__traceback__, err.__context__ = None, None      # keep no frames (and their tensors) alive
    return lambda: err


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def free_vram() -> tuple[Optional[int], str]:
    """Free GPU memory in bytes (None: unknown), and in words."""
    try:
        free, total = torch.cuda.mem_get_info()
        return free, f"{free / GiB:.1f} GiB free of {total / GiB:.1f} GiB"
    except Exception:
        return None, "free memory unknown"


def oom(what: str, err: BaseException, cap: Optional[int] = None, context: str = "") -> OutOfMemory:
    """`cap`: the VRAM budget the allocator was held to (bytes), where the load had one: the GPU's free
    memory then says nothing of why it ran out. `context`: where and with what torch held (detail)."""
    from runtime.backends.gpu_offload import return_cached_memory
    return_cached_memory()                      # device blocks and page-locked host blocks
    free, words = free_vram()
    within = "" if cap is None else f" within the VRAM budget of {cap / GiB:.1f} GiB"
    larger = "" if cap is None else "a larger VRAM budget, "
    return OutOfMemory(f"Not enough GPU memory for {what}{within} ({words} after freeing what was taken). "
                       f"Try {larger}a shorter context, a quantized KV cache, or a smaller model.",
                       "; ".join(filter(None, (str(err), context))), free_bytes=free)


def oom_context(e: BaseException) -> str:
    """Where an out-of-memory was raised (the innermost frames, exllamav2's and torch's included) and
    what torch's allocator held then: taken before the cleanup, for the error's detail."""
    import traceback
    frames = traceback.extract_tb(e.__traceback__)[::-1][:5]
    where = " < ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames)
    try:
        held = (f"torch held {torch.cuda.memory_allocated() / GiB:.2f} GiB allocated, "
                f"{torch.cuda.memory_reserved() / GiB:.2f} GiB reserved")
    except Exception:
        held = ""
    return "; ".join(filter(None, (f"raised at {where}" if where else "", held)))


# -- the engine's side of the experts ----------------------------------------------------------------

class GpuEngine:
    """Mixed into both GPU engines: what they do around their experts (module docstring)."""
    offload: Any = None              # runtime/offload/manager.OffloadManager, or None: every expert resident
    setup: Any = None                # runtime/backends/gpu_offload.OffloadSetup (budgets), or None
    experiment = NO_EXPERIMENT       # benchmarks and tests only: set_experiment
    # the CPU expert path's decision under offload (runtime/backends/expert_path.py)
    path_judge = None                # runtime/offload/path_judge.PathJudge, once decided at load
    _trial = None                    # its measurement in progress (idle time): a generator of steps
    decision_save = None             # (file, key) where a measured decision is saved

    def expert_layers(self) -> list:
        """The MoE layers' ExpertLayer, in order."""
        raise NotImplementedError

    def _drop_graphs(self) -> None:
        """Before the slots move: wait for queued steps, drop the graphs that captured the old addresses."""
        raise NotImplementedError

    def set_experiment(self, experiment) -> None:
        """Benchmarks and tests: run the MoE layers under `experiment` (runtime/offload/experiment.py) from the
        next forward; captured graphs are dropped where it changes what they captured."""
        from runtime.offload.experiment import apply_experiment
        if self.experiment.changes_graphs(experiment):
            self._drop_graphs()
        try:
            apply_experiment(experiment, self.expert_layers(), self.offload)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.experiment = experiment

    def place_experts(self, resident: list[list[int]]) -> None:
        """Tests and benchmarks: exactly these experts of each MoE layer in VRAM slots, the others read from
        host memory (within the ledger)."""
        if self.offload is None:
            raise EngineError("place_experts needs a model loaded with expert offload")
        self._drop_graphs()
        self.offload.apply(resident)

    def set_vram_budget(self, vram_budget_gb: float) -> None:
        """Benchmarks: the offloaded experts placed again for another VRAM budget without reloading: the
        allocator cap moves, hot slots and staging are planned anew, captured graphs (which hold the old
        slots' addresses) are dropped and recaptured at the next step."""
        if self.offload is None or self.setup is None:
            raise EngineError("set_vram_budget needs a model loaded with expert offload")
        from runtime.backends.expert_path import set_vram_budget
        set_vram_budget(self, vram_budget_gb)

    def recheck_placement(self, progress: ProgressFn = lambda *a: None, measure: bool = True) -> None:
        """Decide the CPU expert path again now (benchmarks, after the routing or the budget changed; the
        worker does it while idle when decode steps drift), timing both paths; a path saved for this model
        and budget stays unless the other is clearly faster. measure=False: the saved decision is reused
        untimed where there is one (as a load does)."""
        if self.offload is not None:
            from runtime.backends.expert_path import settle_cpu_path
            settle_cpu_path(self, progress, measure)

    def reset_graphs(self) -> None:
        """Benchmarks and tests, after changing what a step does by hand: graphs captured again."""
        self._drop_graphs()

    def offload_telemetry(self) -> dict[str, Any]:
        """The offload's keys of the engine's telemetry (its snapshot and the path decision), or the VRAM
        ledger's totals where nothing is offloaded."""
        out: dict[str, Any] = {}
        if self.offload is not None:
            out.update(self.offload.telemetry().as_dict())
            if self.path_judge is not None:
                out["placement_decision"] = self.path_judge.telemetry()
        elif self.setup is not None and self.setup.vram is not None:
            out["vram_budget_bytes"] = self.setup.vram.total_bytes
            out["vram_budget_used_bytes"] = self.setup.vram.used_bytes
        return out
