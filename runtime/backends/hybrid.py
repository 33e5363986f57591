"""The hybrid engine: Qwen3.5-MoE (Gated DeltaNet + gated attention + MoE with a shared expert) from an
EXL2 folder, on CUDA (exllamav2's quantized matmul, our expert kernels and offload) or on the CPU (the
same code with the projections dequantized: how its tests run without a GPU).

    load(path, options, progress) -> (HybridExl2Engine, applied)       as runtime/backends/exl2.load

exllamav2 has neither linear attention nor shared experts, so this engine builds the model itself
(runtime/backends/hybrid_layers.py) and uses exllamav2 only for its quantized GEMM
(runtime/backends/quant_linear.py). The routed experts are our `ExpertLayer`s: with offload the
manager (runtime/experts/manager.py) places them as it does for the exllamav2 engine.

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
The CPU expert path is decided as for the exllamav2 engine (runtime/backends/exl2_placement.py, shared:
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

from runtime.backends import exl2_offload, hybrid_layers, hybrid_mtp
from runtime.backends.hybrid_mtp import MtpHead, MtpHooks
from runtime.backends.exl2_graph import answer_plan, bucket, capture_position, warm_plan
from runtime.backends.exl2_placement import StepClock, idle_trial_step
from runtime.backends.hybrid_graphs import StepGraphs
from runtime.backends.hybrid_state import HybridCache
from runtime.engine import Engine, ModelInfo, ProgressFn
from runtime.errors import (BadRequest, ContextOverflow, CudaUnavailable, EngineError, InvalidModel, NoModel,
                            OutOfMemory, UnsupportedArchitecture)
from runtime.experts.budget import BudgetError, MemoryBudget
from runtime.experts.experiment import NO_EXPERIMENT
from runtime.options import LoadOptions
from runtime.tuning import Tuning, current as current_tuning
from runtime.reference.mtp import MtpCache

REPLAY_CHUNK = 512          # tokens per forward when a truncate replays the kept tokens
PREFILL_CHUNK = 512         # rows per forward at most (longer ones are cut)
MIN_WINDOW = 2              # rows of rollback kept without drafting (a regenerate's one-token step back)


class HybridExl2Engine(MtpHooks, Engine):
    def __init__(self, info: ModelInfo, spec, model: hybrid_layers.HybridModel, cache: HybridCache,
                 offload=None, setup=None, graphs: bool = False, mtp_head: Optional[MtpHead] = None):
        exl2_offload.engine_opened(self)
        self.info, self.spec, self.model, self.cache = info, spec, model, cache
        self.refused_tokens = spec.media_tokens      # refused as input (`_check`), so never sampled
        self.backend = "cuda" if model.device.type == "cuda" else "cpu"
        self.offload = offload          # runtime/experts/manager.OffloadManager, or None: all experts resident
        self.setup = setup              # runtime/backends/exl2_offload.OffloadSetup (budgets), or None
        self.tokens: list[int] = []     # what the cache holds: replayed by a truncate before the snapshots
        self.static = False             # short forwards with fixed shapes (always on under graphs)
        self.graphs: Optional[StepGraphs] = StepGraphs(self) if graphs else None
        self.graph_error: Optional[str] = None
        self._bytes_per_token = model.nbytes_per_token()
        self._expert_bytes_per_token = model.expert_bytes_per_token()
        self.mtp_head = mtp_head        # the multi-token-prediction head (hybrid_mtp.py), when the load asked for it
        self.mtp = MtpCache(spec, cache.capacity, model.dtype, model.device) if mtp_head is not None else None
        self.mtp_on = False             # the head follows the forwards (a drafter asked for it)
        self.experiment = NO_EXPERIMENT  # benchmarks and tests only: set_experiment
        # the CPU expert path's decision under offload (runtime/backends/exl2_placement.py, shared)
        self.path_judge = None           # runtime/experts/path_judge.PathJudge, once decided at load
        self._trial = None               # its measurement in progress (idle time): a generator of steps
        self.decision_save = None        # (file, key) where a measured decision is saved
        self._clock = StepClock()        # one-row steps' times for the judge's drift check

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
            self.offload.begin_forward(t)
        logged = cache.begin(t, at)
        try:
            if logged and self.graphs is not None and (self.offload is None or not self.offload.stage_worth(t)):
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

    def place_experts(self, resident: list[list[int]]) -> None:
        """Tests and benchmarks: these experts of each layer in VRAM slots, the others read from host memory."""
        if self.offload is None:
            raise EngineError("place_experts needs a model loaded with expert offload")
        self._drop_graphs()
        self.offload.apply(resident)

    # -- benchmarks and tests (bench/offload.py drives both GPU engines through these) ------------

    @property
    def max_draft_tokens(self) -> int:
        """Drafts a verify may carry: its rows (drafts + 1) must fit the snapshot ring to be rolled back
        (speculative.make_decoder caps a request's draft tokens here)."""
        return self.cache.window - 1

    @property
    def budget(self):
        """The load's budgets (exl2_offload.OffloadSetup), as the expert-path trial names them."""
        return self.setup

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

    def set_experiment(self, experiment) -> None:
        """Run the MoE layers under `experiment` (runtime/experts/experiment.py) from the next forward;
        captured graphs are dropped where it changes what they captured (the naive baseline runs none:
        the benchmark sets the graphs aside)."""
        from runtime.experts.experiment import apply_experiment
        if self.experiment.changes_graphs(experiment):
            self._drop_graphs()
        try:
            apply_experiment(experiment, self.model.expert_layers(), self.offload)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.experiment = experiment

    def set_vram_budget(self, vram_budget_gb: float) -> None:
        """Place the offloaded experts again for another VRAM budget, without reloading."""
        if self.offload is None or self.setup is None:
            raise EngineError("set_vram_budget needs a model loaded with expert offload")
        from runtime.backends.exl2_placement import set_vram_budget
        set_vram_budget(self, vram_budget_gb)

    def recheck_placement(self, progress: ProgressFn = lambda *a: None, measure: bool = True) -> None:
        """Decide the CPU expert path again now, timing both (benchmarks: after the routing changed)."""
        if self.offload is not None:
            from runtime.backends.exl2_placement import settle_cpu_path
            settle_cpu_path(self, progress, measure)

    def reset_graphs(self) -> None:
        """After changing what a step does by hand: graphs captured again."""
        self._drop_graphs()

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
        if self.offload is not None:
            out.update(self.offload.telemetry().as_dict())
            if self.path_judge is not None:
                out["placement_decision"] = self.path_judge.telemetry()
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
            exl2_offload.engine_closed(self)
            gc.collect()                              # (before the page-locked experts go)
            if self.setup is not None:
                self.setup.release()
            exl2_offload.return_cached_memory()


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
    tuning = tuning or current_tuning()
    from runtime import qwen35
    from runtime.modelfolder import ModelFolder
    from runtime.reference import qwen35 as reference35

    options = options or LoadOptions()
    progress = progress or (lambda stage, message, done, total: None)
    off = options.offload
    dev = _device(device)
    cuda = dev.type == "cuda"
    dtype = dtype or (torch.float16 if cuda else torch.float32)
    if cuda:
        from runtime.backends.exl2_kernels import build_kernels
        build_kernels(progress)
    progress("validate", f"Checking {Path(path).name}", 0, 1)
    folder = ModelFolder(path)
    setup = engine = None
    try:
        info = folder.info
        if folder.config["architectures"][0] not in qwen35.ARCHITECTURES:
            raise UnsupportedArchitecture(folder.path, f"{info.architecture} is not Qwen3.5-MoE: this engine runs "
                                                       "Qwen3.5-MoE only")
        if not info.is_exl2:
            raise UnsupportedArchitecture(folder.path, "not an EXL2 folder: the GPU engine runs EXL2-quantized "
                                                       "models (the CPU reference engine runs this one)")
        spec = reference35.Spec.from_config(folder.config, str(folder.path / "config.json"))
        context = min(off.context_length, spec.max_positions)
        window = window or rollback_window(options)
        applied = {"offload.context_length": "applied" if context == off.context_length else
                   f"applied: capped at {context}, the model's max_position_embeddings",
                   "offload.kv_cache": "applied" if off.kv_cache == "fp16" else
                   f"ignored: the Qwen3.5 engine keeps its attention cache in {str(dtype).removeprefix('torch.')}"}
        setup = _prepare_offload(folder, spec, off, cuda, host_experts, applied, tuning)
        progress("load", "Loading weights", 0, spec.layers + 1)
        model = hybrid_layers.load(
            folder, spec, dev, dtype, context, host=setup.arena if setup is not None and setup.offload else None,
            on_host=(lambda what, n: setup.ram.reserve(what, n, "raise the RAM budget or the VRAM budget"))
            if setup is not None and setup.offload else None,
            progress=lambda done, total: progress("load", "Loading weights", done, total), tuning=tuning)
        head = None
        if options.draft.mode == "mtp" if mtp is None else mtp:
            progress("load", "Loading the multi-token-prediction head", 0, 1)
            head = hybrid_mtp.load(folder, spec, dev, dtype)
        progress("load", "Allocating the cache", 0, 1)
        cache = HybridCache(spec, context, window, dtype, dev)
        if cuda:
            from runtime.backends.quant_linear import settle_autotune
            progress("load", "Tuning GPU kernels", 0, 1)
            settle_autotune(model.linears())
            from runtime.backends import gdn_kernels
            gdn_kernels.warm(spec, dev, dtype)             # fla's autotuning here, not in the first prefill
            progress("load", "Tuning GPU kernels", 1, 1)
        manager = _start_offload(setup, model, folder.path, off, progress) if setup is not None else None
        model_info = ModelInfo(name=info.name, path=str(info.path), architecture=info.architecture,
                               vocab_size=spec.vocab, context_length=context, num_layers=spec.layers,
                               num_experts=spec.experts, experts_per_token=spec.top_k,
                               bits_per_weight=info.bits_per_weight,
                               extra={"engine": "hybrid", "rollback_window": window, "device": str(dev),
                                      "num_params": info.num_params, "active_params": info.active_params})
        use_graphs = cuda if graphs is None else graphs
        engine = HybridExl2Engine(model_info, spec, model, cache, manager, setup, graphs=bool(use_graphs and cuda),
                                  mtp_head=head)
        if head is None and qwen35.has_mtp(set(folder.info.shard_of)):
            engine.mtp_source = folder.path               # read on first use (hybrid_mtp.MtpHooks)
        try:
            if manager is not None and cuda:
                # the routing prior where the model has no saved statistics, then the CPU expert path
                # (saved for this model, budget and machine, else both paths timed), then the graphs
                from runtime.backends.exl2_placement import settle_cpu_path
                settle_cpu_path(engine, progress, load=True)
                applied.update(setup.applied)
                manager.forget_warmup()       # the prior's and the trial's staged bytes are no answer's
            elif engine.graphs is not None:
                engine.prepare_graphs(progress)
        except BaseException:
            engine.close()                    # the model, the manager, the budgets
            raise
        applied["offload.backend"] = "applied"
        return engine, applied
    except BudgetError as e:
        from runtime.backends.exl2_offload import budget_error
        err = budget_error(e)
    except MemoryError as e:
        err = OutOfMemory(f"not enough host memory to load {folder.info.name}", str(e))
    except torch.cuda.OutOfMemoryError as e:
        err = OutOfMemory(f"not enough GPU memory to load {folder.info.name} with a {off.context_length}-token "
                          "context", str(e))
    except (ValueError, KeyError) as e:
        err = InvalidModel(folder.path, f"could not load the model: {type(e).__name__}: {e}")
    finally:
        folder.close()
        if engine is None and setup is not None:
            setup.release()
    raise err from None


def _prepare_offload(folder, spec, off, cuda: bool, host_experts: Optional[bool], applied: dict, tuning: Tuning):
    """Budgets (runtime/backends/exl2_offload.prepare) on CUDA; None on the CPU (unless host_experts,
    for tests: every expert's codes in host memory, placed by hand)."""
    from types import SimpleNamespace
    if not cuda:
        for key in ("vram_budget_gb", "ram_budget_gb", "placement", "cpu_threads"):
            applied[f"offload.{key}"] = "ignored: the hybrid engine on the CPU keeps every weight in RAM"
        if not host_experts:
            return None
        from runtime.backends.exl2_offload import OffloadSetup
        from runtime.experts.pack import HostArena
        return OffloadSetup(MemoryBudget(1 << 50), MemoryBudget(1 << 50), HostArena(1 << 20), "stream", False,
                            tuning=tuning)
    from runtime.backends import exl2_offload
    config = SimpleNamespace(num_hidden_layers=spec.layers, num_experts=spec.experts, hidden_size=spec.hidden,
                             intermediate_size=folder.config["moe_intermediate_size"])
    if host_experts is False:
        off = dataclasses.replace(off, placement="vram")
    setup = exl2_offload.prepare(folder.path, config, off, own_moe=True, tuning=tuning)
    if host_experts and not setup.offload:
        raise EngineError("offload was asked for but the budgets keep every expert in VRAM")
    applied.update(setup.applied)
    return setup


def _start_offload(setup, model, path: Path, off, progress):
    """After the weights and the cache: the VRAM ledger, then the offload manager places hot experts."""
    if not setup.offload:
        if model.device.type == "cuda" and setup.vram.fits(torch.cuda.memory_allocated()):
            setup.vram.reserve("weights and cache", torch.cuda.memory_allocated())
        return None
    from runtime.experts.manager import OffloadManager
    layers = model.expert_layers()
    cuda = model.device.type == "cuda"
    if cuda:
        setup.vram.reserve("weights and cache", torch.cuda.memory_allocated(),
                           "lower the context length or raise the VRAM budget")
        s = model.spec
        scratch = 2048 * (s.top_k * (layers[0].w1.out_features * 2 + s.hidden * 4) + s.hidden * 32
                          + s.conv_channels * 8) + 16 * s.vocab * 4 + (512 << 20)
        setup.vram.reserve("prefill scratch", scratch, "lower the context length")
        from runtime.backends.routing_prior import saved_statistics
        stats, stats_file, setup.stats_warning, prior = saved_statistics(path, len(layers), layers[0].num_experts,
                                                                         route_prior=setup.tuning.route_prior)
    else:
        stats_file, stats, prior = None, None, None
    manager = OffloadManager(layers, setup.vram, setup.policy if cuda else "stream", stats, stats_file,
                             cpu_threads=setup.cpu_threads, ram=setup.ram if cuda else None,
                             lend_staging=setup.tuning.lend_staging)
    manager.prior_reason = prior                  # measured once the engine is made (routing_prior.py)
    if cuda:
        from runtime.backends.exl2_decisions import saved_off
        # no CPU copies that a saved decision drops at once (again at the routing prior's placement)
        manager.cpu.saved_off = manager.saved_off = saved_off(path, setup)
        manager.on_stage = lambda message: progress("load", message, 0, 1)
        try:
            manager.place()
        except BudgetError:
            manager.close()
            raise
        finally:
            manager.on_stage = lambda message: None
        from runtime.backends.exl2_offload import cpu_path_applied
        cpu_path_applied(setup, manager)
    return manager
