"""Requantizing an EXL2 model's experts to a lower width, without the model's bf16 checkpoint.

    moedesk-cli requantize --model EXL2_DIR --bpw B --out DIR [--experts all|cold] [--cold-share F]
                           [--linears experts|mlp] [--calibration FILE] [--rows R] [--seq-len T] [--device D]

A model imported from a 4-bit build (or converted by us) can be made smaller where its experts take the room:
the converter runs on the EXL2 folder itself (`Exl2Source` reads it as convert.py reads a Hugging Face folder,
each quantized linear dequantized on read: EXL2's values are fp16 values, so this is the model as it runs),
calibrated on its own activations of the calibration text, layer by layer as a conversion is. The linears
chosen (`--linears experts`: the routed experts; `mlp`: every MLP projection, for dense models such as the
demo) are quantized again by GPTQ at --bpw (the measured allocation spreads the bits among them); every other
linear, the router, norms, embeddings and head are copied as they are stored, bit for bit. `--experts cold`
requantizes only the share `--cold-share` of each layer's experts that the calibration routed fewest tokens
to (the ones the offload keeps in RAM), the others are copied. The error of the source's quantization is
not undone: the new codes approximate the source's weights, so the result is a little worse than converting
the bf16 weights at the same width (docs/converter.md has the measured cost on the demo).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from runtime import modelfolder, qwen35
from runtime.modelfolder import EXL2_PARTS, InvalidModel, ModelFolder, stored_name

from . import convert as cv
from . import convert_args

SELECTIONS = {"experts": re.compile(r"\.experts\.\d+\.(gate|up|down)_proj$"),
              "mlp": re.compile(r"\.mlp\.(experts\.\d+\.)?(gate|up|down)_proj$")}
COLD_SHARE = 0.5            # --experts cold: this share of each layer's experts, the least routed


class Exl2Source:
    """An EXL2 folder read as convert.Checkpoint reads a Hugging Face folder (tensors by their Hugging Face names,
    quantized linears dequantized to fp16), with what the converter copies instead of quantizing (`keeps`) and
    which experts it quantizes again (`requantized`)."""

    def __init__(self, path, linears: str = "experts", experts: str = "all", cold_share: float = COLD_SHARE):
        try:
            self.folder = ModelFolder(path)
        except (InvalidModel, modelfolder.ModelNotFound, modelfolder.UnsupportedArchitecture) as e:
            raise cv.ConvertError(str(e)) from None
        if not self.folder.info.is_exl2:
            raise cv.ConvertError(f"{path}: not an EXL2 model (no quantized linears); convert its weights instead")
        self.path = self.folder.path
        self.config = modelfolder.read_json(self.path / "config.json", "config.json")
        self.sizes = self.folder.info.config            # flattened and bounded by the loader (convert_check.Source's)
        arch = self.config["architectures"][0]
        if arch not in cv.ARCHITECTURES and arch not in qwen35.ARCHITECTURES or arch == cv.convert_dbrx.ARCH:
            raise cv.ConvertError(f"{self.path / 'config.json'}: requantizing {arch} is not supported; it handles "
                                  f"{', '.join(a for a in (*cv.ARCHITECTURES, *qwen35.ARCHITECTURES) if a != cv.convert_dbrx.ARCH)}")
        if linears not in SELECTIONS or experts not in ("all", "cold") or not 0 < cold_share <= 1:
            raise cv.ConvertError(f"requantize: --linears must be one of {', '.join(SELECTIONS)}, --experts all or "
                                  f"cold, --cold-share in (0, 1]; got {linears}, {experts}, {cold_share}")
        self.arch, self.linears, self.experts, self.cold_share = arch, linears, experts, cold_share
        self.settings = {"requantize": {"linears": linears, "experts": experts, "cold_share": cold_share}}
        self.shard_of: dict[str, Path] = {}
        for name, shard in self.folder.info.shard_of.items():
            prefix, _, part = name.rpartition(".")
            if part in EXL2_PARTS and part != "q_weight":
                continue
            self.shard_of[f"{prefix}.weight" if part == "q_weight" else name] = self.path / shard

    def has(self, name: str) -> bool:
        return name in self.shard_of

    def _quantized(self, prefix: str) -> bool:
        return self.folder.has(f"{prefix}.q_weight")

    def get_raw(self, name: str) -> torch.Tensor:
        """The tensor as stored, a quantized linear's weight dequantized (fp16, as the engines compute with it)."""
        if name not in self.shard_of:
            raise cv.ConvertError(f"{self.path}: tensor {name} is missing from the model")
        prefix = name[:-len(".weight")] if name.endswith(".weight") else None
        if prefix is not None and self._quantized(prefix):
            return self.folder.linear(prefix, torch.float16)
        return self.folder.tensor(name)

    def get(self, name: str) -> torch.Tensor:
        return self.get_raw(name).to(torch.float32)

    def total_bytes(self) -> int:
        return self.folder.info.size_bytes

    def stored(self, key: str) -> dict[str, torch.Tensor] | None:
        """The tensors the folder stores for the linear `key` (the converter's name for it): its EXL2 set, or
        {"weight": ...} where it is kept plain; None where the folder has no such linear."""
        name = stored_name(self.arch, key)
        if self._quantized(name):
            return {part: self.folder.tensor(f"{name}.{part}") for part in EXL2_PARTS}
        return {"weight": self.folder.tensor(f"{name}.weight")} if self.folder.has(f"{name}.weight") else None

    def keeps(self, key: str) -> dict[str, torch.Tensor] | None:
        """What to copy for the linear `key` instead of quantizing it: its stored tensors unless it is chosen."""
        return None if SELECTIONS[self.linears].search(key) else self.stored(key)

    def requantized(self, key: str, counts: torch.Tensor) -> list[int]:
        """Which experts of the experts module `key` to quantize again, from the calibration's routed counts:
        all, or (cold) the least routed share of them (fewest first, lower index on ties)."""
        n = counts.shape[0]
        if not SELECTIONS[self.linears].search(f"{key}.0.gate_proj"):
            return []
        if self.experts == "all":
            return list(range(n))
        order = sorted(range(n), key=lambda e: (int(counts[e]), e))
        return sorted(order[:max(1, round(self.cold_share * n))])


