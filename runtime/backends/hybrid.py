"""The hybrid engine: Qwen3.5-MoE (Gated DeltaNet + gated attention + MoE with a shared expert) from an
EXL2 folder, on CUDA (exllamav2's quantized matmul, our expert kernels and offload) or on the CPU (the
same code with the projections dequantized: how its tests run without a GPU).

    load(path, options, progress) -> (HybridExl2Engine, applied)       as runtime/backends/exl2.load

exllamav2 has neither linear attention nor shared experts, so this engine builds the model itself
(runtime/backends/hybrid_layers.py) and uses exllamav2 only for its quantized GEMM
(runtime/backends/quant_linear.py). The routed experts are our `ExpertLayer`s: with offload the
manager (runtime/offload/manager.py) places them as it does for the exllamav2 engine.

Rollback (a verify of K drafts, then a truncate to the accepted prefix): the cache keeps the DeltaNet
states after each row of the last `window` rows (runtime/backends/hybrid_state.py), so a truncate
inside that window is a copy; a truncate to before it replays the kept tokens (as the reference does).

Decode graphs (CUDA, with or without offload; runtime/backends/hybrid_graphs.py): a forward of T <= window
rows runs with fixed shapes (`static`), its attention over the first L cache rows (the 512-token bucket
of its last row): its first run in a bucket is eager, then it is captured and later steps of that
(L, T) replay the graph. Which (L, T) are captured ahead of need follows the exllamav2 engine's plans
(runtime/backends/exl2_graph.py): the first buckets at load (`prepare_graphs`), the buckets an answer
can reach before its first token (`prepare_decode`), the current bucket and the next ones while idle
(`idle_work`, one capture a call). A capture ahead of need runs placeholder tokens at a position of
its bucket at or past the cache's end, then rolls the cache back through the snapshot ring.
Under offload a step replays its graph unless the manager stages its cold experts for that many rows
(copies scheduled from the host: prefill-sized forwards, never a verify window), as the exllamav2
engine's; a re-placement that moves the slots (`place_experts`, the routing prior) drops the graphs.
The CPU expert path is decided as for the exllamav2 engine (runtime/backends/expert_path.py, shared:
saved per model, budget and machine, else both paths timed at load, again while idle when the live
steps drift); its timed steps run under `hold_position`.
"""
from __future__ import annotations

import dataclasses
import gc
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from runtime.backends import gpu_offload, hybrid_layers, hybrid_mtp
from runtime.backends.exl2_graph import answer_plan, bucket, capture_position, warm_plan
from runtime.backends.expert_path import StepClock, idle_trial_step
from runtime.backends.gpu_engine import GpuEngine, run
from runtime.backends.hybrid_graphs import StepGraphs
from runtime.backends.hybrid_mtp import MtpHead, MtpHooks
from runtime.backends.hybrid_state import HybridCache
from runtime.budget import MemoryBudget
from runtime.engine import Engine, ModelInfo, ProgressFn
from runtime.errors import (BadRequest, ContextOverflow, CudaUnavailable, EngineError, NoModel, OutOfMemory,
                            UnsupportedArchitecture)
from runtime.options import LoadOptions
from runtime.reference.mtp import MtpCache
from runtime.tuning import Tuning, current as current_tuning

REPLAY_CHUNK = 512          # tokens per forward when a truncate replays the kept tokens
PREFILL_CHUNK = 512         # rows per forward at most (longer ones are cut)
MIN_WINDOW = 2              # rows of rollback kept without drafting (a regenerate's one-token step back)


