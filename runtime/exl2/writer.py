"""Streaming EXL2 model writer: tensors go to disk one at a time, into safetensors shards of bounded size.

Each shard is written front to back: a header area of fixed size is reserved, tensor bytes follow as
they arrive, and at the end the JSON header is written into the reserved area, padded with spaces
(safetensors allows trailing whitespace in the header). Memory stays at one tensor plus the header
entries, whatever the model size. When all tensors are in, shards get their final
`model-0000i-of-0000n.safetensors` names and `model.safetensors.index.json` and `config.json` are
written. Only the dtypes exllamav2's loader reads are accepted (F16, BF16, F32, I32, I16).

`quantize_model` turns an HF state dict (iterable of (name, tensor)) into an EXL2 model folder the way
exllamav2's converter lays it out: attention and MLP / expert projections quantized at `bits`,
`lm_head` at `head_bits` (absent when tied to the embeddings), everything else (embeddings, norms,
the MoE router `mlp.gate`) in fp16.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from runtime.modelfolder import stored_name

from . import format as fmt

SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
                      torch.int32: "I32", torch.int16: "I16"}
DEFAULT_SHARD_BYTES = 4 * 2**30
EXL2_VERSION = "0.3.2"              # the exllamav2 release whose format this writes

ProgressFn = Callable[[int, int], None]      # (done, total)


class _Shard:
    """One safetensors file being written front to back."""

    def __init__(self, path: Path, header_reserve: int):
        self.path = path
        self.reserve = header_reserve
        self.entries: dict[str, dict] = {}
        self.header_len = 64                        # '{"__metadata__":{"format":"pt"}}' and braces
        self.data_bytes = 0
        self.file = open(path, "wb")
        self.file.seek(8 + header_reserve)

    def fits(self, name: str, nbytes: int, max_bytes: int) -> bool:
        entry_len = len(name) + 96
        room_header = self.header_len + entry_len <= self.reserve
        room_data = self.data_bytes == 0 or self.data_bytes + nbytes <= max_bytes
        return room_header and room_data

    def write(self, name: str, tensor: torch.Tensor) -> None:
        flat = tensor.reshape(-1).view(torch.uint8)
        self.file.write(flat.numpy().data)
        end = self.data_bytes + flat.numel()
        self.entries[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self.data_bytes, end]}
        self.data_bytes = end
        self.header_len += len(json.dumps({name: self.entries[name]})) + 1

    def finish(self) -> None:
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        if len(header) > self.reserve:                      # fits() keeps a margin; this is a bug guard
            raise RuntimeError(f"{self.path.name}: header of {len(header)} bytes exceeds its reserved space")
        self.file.seek(0)
        self.file.write(struct.pack("<Q", self.reserve) + header + b" " * (self.reserve - len(header)))
        self.file.close()


@dataclass
class WrittenModel:
    path: Path
    shards: list[str] = field(default_factory=list)
    num_tensors: int = 0
    total_bytes: int = 0


class ModelWriter:
    """Usage: with ModelWriter(dir) as w: w.add(name, t) ...; w.finish(config) -> WrittenModel."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 header_reserve: int = 1 << 20):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.header_reserve = header_reserve
        self.done: list[_Shard] = []
        self.shard: _Shard | None = None
        self.names: set[str] = set()
        self.finished = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise ValueError(f"{name}: tensor written twice")
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} is not one exllamav2 reads "
                             f"({', '.join(SAFETENSORS_DTYPES.values())})")
        tensor = tensor.detach().cpu().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self.shard is None or not self.shard.fits(name, nbytes, self.max_shard_bytes):
            self._close_shard()
            self.shard = _Shard(self.out_dir / f"model-{len(self.done) + 1:05d}.safetensors.partial",
                                self.header_reserve)
        self.shard.write(name, tensor)
        self.names.add(name)

    def add_all(self, prefix: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """A quantized linear's tensor set under `prefix.` (q_weight, q_scale, ...)."""
        for k, t in tensors.items():
            self.add(f"{prefix}.{k}", t)

    def _close_shard(self) -> None:
        if self.shard is not None:
            self.shard.finish()
            self.done.append(self.shard)
            self.shard = None

    def finish(self, config: dict) -> WrittenModel:
        """Close the last shard, name the shards, write the index and config.json."""
        self._close_shard()
        if not self.done:
            raise ValueError(f"{self.out_dir}: no tensors were written")
        result = WrittenModel(self.out_dir)
        weight_map = {}
        for i, shard in enumerate(self.done):
            final = f"model-{i + 1:05d}-of-{len(self.done):05d}.safetensors"
            os.replace(shard.path, self.out_dir / final)
            result.shards.append(final)
            result.total_bytes += shard.data_bytes
            for name in shard.entries:
                weight_map[name] = final
        result.num_tensors = len(weight_map)
        index = {"metadata": {"total_size": result.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (self.out_dir / "config.json").write_text(json.dumps(config, indent=2))
        self.finished = True
        return result

    def abort(self) -> None:
        """Remove what was written (on error)."""
        if self.shard is not None:
            self.shard.file.close()
            self.done.append(self.shard)
            self.shard = None
        for shard in self.done:
            shard.path.unlink(missing_ok=True)
        self.done = []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.finished:
            self.abort()


# ---------------------------------------------------------------------------------------------
# HF state dict -> EXL2 folder

_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                     r"|mlp\.experts\.\d+\.(gate|up|down)_proj"
                     r"|block_sparse_moe\.experts\.\d+\.(w1|w2|w3|v1))\.weight$")   # experts as stored (Mixtral, DBRX)
_SKIP = re.compile(r"rotary_emb\.inv_freq$")
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _split_fused_experts(name: str, tensor: torch.Tensor):
    """transformers >= 5 keeps experts fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj
    [E, H, I]. exllamav2 reads one linear per expert: experts.{e}.gate_proj / up_proj / down_proj."""
    prefix, kind = _FUSED_EXPERTS.match(name).groups()
    if tensor.dim() != 3:
        raise ValueError(f"{name}: expected fused experts [E, out, in], got shape {list(tensor.shape)}")
    for e in range(tensor.shape[0]):
        if kind == "down_proj":
            yield f"{prefix}.{e}.down_proj", tensor[e]
        else:
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj", gate
            yield f"{prefix}.{e}.up_proj", up


def quantization_config(bits: float, head_bits: float) -> dict:
    return {"quant_method": "exl2", "version": EXL2_VERSION, "bits": float(bits), "head_bits": int(head_bits)}


def exllamav2_config(hf_config: dict) -> dict:
    """config.json for exllamav2, which reads the keys of transformers 4.x: transformers 5's
    `to_dict()` moves rope_theta / rope scaling into `rope_parameters` and torch_dtype to `dtype`."""
    cfg = dict(hf_config)
    archs = cfg.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ValueError(f"config: 'architectures' must name the model class (e.g. ['LlamaForCausalLM']), "
                         f"got {archs!r}")
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" not in cfg and "rope_theta" in rope:
            cfg["rope_theta"] = rope["rope_theta"]
        if cfg.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) == "yarn" \
            and "original_max_position_embeddings" not in scaling:      # exllamav2 needs it; transformers' default
        cfg["rope_scaling"] = {**scaling, "original_max_position_embeddings": cfg.get(
            "original_max_position_embeddings") or cfg.get("max_position_embeddings")}
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "float16"
    return cfg


def quantize_model(named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                   hf_config: dict, bits: float, head_bits: int, out_dir: str | os.PathLike,
                   progress: ProgressFn | None = None, *, group_size: int = 128, total: int | None = None,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> WrittenModel:
    """Quantize an HF model's tensors into an EXL2 folder (weights + index + config.json).

    Tensors are consumed one at a time (pass a generator to keep memory at one tensor). `total`
    defaults to len(named_tensors) when it has one; progress gets (tensors done, total).
    """
    fmt.resolve_bits(bits, name="bits")                 # fail before any work, not at the last tensor
    fmt.resolve_bits(head_bits, name="head_bits")
    config = exllamav2_config(hf_config)
    arch = config["architectures"][0]
    tied = bool(config.get("tie_word_embeddings", False))
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    if total is None:
        total = len(named_tensors) if hasattr(named_tensors, "__len__") else 0
    done = 0
    with ModelWriter(out_dir, max_shard_bytes) as writer:
        for name, tensor in items:
            if _FUSED_EXPERTS.match(name):
                for prefix, weight in _split_fused_experts(name, tensor):
                    prefix = stored_name(arch, prefix)
                    writer.add_all(prefix, fmt.quantize(weight, bits, group_size, name=prefix))
            elif _LINEAR.match(name) or (name == "lm_head.weight" and not tied):
                b = head_bits if name == "lm_head.weight" else bits
                prefix = stored_name(arch, name[: -len(".weight")])
                writer.add_all(prefix, fmt.quantize(tensor, b, group_size, name=prefix))
            elif name == "lm_head.weight" or _SKIP.search(name):
                pass                                        # tied to the embeddings / a buffer
            elif tensor.is_floating_point():
                writer.add(stored_name(arch, name), tensor.to(torch.float16))
            else:
                raise ValueError(f"{name}: unexpected {tensor.dtype} tensor in a model's state dict")
            done += 1
            if progress is not None:
                progress(done, max(total, done))
        config["quantization_config"] = quantization_config(bits, head_bits)
        return writer.finish(config)
