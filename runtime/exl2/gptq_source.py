"""A GPTQ-family model folder seen as the converter sees a checkpoint, and the import's work on one layer.

`Source` opens the folder through model-folder validation (runtime/modelfolder.py with `gptq=True`: links,
index, headers, config bounds, every quantized linear's tensors against its quantization_config) and offers
what convert.Checkpoint offers (`path`, `config`, `arch`, `shard_of`, `has`, `get_raw`, `get`, `total_bytes`).
A quantized linear `K` answers to `K.weight` too: the dequantized EXL2 weight it was imported as
(`import_linears`), so the converter's layers run on what the imported model will compute.

Every imported linear whose codes fit the EXL2 width carries exact scales (q_scale_exact, gptq_tensors.py), and
the nearest steps in q_scale / q_scale_max. The project's own readers take the exact ones (the CPU engine, the GPU
experts' packing, the CPU experts' packing); on a GPU, exllamav2's own Q matrix reads the linears other than the
routed experts (attention, dense MLPs, shared experts, a quantized head) and takes the steps: with the build's
codes as they are, a better model than the search's steps and re-rounded codes at the build's own width
(bench/gptq_quality.py: perplexity 53.6 against 56.0 at g32, 59.0 against 60.6 at g128, on the demo model).
`exact=False` (the bench's comparison) searches the steps for every linear, as before exact scales existed.

One layer (`LayerWork`): its quantized linears repacked into EXL2 (gptq_tensors.py); its FP16/BF16 linears
quantized at the stored width asked for, either with calibration (the converter's: the layer runs on the
calibration hidden states, Hessians and GPTQ as `moedesk-cli convert` does them, only the linears the build
kept in 16 bits are quantized) or by rounding to nearest (`calibrate=False`: no forward pass at all); routers,
norms and the small tensors EXL2 folders keep in fp16 copied as fp16.
"""
from __future__ import annotations

from pathlib import Path

import torch

from runtime import gptq_spec, qwen35
from runtime.errors import ModelFolderError
from runtime.modelfolder import MOE_ARCHITECTURES, ModelFolder, layout, read_json, stored_name
from runtime.options import IMPORT_ARCHITECTURES

from . import format as fmt
from .calibrate import CalibrationError, Collector, quantize_jobs
from .convert_qwen35 import PLAIN_LINEARS
from .gptq_tensors import RepackStats, repack_many, unpack

SAFETENSORS_DTYPE = {torch.int32: "I32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16",
                     torch.float32: "F32"}
GROUP_SIZE = 32                      # rows per scale group of the linears quantized here (the converter's)
BATCH = 64                           # quantized linears of one shape repacked together (an MoE layer's experts)


class ImportFailed(RuntimeError):
    """An import that cannot go on; the message says what is wrong and where."""


