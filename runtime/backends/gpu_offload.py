"""Expert offload in either GPU engine's load: budgets, the allocator cap, and placement after load.

Both GPU engines (runtime/backends/exl2.py, hybrid.py) load through here. `prepare` runs before the model is
built: it turns the user's settings into a VRAM and a RAM budget
(runtime/budget.py), caps torch's allocator at the VRAM budget
(`torch.cuda.set_per_process_memory_fraction`, so a 24 GB card is emulated for real on a larger one),
and decides whether experts are offloaded: with a VRAM budget or a model bigger than the free VRAM,
unless the placement is "vram". Offloaded experts are packed into pinned host RAM as they load
(runtime/experts/exl2_module.py). `start` runs after every module and the KV cache are allocated:
it enters them in the VRAM ledger with a reserve for prefill scratch, and places hot experts in
what is left (runtime/offload/manager.py). Imports torch; exllamav2 objects come from the caller.
"""
from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from runtime.budget import GB, BudgetError, MemoryBudget, gb, ram_budget, vram_budget
from runtime.errors import OutOfMemory
from runtime.experts.pack import HostArena
from runtime.options import OffloadOptions
from runtime.tuning import Tuning

log = logging.getLogger(__name__)
SCRATCH_MARGIN = 512 << 20      # allocator fragmentation, graph pools, library workspaces
LOGIT_ROWS = 16                 # rows of logits a forward under offload is budgeted for (a verify: <= 9)


@dataclass
class OffloadSetup:
    vram: MemoryBudget
    ram: Optional[MemoryBudget]             # None: experts stay in VRAM
    arena: Optional[HostArena]              # page-locked host memory for the experts' codes
    policy: str
    capped: bool                            # the allocator fraction was lowered (restore at close)
    applied: dict[str, str] = field(default_factory=dict)
    cpu_threads: int = 0                    # the CPU expert path's threads (0: the physical cores)
    stats_warning: Optional[str] = None
    tuning: Tuning = field(default_factory=Tuning)   # the load's (route_prior, lend_staging)

    @property
    def offload(self) -> bool:
        return self.ram is not None

    def release(self) -> None:
        """Give the allocator its whole device back and the host memory to the system (after the
        model is unloaded: at close, or when the load fails)."""
        if self.capped:
            torch.cuda.set_per_process_memory_fraction(1.0)
            self.capped = False
        if self.arena is not None:
            self.arena.release()


def budget_error(e: BudgetError) -> OutOfMemory:
    return OutOfMemory(str(e), f"{e.label}: needed {e.needed} bytes, available {e.available} of {e.total}",
                       needed_bytes=e.needed, free_bytes=e.available)


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def expert_code_bytes_estimate(config, path: Path) -> int:
    """Lower bound of the host RAM the experts' codes take: the stored bits per weight of the folder
    (at least 3: the packed codes never shrink below the EXL2 bits)."""
    import json
    L, E = config.num_hidden_layers, config.num_experts or 0
    weights = L * E * 3 * config.hidden_size * config.intermediate_size
    try:
        qc = json.loads((path / "config.json").read_text(encoding="utf-8")).get("quantization_config") or {}
        bits = float(qc.get("bits", 3.0))
    except (OSError, ValueError, TypeError, AttributeError):
        bits = 3.0
    return int(weights * max(3.0, min(8.0, bits)) / 8)


_LIVE_ENGINES: "weakref.WeakSet" = weakref.WeakSet()     # engines open in this process (their graphs)


def engine_opened(engine) -> None:
    _LIVE_ENGINES.add(engine)


def engine_closed(engine) -> None:
    _LIVE_ENGINES.discard(engine)


def return_cached_memory() -> None:
    """Give what torch caches but nothing uses back to the driver and the system: the caching
    allocator's free device blocks and the page-locked host blocks of finished copies.

    With no engine open, torch's cuBLAS workspaces (one per handle and stream) go too: a small block
    that outlives its model can keep a whole freed segment reserved, and the next load's allocator cap
    counts it (on the H200, after closed models, torch held 0.28 GiB allocated with no live tensor and
    1.94 GiB reserved; that the workspaces were those blocks is not confirmed yet). Not while an
    engine is open: its CUDA graphs replay the workspace they captured.

    A load allocates outside torch's device allocator too (CUDA modules of kernels used for the first
    time, library workspaces, the device-side mappings of page-locked host memory): those come from
    what the driver has free, not from blocks torch keeps cached (after a failed load, a closed model,
    or a large tensor just deleted). So every load starts with the cache handed back, and a failed
    load or a closed model ends so."""
    gc.collect()
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()                  # copies out of page-locked blocks are done: they can go
    if not _LIVE_ENGINES and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


HELD_BEFORE = "memory this process held before the load (unused blocks torch could not give back)"


