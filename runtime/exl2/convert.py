"""Calibrated conversion of a Hugging Face safetensors checkpoint into an EXL2 model, layer by layer, on the CPU.

Flow (exllamav2's converter works the same way in outline):
1. The calibration text is tokenized into `rows` sequences of `seq_len` tokens and embedded.
2. For each decoder layer in turn, only that layer's weights are read from the checkpoint into the
   transformers decoder-layer module of the architecture. The calibration hidden states go through it
   with a hook on every linear that sums the Hessian 2 X^T X of the linear's real inputs; every linear
   is quantized with GPTQ (gptq.py); the layer, now holding the dequantized weights, runs again and
   its outputs are the next layer's inputs, so later layers are calibrated on what the quantized model
   really computes.
3. The final norm's outputs calibrate `lm_head` (absent when tied to the embeddings).
Memory: one layer's weights plus the calibration activations (rows x seq_len x hidden, float32, twice).

MoE experts (Qwen3-MoE): the hook on the experts module sees the router's choice, so each expert's
gate/up Hessian sums only the tokens routed to it and its down Hessian only its own intermediate
activations of those tokens. An expert that got fewer than `MIN_EXPERT_TOKENS_PER_INPUT` x in_features
tokens would be calibrated on a nearly singular Hessian; it falls back to the Hessian of all tokens of
the layer (every token through that expert's gate/up for down_proj). The fallbacks are counted in
quantization_config.

Resume and safety: everything happens in a hidden staging folder next to the output, `.NAME.partial`.
After each layer its quantized tensors go to `layer-NNNNN.safetensors`, the next layer's inputs to
`hidden-NNNNN.safetensors`, then `state.json` records the layer as done (each file written under a
temporary name and renamed). A conversion started again with the same settings continues after the
last finished layer. The model folder is assembled inside the staging folder by the streaming writer
and renamed into place at the very end, so a folder at the output path is always a finished model.

    moedesk-cli convert --model HF_DIR --bpw B --out DIR [--calibration FILE] [--head-bits H]

The default calibration text (data/calibration.txt) is the Declaration of Independence and the
Gettysburg Address, both public domain.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.options import CONVERT_CALIBRATION_ROWS, CONVERT_CALIBRATION_SEQ_LEN, CONVERT_HEAD_BITS

from . import allocate
from . import format as fmt
from .gptq import DAMP_PER_INPUT, DEFAULT_DAMP, HessianAccumulator, quantize_gptq
from .writer import ModelWriter, exllamav2_config, quantization_config

ARCHITECTURES = {     # HF class -> (transformers module, decoder layer, rotary embedding, RMS norm)
    "LlamaForCausalLM": ("llama", "LlamaDecoderLayer", "LlamaRotaryEmbedding", "LlamaRMSNorm"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3DecoderLayer", "Qwen3RotaryEmbedding", "Qwen3RMSNorm"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeDecoderLayer", "Qwen3MoeRotaryEmbedding", "Qwen3MoeRMSNorm"),
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MIN_EXPERT_TOKENS_PER_INPUT = 2      # expert tokens below this x in_features -> all-token Hessian
DISK_MARGIN = 64 << 20               # bytes kept free beyond the estimate
BATCH_ROWS = 4                       # calibration sequences per forward

Say = Callable[[str], None]


class ConvertError(RuntimeError):
    """A conversion that cannot go on; the message says what is wrong and where."""


# ---------------------------------------------------------------------------------------------
# The source checkpoint

class Checkpoint:
    """An HF model folder: config.json plus safetensors weights, read one tensor at a time."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise ConvertError(f"{self.path}: no config.json; expected a Hugging Face model folder")
        try:
            self.config = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise ConvertError(f"{cfg_file}: unreadable ({e})") from e
        archs = self.config.get("architectures") or []
        self.arch = next((a for a in archs if a in ARCHITECTURES), None)
        if self.arch is None:
            raise ConvertError(f"{cfg_file}: architecture {archs} is not supported; the converter handles "
                               f"{', '.join(ARCHITECTURES)}")
        if self.config.get("quantization_config"):
            raise ConvertError(f"{cfg_file}: the checkpoint is already quantized "
                               f"({self.config['quantization_config'].get('quant_method', '?')}); "
                               f"convert the original fp16/bf16 weights")
        self.shard_of = self._shards()
        self._open: dict[str, object] = {}

    def _shards(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ConvertError(f"{index}: not a safetensors index ({e})") from e
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise ConvertError(f"{self.path}: missing shards {', '.join(missing)} named in "
                                   f"model.safetensors.index.json; download them first")
            return {name: self.path / f for name, f in weight_map.items()}
        single = self.path / "model.safetensors"
        if single.is_file():
            with safe_open(single, "pt") as f:
                return {name: single for name in f.keys()}
        pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ConvertError(f"{self.path}: weights are pickle files ({', '.join(pickles)}), which can run code "
                               f"when loaded and are refused; use a safetensors copy of the model")
        raise ConvertError(f"{self.path}: no model.safetensors or model.safetensors.index.json")

    def has(self, name: str) -> bool:
        return name in self.shard_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self.shard_of:
            raise ConvertError(f"{self.path}: tensor {name} is missing from the checkpoint")
        shard = str(self.shard_of[name])
        if shard not in self._open:
            self._open = {shard: safe_open(shard, "pt")}       # one shard open at a time
        return self._open[shard].get_tensor(name).to(torch.float32)

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in set(self.shard_of.values()))


