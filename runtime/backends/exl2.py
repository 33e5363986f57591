"""The CUDA engine: EXL2 models on exllamav2, with the project's own MoE layer and a graph-captured decode step.

`load(path, options, progress) -> (Engine, applied)`, as runtime/reference. exllamav2 is imported
only inside functions (here, exl2_kernels.py, exl2_fixes.py), never at module level: on a machine
without CUDA its import itself fails.

- Attention, norms, embeddings and the head are exllamav2's (a load without offload runs the decode graphs'
  attention prologue and o in our launches, exl2_gemv.py); MoE layers are `OwnMoE` (runtime/experts/)
  unless `moe="stock"` (kept for comparisons and the benchmark's baseline).
- `forward(tokens)` appends at the cache position and returns fp16 logits [T, vocab] on the GPU:
  with an FP16 cache, 1..9 tokens (the decode step, a verify) replay a CUDA graph of the whole forward,
  one per (context bucket, T) (exl2_graph.py); anything else (prefill) runs exllamav2's layer loop.
  `truncate(n)` rolls back by moving the cache position (the next forward overwrites what lies past it).
- CUDA out-of-memory, in load or forward, frees what was taken and raises OutOfMemory (runtime/errors.py)
  saying what did not fit and how much was free, so the worker survives. `load` runs named steps
  (`_Loading`, the hybrid engine's alike, through runtime/backends/gpu_engine.run); a failure at any of them
  goes through its one cleanup, `_Loading.close`, and the one failure mapping, gpu_engine.failure.
"""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from runtime.backends import exl2_arch
from runtime.backends.exl2_fixes import causal_sdpa_attention, prefill_attention_is_causal, rms_head_norms
from runtime.backends.exl2_gemv import settle_kernels
from runtime.backends.exl2_kernels import build_kernels
from runtime.backends.expert_path import StepClock, idle_trial_step
from runtime.backends.gpu_engine import GpuEngine, is_oom, oom, run
from runtime.backends.gpu_offload import engine_closed, engine_opened, return_cached_memory
from runtime.cpu_load import on_cores, physical_cores
from runtime.engine import Engine, ModelInfo, ProgressFn
from runtime.errors import (ContextOverflow, CudaUnavailable, EngineError, InvalidModel, KernelBuildFailed,
                            UnsupportedArchitecture)
from runtime.options import LoadOptions
from runtime.tuning import Tuning, current as current_tuning

SUPPORTED = exl2_arch.SUPPORTED     # per-architecture differences: runtime/backends/exl2_arch.py
# Prefill chunk sizes run at load so that their kernels compile before the first answer: the loop's chunk
# (512), a staged and an unstaged tail that Triton specializes apart (not multiples of 16), a multiple of 16.
PREFILL_WARM_ROWS = (512, 203, 37, 12, 64)
MAX_WARM_ROWS = 9               # decode graphs cover 1..9 rows (exl2_graph.MAX_ROWS)
MAX_DQ_ELEMENTS = 64 << 20       # exllamav2's dequantization scratch: 128 MiB (its default: 1 GiB)


def choose_prefill_attention(config, head_dim: int = 128) -> str:
    """Make exllamav2's attention for more than one row causal, check it, and say what runs.

    flash-attn or xformers, when installed, are exllamav2's choice and are causal. Otherwise its
    `_attn_torch` runs, and its SDPA branch is not causal (`causal_sdpa_attention`): it is replaced,
    once per process, by the wrapper, then checked on a small problem; if the check fails (a torch
    whose SDPA backends mishandle the lower-right bias), cuDNN's SDPA is turned off and, failing that,
    exllamav2's matmul attention (explicit mask) runs."""
    from exllamav2 import attn as xattn
    if (xattn.has_flash_attn and not config.no_flash_attn) or (xattn.has_xformers and not config.no_xformers):
        return "flash-attn" if xattn.has_flash_attn and not config.no_flash_attn else "xformers"
    cls = xattn.ExLlamaV2Attention
    if not hasattr(cls._attn_torch, "wraps_exllamav2"):
        if not xattn.has_lower_right_sdpa:
            config.no_sdpa = True
            return "matmul (this torch has no lower-right causal bias)"
        cls._attn_torch = causal_sdpa_attention(cls._attn_torch)
    if prefill_attention_is_causal(cls._attn_torch, config, head_dim):
        return "sdpa (causal)"
    torch.backends.cuda.enable_cudnn_sdp(False)
    if prefill_attention_is_causal(cls._attn_torch, config, head_dim):
        return "sdpa (causal; cuDNN backend off: it mishandled the causal bias)"
    config.no_sdpa = True
    if prefill_attention_is_causal(cls._attn_torch, config, head_dim):
        return "matmul (SDPA mishandled the causal bias)"
    raise KernelBuildFailed("exllamav2's attention over several rows is not causal on this GPU and PyTorch, "
                            "with SDPA or without: prompts would be read wrongly, so the model is not loaded.")


