"""Calibrated conversion of a Hugging Face safetensors checkpoint into an EXL2 model, layer by layer, on the CPU.

Flow (exllamav2's converter works the same way in outline):
1. The calibration texts are tokenized into `rows` sequences of `seq_len` tokens and embedded.
2. For each decoder layer in turn, only that layer's weights are read from the checkpoint, one tensor
   at a time, into the transformers decoder-layer module of the architecture (built on the meta device,
   so its parameters exist once). The calibration hidden states go through it with hooks that sum the
   Hessian 2 X^T X of each linear's real inputs (calibrate.py); every linear is quantized with GPTQ
   (gptq.py); the layer, now holding the dequantized weights, runs again and its outputs are the next
   layer's inputs, so later layers are calibrated on what the quantized model really computes.
3. The final norm's outputs calibrate `lm_head` (absent when tied to the embeddings).
Qwen3.5-MoE (hybrid Gated DeltaNet + gated attention) takes the same steps with the reference engine's
own layers in place of transformers' modules: convert_qwen35.py (on either device). Mixtral's tensors keep the
Hub's names (modelfolder.stored_name); DBRX's blocks are rebuilt and renamed as exllamav2 names them
(convert_dbrx.py).
Memory: one layer's weights (float32; Qwen3.5's experts as stored) plus the calibration activations (rows x
seq_len x hidden, float32, twice; the experts' inputs in float16) plus the Hessians: the dense linears' (shared
inputs share one) and at most `hessian_budget` bytes for a group of experts (calibrate.expert_bytes; on a GPU by
default what it has free). While a layer is quantized a thread reads the next one into the page cache (readahead.py).

MoE experts (Qwen3-MoE, Mixtral, DBRX): each expert's gate/up Hessian sums only the tokens the router sent to it and its
down Hessian only its own intermediate activations of those tokens; experts routed too few tokens fall
back to all the layer's tokens (calibrate.py; the fallbacks are counted in quantization_config).

Resume and safety: everything happens in a hidden staging folder next to the output, `.NAME.partial`.
After each layer its quantized tensors go to `layer-NNNNN.safetensors`, the next layer's inputs to
`hidden-NNNNN.safetensors`, then `state.json` records the layer as done (each file written under a
temporary name and renamed). A conversion started again with the same settings continues after the
last finished layer. The model folder is assembled inside the staging folder by the streaming writer
and renamed into place at the very end, so a folder at the output path is always a finished model.
The source folder is untrusted and checked before anything is built from it (links out of it, config sizes, headers,
the index, every tensor's shape), as are the output path, the staging folder and its state.json (convert_check.py).

    moedesk-cli convert --model HF_DIR --bpw B --out DIR [--calibration FILE] [--head-bits H] [--[no-]measure]
                        [--threads N]

--bpw counts every bit the quantized decoder linears store (codes, 4-bit scales, group table,
permutation), as exllamav2's -b does; the codes get ~0.2 bits per weight less at groups of 32.

The default calibration is exllamav2's standard set (caldata.py), 32 x 512 tokens; without exllamav2 it
falls back to data/calibration.txt (the Declaration of Independence and the Gettysburg Address, both
public domain), with a note. Groups are 32 rows; widths are allocated per linear by measured error
(allocate.py; --no-measure: every linear at the target). The measurement needs a real calibration: below
CONVERT_MEASURE_MIN_TOKENS tokens (runtime/options.py) every linear gets the target width unless --measure asks
for the measurement anyway; the log and quantization_config["allocation"] say which was used and why.

On the CPU, torch's thread count for the conversion is the physical cores less those other programs keep busy
(runtime/cpu_load.py: GPTQ's thread team stalls at its barriers beside a busy core, ~12x slower with two
threads than one on a busy 2-core machine), looked at again after each layer, or --threads; the log says
the count, and the previous setting is put back at the end.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from runtime import cpu_load, qwen35
from runtime.modelfolder import stored_name
from runtime.options import (CONVERT_CALIBRATION_ROWS, CONVERT_CALIBRATION_SEQ_LEN, CONVERT_GROUP_SIZE,
                             CONVERT_HEAD_BITS)

from . import allocate, caldata, convert_args, convert_dbrx
from . import format as fmt
from .convert_check import ConvertError, check_output, check_source, copy_extras, make_staging, read_state, staging_dir
from .calibrate import (DEFAULT_HESSIAN_BUDGET, MIN_EXPERT_TOKENS_PER_INPUT, CalibrationError, Collector, LayerReport,
                        quantize_jobs, quantize_layer)
from .gptq import DAMP_PER_INPUT, DEFAULT_DAMP, HessianAccumulator, quantize_gptq
from .readahead import Readahead
from .writer import ModelWriter, exllamav2_config, quantization_config

ARCHITECTURES = {     # HF class -> (transformers module, decoder layer, rotary embedding, RMS norm)
    "LlamaForCausalLM": ("llama", "LlamaDecoderLayer", "LlamaRotaryEmbedding", "LlamaRMSNorm"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3DecoderLayer", "Qwen3RotaryEmbedding", "Qwen3RMSNorm"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeDecoderLayer", "Qwen3MoeRotaryEmbedding", "Qwen3MoeRMSNorm"),
    # its tensors named as the Hub's checkpoints and EXL2 folders hold them (modelfolder.stored_name)
    "MixtralForCausalLM": ("mixtral", "MixtralDecoderLayer", "MixtralRotaryEmbedding", "MixtralRMSNorm"),
    # its blocks rebuilt, read and renamed by convert_dbrx.py; its final norm a bias-free LayerNorm
    convert_dbrx.ARCH: ("dbrx", "DbrxBlock", "DbrxRotaryEmbedding", None),
}
DISK_MARGIN = 64 << 20               # bytes kept free beyond the estimate
BATCH_ROWS = 4                       # calibration sequences per forward
AUTO_MARGIN = 1 << 30                # device="auto": VRAM kept beyond a layer's estimate (context, activations)
STORED_BPW_MIN, STORED_BPW_MAX = 2.0, 8.5    # --bpw range (2-bit codes store ~2.2, 8-bit ~8.2)

Say = Callable[[str], None]


# ---------------------------------------------------------------------------------------------
# The source checkpoint

class Checkpoint:
    """An HF model folder: config.json plus safetensors weights, read one tensor at a time."""

    def __init__(self, path: str | os.PathLike):
        source = check_source(path)         # links, config sizes, headers, index, shapes: convert_check.py
        self.path, self.config, self.arch, self.sizes = source.path, source.config, source.arch, source.sizes
        self.shard_of = source.shard_of
        self._open: dict[str, object] = {}

    def has(self, name: str) -> bool:
        return name in self.shard_of

    def get_raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (bf16, fp16, fp32)."""
        if name not in self.shard_of:
            raise ConvertError(f"{self.path}: tensor {name} is missing from the checkpoint")
        shard = str(self.shard_of[name])
        try:
            if shard not in self._open:
                self._open = {shard: safe_open(shard, "pt")}       # one shard open at a time
            return self._open[shard].get_tensor(name)
        except (OSError, SafetensorError) as e:                    # changed since it was checked
            raise ConvertError(f"{shard}: cannot read tensor {name} ({e})") from None

    def get(self, name: str) -> torch.Tensor:
        return self.get_raw(name).to(torch.float32)

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in set(self.shard_of.values()))