# ---------------------------------------------------------------------------------------------
# Calibration data

def calibration_ids(tokenizer, text: str, rows: int, seq_len: int, source: str) -> torch.Tensor:
    """[rows', seq_len] token ids cut from the text (rows' <= rows: as many as the text fills)."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    n = min(rows, ids.numel() // seq_len)
    if n < 1:
        raise ConvertError(f"{source}: calibration text has {ids.numel()} tokens; at least {seq_len} are needed")
    return ids[: n * seq_len].view(n, seq_len)


# ---------------------------------------------------------------------------------------------
# Staging: resumable state in a hidden folder next to the output

def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _write_state(staging: Path, state: dict) -> None:
    tmp = staging / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, staging / "state.json")


def _check_disk(where: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    if free < need + DISK_MARGIN:
        raise ConvertError(f"{where}: not enough disk space to {what}: {need / 2**20:.0f} MiB needed "
                           f"(+{DISK_MARGIN >> 20} MiB margin), {free / 2**20:.0f} MiB free")


def staging_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.partial"


# ---------------------------------------------------------------------------------------------
# One decoder layer

def _classes(arch: str):
    mod_name, layer_cls, rope_cls, norm_cls = ARCHITECTURES[arch]
    mod = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
    return getattr(mod, layer_cls), getattr(mod, rope_cls), getattr(mod, norm_cls)


def _load_layer(layer: torch.nn.Module, ckpt: Checkpoint, prefix: str) -> None:
    """Fill a decoder-layer module from the checkpoint; fused expert parameters are built from the
    per-expert tensors of HF checkpoints when the fused ones are not stored."""
    state = {}
    for key, param in layer.state_dict().items():
        full = prefix + key
        if ckpt.has(full):
            state[key] = ckpt.get(full)
        elif key.endswith("experts.gate_up_proj"):
            base = full[: -len("gate_up_proj")]
            state[key] = torch.stack([torch.cat([ckpt.get(f"{base}{e}.gate_proj.weight"),
                                                 ckpt.get(f"{base}{e}.up_proj.weight")]) for e in range(param.shape[0])])
        elif key.endswith("experts.down_proj"):
            base = full[: -len("down_proj")]
            state[key] = torch.stack([ckpt.get(f"{base}{e}.down_proj.weight") for e in range(param.shape[0])])
        else:
            raise ConvertError(f"{ckpt.path}: tensor {full} is missing from the checkpoint")
        if state[key].shape != param.shape:
            raise ConvertError(f"{ckpt.path}: {full} has shape {list(state[key].shape)}, the config implies "
                               f"{list(param.shape)}")
    layer.load_state_dict(state)


class _Collector:
    """Hooks that sum each linear's (and each expert's) input Hessian while the layer runs."""

    def __init__(self, layer: torch.nn.Module):
        self.acc: dict[str, HessianAccumulator] = {}
        self.experts: dict[str, torch.nn.Module] = {}
        self.handles = []
        for name, mod in layer.named_modules():
            if isinstance(mod, torch.nn.Linear):
                self.handles.append(mod.register_forward_pre_hook(self._linear_hook(name)))
            elif hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and hasattr(mod, "num_experts"):
                self.experts[name] = mod
                self.handles.append(mod.register_forward_pre_hook(self._expert_hook(name, mod)))
        self.routed: dict[str, int] = {}

    def _get(self, key: str, width: int) -> HessianAccumulator:
        if key not in self.acc:
            self.acc[key] = HessianAccumulator(width)
        return self.acc[key]

    def _linear_hook(self, name):
        def hook(_mod, args):
            self._get(name, args[0].shape[-1]).add(args[0])
        return hook

    def _expert_hook(self, name, mod):
        def hook(_mod, args):
            x, top_k_index = args[0], args[1]
            with torch.no_grad():
                self._get(f"{name}.*all.in", x.shape[-1]).add(x)
                for e in range(mod.num_experts):
                    mine = (top_k_index == e).any(dim=-1)
                    gate, up = torch.nn.functional.linear(x, mod.gate_up_proj[e]).chunk(2, dim=-1)
                    inter = mod.act_fn(gate) * up
                    self._get(f"{name}.{e}.*all.down", inter.shape[-1]).add(inter)
                    if mine.any():
                        self._get(f"{name}.{e}.in", x.shape[-1]).add(x[mine])
                        self._get(f"{name}.{e}.down", inter.shape[-1]).add(inter[mine])
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _run_layer(layer, rotary, hidden: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(hidden)
    pos = torch.arange(hidden.shape[1]).unsqueeze(0)
    with torch.no_grad():
        for r in range(0, hidden.shape[0], BATCH_ROWS):
            h = hidden[r:r + BATCH_ROWS]
            pe = rotary(h, pos.expand(h.shape[0], -1))
            y = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            out[r:r + BATCH_ROWS] = y[0] if isinstance(y, tuple) else y
    return out


def _jobs(layer, prefix: str, stats: dict, collector: _Collector):
    """(name, weight, Hessian accumulator, set dequantized weight) for every linear of the layer, experts included."""
    jobs = []
    for name, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear):
            if name not in collector.acc:
                raise ConvertError(f"{prefix}{name}: received no calibration input")
            jobs.append((f"{prefix}{name}", mod.weight.data, collector.acc[name],
                         lambda d, mod=mod: setattr(mod.weight, "data", d)))
    for name, mod in collector.experts.items():
        hidden_in, inter = mod.gate_up_proj.shape[-1], mod.down_proj.shape[-1]
        for e in range(mod.num_experts):
            routed = collector.acc.get(f"{name}.{e}.in")
            if (routed.tokens if routed else 0) < MIN_EXPERT_TOKENS_PER_INPUT * hidden_in:
                h_in, h_down = collector.acc[f"{name}.*all.in"], collector.acc[f"{name}.{e}.*all.down"]
                stats["experts_all_token_fallback"] += 1
            else:
                h_in, h_down = routed, collector.acc[f"{name}.{e}.down"]
                stats["experts_routed"] += 1
            gu, down = mod.gate_up_proj.data[e], mod.down_proj.data[e]
            key = f"{prefix}{name}.{e}"
            jobs += [(f"{key}.gate_proj", gu[:inter], h_in, lambda d, gu=gu: gu[:inter].copy_(d)),
                     (f"{key}.up_proj", gu[inter:], h_in, lambda d, gu=gu: gu[inter:].copy_(d)),
                     (f"{key}.down_proj", down, h_down, lambda d, down=down: down.copy_(d))]
    return jobs


def _quantize_layer(layer, prefix: str, bits, group_size: int, damp: float, stats: dict,
                    collector: _Collector, measure: bool) -> dict[str, torch.Tensor]:
    """GPTQ every linear of the layer (in place: weights become the dequantized ones); -> tensors to write.
    With `measure`, each linear's width is chosen among candidates by measured error (allocate.py)."""
    jobs = _jobs(layer, prefix, stats, collector)
    widths = allocate.candidates(bits) if measure else [bits]
    results, errors = {}, {}
    for key, w, acc, _ in jobs:
        for b in widths:
            q = quantize_gptq(w, acc.h, b, group_size, damp=damp, tokens=acc.tokens, name=key)
            deq = fmt.dequantize(q, out_features=w.shape[0])
            results[key, b] = (q, deq)
            if measure:
                errors.setdefault(key, {})[b] = (allocate.code_bits(q), allocate.relative_error(w, deq, acc.h))
    chosen = allocate.allocate(errors, {k: w.numel() for k, w, _, _ in jobs}, bits) if measure else {}
    tensors = {}
    for key, w, _, set_weight in jobs:
        b = chosen.get(key, bits)
        q, deq = results[key, b]
        tensors.update({f"{key}.{k}": v for k, v in q.items()})
        stats["code_bits"] = stats.get("code_bits", 0) + allocate.code_bits(q) * w.numel()
        stats["weights"] = stats.get("weights", 0) + w.numel()
        set_weight(deq)
    for key, value in layer.state_dict().items():                # norms, router: fp16 as they are
        if value.dim() == 1 or key.endswith("gate.weight"):
            tensors[f"{prefix}{key}"] = value.to(torch.float16)
    return tensors