def _cache_class(kind: str):
    from exllamav2 import ExLlamaV2Cache, ExLlamaV2Cache_Q4, ExLlamaV2Cache_Q6, ExLlamaV2Cache_Q8
    return {"fp16": ExLlamaV2Cache, "q8": ExLlamaV2Cache_Q8, "q6": ExLlamaV2Cache_Q6, "q4": ExLlamaV2Cache_Q4}[kind]


class Exl2Engine(GpuEngine, Engine):
    backend = "cuda"

    def __init__(self, model, cache, info: ModelInfo, graphs: bool, offload=None, setup=None):
        engine_opened(self)
        self.model = model
        self.offload = offload          # runtime/offload/manager.OffloadManager, or None: all in VRAM
        self.setup = setup              # runtime/backends/gpu_offload.OffloadSetup (VRAM ledger, cap)
        self.cache = cache
        self.info = info
        self.vocab = info.vocab_size
        self.graphs = None
        self.graph_error: Optional[str] = None
        if graphs:
            from runtime.backends.exl2_graph import DecodeGraphs
            self.graphs = DecodeGraphs.build_if_supported(model, cache)
            if self.graphs is not None and offload is not None:
                self.graphs.after_qkv = offload.release_prefetch
        self.warm_rows = 1              # rows whose graphs are captured ahead of need (1 + drafts)
        self._clock = StepClock()       # one-row steps' times for the expert-path judge's drift check
        self.moe = []
        if info.num_experts:
            from runtime.experts.exl2_module import moe_layers
            self.moe = moe_layers(model)

    def expert_layers(self) -> list:
        return [m.experts for m in self.moe]

    # -- Engine interface ---------------------------------------------------------------------------

    @property
    def position(self) -> int:
        return self.cache.current_seq_len

    def forward(self, tokens: Sequence[int]):
        return self._forward(tokens, last_only=False)

    def prefill(self, tokens: Sequence[int]):
        return self._forward(tokens, last_only=True)

    def _forward(self, tokens: Sequence[int], last_only: bool):
        T = len(tokens)
        if T == 0:
            raise EngineError("forward() needs at least one token")
        tokens = [int(t) for t in tokens]
        bad = [t for t in tokens if not 0 <= t < self.vocab]
        if bad:
            raise EngineError(f"token ids outside 0..{self.vocab - 1}: {bad[:5]}")
        if self.position + T > self.info.context_length:
            raise ContextOverflow(f"{self.position} tokens in the cache + {T} new exceed the context length "
                                  f"{self.info.context_length}",
                                  tokens=self.position + T, limit=self.info.context_length)
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        if 1 < T <= MAX_WARM_ROWS:
            self.note_rows(T)
        self._clock.tick(T, self.path_judge)
        if self.offload is not None:
            from exllamav2.device import set_device_streams
            set_device_streams()                      # table writes go on the stream the step runs on
            self.offload.step_boundary(T)             # finish promotions, maybe start new ones
        # many rows: the offload starts staging the first layer (copies scheduled from the host per call, so
        # not through a graph; with 128 experts it stages from 32 rows on, far above a verify)
        stages = self.offload is not None and self.offload.begin_forward(T)
        failure, pos0 = None, self.position
        try:
            if self.graphs is not None and T <= self.graphs.max_rows and not stages:
                try:
                    logits = self.graphs.step(ids, self.position)      # [T, V'] fp16, reused next step
                except RuntimeError as e:
                    # (the forward is recomputed below by the layer loop; its K/V rows are simply written again)
                    self._graph_failed(e, T)
                    torch.cuda.synchronize()
                else:
                    self.cache.current_seq_len += T
                    return logits[-1:, : self.vocab].clone() if last_only else logits[:, : self.vocab].clone()
            # last_only: exllamav2 runs the head on the last row only (no [T, V'] logits in VRAM)
            logits = self.model.forward(ids, self.cache, last_id_only=last_only)   # [1, T or 1, V'] fp16
            return logits[0, :, : self.vocab]
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
            failure = str(e)
        # outside the except block, so the traceback no longer holds the step's tensors
        self.cache.current_seq_len = pos0
        raise oom(f"a forward pass of {T} tokens at position {self.position}", RuntimeError(failure))

    # -- warm-up: what compiles or captures on first use happens at load and while idle ---------------

    def warm_up(self, progress: ProgressFn, draft_rows: int = 1, capture: bool = True) -> None:
        """At load, behind its progress: compile the prefill kernels (chunk sizes Triton specializes apart),
        the graphs' attention for every bucket (warm rows), and capture the first buckets' decode and verify graphs
        (capture=False: left to `prepare_graphs`, after the expert path is settled). Cache empty after."""
        self.warm_rows = max(1, min(draft_rows, MAX_WARM_ROWS))
        chunks = [n for n in PREFILL_WARM_ROWS if n < self.info.context_length]
        plan = self._load_plan() if capture else []
        total = len(chunks) + len(plan)
        g = torch.Generator().manual_seed(0)
        for i, n in enumerate(chunks):
            progress("warmup", f"Preparing GPU kernels {i + 1}/{total}", i, total)
            self.prefill(torch.randint(0, self.vocab, (n,), generator=g).tolist())
            self.truncate(0)
        if self.graphs is not None:         # attention kernels of every context length (the graphs' buckets)
            self.graphs.warm_attention(progress, self.warm_rows)
        if capture:         # else captured after the path is settled (graphs captured now would be dropped)
            self.prepare_graphs(progress, len(chunks), total)
        else:
            progress("warmup", f"GPU kernels ready ({total} prepared)", total, total)

    def _load_plan(self) -> list[tuple[int, int]]:
        """The graphs captured at load: the first two buckets, decode and verify rows (1 + drafts)."""
        if self.graphs is None:
            return []
        from runtime.backends.exl2_graph import warm_plan
        return warm_plan(self.position, self.warm_rows, self.info.context_length, self.graphs.captured(),
                         ahead=1, max_rows=self.warm_rows)

    def prepare_graphs(self, progress: ProgressFn, done: int = 0, total: Optional[int] = None) -> None:
        """Capture the load's graphs not captured yet (at load; again after a switch of the expert path)."""
        plan = self._load_plan()
        total = max(done + len(plan), total or 0)      # never "6/5": the plan may outgrow the announced total
        for i, (L, T) in enumerate(plan):
            progress("warmup", f"Preparing GPU kernels {done + i + 1}/{total}", done + i, total)
            self._prepare_graph(L, T)
        torch.cuda.synchronize()
        progress("warmup", f"GPU kernels ready ({total} prepared)", total, total)

    def _prepare_graph(self, L: int, T: int) -> bool:
        if self.graphs is None or T > self.graphs.max_rows:
            return False
        if self.offload is not None:
            from exllamav2.device import set_device_streams
            set_device_streams()
            self.offload.begin_forward(T)
        try:
            return self.graphs.prepare(L, T, self.position)
        except RuntimeError as e:
            self._graph_failed(e, T, ", ahead of need")
            return False

    def _graph_failed(self, e: RuntimeError, T: int, when: str = "") -> None:
        """A capture this torch/driver refuses: the layer loop runs from now on, for this and larger
        row counts only when the one-row step still works. Out of memory is re-raised."""
        if is_oom(e):
            raise e
        self.graph_error = f"{type(e).__name__} ({T} rows{when}): {e}"[:500]
        if T > 1:
            self.graphs.max_rows = T - 1
        else:
            self.graphs = None

    def idle_work(self) -> bool:
        """One step of work while the worker waits for a command: a step of measuring the expert
        paths again (when the live decode steps drifted from the choice), else one graph captured for
        the buckets at and after the cache position; False when nothing is left to do."""
        if idle_trial_step(self):                  # the expert paths measured again, a step at a time
            return True
        if self.graphs is None:
            return False
        from runtime.backends.exl2_graph import warm_plan
        plan = warm_plan(self.position, self.warm_rows, self.info.context_length, self.graphs.captured(),
                         max_rows=self.graphs.max_rows)
        for L, T in plan:
            if self._prepare_graph(L, T):
                return True
        return False

    def prepare_decode(self, max_new_tokens: int = 1) -> None:
        """After a prefill, before the first token is sent: the graphs of the buckets the answer can
        reach (exl2_graph.answer_plan: a prompt may jump past the buckets prepared while idle, and a
        request sent at once leaves no idle time), so that no capture falls between two tokens."""
        if self.graphs is not None:
            from runtime.backends.exl2_graph import answer_plan
            for L, T in answer_plan(self.position, max_new_tokens, self.warm_rows, self.info.context_length,
                                    self.graphs.captured(), self.graphs.max_rows):
                self._prepare_graph(L, T)

    def note_rows(self, rows: int) -> None:
        """A forward of `rows` rows ran (a verify): keep graphs ready for that many from now on."""
        self.warm_rows = max(self.warm_rows, min(rows, MAX_WARM_ROWS))

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.position:
            raise EngineError(f"truncate({length}) outside 0..{self.position} (tokens in the cache)")
        self.cache.current_seq_len = length

    def telemetry(self) -> dict[str, Any]:
        out: dict[str, Any] = {"vram_allocated_bytes": torch.cuda.memory_allocated(),
                               "decode_graphs": self.graphs is not None}
        if self.graph_error:
            out["graph_error"] = self.graph_error
        if self.graphs is not None:
            out["graph_attention"] = self.graphs.attention
            out["graph_rows"] = self.graphs.max_rows
            shapes = self.graphs.captured()                        # [(bucket L, rows T)]
            out["graph_buckets"] = sorted({L for L, _ in shapes})
            out["graph_shapes"] = [list(s) for s in shapes]
        out.update(self.offload_telemetry())
        return out

    def _drop_graphs(self) -> None:
        """Before the slots move: wait for queued steps, drop graphs that captured the old addresses."""
        torch.cuda.synchronize()
        if self.graphs is not None:
            self.graphs.graphs.clear()
            self.graphs.pool = None

    def close(self) -> None:
        if self.model is None:
            return
        self.graphs = None
        try:
            if self.offload is not None:
                self.offload.close()                  # saves the routing statistics
            self.model.unload()
        finally:
            self.offload = None
            self.model = None
            self.cache = None
            self.moe = []
            engine_closed(self)
            gc.collect()
            if self.setup is not None:
                self.setup.release()                  # allocator cap off, page-locked experts freed
            return_cached_memory()