class HybridExl2Engine(MtpHooks, GpuEngine, Engine):
    def __init__(self, info: ModelInfo, spec, model: hybrid_layers.HybridModel, cache: HybridCache,
                 offload=None, setup=None, graphs: bool = False, mtp_head: Optional[MtpHead] = None):
        gpu_offload.engine_opened(self)
        self.info, self.spec, self.model, self.cache = info, spec, model, cache
        self.refused_tokens = spec.media_tokens      # refused as input (`_check`), so never sampled
        self.backend = "cuda" if model.device.type == "cuda" else "cpu"
        self.offload = offload          # runtime/offload/manager.OffloadManager, or None: all experts resident
        self.setup = setup              # runtime/backends/gpu_offload.OffloadSetup (budgets), or None
        self.tokens: list[int] = []     # what the cache holds: replayed by a truncate before the snapshots
        self.static = False             # short forwards with fixed shapes (always on under graphs)
        self.graphs: Optional[StepGraphs] = StepGraphs(self) if graphs else None
        self.graph_error: Optional[str] = None
        self._bytes_per_token = model.nbytes_per_token()
        self._expert_bytes_per_token = model.expert_bytes_per_token()
        self.mtp_head = mtp_head        # the multi-token-prediction head (hybrid_mtp.py), when the load asked for it
        self.mtp = MtpCache(spec, cache.capacity, model.dtype, model.device) if mtp_head is not None else None
        self.mtp_on = False             # the head follows the forwards (a drafter asked for it)
        self._clock = StepClock()        # one-row steps' times for the expert-path judge's drift check

    @property
    def position(self) -> int:
        return self.cache.length if self.cache is not None else 0

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        return self._forward(tokens, last_only=False)

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        return self._forward(tokens, last_only=True)

    def _check(self, tokens: Sequence[int]) -> list[int]:
        if self.model is None:
            raise NoModel("the engine was closed")
        ids = [int(t) for t in tokens]
        if not ids:
            raise BadRequest("forward needs at least one token")
        if self.position + len(ids) > self.info.context_length:
            raise ContextOverflow(f"{self.position} cached + {len(ids)} new tokens exceed the context length of "
                                  f"{self.info.context_length} tokens", tokens=self.position + len(ids),
                                  limit=self.info.context_length)
        bad = [t for t in ids if not 0 <= t < self.spec.vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{self.spec.vocab - 1})")
        media = [t for t in ids if t in self.spec.media_tokens]
        if media:
            raise BadRequest(f"token {media[0]} is an image or video placeholder: images and video are not "
                             f"supported (this engine runs {self.info.name}'s language model only)")
        return ids

    def _forward(self, tokens: Sequence[int], last_only: bool) -> torch.Tensor:
        """Long forwards run in chunks of PREFILL_CHUNK rows (the attention's mask and the chunked rule's
        temporaries grow with the rows); a failed one leaves the cache where it was."""
        ids = self._check(tokens)
        self._clock.tick(len(ids), self.path_judge)
        pos0, outs = self.position, []
        with torch.inference_mode():
            try:
                for s in range(0, len(ids), PREFILL_CHUNK):
                    part, start = ids[s:s + PREFILL_CHUNK], self.position
                    keep = [] if self.mtp_on else None
                    if last_only:
                        outs.clear()            # the last chunk's row is the answer: no earlier one is kept
                    outs.append(self._run(part, last_only, keep=keep))
                    self.tokens += part
                    if keep:
                        self._mtp_follow(start, part, keep[0])
            except torch.cuda.OutOfMemoryError as e:
                failure = str(e)
            except BaseException:
                self._back_to(pos0)
                raise
            else:
                return outs[-1] if last_only else outs[0] if len(outs) == 1 else torch.cat(outs)
            outs = []
            self._back_to(pos0)
        raise OutOfMemory(f"out of GPU memory in a forward of {len(ids)} tokens at position {pos0}", failure)

    def _back_to(self, length: int) -> None:
        if self.cache is not None and self.cache.length > length:
            self.truncate(length)

    def _run(self, ids: list[int], last_only: bool, at: Optional[int] = None, keep: Optional[list] = None) -> torch.Tensor:
        """at: the rows' positions start there, past the cache's length (a capture ahead of need).
        keep: receives the rows' final hidden states (HybridModel.forward)."""
        cache, t = self.cache, len(ids)
        start = cache.length
        at = start if at is None else at
        if self.offload is not None:
            self.offload.step_boundary(t)
        stages = self.offload is not None and self.offload.begin_forward(t)      # copies from the host: no graph
        logged = cache.begin(t, at)
        try:
            if logged and self.graphs is not None and not stages:
                out = self.graphs.step(ids, at, keep)
            else:
                dev = torch.tensor(ids, dtype=torch.long).to(self.model.device, non_blocking=True)
                static = self.static and logged
                # last_only: the head reads the last row only (a 512-row chunk's logits are 0.47 GiB in float32)
                out = self.model.forward(dev, cache, start, logged, static=static, last_only=last_only,
                                         span=bucket(at, t, cache.capacity) if static else None, keep=keep)
        except BaseException:
            # the states may be half-written: back to those before this forward (the snapshot ring holds
            # them when it was snapshotted; otherwise the kept tokens are replayed)
            if not (logged and cache.rollback(start, force=True)):
                self._recover(start)
            raise
        cache.end(t, logged)
        return out[-1:] if last_only else out

    def _recover(self, length: int) -> None:
        keep = self.tokens[:length]
        self.cache.reset()
        self.tokens = []
        for s in range(0, len(keep), REPLAY_CHUNK):
            self._run(keep[s:s + REPLAY_CHUNK], last_only=True)
            self.tokens += keep[s:s + REPLAY_CHUNK]

    def _truncate(self, length: int) -> None:
        """The cache and its tokens back to `length`: by the snapshot ring, else the kept tokens run again
        (`truncate`, reference/mtp.MtpDrafting's, keeps the MTP head in step)."""
        if length == 0:
            self.cache.reset()
        elif not self.cache.rollback(length):
            self._recover(length)
        del self.tokens[length:]

    def reset(self) -> None:
        self.truncate(0)

    def _graph_plan(self, ahead: Optional[int] = None) -> list[tuple[int, int]]:
        """exl2_graph.warm_plan from the cache's position: (L, T) not captured yet, most urgent first
        (decode steps of the current bucket and the next `ahead`, then the verify rows 2..window)."""
        w = self.cache.window
        kw = {} if ahead is None else {"ahead": ahead}
        return warm_plan(self.position, w, self.cache.capacity, self.graphs.captured(), max_rows=w, **kw)

    def _prepare_graph(self, L: int, t: int) -> bool:
        """Capture the graph of (L, t) ahead of need: t placeholder tokens at a position of bucket L at or
        past the cache's end (exl2_graph.capture_position; their K/V rows there are overwritten before
        they are attended), then the cache rolled back through the snapshot ring. False when it is
        captured already or cannot be reached from the cache's position."""
        g = self.graphs
        if g is None or self.model is None or t > self.cache.window or (L, t) in g.graphs:
            return False
        start = self.position
        at = capture_position(L, t, start, self.cache.capacity)
        if at is None:
            return False
        with torch.inference_mode():
            try:
                self._run([0] * t, last_only=True, at=at)
            except torch.cuda.OutOfMemoryError as e:
                failure = str(e)          # _run took the cache back
            else:
                self.truncate(start)
                return True
        raise OutOfMemory(f"out of GPU memory capturing the decode graph of {t} rows over {L}", failure)

    def prepare_graphs(self, progress: Optional[ProgressFn] = None) -> int:
        """At load (empty cache): capture the first two buckets' decode and verify graphs. -> captured."""
        if self.graphs is None:
            return 0
        progress = progress or (lambda stage, message, done, total: None)
        plan = self._graph_plan(ahead=1)
        for i, (L, t) in enumerate(plan):
            progress("warmup", f"Capturing decode graphs {i + 1}/{len(plan)}", i, len(plan))
            self._prepare_graph(L, t)
        progress("warmup", "Decode graphs ready", len(plan), len(plan))
        return len(plan)

    def idle_work(self) -> bool:
        """Capture one graph ahead of need (exl2_graph.warm_plan: the decode step of the current bucket and
        the next two, then the verifies'); before that, a step of measuring the expert paths again where
        the live decode steps drifted from the choice. False when nothing is left, nothing fits before
        the context's end, or the graphs held are full of wanted ones."""
        if idle_trial_step(self):                  # the expert paths measured again, a step at a time
            return True
        if self.graphs is None or self.model is None:
            return False
        wanted = set(warm_plan(self.position, self.cache.window, self.cache.capacity, (),   # captured or not
                               max_rows=self.cache.window))
        for L, t in self._graph_plan():                    # the wanted ones not captured yet
            if self.graphs is None or self.graphs.full_of(wanted):
                return False
            if self._prepare_graph(L, t):
                return True
        return False

    def prepare_decode(self, max_new_tokens: int = 1) -> None:
        """After a prefill, before the first token: the graphs of the buckets the answer can reach
        (exl2_graph.answer_plan: the prompt may have jumped past the buckets prepared while idle), so
        that no capture falls between two tokens."""
        if self.graphs is None or self.model is None:
            return
        w = self.cache.window
        for L, t in answer_plan(self.position, max_new_tokens, w, self.cache.capacity, self.graphs.captured(), w):
            self._prepare_graph(L, t)

    # -- benchmarks and tests (bench/offload.py drives both GPU engines through these) ------------

    @property
    def max_draft_tokens(self) -> int:
        """Drafts a verify may carry: its rows (drafts + 1) must fit the snapshot ring to be rolled back
        (speculative.make_decoder caps a request's draft tokens here)."""
        return self.cache.window - 1

    @property
    def vocab(self) -> int:
        return self.spec.vocab

    @contextmanager
    def hold_position(self):
        """Forwards run inside leave the cache as they found it (the expert-path trial's timed steps): the
        DeltaNet states at the position are kept aside (one copy of each layer's) and put back, where a
        truncate past the rollback window would replay the whole conversation. The snapshots of earlier
        rows are gone after it: a later truncate before this position replays."""
        cache, pos0, kept = self.cache, self.position, len(self.tokens)
        head = self.mtp if self.mtp_on else None
        slots = head.slots if head is not None else 0
        with torch.inference_mode():
            states = cache.states()
        try:
            yield
        finally:
            with torch.inference_mode():
                cache.restore(pos0, states)
            del self.tokens[kept:]
            if head is not None:
                head.trim(pos0)
                head.slots = min(slots, max(pos0 - 1, 0))

    @property
    def moe(self) -> list:
        """The MoE blocks (each with its `experts`), in layer order."""
        return [block[4] for block in self.model.blocks]

    def expert_layers(self) -> list:
        return self.model.expert_layers()

    def _drop_graphs(self) -> None:
        """Before the slots move (routing_prior.py calls it too): wait for queued steps, drop the graphs
        that captured the old addresses and their pool; later steps capture again."""
        if self.graphs is not None:
            self.graphs.cuda.synchronize()
            self.graphs.graphs.clear()
            self.graphs.pool = None

    def telemetry(self) -> dict[str, Any]:
        out: dict[str, Any] = {"weight_bytes_per_token": self._bytes_per_token,
                               # the experts' share: the worker benchmark's roofline of an offloaded placement
                               "weight_bytes_per_token_parts": {"experts": self._expert_bytes_per_token,
                                                                "total": self._bytes_per_token},
                               "cache_bytes": self.cache.nbytes() if self.cache is not None else 0,
                               "rollback_window": self.cache.window if self.cache is not None else 0,
                               "decode_graphs": self.graphs is not None}
        if self.mtp is not None:
            out["cache_bytes"] += self.mtp.nbytes()
            out["mtp_head_bytes"] = self.mtp_head.nbytes()
            out["mtp_following"] = self.mtp_on
        if self.graphs is not None:
            shapes = self.graphs.captured()                        # [(bucket L, rows T)]
            out["graph_buckets"] = sorted({L for L, _ in shapes})
            out["graph_shapes"] = [list(x) for x in shapes]
        if self.graph_error:
            out["graph_error"] = self.graph_error
        if self.backend == "cuda":
            out["vram_allocated_bytes"] = torch.cuda.memory_allocated()
        out.update(self.offload_telemetry())
        return out

    def close(self) -> None:
        if self.model is None:
            return
        try:
            if self.offload is not None:
                self.offload.close()                  # saves the routing statistics
        finally:
            self.graphs = None
            self.offload = self.model = self.cache = self.mtp_head = self.mtp = None
            gpu_offload.engine_closed(self)
            gc.collect()                              # (before the page-locked experts go)
            if self.setup is not None:
                self.setup.release()
            gpu_offload.return_cached_memory()