def _held_before(vram: MemoryBudget) -> None:
    """Under a budget the allocator's cap counts every byte torch has reserved, the ledger only what
    it is told: the blocks torch still holds after handing its cache back (segments shared with a live
    tensor, the private pools of CUDA graphs something still refers to) go into the ledger, else the
    planner fills that much of the cap twice. What is allocated is counted at `start`."""
    held = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if held > 0:
        vram.reserve(HELD_BEFORE, held, "close other models in this process or raise the VRAM budget")


def prepare(path: Path, config, off: OffloadOptions, own_moe: bool, tuning: Tuning = Tuning()) -> OffloadSetup:
    """Budgets and the allocator cap for a load; raises OutOfMemory in words. tuning: the load's (pages
    locked ahead, the routing prior, lending)."""
    return_cached_memory()                    # free means free for the driver too, not cached by torch
    free, total = torch.cuda.mem_get_info()
    # what torch still holds unused (blocks of a live tensor's segment) is free for this load too
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    try:
        vram = vram_budget(off.vram_budget_gb, free, total)
    except BudgetError as e:
        raise budget_error(e) from None
    capped = False
    if off.vram_budget_gb is not None:
        try:
            _held_before(vram)
        except BudgetError as e:
            raise budget_error(e) from None
        torch.cuda.set_per_process_memory_fraction(vram.fraction_of(total))
        capped = True
    applied = {"offload.vram_budget_gb": "applied"}
    wants = own_moe and off.placement != "vram" and (
        off.vram_budget_gb is not None or _folder_bytes(path) > 0.9 * vram.total_bytes)
    ram = None
    if wants:
        import psutil
        try:
            ram = ram_budget(off.ram_budget_gb, psutil.virtual_memory().available)
            need = expert_code_bytes_estimate(config, path)
            if need > ram.total_bytes:
                raise BudgetError("RAM", "the experts of this model (at least)", need, ram.total_bytes,
                                  ram.total_bytes, "close other programs, raise the RAM budget, or "
                                  "choose a smaller model")
        except BudgetError as e:
            if capped:
                torch.cuda.set_per_process_memory_fraction(1.0)
            raise budget_error(e) from None
        applied["offload.ram_budget_gb"] = "applied"
    else:
        why = ("the 'vram' placement keeps every expert in VRAM" if own_moe and off.placement == "vram"
               else "this model has no offloadable experts" if not own_moe
               else "the model fits the VRAM budget: every expert stays in VRAM")
        applied["offload.ram_budget_gb"] = f"ignored: {why}"
    applied["offload.placement"] = "applied"           # the CPU path's part: settled by `start`
    if ram is None:
        applied["offload.cpu_threads"] = f"ignored: {why}"
        if off.placement == "cpu":
            applied["offload.placement"] = f"ignored: {why}"
    else:
        applied["offload.cpu_threads"] = "applied"          # settled after placement (cpu_path_applied)
        if off.placement in ("cpu", "auto"):
            from runtime.cpu.experts import build_kernel_in_background
            build_kernel_in_background()     # while the weights load: placing needs it (its rate, copies)
    return OffloadSetup(vram, ram, HostArena(ahead=tuning.pin_ahead) if ram is not None else None, off.placement,
                        capped, applied, cpu_threads=off.cpu_threads, tuning=tuning)


def replace_for_budget(setup: OffloadSetup, manager, vram_budget_gb: float) -> None:
    """Benchmarks: place the offloaded experts again for another VRAM budget without reloading (either
    engine's `set_vram_budget`, its graphs dropped first): the ledger's total and the allocator cap
    move (before the new slots are allocated when growing, after the old ones are freed when shrinking),
    hot slots and staging are planned anew."""
    free, total = torch.cuda.mem_get_info()
    want = int(vram_budget_gb * GB)
    if want > total:
        raise OutOfMemory(f"a VRAM budget of {vram_budget_gb:g} GiB is more than the GPU's {total / GB:.1f} GiB",
                          needed_bytes=want)
    growing = want >= setup.vram.total_bytes
    setup.vram.total_bytes = want
    if growing:                                   # the new slots are allocated under the new cap
        torch.cuda.set_per_process_memory_fraction(min(1.0, want / total))
    try:
        manager.place()
    except BudgetError as e:
        raise budget_error(e) from None
    finally:
        if not growing:                           # the old slots are gone: the smaller cap fits
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(min(1.0, want / total))
        setup.capped = True


def cpu_path_applied(setup: OffloadSetup, manager, decision: str = "") -> None:
    """After placement: whether the CPU expert path runs, in `setup.applied` (placement, cpu_threads);
    `decision`: how that was decided (runtime/offload/path_judge.py), in words."""
    if manager.cpu.active:       # "auto" says how it decided; "cpu" is just applied
        setup.applied["offload.placement"] = f"applied: {decision}" if decision and setup.policy == "auto" else "applied"
        setup.applied["offload.cpu_threads"] = "applied"
        return
    setup.applied["offload.cpu_threads"] = f"ignored: {manager.cpu.reason}"
    if decision and setup.policy == "auto":
        setup.applied["offload.placement"] = f"applied: {decision}"
    if setup.policy == "cpu":
        setup.applied["offload.placement"] = (f"ignored: no layer computes experts on the CPU ({manager.cpu.reason})"
                                              + ("" if manager.all_in_vram
                                                 else "; cold experts are read from host RAM by the GPU ('stream')"))