class Source:
    """A validated GPTQ-family folder, read one tensor at a time."""

    def __init__(self, path: str | Path, width: int | None = None, device: str = "cpu", exact: bool = True):
        self.path, self.exact = Path(path), exact
        try:
            raw = read_json(self.path / "config.json") if (self.path / "config.json").is_file() else None
            if isinstance(raw, dict) and gptq_spec.quant_method(raw) is None:
                raise ImportFailed(f"{self.path / 'config.json'}: no 'quantization_config': not a GPTQ-family build; "
                                   f"quantize its 16-bit weights with moedesk-cli convert instead")
            self.folder = ModelFolder(self.path, require_tokenizer=True, gptq=True)
        except ModelFolderError as e:
            raise ImportFailed(str(e)) from None
        self.config, info = raw, self.folder.info
        self.arch = info.architecture
        if self.arch not in IMPORT_ARCHITECTURES:
            raise ImportFailed(f"{self.path / 'config.json'}: architecture {self.arch} is not imported (the import "
                               f"takes {', '.join(IMPORT_ARCHITECTURES)})")
        self.spec, self.flat = info.gptq, info.config              # flat: the checked, flattened config
        self.width, self.device = width, device
        self.quantized = sorted(n[: -len(".qweight")] for n in info.shard_of if n.endswith(".qweight"))
        self.shapes = dict(layout(self.flat, set(info.shard_of)).linears)
        if self.arch in qwen35.ARCHITECTURES and qwen35.has_mtp(set(info.shard_of)):
            self.shapes.update(qwen35.mtp_layout(self.flat, set(info.shard_of)).linears)
        unknown = [p for p in self.quantized if p not in self.shapes]
        if unknown:                                                    # a vision tower's, say: not read
            self.quantized = [p for p in self.quantized if p in self.shapes]
        self.shard_of = {n: self.path / f for n, f in info.shard_of.items()}
        for p in self.quantized:                                       # K.weight: the imported weight
            self.shard_of[f"{p}.weight"] = self.shard_of[f"{p}.qweight"]
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}     # the imported linears of the layer at hand
        self._weights: dict[str, torch.Tensor] = {}                # and their dequantized weights, when asked for
        self.stats = RepackStats()

    # -- what convert.Checkpoint offers -----------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.shard_of

    def get_raw(self, name: str) -> torch.Tensor:
        prefix = name[: -len(".weight")]
        if name.endswith(".weight") and prefix in self._tensors:
            return self._weight(prefix)
        if name.endswith(".weight") and prefix in self.shapes and f"{prefix}.qweight" in self.shard_of:
            raise ImportFailed(f"{prefix}: read before it was imported (a bug of the import's order)")
        if name not in self.shard_of:
            raise ImportFailed(f"{self.path}: tensor {name} is missing from the checkpoint")
        return self.folder.tensor(name)

    def get(self, name: str) -> torch.Tensor:
        return self.get_raw(name).to(torch.float32)

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in set(self.shard_of.values()))

    # -- the quantized linears --------------------------------------------------------------------

    def under(self, prefix: str) -> list[str]:
        """The quantized linears whose names start with `prefix`."""
        return [p for p in self.quantized if p.startswith(prefix)]

    def import_linears(self, prefixes: list[str]) -> dict[str, torch.Tensor]:
        """Repack each quantized linear into EXL2 -> its tensors by stored name; its dequantized weight is made when
        asked for (`get_raw(K.weight)`) until `forget()`, and its error added to `stats`. Linears of one shape and
        width (a layer's experts) are repacked together, BATCH at a time."""
        batches: dict[tuple, list] = {}
        for p in prefixes:
            parts = {k: self.folder.tensor(f"{p}.{k}") for k in (*gptq_spec.GPTQ_PARTS, "g_idx") if self.has(f"{p}.{k}")}
            rows, cols = self.shapes[p]
            lay = gptq_spec.linear_layout(self.spec, p, rows, cols, lambda n: _header(parts, p, n),
                                          lambda n: self.path / n)
            try:
                lin = unpack(parts, self.spec, lay, p, self.device)
            except ModelFolderError as e:
                raise ImportFailed(f"{self.path}: {e.file}: {e.problem}") from None
            width = max(self.width or lay.bits, lay.bits)
            batch = batches.setdefault((rows, cols, lay.bits, width, lin.scales.shape[0]), [])
            batch.append((p, lin))
            if len(batch) == BATCH:
                self._repack(batch, width)
                batch.clear()
        for (_, _, _, width, _), batch in batches.items():
            if batch:
                self._repack(batch, width)
        out = {}
        for p in prefixes:
            out.update({f"{p}.{k}": v for k, v in self._tensors[p].items()})
        return out

    def _repack(self, batch: list, width: int) -> None:
        names = [p for p, _ in batch]
        try:
            results = repack_many([lin for _, lin in batch], width, names, self.exact)
        except ModelFolderError as e:
            raise ImportFailed(f"{self.path}: {e.file}: {e.problem}") from None
        for name, (tensors, stats) in zip(names, results):
            self.stats.add(stats, name)
            self._tensors[name] = tensors

    def _weight(self, prefix: str) -> torch.Tensor:
        if prefix not in self._weights:
            self._weights[prefix] = fmt.dequantize(self._tensors[prefix], out_features=self.shapes[prefix][0],
                                                   device=self.device)
        return self._weights[prefix]

    def forget(self) -> None:
        self._weights.clear()
        self._tensors.clear()


def _header(parts: dict, prefix: str, name: str) -> dict | None:
    """A loaded tensor as a safetensors header entry (what gptq_spec.linear_layout checks)."""
    t = parts.get(name[len(prefix) + 1:])
    if t is None:
        return None
    return {"dtype": SAFETENSORS_DTYPE.get(t.dtype, str(t.dtype)), "shape": list(t.shape)}


# ---------------------------------------------------------------------------------------------
# One layer: the 16-bit linears, rounded to nearest (no calibration)

def plain_linear(source: Source, prefix: str) -> bool:
    """A linear EXL2 folders keep in fp16 (routers; Qwen3.5's small per-head gates and shared expert gate)."""
    moe = MOE_ARCHITECTURES.get(source.arch)
    tail = prefix.rsplit(".layers.", 1)[-1].split(".", 1)[-1]
    return (moe is not None and tail == moe.router) or (source.arch in qwen35.ARCHITECTURES and tail in PLAIN_LINEARS)