# ----------------------------------------------------------------------------------------------
# Load

def _device(requested: Optional[str]) -> torch.device:
    if requested is not None:
        return torch.device(requested)
    if not torch.cuda.is_available():
        raise CudaUnavailable("No CUDA GPU is available to this process: use the CPU engine (backend cpu).")
    return torch.device("cuda", torch.cuda.current_device())


def rollback_window(options: LoadOptions) -> int:
    """Rows of DeltaNet states kept for rollback: a verify of the drafts plus its bonus row."""
    draft = options.draft
    return max(MIN_WINDOW, draft.draft_tokens + 1) if draft.mode != "off" else MIN_WINDOW


def load(path, options: Optional[LoadOptions] = None, progress: Optional[ProgressFn] = None, *,
         device: Optional[str] = None, window: Optional[int] = None, dtype: Optional[torch.dtype] = None,
         graphs: Optional[bool] = None, host_experts: Optional[bool] = None,
         mtp: Optional[bool] = None, tuning: Optional[Tuning] = None) -> tuple[HybridExl2Engine, dict[str, str]]:
    """Load a Qwen3.5-MoE EXL2 folder. device: "cuda" (default, needs a GPU) or "cpu" (tests: the
    projections dequantized). window: rollback rows (default from the draft options). dtype: activations
    (float16 on CUDA, as exllamav2's GEMM takes; float32 on the CPU). host_experts: experts' codes in
    host memory for offload (default: as the budgets decide, CUDA only). mtp: load the folder's MTP head
    (default: when the draft options choose "mtp"; it holds one layer's weights, its experts in VRAM; left
    out, it is read on first use where there is room). tuning: the engine tuning (default: the process's)."""
    options = options or LoadOptions()
    return run(_Loading(Path(path), options, progress or (lambda stage, message, done, total: None), device,
                        window or rollback_window(options), dtype, graphs, host_experts,
                        options.draft.mode == "mtp" if mtp is None else mtp, tuning or current_tuning()))


