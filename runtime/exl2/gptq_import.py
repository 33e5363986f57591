"""Import a GPTQ-family checkpoint (GPTQ / GPTQModel, AutoRound, AWQ) into an EXL2 model folder, layer by layer.

    moedesk-cli import PATH_OR_REPO [--out DIR] [--bpw B] [--width W] [--head-bits H] [--no-calibrate]
                                    [--device auto|cpu|cuda] [--threads N]

PATH_OR_REPO: a model folder, or a Hub repository (owner/name), downloaded first by the app's resumable
download code into the models folder's `.import-sources/` (pause with Ctrl+C, run the command again to resume).

Flow, per decoder layer (then the head, Qwen3.5's MTP head, and the assembly), as `moedesk-cli convert` works:
1. The layer's quantized linears (qweight / qzeros / scales / g_idx) are repacked into EXL2 tensors
   (gptq_tensors.py) with exact scales (q_scale_exact): bit-exact for symmetric builds, and asymmetric ones at
   --width above their bits (elsewhere the least error found); exllamav2's own Q matrix, which reads the linears
   other than the routed experts on a GPU, takes the nearest EXL2 steps (gptq_source.py). The error is summed
   and reported (quantization_config["import"], and the last line of the log).
2. The linears the build kept in 16 bits (Qwen3.5's attention, Gated DeltaNet projections and shared expert;
   whatever a build left unquantized) are quantized at `--bpw` stored bits per weight (default
   IMPORT_BPW), through the converter's calibration and GPTQ, with the imported weights in the layer while it
   runs on the calibration text, or (`--no-calibrate`) rounded to nearest without any forward pass.
3. Norms, routers and small gates are kept in fp16.
Memory: one layer's weights in float32 (plus, calibrating, what convert.py's docstring lists). Output on disk: the
imported linears at their width (4-bit codes in groups of 32: ~4.6 stored bits per weight with exact scales, about
the build's own size; ~4.1 without), the rest at --bpw.

Resume and safety as the converter's: a hidden staging folder `.NAME.partial` next to the output; after each layer
its tensors go to `layer-NNNNN.safetensors`, the calibration's hidden states to `hidden-NNNNN.safetensors`, and
`state.json` records it; the same command continues after the last finished layer; the model folder appears
only once complete. The log line of each layer says how long the rest should take.

--width: the EXL2 width of the imported linears (default: the build's own, 4 or 8; 5, 6 or 8 for less error
where the steps are searched: asymmetric builds, exact at their bits + 1). The build's group size is kept (EXL2
groups of the same rows).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from safetensors import safe_open

from runtime import cpu_load, gptq_spec, qwen35
from runtime.options import (CONVERT_CALIBRATION_ROWS, CONVERT_CALIBRATION_SEQ_LEN, CONVERT_HEAD_BITS, IMPORT_BPW,
                             IMPORT_WIDTHS)

from . import allocate, caldata
from . import convert as cv
from . import format as fmt
from .calibrate import DEFAULT_HESSIAN_BUDGET
from .gptq import DEFAULT_DAMP, HessianAccumulator, quantize_gptq
from .gptq_source import GROUP_SIZE, ImportFailed, Source, calibrated_layer, hybrid_jobs, rtn_tensors
from .gptq_tensors import RepackStats
from .writer import exllamav2_config, quantization_config

Say = Callable[[str], None]
Progress = Callable[[int, int], None]


@dataclass
class Plan:
    """One import's settings (what a resume must match) and where it runs."""
    bits: float
    width: int | None
    head_bits: int
    calibrate: bool
    rows: int
    seq_len: int
    damp: float
    device: str
    hessian_budget: int
    exact: bool = True