# ---------------------------------------------------------------------------------------------
# The whole model

def convert(model_dir: str | os.PathLike, out_dir: str | os.PathLike, bits: float, *,
            head_bits: int = CONVERT_HEAD_BITS, calibration_text: str, calibration_source: str = "calibration",
            rows: int = CONVERT_CALIBRATION_ROWS, seq_len: int = CONVERT_CALIBRATION_SEQ_LEN,
            group_size: int = 128, damp: float = DEFAULT_DAMP, say: Say = print,
            measure: bool = False, stop_after_layers: int | None = None) -> Path:
    """Convert an HF checkpoint into an EXL2 folder at out_dir; -> out_dir.

    Resumes from the staging folder when one with the same settings exists. `stop_after_layers`
    stops (ConvertError) once that many layers are done in this run: what an interruption leaves.
    """
    from transformers import AutoConfig, AutoTokenizer

    fmt.resolve_bits(bits, name="bits")
    fmt.resolve_bits(head_bits, name="head_bits")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ConvertError(f"{out_dir}: already exists; choose another output folder or remove it")
    ckpt = Checkpoint(model_dir)
    cfg = AutoConfig.from_pretrained(ckpt.path)
    cfg._attn_implementation = "sdpa"
    layer_cls, rope_cls, norm_cls = _classes(ckpt.arch)
    n_layers = cfg.num_hidden_layers
    tied = bool(ckpt.config.get("tie_word_embeddings", False))
    settings = {"source": str(ckpt.path.resolve()), "bits": float(bits), "head_bits": int(head_bits),
                "group_size": group_size, "damp": damp, "damp_per_input": DAMP_PER_INPUT, "measure": measure,
                "rows": rows, "seq_len": seq_len,
                "calibration_sha256": hashlib.sha256(calibration_text.encode()).hexdigest()}

    staging = staging_dir(out_dir)
    state = {"settings": settings, "layers_done": 0, "rows_used": 0,
             "stats": {"experts_routed": 0, "experts_all_token_fallback": 0}}
    if (staging / "state.json").is_file():
        old = json.loads((staging / "state.json").read_text())
        if old.get("settings") != settings:
            raise ConvertError(f"{staging}: an interrupted conversion with other settings is there; run it again "
                               f"with the same settings to resume, or remove that folder to start over")
        state = old
        say(f"resuming after layer {state['layers_done']} of {n_layers}")
    else:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir(exist_ok=True)
    # output ~ bits/8 of the fp32 count, kept twice at the end (layer files + assembled model)
    _check_disk(staging, int(ckpt.total_bytes() / 2 * max(bits, head_bits) / 8 * 2), "convert this model")

    k = state["layers_done"]
    if k == 0:
        tok = AutoTokenizer.from_pretrained(ckpt.path)
        ids = calibration_ids(tok, calibration_text, rows, seq_len, calibration_source)
        hidden = torch.nn.functional.embedding(ids, ckpt.get("model.embed_tokens.weight"))
        state["rows_used"] = ids.shape[0]
    else:
        with safe_open(str(staging / f"hidden-{k:05d}.safetensors"), "pt") as f:
            hidden = f.get_tensor("hidden")
    rotary = rope_cls(config=cfg)
    done_now = 0
    for i in range(k, n_layers):
        if stop_after_layers is not None and done_now >= stop_after_layers:
            raise ConvertError(f"conversion stopped after layer {i} of {n_layers}; run it again to resume")
        prefix = f"model.layers.{i}."
        layer = layer_cls(cfg, layer_idx=i).float().eval()
        _load_layer(layer, ckpt, prefix)
        collector = _Collector(layer)
        _run_layer(layer, rotary, hidden)
        collector.remove()
        tensors = _quantize_layer(layer, prefix, bits, group_size, damp, state["stats"], collector, measure)
        del collector
        hidden = _run_layer(layer, rotary, hidden)
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + hidden.numel() * 4
        _check_disk(staging, need, f"write layer {i}")
        try:
            _atomic_save(tensors, staging / f"layer-{i:05d}.safetensors")
            _atomic_save({"hidden": hidden}, staging / f"hidden-{i + 1:05d}.safetensors")
        except OSError as e:
            raise ConvertError(f"{staging}: writing layer {i} failed ({e}); free space and run again to resume") from e
        state["layers_done"] = i + 1
        _write_state(staging, state)
        (staging / f"hidden-{i:05d}.safetensors").unlink(missing_ok=True)
        done_now += 1
        say(f"layer {i + 1}/{n_layers} quantized")

    head = None
    if not tied:
        norm = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norm.weight.data = ckpt.get("model.norm.weight")
        acc = HessianAccumulator(cfg.hidden_size)
        with torch.no_grad():
            acc.add(norm(hidden))
        head = quantize_gptq(ckpt.get("lm_head.weight"), acc.h, head_bits, group_size, damp=damp, tokens=acc.tokens,
                             name="lm_head")
    del hidden

    config = exllamav2_config(ckpt.config)
    config["quantization_config"] = {
        **quantization_config(bits, head_bits), "method": "gptq", "act_order": True, "damp": damp,
        "damp_floor": f"{DAMP_PER_INPUT} x in_features / calibration tokens",
        "group_size": group_size, "calibration": {"source": calibration_source, "rows": state["rows_used"],
                                                  "seq_len": seq_len, "sha256": settings["calibration_sha256"]},
        "min_expert_tokens_per_input": MIN_EXPERT_TOKENS_PER_INPUT, "measured_allocation": measure,
        **{k: v for k, v in state["stats"].items() if k not in ("code_bits", "weights")},
        "linear_bits": round(state["stats"]["code_bits"] / max(state["stats"]["weights"], 1), 4)}
    assembled = staging / "model"
    if assembled.exists():
        shutil.rmtree(assembled)
    try:
        with ModelWriter(assembled) as writer:
            writer.add("model.embed_tokens.weight", ckpt.get("model.embed_tokens.weight").to(torch.float16))
            for i in range(n_layers):
                with safe_open(str(staging / f"layer-{i:05d}.safetensors"), "pt") as f:
                    for name in f.keys():
                        writer.add(name, f.get_tensor(name))
            writer.add("model.norm.weight", ckpt.get("model.norm.weight").to(torch.float16))
            if head is not None:
                writer.add_all("lm_head", head)
            writer.finish(config)
    except OSError as e:
        raise ConvertError(f"{assembled}: writing the model failed ({e}); free space and run again") from e
    for extra in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                  "generation_config.json", "chat_template.jinja"):
        if (ckpt.path / extra).is_file():
            shutil.copy2(ckpt.path / extra, assembled / extra)
    os.replace(assembled, out_dir)
    shutil.rmtree(staging)
    say(f"wrote {out_dir}")
    return out_dir