class _Loading:
    """One load in progress, step by step (gpu_engine.Loading, as the exllamav2 engine's); what the steps
    opened, so that `close` frees it on failure."""

    def __init__(self, path: Path, options: LoadOptions, progress: ProgressFn, device: Optional[str], window: int,
                 dtype: Optional[torch.dtype], graphs: Optional[bool], host_experts: Optional[bool], mtp: bool,
                 tuning: Tuning):
        self.path, self.options, self.off, self.progress = path, options, options.offload, progress
        self.device, self.window, self.dtype = device, window, dtype
        self.graphs, self.host_experts, self.mtp, self.tuning = graphs, host_experts, mtp, tuning
        self.applied: dict[str, str] = {}
        self.step = "check_folder"
        self.folder = self.spec = self.setup = self.model = self.head = self.cache = self.manager = None
        self.engine: Optional[HybridExl2Engine] = None
        self.context = 0

    def steps(self) -> list[str]:
        return ["check_folder", "read_config", "plan_offload", "build_model", "allocate_cache", "place_experts",
                "make_engine", "settle_expert_path"]

    def run_step(self, name: str) -> None:
        getattr(self, name)()

    def what(self, step: str) -> str:
        if step in ("build_model", "allocate_cache", "place_experts"):
            return f"the model's weights and a {self.off.context_length}-token cache"
        return {"make_engine": "the decode graphs", "settle_expert_path": "the expert path's trial and the first "
                "decode graphs"}.get(step, "the load's first checks on the GPU")

    def vram_cap(self) -> Optional[int]:
        return self.setup.vram.total_bytes if self.setup is not None and self.setup.capped else None

    def check_folder(self) -> None:
        """The device (a GPU unless asked otherwise; its kernels built), the folder Qwen3.5-MoE in EXL2."""
        from runtime import qwen35
        from runtime.modelfolder import ModelFolder
        self.device = _device(self.device)
        self.cuda = self.device.type == "cuda"
        self.dtype = self.dtype or (torch.float16 if self.cuda else torch.float32)
        if self.cuda:
            from runtime.backends.exl2_kernels import build_kernels
            build_kernels(self.progress)
        self.progress("validate", f"Checking {self.path.name}", 0, 1)
        folder = self.folder = ModelFolder(self.path)
        if folder.config["architectures"][0] not in qwen35.ARCHITECTURES:
            raise UnsupportedArchitecture(folder.path, f"{folder.info.architecture} is not Qwen3.5-MoE: this engine "
                                                       "runs Qwen3.5-MoE only")
        if not folder.info.is_exl2:
            raise UnsupportedArchitecture(folder.path, "not an EXL2 folder: the GPU engine runs EXL2-quantized "
                                                       "models (the CPU reference engine runs this one)")

    def read_config(self) -> None:
        from runtime.reference import qwen35 as reference35
        off, folder = self.off, self.folder
        self.spec = reference35.Spec.from_config(folder.config, str(folder.path / "config.json"))
        self.context = min(off.context_length, self.spec.max_positions)
        self.applied.update({
            "offload.context_length": "applied" if self.context == off.context_length else
            f"applied: capped at {self.context}, the model's max_position_embeddings",
            "offload.kv_cache": "applied" if off.kv_cache == "fp16" else
            f"ignored: the Qwen3.5 engine keeps its attention cache in {str(self.dtype).removeprefix('torch.')}"})

    def plan_offload(self) -> None:
        self.setup = _prepare_offload(self.folder, self.spec, self.off, self.cuda, self.host_experts, self.applied,
                                      self.tuning)

    def build_model(self) -> None:
        """Every layer from the folder (the experts' codes into page-locked memory under offload), the MTP head."""
        setup, progress, spec = self.setup, self.progress, self.spec
        offload = setup is not None and setup.offload
        progress("load", "Loading weights", 0, spec.layers + 1)
        self.model = hybrid_layers.load(
            self.folder, spec, self.device, self.dtype, self.context, host=setup.arena if offload else None,
            on_host=(lambda what, n: setup.ram.reserve(what, n, "raise the RAM budget or the VRAM budget"))
            if offload else None,
            progress=lambda done, total: progress("load", "Loading weights", done, total), tuning=self.tuning)
        if self.mtp:
            progress("load", "Loading the multi-token-prediction head", 0, 1)
            self.head = hybrid_mtp.load(self.folder, spec, self.device, self.dtype)

    def allocate_cache(self) -> None:
        progress = self.progress
        progress("load", "Allocating the cache", 0, 1)
        self.cache = HybridCache(self.spec, self.context, self.window, self.dtype, self.device)
        if self.cuda:
            from runtime.backends import gdn_kernels
            from runtime.backends.quant_linear import settle_autotune
            progress("load", "Tuning GPU kernels", 0, 1)
            settle_autotune(self.model.linears())
            gdn_kernels.warm(self.spec, self.device, self.dtype)   # fla's autotuning here, not in the first prefill
            progress("load", "Tuning GPU kernels", 1, 1)

    def place_experts(self) -> None:
        """The VRAM ledger and the hot experts (gpu_offload.start, as the exllamav2 engine's)."""
        if self.setup is not None:
            layers = self.model.expert_layers()
            self.manager = gpu_offload.start(self.setup, layers, self.path, prefill_scratch(self.spec, layers),
                                             self.progress)

    def make_engine(self) -> None:
        from runtime import qwen35
        info, spec = self.folder.info, self.spec
        model_info = ModelInfo(name=info.name, path=str(info.path), architecture=info.architecture,
                               vocab_size=spec.vocab, context_length=self.context, num_layers=spec.layers,
                               num_experts=spec.experts, experts_per_token=spec.top_k,
                               bits_per_weight=info.bits_per_weight,
                               extra={"engine": "hybrid", "rollback_window": self.window, "device": str(self.device),
                                      "num_params": info.num_params, "active_params": info.active_params})
        graphs = self.cuda if self.graphs is None else self.graphs
        self.engine = HybridExl2Engine(model_info, spec, self.model, self.cache, self.manager, self.setup,
                                       graphs=bool(graphs and self.cuda), mtp_head=self.head)
        if self.head is None and qwen35.has_mtp(set(info.shard_of)):
            self.engine.mtp_source = self.folder.path     # read on first use (hybrid_mtp.MtpHooks)
        self.folder.close()                               # every tensor is read

    def settle_expert_path(self) -> None:
        """Under offload on a GPU: the routing prior where the model has no saved statistics, then the CPU expert
        path (saved for this model, budget and machine, else both paths timed), then the graphs; else the
        graphs."""
        if self.manager is not None and self.cuda:
            from runtime.backends.expert_path import settle_cpu_path
            settle_cpu_path(self.engine, self.progress, load=True)
            self.applied.update(self.setup.applied)
            self.manager.forget_warmup()       # the prior's and the trial's staged bytes are no answer's
        elif self.engine.graphs is not None:
            self.engine.prepare_graphs(self.progress)
        self.applied["offload.backend"] = "applied"

    def close(self) -> None:
        """The one cleanup path: free what the steps opened, the engine or its parts."""
        if self.folder is not None:
            self.folder.close()
        if self.engine is not None:
            self.engine.close()                # the model, the manager, the budgets
        else:
            try:
                if self.manager is not None:
                    self.manager.close()
            finally:
                gc.collect()
                if self.setup is not None:
                    self.setup.release()
                gpu_offload.return_cached_memory()
        self.engine = self.manager = self.cache = self.model = self.head = self.setup = self.folder = None