def import_model(source_dir: str | os.PathLike, out_dir: str | os.PathLike, bits: float = IMPORT_BPW, *,
                 width: int | None = None, head_bits: int = CONVERT_HEAD_BITS, calibrate: bool = True,
                 calibration_text=None, calibration_source: str = "calibration", rows: int = CONVERT_CALIBRATION_ROWS,
                 seq_len: int = CONVERT_CALIBRATION_SEQ_LEN, damp: float = DEFAULT_DAMP, device: str = "cpu",
                 say: Say = print, progress: Progress | None = None, stop_after_layers: int | None = None,
                 hessian_budget: int = DEFAULT_HESSIAN_BUDGET, exact: bool = True) -> Path:
    """Import the GPTQ-family folder `source_dir` into an EXL2 folder at `out_dir`; -> out_dir.

    `bits`: stored bits per weight of the linears the build kept in 16 bits; `width`: EXL2 code width of the
    imported ones (None: the build's); `exact`: exact scales where the codes fit (False: the steps searched, as
    before they existed). `progress(done, total)` after each layer (total: the decoder layers).
    `stop_after_layers` stops (ImportFailed) once that many layers are done in this run: what a kill leaves."""
    if not cv.STORED_BPW_MIN <= bits <= cv.STORED_BPW_MAX:
        raise ImportFailed(f"bits per weight {bits} is outside {cv.STORED_BPW_MIN}..{cv.STORED_BPW_MAX}")
    if width is not None and width not in IMPORT_WIDTHS:
        raise ImportFailed(f"width {width} is not one of {', '.join(map(str, IMPORT_WIDTHS))}")
    fmt.resolve_bits(head_bits, name="head_bits")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ImportFailed(f"{out_dir}: already exists; choose another output folder or remove it")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = Plan(float(bits), width, int(head_bits), calibrate, rows, seq_len, damp, device, hessian_budget, exact)
    source = Source(source_dir, width, device, exact)
    if calibrate and calibration_text is None:
        calibration_text, calibration_source, note = caldata.default_texts()
        if note:
            say(f"note: {note}")
    return _Import(source, out_dir, plan, say, progress).run(calibration_text, calibration_source, stop_after_layers)