# ---------------------------------------------------------------------------------------------
# Calibration data

def calibration_ids(tokenizer, texts, rows: int, seq_len: int, source: str) -> torch.Tensor:
    """[rows', seq_len] token ids cut from the text, or shared between several (caldata.py)."""
    try:
        return caldata.calibration_ids(tokenizer, texts, rows, seq_len, source)
    except caldata.CalibrationDataError as e:
        raise ConvertError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Staging: resumable state in a hidden folder next to the output

def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)                  # a file made anew: never written through a link left there
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _write_state(staging: Path, state: dict) -> None:
    tmp = staging / "state.json.tmp"
    tmp.unlink(missing_ok=True)
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, staging / "state.json")


def _check_disk(where: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    if free < need + DISK_MARGIN:
        raise ConvertError(f"{where}: not enough disk space to {what}: {need / 2**20:.0f} MiB needed "
                           f"(+{DISK_MARGIN >> 20} MiB margin), {free / 2**20:.0f} MiB free")


# ---------------------------------------------------------------------------------------------
# One decoder layer

def _classes(arch: str):
    mod_name, layer_cls, rope_cls, norm_cls = ARCHITECTURES[arch]
    mod = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
    return getattr(mod, layer_cls), getattr(mod, rope_cls), getattr(mod, norm_cls) if norm_cls else None


def _new_layer(layer_cls, cfg, i: int, device: str) -> torch.nn.Module:
    """The decoder-layer module with uninitialised float32 parameters (filled by _load_layer)."""
    with torch.device("meta"):
        layer = layer_cls(cfg, layer_idx=i)
    persistent = set(layer.state_dict())
    if any(name not in persistent for name, _ in layer.named_buffers()):     # buffers the checkpoint lacks
        return layer_cls(cfg, layer_idx=i).to(device).float().eval()
    return layer.to_empty(device=device).float().eval()


def _load_layer(layer: torch.nn.Module, ckpt: Checkpoint, prefix: str) -> None:
    """Fill a decoder-layer module from the checkpoint one tensor at a time, copied straight into its
    parameters; fused expert parameters are filled from the per-expert tensors of HF checkpoints when
    the fused ones are not stored."""
    def put(dst: torch.Tensor, name: str) -> None:
        src = ckpt.get_raw(name)
        if src.shape != dst.shape:
            raise ConvertError(f"{ckpt.path}: {name} has shape {list(src.shape)}, the config implies "
                               f"{list(dst.shape)}")
        dst.copy_(src)

    with torch.no_grad():
        for key, param in layer.state_dict().items():
            full = stored_name(ckpt.arch, prefix + key)
            if ckpt.has(full):
                put(param, full)
            elif key.endswith("experts.gate_up_proj"):
                base, inter = prefix + key[: -len("gate_up_proj")], param.shape[1] // 2
                for e in range(param.shape[0]):
                    put(param[e, :inter], stored_name(ckpt.arch, f"{base}{e}.gate_proj.weight"))
                    put(param[e, inter:], stored_name(ckpt.arch, f"{base}{e}.up_proj.weight"))
            elif key.endswith("experts.down_proj"):
                base = prefix + key[: -len("down_proj")]
                for e in range(param.shape[0]):
                    put(param[e], stored_name(ckpt.arch, f"{base}{e}.down_proj.weight"))
            else:
                raise ConvertError(f"{ckpt.path}: tensor {full} is missing from the checkpoint")


def _run_layer(layer, rotary, hidden: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(hidden)
    pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    with torch.no_grad():
        for r in range(0, hidden.shape[0], BATCH_ROWS):
            h = hidden[r:r + BATCH_ROWS]
            pe = rotary(h, pos.expand(h.shape[0], -1))
            y = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            out[r:r + BATCH_ROWS] = y[0] if isinstance(y, tuple) else y
    return out


# ---------------------------------------------------------------------------------------------
# The whole model

def convert(model_dir: str | os.PathLike, out_dir: str | os.PathLike, bits: float, *,
            head_bits: int = CONVERT_HEAD_BITS, calibration_text: str | Mapping[str, str],
            calibration_source: str = "calibration",
            rows: int = CONVERT_CALIBRATION_ROWS, seq_len: int = CONVERT_CALIBRATION_SEQ_LEN,
            group_size: int = CONVERT_GROUP_SIZE, damp: float = DEFAULT_DAMP, say: Say = print,
            measure: bool | None = None, stop_after_layers: int | None = None,
            hessian_budget: int | None = None, device: str = "cpu",
            progress: Callable[[dict], None] | None = None, threads: int = 0) -> Path:
    """Convert an HF checkpoint into an EXL2 folder at out_dir; -> out_dir.

    `bits`: bits stored per weight of the decoder's quantized linears on average, codes, scales, group
    table and permutation included (what exllamav2's -b means); `head_bits`: lm_head's code width.
    `measure`: True: widths chosen per linear by measured error (allocate.py); False: each linear at the
    target; None (default): measured when the calibration has at least CONVERT_MEASURE_MIN_TOKENS tokens.
    `threads`: torch's CPU threads for the conversion (0: automatic, see the module's docstring).

    Resumes from the staging folder when one with the same settings exists. `stop_after_layers`
    stops (ConvertError) once that many layers are done in this run: what an interruption leaves.
    `hessian_budget` bounds the bytes a group of experts holds at once (calibrate.expert_bytes; None: what
    calibrate.expert_budget gives; it does not change the result). `device` runs the layers, Hessians and GPTQ
    there ("cuda"; "auto": `choose_device`); `progress` gets a dict per finished layer (layer, kind, seconds,
    phases: seconds per step, hessian_peak_bytes, experts_per_group, expert_seconds, cpu_threads).
    """
    if threads < 0:
        raise ConvertError(f"threads must be 0 (automatic) or a positive count, got {threads}")
    asked = device
    device, why = choose_device(device, model_dir, out_dir, hessian_budget)
    if asked == "auto":
        say(f"device: {device} ({why})")
    if device != "cpu":
        try:
            return _convert(model_dir, out_dir, bits, head_bits, calibration_text, calibration_source, rows, seq_len,
                            group_size, damp, say, measure, stop_after_layers, hessian_budget, device, progress)
        except torch.cuda.OutOfMemoryError as e:
            raise ConvertError(f"the GPU ran out of memory ({str(e).splitlines()[0][:160]}); the finished layers are "
                               f"kept: free GPU memory (unload the chat's model, close other programs) and run it "
                               f"again to resume, or convert on the CPU (--device cpu) into another folder") from None
    cores = cpu_load.physical_cores()
    n, why = cpu_load.conversion_threads(cores, None if threads else cpu_load.measure_others(), threads)
    governor = None if threads else cpu_load.ThreadGovernor(cores)

    def retune() -> None:                         # after each layer: the others' load over that layer
        changed = governor.observe() if governor is not None else None
        if changed is not None:
            torch.set_num_threads(changed)
            say(f"CPU threads: {changed} of {cores} physical cores (other programs keep "
                f"{governor.others:.1f} CPUs busy)")

    if governor is not None:
        governor.threads = n
    with cpu_load.torch_threads_set(n):
        return _convert(model_dir, out_dir, bits, head_bits, calibration_text, calibration_source, rows, seq_len,
                        group_size, damp, say, measure, stop_after_layers, hessian_budget, device, progress,
                        f"CPU threads: {why}", retune)


def choose_device(device: str, model_dir, out_dir, hessian_budget: int | None) -> tuple[str, str]:
    """-> (device, why). "auto": the device an interrupted conversion into out_dir started on; else CUDA when
    torch sees a GPU with room for one layer (its float32 weights and a half more, the Hessian budget, a
    margin: what is free, so a model loaded beside it counts), else the CPU. Any other value as given."""
    if device != "auto":
        return device, "as asked"
    staging = staging_dir(Path(out_dir))
    try:
        started = json.loads((staging / "state.json").read_text())["settings"].get("device", "cpu")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        started = None
    if started == "cpu" or started and torch.cuda.is_available():
        return started, "where the interrupted conversion being resumed started"
    if started:
        raise ConvertError(f"{staging}: the interrupted conversion started on {started} and resumes only there, and "
                           f"no CUDA GPU is visible now; resume it where a GPU is, or remove that folder to start over")
    if not torch.cuda.is_available():
        return "cpu", "no CUDA GPU is visible"
    ckpt = model_dir if hasattr(model_dir, "keeps") else Checkpoint(model_dir)     # requantize.Exl2Source or a folder
    layers = {n.split(".layers.", 1)[1].split(".", 1)[0] for n in ckpt.shard_of if ".layers." in n}
    layers |= {n.split(".blocks.", 1)[1].split(".", 1)[0] for n in ckpt.shard_of if ".blocks." in n}
    need = ckpt.total_bytes() * 3 // max(1, len(layers)) + (hessian_budget or DEFAULT_HESSIAN_BUDGET) + AUTO_MARGIN
    free = torch.cuda.mem_get_info()[0]
    if free < need:
        return "cpu", f"the GPU has {free / 2**30:.1f} GiB free, a layer needs about {need / 2**30:.1f} GiB"
    return "cuda", f"the GPU has {free / 2**30:.1f} GiB free, a layer needs about {need / 2**30:.1f} GiB"


def _check_arguments(bits, head_bits, hessian_budget, device) -> None:
    if not STORED_BPW_MIN <= bits <= STORED_BPW_MAX:
        raise ConvertError(f"bits per weight {bits} is outside {STORED_BPW_MIN}..{STORED_BPW_MAX} (bits stored per "
                           f"weight of the quantized linears, scales and permutation included)")
    fmt.resolve_bits(head_bits, name="head_bits")
    if hessian_budget is not None and hessian_budget <= 0:
        raise ConvertError(f"hessian_budget must be positive, got {hessian_budget} bytes")
    if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
        raise ConvertError(f"device {device!r} is not available here; use cpu or a visible cuda device")


def _model_kind(ckpt: Checkpoint, seq_len: int, device: str) -> tuple:
    """How the checkpoint's layers are run: (Qwen3.5's by our own forward, or None; else transformers' config and
    its layer, rotary and norm classes; the layers; whether the head is tied; the embedding's and final norm's
    names)."""
    from transformers import AutoConfig
    if ckpt.arch in qwen35.ARCHITECTURES:                        # our own forward calibrates it
        from .convert_qwen35 import HybridLayers
        hybrid = HybridLayers(ckpt, seq_len, ConvertError, device)
        tied = bool(hybrid.config.get("tie_word_embeddings", False))
        return hybrid, None, (None, None, None), hybrid.n_layers, tied, hybrid.embed_name, hybrid.norm_name
    try:
        cfg = AutoConfig.from_pretrained(ckpt.path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConvertError(f"{ckpt.path / 'config.json'}: transformers cannot read it ({e})") from None
    cfg._attn_implementation = "sdpa"
    embed_name, norm_name = "model.embed_tokens.weight", "model.norm.weight"
    if ckpt.arch == convert_dbrx.ARCH:
        embed_name, norm_name = convert_dbrx.EMBED, convert_dbrx.NORM
    return (None, cfg, _classes(ckpt.arch), cfg.num_hidden_layers, bool(ckpt.config.get("tie_word_embeddings", False)),
            embed_name, norm_name)


def _resume_state(staging: Path, settings: dict, n_layers: int, hidden_size: int, say: Say) -> dict:
    """The state of an interrupted conversion with these settings, or a new one (its staging folder made)."""
    state = read_state(staging, settings, n_layers, hidden_size)
    if state is not None:
        say(f"resuming after layer {state['layers_done']} of {n_layers}")
        return state
    make_staging(staging)
    return {"settings": settings, "layers_done": 0, "rows_used": 0,
            "stats": {"experts_routed": 0, "experts_all_token_fallback": 0}}


def _quantize_head(ckpt: Checkpoint, hybrid, cfg, norm_cls, norm_name: str, hidden: torch.Tensor, head_bits, group_size,
                   damp, device):
    """lm_head by GPTQ on the final norm of the last layer's output (as stored, when requantizing)."""
    acc = HessianAccumulator(hidden.shape[-1], device=device)
    with torch.no_grad():
        if hybrid is not None:
            acc.add(hybrid.head_input(hidden))
        else:
            norm = (norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps) if norm_cls else convert_dbrx.head_norm(cfg))
            norm = norm.to(device)
            norm.weight.data = ckpt.get(norm_name).to(device)
            acc.add(norm(hidden))
    return (getattr(ckpt, "keeps", lambda k: None)("lm_head")      # as stored, when requantizing (requantize.py)
            or quantize_gptq(ckpt.get("lm_head.weight"), acc.h, head_bits, group_size, damp=damp, tokens=acc.tokens,
                             name="lm_head"))


def _calibration_ids(ckpt: Checkpoint, text: str, rows: int, seq_len: int, source: str) -> torch.Tensor:
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(ckpt.path)
    except Exception as e:                        # whatever the library raises on broken tokenizer files
        raise ConvertError(f"{ckpt.path}: its tokenizer cannot be read ({type(e).__name__}: {e})") from None
    return calibration_ids(tok, text, rows, seq_len, source)


def _first_hidden(ckpt: Checkpoint, staging: Path, state: dict, ids: torch.Tensor, embed_name: str) -> torch.Tensor:
    """The first layer's input: the calibration rows embedded, or where a resumed conversion left off."""
    k = state["layers_done"]
    if k == 0:
        state["rows_used"] = ids.shape[0]
        return torch.nn.functional.embedding(ids, ckpt.get_raw(embed_name)).float()
    with safe_open(str(staging / f"hidden-{k:05d}.safetensors"), "pt") as f:
        return f.get_tensor("hidden")


def _save_layer(staging: Path, state: dict, i: int, tensors: dict, hidden: torch.Tensor) -> None:
    """Layer i's quantized tensors and the next layer's input into the staging folder, the state moved past it
    (an interrupted conversion resumes there)."""
    need = sum(t.numel() * t.element_size() for t in tensors.values()) + hidden.numel() * 4
    _check_disk(staging, need, f"write layer {i}")
    try:
        _atomic_save(tensors, staging / f"layer-{i:05d}.safetensors")
        _atomic_save({"hidden": hidden.cpu()}, staging / f"hidden-{i + 1:05d}.safetensors")
    except OSError as e:
        raise ConvertError(f"{staging}: writing layer {i} failed ({e}); free space and run again to resume") from e
    state["layers_done"] = i + 1
    _write_state(staging, state)
    (staging / f"hidden-{i:05d}.safetensors").unlink(missing_ok=True)


def _assemble(ckpt: Checkpoint, staging: Path, out_dir: Path, n_layers: int, embed_name: str, norm_name: str, head,
              mtp: dict, bits, head_bits, group_size, damp, calibration_source, seq_len, settings: dict, state: dict,
              allocation: dict, measured: bool, say: Say) -> None:
    """The quantized layers, embedding, norm, head and MTP head into one model folder with its config and
    tokenizer files, moved into place; the staging folder removed."""
    config = exllamav2_config(ckpt.config)
    config["quantization_config"] = {
        **quantization_config(bits, head_bits), "method": "gptq", "act_order": True, "damp": damp,
        "damp_floor": f"{DAMP_PER_INPUT} x in_features / calibration tokens",
        "group_size": group_size, "calibration": {"source": calibration_source, "rows": state["rows_used"],
                                                  "seq_len": seq_len, "sha256": settings["calibration_sha256"]},
        "min_expert_tokens_per_input": MIN_EXPERT_TOKENS_PER_INPUT, "measured_allocation": measured,
        "allocation": allocation,
        **{k: v for k, v in state["stats"].items() if k not in ("code_bits", "stored_bits", "weights")},
        "bits_counted": "stored bits per weight of the quantized decoder linears (codes, scales, group table, "
                        "permutation), as exllamav2's -b",
        "linear_bits": round(state["stats"]["code_bits"] / max(state["stats"]["weights"], 1), 4),
        "stored_bits_per_weight": round(state["stats"].get("stored_bits", 0) / max(state["stats"]["weights"], 1), 4)}
    assembled = staging / "model"
    if assembled.exists():
        shutil.rmtree(assembled)
    try:
        with ModelWriter(assembled) as writer:
            renamed = {convert_dbrx.EMBED: convert_dbrx.OUT_EMBED, convert_dbrx.NORM: convert_dbrx.OUT_NORM}
            writer.add(renamed.get(embed_name, embed_name), ckpt.get_raw(embed_name).to(torch.float16))
            for i in range(n_layers):
                with safe_open(str(staging / f"layer-{i:05d}.safetensors"), "pt") as f:
                    for name in f.keys():
                        writer.add(name, f.get_tensor(name))
            writer.add(renamed.get(norm_name, norm_name), ckpt.get(norm_name).to(torch.float16))
            if head is not None:
                writer.add_all("lm_head", head)
            for name, tensor in mtp.items():
                writer.add(name, tensor)
            writer.finish(config)
    except OSError as e:
        raise ConvertError(f"{assembled}: writing the model failed ({e}); free space and run again") from e
    copy_extras(ckpt.path, ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                            "generation_config.json", "chat_template.jinja"), assembled)
    os.replace(assembled, out_dir)
    shutil.rmtree(staging)
    say(f"wrote {out_dir}")


def _quantize_decoder_layer(ckpt: Checkpoint, cfg, layer_cls, rotary, i: int, hidden: torch.Tensor, ahead: Readahead,
                            t0: float, bits, group_size, damp, state: dict, measured: bool, hessian_budget,
                            device) -> tuple[dict, torch.Tensor, Collector]:
    """Layer i of a transformers model (or DBRX's rebuilt block): read (the next one read ahead meanwhile), run
    on the calibration rows while its linears' inputs are collected, quantized, run again for the next layer's
    input. -> (its quantized tensors by the checkpoint's names, the next input, its report)."""
    prefix = f"model.layers.{i}."
    if ckpt.arch == convert_dbrx.ARCH:
        layer = convert_dbrx.new_layer(cfg, i, ckpt, device, ConvertError)
    else:
        layer = _new_layer(layer_cls, cfg, i, device)
        _load_layer(layer, ckpt, prefix)
    ahead.start(i + 1)
    collector = Collector(layer, {"read": time.perf_counter() - t0})
    _run_layer(layer, rotary, hidden)
    collector.remove()
    try:
        tensors = quantize_layer(layer, prefix, bits, group_size, damp, state["stats"], collector, measured,
                                 hessian_budget, ckpt)
    except CalibrationError as e:
        raise ConvertError(str(e)) from e
    hidden = _run_layer(layer, rotary, hidden)
    return tensors, hidden, collector          # the layer is dropped on return: before the next layer is read


def _convert(model_dir, out_dir, bits, head_bits, calibration_text, calibration_source, rows, seq_len, group_size,
             damp, say: Say, measure, stop_after_layers, hessian_budget, device, progress,
             threads_note: str = "", after_layer: Callable[[], None] = lambda: None) -> Path:
    _check_arguments(bits, head_bits, hessian_budget, device)
    out_dir = Path(out_dir)
    staging = check_output(out_dir)
    ckpt = model_dir if hasattr(model_dir, "keeps") else Checkpoint(model_dir)     # requantize.Exl2Source or a folder
    hybrid, cfg, classes, n_layers, tied, embed_name, norm_name = _model_kind(ckpt, seq_len, device)
    layer_cls, rope_cls, norm_cls = classes
    settings = {"source": str(ckpt.path.resolve()), "bits": float(bits), "head_bits": int(head_bits),
                "bits_counted": "stored", "group_size": group_size, "damp": damp, "damp_per_input": DAMP_PER_INPUT,
                "measure": measure, **getattr(ckpt, "settings", {}),
                "rows": rows, "seq_len": seq_len,
                "calibration_sha256": caldata.fingerprint(calibration_text)}
    if device != "cpu":                 # other rounding in the layer runs: not resumed on another device
        settings["device"] = device.split(":")[0]
    state = _resume_state(staging, settings, n_layers, ckpt.sizes["hidden_size"], say)
    # output ~ bits/8 of the fp32 count, kept twice at the end (layer files + assembled model)
    _check_disk(staging, int(ckpt.total_bytes() / 2 * max(bits, head_bits) / 8 * 2), "convert this model")

    ids = _calibration_ids(ckpt, calibration_text, rows, seq_len, calibration_source)
    allocation = allocate.choose_allocation(ids.numel(), measure)
    measured = allocation["widths"] == "measured"
    say(f"bit allocation: {allocation['widths']} ({allocation['reason']})")
    if threads_note:
        say(threads_note)
    hidden = _first_hidden(ckpt, staging, state, ids, embed_name).to(device)
    rotary = rope_cls(config=cfg).to(device) if hybrid is None else None
    out_name = convert_dbrx.stored_name if ckpt.arch == convert_dbrx.ARCH else partial(stored_name, ckpt.arch)
    def jobs_done(jobs, experts=None):           # Qwen3.5's layers: their linears, then their experts in groups
        return quantize_jobs(jobs, bits, group_size, damp, state["stats"], measured,
                             None if experts is None else (*experts, hessian_budget), report, ckpt)
    done_now, ahead = 0, Readahead(ckpt.shard_of)
    for i in range(state["layers_done"], n_layers):
        if stop_after_layers is not None and done_now >= stop_after_layers:
            raise ConvertError(f"conversion stopped after layer {i} of {n_layers}; run it again to resume")
        t0, report = time.perf_counter(), LayerReport()
        if hybrid is not None:
            tensors, hidden = hybrid.quantize_layer(i, hidden, jobs_done, report, lambda: ahead.start(i + 1))
        else:
            tensors, hidden, report = _quantize_decoder_layer(ckpt, cfg, layer_cls, rotary, i, hidden, ahead, t0, bits,
                                                              group_size, damp, state, measured, hessian_budget, device)
            tensors = {out_name(k): v for k, v in tensors.items()}
        _save_layer(staging, state, i, tensors, hidden)
        del tensors
        done_now += 1
        say(f"layer {i + 1}/{n_layers} quantized")
        if progress is not None:
            progress({"layer": i, "kind": hybrid.spec.kinds[i] if hybrid else "decoder", "phases": dict(report.seconds),
                      "seconds": time.perf_counter() - t0, "hessian_peak_bytes": report.peak,
                      "experts_per_group": report.experts_per_group, "expert_seconds": report.expert_seconds,
                      "cpu_threads": torch.get_num_threads() if device == "cpu" else None})
        after_layer()
    ahead.close()

    head = None if tied else _quantize_head(ckpt, hybrid, cfg, norm_cls, norm_name, hidden, head_bits, group_size,
                                            damp, device)
    mtp = {}
    if hybrid is not None and hybrid.has_mtp():                  # Qwen3.5's MTP head: read where it drafts
        mtp = hybrid.quantize_mtp(ids, hidden, jobs_done)
    del hidden

    _assemble(ckpt, staging, out_dir, n_layers, embed_name, norm_name, head, mtp, bits, head_bits, group_size, damp,
              calibration_source, seq_len, settings, state, allocation, measured, say)
    return out_dir


# ---------------------------------------------------------------------------------------------
# moedesk-cli convert

DEFAULT_CALIBRATION = caldata.SHIPPED          # the fallback text (tests calibrate on it: it is small)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model folder (config.json + safetensors)")
    p.add_argument("--bpw", type=float, required=True,
                   help=f"bits stored per weight of the quantized linears on average, scales and permutation included, "
                        f"as exllamav2's -b ({STORED_BPW_MIN:g}..{STORED_BPW_MAX:g}; codes take ~0.2 less at groups of 32)")
    p.add_argument("--out", required=True, help="output folder (must not exist; an interrupted run resumes)")
    p.add_argument("--head-bits", type=int, default=CONVERT_HEAD_BITS,
                   help=f"bits of lm_head (default {CONVERT_HEAD_BITS})")
    convert_args.add_calibration_arguments(p)


def run(args: argparse.Namespace) -> int:
    return run_with(args, "convert", lambda kw: convert(args.model, args.out, args.bpw, head_bits=args.head_bits, **kw))


def run_with(args: argparse.Namespace, prog: str, start: Callable[[dict], object]) -> int:
    """start(convert's keyword arguments from the calibration flags, checked: convert_args.py); errors as one
    line on stderr (exit 1), an interruption says how to resume (exit 130)."""
    try:
        start(convert_args.convert_kwargs(args, prog, ConvertError))
        return 0
    except (ConvertError, fmt.Exl2FormatError, OSError) as e:       # OSError: its message names the file
        print(f"moedesk-cli {prog}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"moedesk-cli {prog}: stopped; the finished layers are kept in {staging_dir(Path(args.out))}, "
              f"run the same command again to resume", file=sys.stderr)
        return 130