def prefill_scratch(spec, layers: list) -> int:
    """VRAM a prefill chunk of up to 2048 rows needs beyond the weights and the cache (MoE intermediates, the
    DeltaNet's chunked rule, the logits of a verify, a margin): the offload's reserve."""
    return (2048 * (spec.top_k * (layers[0].w1.out_features * 2 + spec.hidden * 4) + spec.hidden * 32
                    + spec.conv_channels * 8) + 16 * spec.vocab * 4 + (512 << 20))


def _prepare_offload(folder, spec, off, cuda: bool, host_experts: Optional[bool], applied: dict, tuning: Tuning):
    """Budgets (runtime/backends/gpu_offload.prepare) on CUDA; None on the CPU (unless host_experts,
    for tests: every expert's codes in host memory, placed by hand)."""
    from types import SimpleNamespace
    if not cuda:
        for key in ("vram_budget_gb", "ram_budget_gb", "placement", "cpu_threads"):
            applied[f"offload.{key}"] = "ignored: the hybrid engine on the CPU keeps every weight in RAM"
        if not host_experts:
            return None
        from runtime.backends.gpu_offload import OffloadSetup
        from runtime.experts.pack import HostArena
        return OffloadSetup(MemoryBudget(1 << 50), MemoryBudget(1 << 50), HostArena(1 << 20), "stream", False,
                            tuning=tuning)
    from runtime.backends import gpu_offload
    config = SimpleNamespace(num_hidden_layers=spec.layers, num_experts=spec.experts, hidden_size=spec.hidden,
                             intermediate_size=folder.config["moe_intermediate_size"])
    if host_experts is False:
        off = dataclasses.replace(off, placement="vram")
    setup = gpu_offload.prepare(folder.path, config, off, own_moe=True, tuning=tuning)
    if host_experts and not setup.offload:
        raise EngineError("offload was asked for but the budgets keep every expert in VRAM")
    applied.update(setup.applied)
    return setup