class _Import:
    """One import in progress: the staging folder, the calibration state, the layer loop."""

    def __init__(self, source: Source, out_dir: Path, plan: Plan, say: Say, progress: Progress | None):
        self.source, self.out_dir, self.plan, self.say, self.progress = source, out_dir, plan, say, progress
        self.hybrid = source.arch in qwen35.ARCHITECTURES
        self.n_layers = source.flat["num_hidden_layers"]
        self.p0 = qwen35.prefix(source.flat) if self.hybrid else "model"
        self.staging = cv.staging_dir(out_dir)
        self.ids = self.hidden = self.parts = self.layers = None
        self.measured = False

    # -- the whole run ----------------------------------------------------------------------------

    def run(self, text, text_source: str, stop_after: int | None) -> Path:
        state = self._start(text)
        if self.plan.calibrate:
            self._calibration(text, text_source, state)
        t0, done_now = time.perf_counter(), 0
        for i in range(state["layers_done"], self.n_layers):
            if stop_after is not None and done_now >= stop_after:
                raise ImportFailed(f"import stopped after layer {i} of {self.n_layers}; run it again to resume")
            tensors = self._layer(i, state)
            self._save_layer(i, tensors, state)
            done_now += 1
            left = (time.perf_counter() - t0) / done_now * (self.n_layers - i - 1)
            self.say(f"layer {i + 1}/{self.n_layers} imported, about {_minutes(left)} left")
            if self.progress is not None:
                self.progress(i + 1, self.n_layers)
        extra = self._head_and_mtp(state)
        return self._assemble(state, extra)

    def _start(self, text) -> dict:
        p = self.plan
        settings = {"source": str(self.source.path.resolve()), "bits": p.bits, "width": p.width,
                    "head_bits": p.head_bits, "calibrate": p.calibrate, "group_size": GROUP_SIZE,
                    "device": p.device.split(":")[0], "exact": p.exact}
        if p.calibrate:
            settings.update(rows=p.rows, seq_len=p.seq_len, damp=p.damp, calibration_sha256=caldata.fingerprint(text))
        state = {"settings": settings, "layers_done": 0, "rows_used": 0, "repack": RepackStats().state(),
                 "stats": {"experts_routed": 0, "experts_all_token_fallback": 0}}
        if (self.staging / "state.json").is_file():
            old = json.loads((self.staging / "state.json").read_text())
            if old.get("settings") != settings:
                raise ImportFailed(f"{self.staging}: an interrupted import with other settings is there; run it again "
                                   f"with the same settings to resume, or remove that folder to start over")
            state = old
            self.say(f"resuming after layer {state['layers_done']} of {self.n_layers}")
        else:
            self.out_dir.parent.mkdir(parents=True, exist_ok=True)
            self.staging.mkdir(exist_ok=True)
        self.source.stats = RepackStats(**state["repack"])
        # the output is about the build's size (its 16-bit linears shrink, the layer files become the shards)
        cv._check_disk(self.staging, self.source.total_bytes(), "import this model")
        return state

    # -- calibration --------------------------------------------------------------------------------

    def _calibration(self, text, text_source: str, state: dict) -> None:
        """Token ids, the first hidden states (or the resumed ones), the layer machinery."""
        from transformers import AutoTokenizer
        p, k = self.plan, state["layers_done"]
        self.ids = cv.calibration_ids(AutoTokenizer.from_pretrained(self.source.path), text, p.rows, p.seq_len,
                                      text_source)
        allocation = allocate.choose_allocation(self.ids.numel(), None)
        self.measured = allocation["widths"] == "measured"
        self.say(f"bit allocation of the 16-bit linears: {allocation['widths']} ({allocation['reason']})")
        if k == 0:
            embed = self.source.get_raw(f"{self.p0}.embed_tokens.weight")
            self.hidden = torch.nn.functional.embedding(self.ids, embed).float()
            state["rows_used"] = self.ids.shape[0]
        else:
            with safe_open(str(self.staging / f"hidden-{k:05d}.safetensors"), "pt") as f:
                self.hidden = f.get_tensor("hidden")
        self.hidden = self.hidden.to(p.device)
        if self.hybrid:
            from .convert_qwen35 import HybridLayers
            self.layers = HybridLayers(self.source, p.seq_len, ImportFailed, p.device)
        else:
            self.parts = _transformers_parts(self.source, p, self.measured)

    # -- one layer ----------------------------------------------------------------------------------

    def _layer(self, i: int, state: dict) -> dict[str, torch.Tensor]:
        prefix = f"{self.p0}.layers.{i}."
        imported = self._import(prefix)
        p = self.plan
        if not p.calibrate:
            tensors = rtn_tensors(self.source, prefix, p.bits, set(imported))
        elif self.hybrid:
            jobs = hybrid_jobs(set(imported), p.bits, p.damp, state["stats"], self.measured, p.hessian_budget)
            tensors, self.hidden = self.layers.quantize_layer(i, self.hidden, jobs)
        else:
            tensors, self.hidden = calibrated_layer(self.source, self.parts, i, self.hidden, p.bits, imported,
                                                    state["stats"])
        tensors.update({k: v for t in imported.values() for k, v in t.items()})
        self.source.forget()
        return tensors

    def _import(self, prefix: str) -> dict[str, dict[str, torch.Tensor]]:
        """{linear: its EXL2 tensors} of the quantized linears under prefix (a layer's experts all or none)."""
        prefixes = self.source.under(prefix)
        experts = [q for q in self.source.shapes if q.startswith(prefix) and ".experts." in q]
        got = [q for q in experts if q in prefixes]
        if got and len(got) != len(experts):
            raise ImportFailed(f"{prefix[:-1]}: {len(got)} of its {len(experts)} expert linears are quantized; the "
                               f"import takes a layer's experts all quantized or all in 16 bits")
        tensors = self.source.import_linears(prefixes)
        return {q: {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == q} for q in prefixes}

    def _save_layer(self, i: int, tensors: dict, state: dict) -> None:
        st = self.staging
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        need += self.hidden.numel() * 4 if self.hidden is not None else 0
        cv._check_disk(st, need, f"write layer {i}")
        try:
            cv._atomic_save(tensors, st / f"layer-{i:05d}.safetensors")
            if self.hidden is not None:
                cv._atomic_save({"hidden": self.hidden.cpu()}, st / f"hidden-{i + 1:05d}.safetensors")
        except OSError as e:
            raise ImportFailed(f"{st}: writing layer {i} failed ({e}); free space and run again to resume") from e
        state["layers_done"] = i + 1
        state["repack"] = self.source.stats.state()
        cv._write_state(st, state)
        (st / f"hidden-{i:05d}.safetensors").unlink(missing_ok=True)

    # -- the head, the MTP head, the folder ---------------------------------------------------------

    def _head_and_mtp(self, state: dict) -> dict[str, torch.Tensor]:
        src, p, out = self.source, self.plan, {}
        tied = bool(src.flat.get("tie_word_embeddings", False))
        if "lm_head" in src.quantized:
            out.update(src.import_linears(["lm_head"]))
        elif not tied and self.hidden is not None:
            acc = HessianAccumulator(self.hidden.shape[-1], device=p.device)
            with torch.no_grad():
                acc.add(self.layers.head_input(self.hidden) if self.hybrid else self._norm(self.hidden))
            head = quantize_gptq(src.get("lm_head.weight"), acc.h, p.head_bits, GROUP_SIZE, damp=p.damp,
                                 tokens=acc.tokens, name="lm_head")
            out.update({f"lm_head.{k}": v for k, v in head.items()})
        elif not tied:
            out.update({f"lm_head.{k}": v for k, v in fmt.quantize(src.get("lm_head.weight"), p.head_bits,
                                                                   GROUP_SIZE, name="lm_head").items()})
        if self.hybrid and qwen35.has_mtp(set(src.shard_of)):
            imported = src.under(qwen35.MTP + ".")
            tensors = src.import_linears(imported)
            if p.calibrate:
                jobs = hybrid_jobs(set(imported), p.bits, p.damp, state["stats"], self.measured, p.hessian_budget)
                out.update(self.layers.quantize_mtp(self.ids, self.hidden, jobs))
            else:
                out.update(rtn_tensors(src, qwen35.MTP + ".", p.bits, set(imported)))
            out.update(tensors)
            src.forget()
        return out

    def _norm(self, hidden: torch.Tensor) -> torch.Tensor:
        cfg = self.parts.cfg
        norm = self.parts.norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps).to(self.plan.device)
        norm.weight.data = self.source.get("model.norm.weight").to(self.plan.device)
        return norm(hidden)

    def _assemble(self, state: dict, extra: dict[str, torch.Tensor]) -> Path:
        """The model folder from the layer files (renamed into shards, not copied: the disk holds the model once)
        and one shard of the embeddings, final norm, head and MTP head; idempotent where a run stopped in it."""
        src, st = self.source, self.staging
        assembled, plan_file = st / "model", st / "assembly.json"
        if plan_file.is_file():                              # an earlier run stopped while renaming: undo
            for final, layer in json.loads(plan_file.read_text()).items():
                if (assembled / final).is_file():
                    os.replace(assembled / final, st / layer)
        shutil.rmtree(assembled, ignore_errors=True)
        assembled.mkdir()
        embed, norm = f"{self.p0}.embed_tokens.weight", f"{self.p0}.norm.weight"
        head = {embed: src.get_raw(embed).to(torch.float16), norm: src.get_raw(norm).to(torch.float16), **extra}
        layers = [f"layer-{i:05d}.safetensors" for i in range(self.n_layers)]
        n = len(layers) + 1
        finals = {f"model-{k + 1:05d}-of-{n:05d}.safetensors": layer for k, layer in enumerate(layers)}
        try:
            cv._atomic_save(head, assembled / f"model-{n:05d}-of-{n:05d}.safetensors")
            plan_file.write_text(json.dumps(finals))
            weight_map = {name: f"model-{n:05d}-of-{n:05d}.safetensors" for name in head}
            for final, layer in finals.items():
                with safe_open(str(st / layer), "pt") as f:
                    weight_map.update({name: final for name in f.keys()})
                os.replace(st / layer, assembled / final)
            total = sum((assembled / f).stat().st_size for f in set(weight_map.values()))
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (assembled / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            (assembled / "config.json").write_text(json.dumps(self._config(state), indent=2))
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                         "generation_config.json", "chat_template.jinja"):
                if (src.path / name).is_file():
                    shutil.copyfile(src.path / name, assembled / name)
        except OSError as e:
            raise ImportFailed(f"{assembled}: writing the model failed ({e}); free space and run again") from e
        os.replace(assembled, self.out_dir)
        shutil.rmtree(st)
        report = src.stats.report()
        self.say(f"imported {report['linears']} quantized linears ({report['bit_exact_linears']} bit-exact; relative "
                 f"RMS error {report['relative_rms_error']:.4f}, {100 * report['added_noise']:.1f}% added to the "
                 f"build's own rounding noise); wrote {self.out_dir}")
        return self.out_dir

    def _config(self, state: dict) -> dict:
        src, p = self.source, self.plan
        config = exllamav2_config(src.config)
        config["quantization_config"] = {
            **quantization_config(p.bits, p.head_bits), "method": "import",
            "source": {"quant_method": src.spec.method, "bits": src.spec.bits, "group_size": src.spec.group_size,
                       "sym": src.spec.sym, "desc_act": src.spec.desc_act},
            "imported_width": p.width or src.spec.bits, "exact_scales": p.exact, "import": src.stats.report(),
            "calibrated": p.calibrate,
            "bits_counted": "bits stored per weight of the linears the build kept in 16 bits (codes, scales, "
                            "group table, permutation), as exllamav2's -b"}
        if p.calibrate:
            config["quantization_config"]["calibration"] = {"rows": state["rows_used"], "seq_len": p.seq_len,
                                                            "sha256": state["settings"]["calibration_sha256"]}
        return config