# ---------------------------------------------------------------------------------------------
# moedesk-cli convert

DEFAULT_CALIBRATION = Path(__file__).parent / "data" / "calibration.txt"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model folder (config.json + safetensors)")
    p.add_argument("--bpw", type=float, required=True, help="bits per weight of the quantized linears (2..8)")
    p.add_argument("--out", required=True, help="output folder (must not exist; an interrupted run resumes)")
    p.add_argument("--calibration", help="UTF-8 text file to calibrate on (default: a public-domain English text)")
    p.add_argument("--head-bits", type=int, default=CONVERT_HEAD_BITS,
                   help=f"bits of lm_head (default {CONVERT_HEAD_BITS})")
    p.add_argument("--measure", action="store_true",
                   help="choose each linear's width by measured error to hit --bpw on average (5x slower)")
    p.add_argument("--rows", type=int, default=CONVERT_CALIBRATION_ROWS,
                   help=f"calibration sequences (default {CONVERT_CALIBRATION_ROWS})")
    p.add_argument("--seq-len", type=int, default=CONVERT_CALIBRATION_SEQ_LEN,
                   help=f"tokens per calibration sequence (default {CONVERT_CALIBRATION_SEQ_LEN})")


def run(args: argparse.Namespace) -> int:
    cal = Path(args.calibration) if args.calibration else DEFAULT_CALIBRATION
    try:
        if args.rows < 1 or args.seq_len < 8:
            raise ConvertError(f"--rows must be >= 1 and --seq-len >= 8, got {args.rows} and {args.seq_len}")
        try:
            text = cal.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConvertError(f"{cal}: cannot read the calibration text ({e})") from e
        convert(args.model, args.out, args.bpw, head_bits=args.head_bits, calibration_text=text,
                calibration_source=cal.name, rows=args.rows, seq_len=args.seq_len, measure=args.measure)
        return 0
    except (ConvertError, fmt.Exl2FormatError) as e:
        print(f"moedesk-cli convert: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"moedesk-cli convert: stopped; the finished layers are kept in {staging_dir(Path(args.out))}, "
              f"run the same command again to resume", file=sys.stderr)
        return 130