def load(path, options: LoadOptions, progress: ProgressFn, *, moe: str = "own",
         graphs: bool = True, warm: bool = True, tuning: Optional[Tuning] = None) -> tuple[Engine, dict[str, str]]:
    """Load an EXL2 model folder on the GPU. moe: "own" (runtime/experts) or "stock" (exllamav2's).
    warm: compile kernels and capture the first decode graphs at load (Exl2Engine.warm_up), and
    settle the CPU expert path by measured decode steps ("auto" placement). tuning: the engine tuning
    (default: the process's, runtime/tuning.py), read here once and handed to what the load builds."""
    return run(_Loading(Path(path), options, progress, moe, graphs, warm, tuning or current_tuning()))


class _Loading:
    """One load in progress, step by step (gpu_engine.Loading); what the steps opened, so that `close` frees
    it on failure."""

    def __init__(self, path: Path, options: LoadOptions, progress: ProgressFn, moe: str, graphs: bool,
                 warm: bool = True, tuning: Optional[Tuning] = None):
        self.path, self.options, self.off, self.progress = path, options, options.offload, progress
        self.tuning = tuning or current_tuning()
        self.moe, self.graphs, self.warm = moe, graphs, warm and self.tuning.warmup
        self.applied: dict[str, str] = {}
        self.step = "check_folder"              # the step running: says what an out-of-memory meant
        self.config = self.setup = self.model = self.cache = self.manager = self.engine = None
        self.arch = None                        # runtime/backends/exl2_arch.ArchPlan, from config.json
        self.is_moe = self.use_graphs = False
        self.prefill_attention = ""

    def steps(self) -> list[str]:
        warm = ["warm_up", "settle_expert_path"] if self.warm else []
        return ["check_folder", "prepare_kernels", "read_config", "plan_offload", "build_model", "allocate_cache",
                "place_experts", "make_engine"] + warm

    def run_step(self, name: str) -> None:
        if name in ("build_model", "allocate_cache", "place_experts"):
            on_cores(physical_cores(), getattr(self, name))   # the repacking's host work, the CPU path's copies
        else:
            getattr(self, name)()

    def what(self, step: str) -> str:
        ctx = f"a {self.off.context_length}-token {self.off.kv_cache} KV cache"
        if step in ("build_model", "allocate_cache", "place_experts"):
            return f"the model's weights and {ctx}"
        return {"make_engine": "the decode graphs", "warm_up": "the kernels' warm-up and the first decode graphs",
                "settle_expert_path": "the kernels' warm-up and the first decode graphs"}.get(
            step, "the load's first checks on the GPU (the prefill attention's, before any weights)")

    def vram_cap(self) -> Optional[int]:
        return self.setup.vram.total_bytes if self.setup is not None and self.setup.capped else None

    def check_folder(self) -> None:
        if not torch.cuda.is_available():
            raise CudaUnavailable("No CUDA GPU is available to this process: use the CPU engine (backend cpu).")
        if not (self.path / "config.json").is_file():
            raise InvalidModel(self.path, "config.json missing")
        return_cached_memory()      # the first checks' kernels load outside torch's allocator, from what the driver has

    def prepare_kernels(self) -> None:
        build_kernels(self.progress)

    def read_config(self) -> None:
        from exllamav2 import ExLlamaV2Config
        path, off = self.path, self.off
        self.progress("load", "Reading model configuration", 0, 1)
        try:
            config = ExLlamaV2Config(str(path))
        except Exception as e:
            raise InvalidModel(path, f"exllamav2 cannot read this model: {e}") from None
        if config.architecture not in SUPPORTED:
            raise UnsupportedArchitecture(path, f"architecture {config.architecture} is not supported "
                                                f"(supported: {', '.join(SUPPORTED)})")
        self.arch = exl2_arch.plan(exl2_arch.read_config(path), str(path / "config.json"))
        off, context_note = exl2_arch.cap_context(self.arch, off)
        self.off = off                       # the context capped where the architecture needs it
        rms_head_norms(config)
        self.prefill_attention = choose_prefill_attention(config, config.head_dim)
        config.max_seq_len = off.context_length
        config.max_input_len = min(2048, off.context_length)
        config.max_attention_size = config.max_input_len ** 2
        # exllamav2 sizes its fixed scratch for dequantizing the largest linear whole, up to max_dq_size
        # elements: the head (vocab x hidden, ~600M for Qwen3 at hidden 4096) would take its 1 GiB default
        # for a prefill's all-row logits, which `prefill` never asks for. Linears above this are
        # dequantized in slices of rows instead (exllamav2's max_dq_rows), same result.
        config.max_dq_size = MAX_DQ_ELEMENTS
        is_moe = self.is_moe = bool(config.arch.lm.is_moe)
        use_graphs = self.graphs and off.kv_cache == "fp16" and (self.moe == "own" or not is_moe)
        if use_graphs:
            config.no_graphs = True          # exllamav2's own per-module graphs cannot nest in ours
        self.config, self.use_graphs = config, use_graphs
        self.applied["offload.context_length"] = context_note
        self.applied["offload.kv_cache"] = "applied"

    def plan_offload(self) -> None:
        """Budgets and the allocator cap (runtime/backends/gpu_offload)."""
        from runtime.backends import gpu_offload
        self.setup = gpu_offload.prepare(self.path, self.config, self.off, self.is_moe and self.moe == "own",
                                          self.tuning)
        self.applied.update(self.setup.applied)
        self.applied["offload.backend"] = "applied"

    def build_model(self) -> None:
        from exllamav2 import ExLlamaV2
        self.model = ExLlamaV2(self.config)
        exl2_arch.install(self.model, self.arch)
        exl2_arch.install_rope(self.model, self.arch)     # RoPE tables from runtime/reference/rope.py
        if self.is_moe and self.moe == "own":
            from runtime.experts.exl2_module import install
            ram = self.setup.ram
            on_host = None if ram is None else lambda what, n: ram.reserve(
                what, n, "raise the RAM budget, close other programs, or raise the VRAM budget")
            install(self.model, on_host, self.setup.arena, self.arch.renormalize, self.tuning)
        self.model.load(callback=lambda i, total: self.progress("load", "Loading weights", i, total))

    def allocate_cache(self) -> None:
        progress = self.progress
        progress("load", "Allocating the KV cache", 0, 1)
        self.cache = _cache_class(self.off.kv_cache)(self.model, max_seq_len=self.off.context_length)
        progress("load", "Allocating the KV cache", 1, 1)
        progress("load", "Tuning GPU kernels", 0, 1)
        settle_kernels(self.model, offload=self.setup.offload, splitk=self.tuning.splitk)
        progress("load", "Tuning GPU kernels", 1, 1)

    def place_experts(self) -> None:
        """The VRAM ledger and the hot experts (offload), the CPU expert path by prediction."""
        from runtime.backends import gpu_offload
        from runtime.experts.exl2_module import moe_layers
        if self.setup.offload:
            self.progress("load", "Placing experts", 0, 1)
        scratch = gpu_offload.prefill_scratch_bytes(self.config, self.prefill_attention.startswith("matmul"))
        self.manager = gpu_offload.start(self.setup, [m.experts for m in moe_layers(self.model)], self.path,
                                         scratch, progress=self.progress)
        self.applied.update(self.setup.applied)

    def make_engine(self) -> None:
        config, is_moe, path = self.config, self.is_moe, self.path
        info = ModelInfo(
            name=path.name, path=str(path), architecture=config.architecture, vocab_size=config.vocab_size,
            context_length=self.off.context_length, num_layers=config.num_hidden_layers,
            num_experts=(config.num_experts or 0) if is_moe else 0,
            experts_per_token=(config.num_experts_per_token or 0) if is_moe else 0,
            extra={"moe": self.moe if is_moe else "none", "modules": len(self.model.modules),
                   "prefill_attention": self.prefill_attention})
        if self.setup.stats_warning:
            info.extra["routing_stats_warning"] = self.setup.stats_warning
        self.engine = Exl2Engine(self.model, self.cache, info, graphs=self.use_graphs, offload=self.manager,
                                 setup=self.setup)

    def warm_up(self) -> None:
        """Kernels compiled and first graphs captured; with offload the graphs wait for the settled
        expert path (a switch drops them)."""
        draft = self.options.draft
        self.engine.warm_up(self.progress, draft.draft_tokens + 1 if draft.mode != "off" else 1,
                            capture=self.manager is None)

    def settle_expert_path(self) -> None:
        if self.manager is not None:
            from runtime.backends.expert_path import settle_cpu_path
            settle_cpu_path(self.engine, self.progress, load=True)      # (the routing prior first)
            self.applied.update(self.setup.applied)
            self.manager.forget_warmup()

    def close(self) -> None:
        """The one cleanup path: free what the steps opened, the engine or its parts."""
        if self.engine is not None:
            self.engine.close()            # the model, the offload manager, the budget (allocator cap, pages)
        else:
            try:
                if self.manager is not None:
                    self.manager.close()
                if self.model is not None:
                    self.model.unload()
            finally:
                gc.collect()
                if self.setup is not None:
                    self.setup.release()
                return_cached_memory()             # the repacking's page-locked batches too
        self.engine = self.manager = self.cache = self.model = self.setup = None