def _transformers_parts(source: Source, plan: Plan, measured: bool) -> SimpleNamespace:
    """convert.py's pieces for one decoder layer of a transformers architecture."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(source.path)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config                          # the layers are built plain, in float32
    cfg._attn_implementation = "sdpa"
    layer_cls, rope_cls, norm_cls = cv._classes(source.arch)
    return SimpleNamespace(cfg=cfg, layer_cls=layer_cls, norm_cls=norm_cls, device=plan.device, damp=plan.damp,
                           rotary=rope_cls(config=cfg).to(plan.device), new_layer=cv._new_layer,
                           load_layer=cv._load_layer, run_layer=cv._run_layer, measured=measured,
                           hessian_budget=plan.hessian_budget)


def _minutes(seconds: float) -> str:
    if seconds < 30:
        return "no time"
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{max(1, round(seconds / 60))} min"


# ---------------------------------------------------------------------------------------------
# moedesk-cli import

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="PATH_OR_REPO",
                   help="a GPTQ / AutoRound / AWQ model folder, or a Hub repository (owner/name) to download first")
    p.add_argument("--out", help="output folder (default: NAME-exl2 in the models folder; an interrupted run resumes)")
    p.add_argument("--bpw", type=float, default=IMPORT_BPW,
                   help=f"bits stored per weight of the linears the build kept in 16 bits (attention, Gated DeltaNet, "
                        f"shared experts), scales included (default {IMPORT_BPW:g})")
    p.add_argument("--width", type=int, choices=IMPORT_WIDTHS,
                   help="EXL2 code width of the imported linears (default: the build's own bits; wider: larger; "
                        "asymmetric builds are exact at their bits + 1)")
    p.add_argument("--head-bits", type=int, default=CONVERT_HEAD_BITS,
                   help=f"bits of lm_head where the build kept it in 16 bits (default {CONVERT_HEAD_BITS})")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="quantize the 16-bit linears with calibration and GPTQ (default), or (--no-calibrate) round "
                        "them to nearest: no forward pass, much faster on a CPU, a little less accurate")
    p.add_argument("--calibration", help="UTF-8 text file to calibrate on (default: the converter's)")
    p.add_argument("--rows", type=int, default=CONVERT_CALIBRATION_ROWS, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=CONVERT_CALIBRATION_SEQ_LEN, help="tokens per calibration sequence")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the repacking and calibration run (auto: the GPU when torch sees one)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default 0: the idle physical cores)")


def _source_folder(source: str, say: Say) -> Path:
    """A local folder as it is; a repository id downloaded first (resumable), into the models folder."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists() or source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise ImportFailed(f"{source}: not a model folder, nor a repository name such as owner/model")
    from app.hub.errors import HubError
    from app.hub.fetch import download_source                # the app's resumable Hub downloads (no torch)
    try:
        return download_source(source, say)
    except HubError as e:
        raise ImportFailed(str(e)) from None