def prefill_scratch_bytes(config, matmul_attention: bool = False) -> int:
    """VRAM one prefill chunk of `max_input_len` rows needs beyond the weights, the cache and
    exllamav2's fixed scratch, at the end of the context (`max_seq_len` rows attended): MoE
    intermediates (fp16 h, fp16 inputs gathered per pair, fp32 per-pair outputs), the logits of the rows a forward may return
    (`prefill` asks for the last only; graph-sized forwards up to LOGIT_ROWS), the attention's
    temporaries, hidden states, and a margin.

    Attention: SDPA (or flash-attn) takes K and V expanded to every query head (GQA), over the whole
    attended length, and writes an output per head; exllamav2's matmul attention (`matmul_attention`)
    also writes fp16 scores and probabilities for every head, row and attended row."""
    T, S = config.max_input_len, getattr(config, "max_seq_len", config.max_input_len)
    H, V, Hq = config.hidden_size, config.vocab_size, config.num_attention_heads
    Hk = getattr(config, "num_key_value_heads", Hq) or Hq
    D = getattr(config, "head_dim", None) or H // Hq
    P = T * (config.num_experts_per_token or 0)
    moe = P * (config.intermediate_size * 2 + H * 2 + H * 4 + 16)
    logits = LOGIT_ROWS * V * 2 * 2
    attention = (2 * Hq * S * D * 2 if Hk != Hq else 0) + 2 * T * Hq * D * 2
    if matmul_attention:
        attention += 2 * Hq * T * S * 2
    hidden = T * H * 2 * 8
    return moe + logits + attention + hidden + SCRATCH_MARGIN


def start(setup: OffloadSetup, layers: list, path: Path, scratch_bytes: int, progress=None):
    """After the weights and the cache (either engine): enter what is allocated in the VRAM ledger with a
    reserve of `scratch_bytes` for a prefill chunk, then make the offload manager over the MoE layers
    (`layers`, ExpertLayer) and place hot experts; None where nothing is offloaded. `progress(stage, message,
    done, total)` hears each part of the placement. On the CPU (tests: every expert's codes in host memory)
    the manager streams and nothing is placed: the test places by hand."""
    from runtime.offload.path_judge import saved_off
    from runtime.backends.routing_prior import saved_statistics
    from runtime.offload.manager import OffloadManager
    cuda = layers[0].gate_w.is_cuda if layers else torch.cuda.is_available()
    vram = setup.vram
    if setup.arena is not None:
        setup.arena.finish()              # the weights are in: no block page-locked ahead of need stays
    if cuda and hasattr(torch._C, "_host_emptyCache"):
        torch.cuda.synchronize()          # the repacking's page-locked batches (pack._gather) go back
        torch._C._host_emptyCache()
    what, used = "weights, KV cache and kernel workspaces", torch.cuda.memory_allocated() if cuda else 0
    if not setup.offload:                 # the ledger is telemetry only (the allocator cap is the limit)
        if cuda and vram.fits(used):
            vram.reserve(what, used)
        return None
    stats = stats_file = prior = None
    if cuda:
        vram.reserve(what, used, "lower the context length, quantize the KV cache, or raise the VRAM budget")
        vram.reserve("prefill scratch", scratch_bytes, "lower the context length")
        stats, stats_file, setup.stats_warning, prior = saved_statistics(path, len(layers), layers[0].num_experts,
                                                                         route_prior=setup.tuning.route_prior)
    # no CPU copies that a saved decision drops at once (again at the routing prior's placement)
    manager = OffloadManager(layers, vram, setup.policy if cuda else "stream", stats, stats_file,
                             cpu_threads=setup.cpu_threads, ram=setup.ram if cuda else None,
                             lend_staging=setup.tuning.lend_staging, prior_reason=prior,
                             saved_off=saved_off(path, setup) if cuda else "")
    if not cuda:
        return manager
    if progress is not None:
        manager.on_stage = lambda message: progress("load", message, 0, 1)
    try:
        manager.place()
    except BaseException:
        manager.close()
        raise
    finally:
        manager.on_stage = lambda message: None       # later placements belong to no load's progress
    cpu_path_applied(setup, manager)
    log.info("offload: %s; RAM %s", vram.report(), gb(setup.ram.used_bytes))
    return manager


__all__ = ["OffloadSetup", "prepare", "return_cached_memory", "engine_opened", "engine_closed", "start",
           "prefill_scratch_bytes", "budget_error", "GB"]