def rtn_tensors(source: Source, prefix: str, bits: float, imported: set[str]) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` (a layer, the MTP head) without calibration: quantized linears as imported,
    16-bit linears rounded to nearest at `bits` stored per weight (groups of 32), the rest fp16."""
    lay = layout(source.flat, set(source.shard_of))
    plain = dict(lay.plain)
    linears = dict(source.shapes)
    if source.arch in qwen35.ARCHITECTURES and prefix.startswith(qwen35.MTP):
        mtp = qwen35.mtp_layout(source.flat, set(source.shard_of))
        plain.update(mtp.plain)
    out: dict[str, torch.Tensor] = {}
    for name, shape in plain.items():
        if not name.startswith(prefix):
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):     # stacked 16-bit experts
            out.update(_stacked_rtn(source, name, bits))
        else:
            out[name] = source.get_raw(name).to(torch.float16)
    for p in linears:
        if not p.startswith(prefix) or p in imported:
            continue
        w = source.get(f"{p}.weight")
        if plain_linear(source, p):
            out[f"{p}.weight"] = w.to(torch.float16)
            continue
        out.update({f"{stored_name(source.arch, p)}.{k}": v for k, v in _rtn(w, bits, p).items()})
    return out


def _rtn(w: torch.Tensor, bits: float, name: str) -> dict[str, torch.Tensor]:
    mix, props = fmt.stored_target(bits, w.shape[1], w.shape[0], GROUP_SIZE)
    return fmt.quantize(w, list(mix), GROUP_SIZE, bits_prop=props, name=name)


def _stacked_rtn(source: Source, name: str, bits: float) -> dict[str, torch.Tensor]:
    """Stacked experts (gate_up_proj [E, 2I, H] or down_proj [E, H, I]) split and rounded one by one."""
    base, kind = name.rsplit(".", 1)
    t, out = source.get(name), {}
    for e in range(t.shape[0]):
        parts = {"down_proj": t[e]} if kind == "down_proj" else dict(zip(("gate_proj", "up_proj"), t[e].chunk(2)))
        for part, w in parts.items():
            out.update({f"{base}.{e}.{part}.{k}": v for k, v in _rtn(w, bits, f"{base}.{e}.{part}").items()})
    return out


# ---------------------------------------------------------------------------------------------
# One layer with calibration: transformers' decoder layer (Llama, Qwen3, Qwen3-MoE, Mixtral)

def calibrated_layer(source: Source, parts, i: int, hidden: torch.Tensor, bits: float, imported: dict,
                     state: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Layer i through the converter's machinery (`parts`: convert.py's layer class, rotary, config and helpers):
    Hessians of its 16-bit linears from the calibration run, GPTQ on them (the imported ones left as they are),
    the next layer's inputs through the layer as it now is. -> (tensors to write, next hidden)."""
    prefix = f"model.layers.{i}."
    layer = parts.new_layer(parts.layer_cls, parts.cfg, i, parts.device)
    parts.load_layer(layer, source, prefix)
    collector = Collector(layer)
    parts.run_layer(layer, parts.rotary, hidden)
    collector.remove()
    jobs, experts = [], None
    for name, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear) and stored_name(source.arch, prefix + name) not in imported:
            try:
                jobs.append((prefix + name, mod.weight.data, collector.hessian(name), _setter(mod)))
            except CalibrationError as e:
                raise ImportFailed(f"{prefix}{e}") from None
    for name, inputs in collector.experts.items():   # experts the build kept in 16 bits: the converter's way
        if not any(p.startswith(stored_name(source.arch, f"{prefix}{name}.")) for p in imported):
            experts = (inputs, prefix + name, parts.hessian_budget)
    tensors = quantize_jobs(jobs, bits, GROUP_SIZE, parts.damp, state, parts.measured, experts)
    tensors = {stored_name(source.arch, k): v for k, v in tensors.items()}
    for key, value in layer.state_dict().items():     # norms, router: fp16 as the converter keeps them
        if value.dim() == 1 or key.endswith("gate.weight"):
            tensors[stored_name(source.arch, prefix + key)] = value.to(torch.float16).cpu()
    return tensors, parts.run_layer(layer, parts.rotary, hidden)


def _setter(mod):
    def set_weight(d):
        mod.weight.data = d.to(mod.weight.device)
    return set_weight


def hybrid_jobs(imported: set[str], bits: float, damp: float, state: dict, measured: bool, hessian_budget: int):
    """What convert_qwen35.HybridLayers calls to quantize a layer's jobs: the linears the build kept in 16 bits
    through GPTQ; the imported ones, and imported experts, left as they are (the caller adds their tensors)."""
    def run(jobs, experts=None):
        jobs = [j for j in jobs if j[0] not in imported]
        if experts is not None and any(p.startswith(experts[1] + ".") for p in imported):
            experts = None                            # imported: their weights stay as imported
        return quantize_jobs(jobs, bits, GROUP_SIZE, damp, state, measured,
                             None if experts is None else (*experts, hessian_budget))
    return run