def run(args: argparse.Namespace) -> int:
    from runtime import paths
    from runtime.errors import EngineError
    say = lambda m: print(m, flush=True)                                                          # noqa: E731
    try:
        if args.rows < 1 or args.seq_len < 8 or args.threads < 0:
            raise ImportFailed("--rows must be >= 1, --seq-len >= 8 and --threads >= 0")
        text, text_source = None, "calibration"
        if args.calibration:
            try:
                text, text_source = Path(args.calibration).read_text(encoding="utf-8"), Path(args.calibration).name
            except (OSError, UnicodeDecodeError) as e:
                raise ImportFailed(f"{args.calibration}: cannot read the calibration text ({e})") from e
        folder = _source_folder(args.source, say)
        out = Path(args.out) if args.out else paths.models_dir() / gptq_spec.import_name(args.source)
        cores = cpu_load.physical_cores()
        n, why = cpu_load.conversion_threads(cores, None if args.threads else cpu_load.measure_others(), args.threads)
        say(f"importing {folder} into {out}; CPU threads: {why}")
        with cpu_load.torch_threads_set(n):
            import_model(folder, out, args.bpw, width=args.width, head_bits=args.head_bits, calibrate=args.calibrate,
                         calibration_text=text, calibration_source=text_source, rows=args.rows, seq_len=args.seq_len,
                         device=args.device, say=say)
        return 0
    except (ImportFailed, cv.ConvertError, fmt.Exl2FormatError, EngineError) as e:
        print(f"moedesk-cli import: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("moedesk-cli import: stopped; run the same command again to resume (downloads and finished layers "
              "are kept)", file=sys.stderr)
        return 130