def requantize(model_dir, out_dir, bits: float, *, linears: str = "experts", experts: str = "all",
               cold_share: float = COLD_SHARE, **convert_kwargs) -> Path:
    """Quantize an EXL2 folder's chosen linears again at `bits` into out_dir (convert.convert's other arguments:
    calibration_text, rows, seq_len, device, measure, ...); -> out_dir."""
    source = Exl2Source(model_dir, linears, experts, cold_share)
    return cv.convert(source, out_dir, bits, **convert_kwargs)


# ---------------------------------------------------------------------------------------------
# moedesk-cli requantize

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="EXL2 model folder (imported or converted)")
    p.add_argument("--bpw", type=float, required=True, help="stored bits per weight of the requantized linears")
    p.add_argument("--out", required=True, help="output folder (must not exist; an interrupted run resumes)")
    p.add_argument("--linears", choices=tuple(SELECTIONS), default="experts",
                   help="which linears to quantize again: the routed experts (default) or every MLP projection")
    p.add_argument("--experts", choices=("all", "cold"), default="all",
                   help="all the experts, or only each layer's least routed share (--cold-share)")
    p.add_argument("--cold-share", type=float, default=COLD_SHARE,
                   help=f"share of each layer's experts that --experts cold requantizes (default {COLD_SHARE})")
    convert_args.add_calibration_arguments(p)


def run(args: argparse.Namespace) -> int:
    return cv.run_with(args, "requantize", lambda kw: requantize(
        args.model, args.out, args.bpw, linears=args.linears, experts=args.experts, cold_share=args.cold_share, **kw))
