"""GPTQ-family checkpoints (GPTQ / GPTQModel, AutoRound, AWQ): their `quantization_config`, read and checked, and
the tensors each quantized linear must store. No torch: model-folder validation and the app read it too.

What the builds on the Hub store, per quantized linear `K` with W [out, in] (y = x @ W.T), b bits, G groups:

    GPTQ packing (GPTQ, GPTQModel, AutoRound's `auto_round:auto_gptq`)
      K.qweight  int32 [in * b / 32, out]   codes packed down the input rows: row i sits in word i // (32 / b)
                                            at bit (i % (32 / b)) * b, the low bits first
      K.qzeros   int32 [G, out * b / 32]    zero points packed along the output columns, the same way
      K.scales   fp16  [G, out]
      K.g_idx    int32 [in]                 the group of each input row (optional: row i // group_size)
    AWQ packing (AWQ `version: gemm`, AutoRound's `auto_round:auto_awq`)
      K.qweight  int32 [in, out * b / 32]   codes packed along the output columns, 8 nibbles of a word holding
      K.qzeros   int32 [G, out * b / 32]    columns 0, 2, 4, 6, 1, 3, 5, 7 of its eight (AWQ's order)
      K.scales   fp16  [G, out]

    W[o, i] = scales[g, o] * (q[i, o] - zero[g, o]),  g = g_idx[i]

Zero points: GPTQ v1 checkpoints (`checkpoint_format: gptq`, the default, also AutoRound's auto_gptq packing)
store zero - 1, GPTQModel's `gptq_v2` and AWQ the zero itself. Symmetric builds have zero = 2**(b-1).
`desc_act` builds quantize the input rows in another order; their `g_idx` says which group each row fell in.

Accepted: bits 4 and 8, groups of -1 (one group of all rows) or a positive multiple of 32 (EXL2 groups are
multiples of 32 rows), int32 packing, symmetric or not, desc_act either way. Every other value is refused with
the field named. `dynamic` (GPTQModel) and `extra_config` (AutoRound) give some linears other widths or
groups: then each linear's width and group count are read from its own tensors' shapes, within the same limits.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.errors import InvalidModel, UnsupportedArchitecture

METHODS = ("gptq", "auto-round", "awq")
BITS = (4, 8)
MAX_GROUP = 65536                    # EXL2's largest input width (its permutation is 16-bit)
GPTQ_PARTS = ("qweight", "qzeros", "scales")
SCALE_DTYPES = ("F16", "BF16", "F32")


@dataclass(frozen=True)
class GptqSpec:
    method: str             # "gptq" | "auto-round" | "awq"
    packing: str            # "gptq": codes down the input rows; "awq": along the output columns, interleaved
    bits: int
    group_size: int         # -1: one group of all input rows
    sym: bool
    desc_act: bool
    zero_offset: int        # added to the stored zero points (1: GPTQ v1's zero - 1)
    per_linear: bool        # widths and groups may differ per linear (read from each one's shapes)

    @property
    def label(self) -> str:
        """How the model manager names such a build: "INT4 (GPTQ)"."""
        name = {"gptq": "GPTQ", "auto-round": "AutoRound", "awq": "AWQ"}[self.method]
        return f"INT{self.bits} ({name})"


def quant_method(config: dict) -> str | None:
    """The config's `quantization_config.quant_method`, or None when it has none (a plain checkpoint)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return method if isinstance(method, str) else "?"


def _bad(path, field: str, value, why: str) -> InvalidModel:
    return InvalidModel(path, f"'quantization_config.{field}' is {value!r}: {why}")


def _refuse(path, field: str, value, why: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(path, f"'quantization_config.{field}' is {value!r}: {why}")


def _flag(qc: dict, key: str, default: bool, path) -> bool:
    value = qc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(path, key, value, "must be true or false")
    return value


def read_spec(config: dict, path: Path | str) -> GptqSpec:
    """The checked `quantization_config` of a GPTQ-family build; a named UnsupportedArchitecture for what the
    import cannot take (other methods, bits, packings), a named InvalidModel for values that make no sense."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise InvalidModel(path, f"'quantization_config' must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in METHODS:
        raise _refuse(path, "quant_method", method, f"not a build the import reads (it reads {', '.join(METHODS)})")
    bits = qc.get("bits", qc.get("w_bit"))
    if type(bits) is not int or bits not in BITS:
        raise _refuse(path, "bits", bits, "the import takes 4- or 8-bit codes")
    group = qc.get("group_size", qc.get("q_group_size"))
    if type(group) is not int or not (group == -1 or 0 < group <= MAX_GROUP and group % 32 == 0):
        raise _bad(path, "group_size", group, f"must be -1 (one group of all inputs) or a positive multiple of 32 "
                                              f"up to {MAX_GROUP} (EXL2 groups hold multiples of 32 rows)")
    pack = qc.get("pack_dtype", "int32")
    if pack != "int32":
        raise _refuse(path, "pack_dtype", pack, "only int32 packing is read")
    packing, zero_offset = "gptq", 1
    if method == "awq":
        packing, zero_offset = "awq", 0
        if qc.get("version", "gemm") not in ("gemm", "GEMM"):
            raise _refuse(path, "version", qc.get("version"), "only AWQ's gemm packing is read")
        sym = not _flag(qc, "zero_point", True, path)
        if sym:
            raise _refuse(path, "zero_point", False, "AWQ builds without zero points are not read")
    else:
        sym = _flag(qc, "sym", True, path)
    if method == "auto-round":
        fmt = qc.get("packing_format", "auto_round:auto_gptq")
        if fmt not in ("auto_round:auto_gptq", "auto_round:auto_awq"):
            raise _refuse(path, "packing_format", fmt, "the import reads auto_round:auto_gptq and auto_round:auto_awq")
        if qc.get("data_type", "int") != "int":
            raise _refuse(path, "data_type", qc.get("data_type"), "only integer codes are read")
        if fmt == "auto_round:auto_awq":
            packing, zero_offset = "awq", 0
    if packing == "awq" and bits != 4:
        raise _refuse(path, "bits", bits, "AWQ's interleaved packing is read for 4-bit codes only")
    if method == "gptq":
        key = "checkpoint_format" if "checkpoint_format" in qc or "format" not in qc else "format"  # GPTQModel's older
        fmt = qc.get(key, "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse(path, key, fmt, "the import reads gptq and gptq_v2")
        zero_offset = 0 if fmt == "gptq_v2" else 1
        if qc.get("is_marlin_format"):
            raise _refuse(path, "is_marlin_format", True, "Marlin's repacked layout is not read")
    desc_act = _flag(qc, "desc_act", False, path)
    per_linear = bool(qc.get("dynamic") or qc.get("extra_config"))
    return GptqSpec(method, packing, bits, group, sym, desc_act, zero_offset, per_linear)


def groups_of(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-in_features // group_size)


@dataclass(frozen=True)
class LinearLayout:
    """What one quantized linear stores: its width, groups and rows per group, the shapes of its tensors."""
    bits: int
    groups: int
    group_rows: int         # input rows per group where no g_idx says otherwise (row i in group i // group_rows)
    shapes: dict[str, tuple[int, ...]]


def expected(spec: GptqSpec, out: int, inp: int, bits: int | None = None, groups: int | None = None) -> LinearLayout:
    """The tensors of a linear [out, in] at `bits` in `groups` groups (by default: the config's)."""
    bits = bits or spec.bits
    default = groups_of(inp, spec.group_size)
    groups = groups or default
    if groups == default:
        rows = inp if spec.group_size == -1 else spec.group_size
    else:                                    # a linear of its own (dynamic, extra_config): equal groups
        rows = inp // groups
    per = 32 // bits
    if spec.packing == "gptq":
        shapes = {"qweight": (inp // per, out), "qzeros": (groups, out // per), "scales": (groups, out)}
    else:
        shapes = {"qweight": (inp, out // per), "qzeros": (groups, out // per), "scales": (groups, out)}
    return LinearLayout(bits, groups, rows, shapes)


def _own_width(spec: GptqSpec, heads: dict, out: int, inp: int) -> tuple[int, int]:
    """(bits, groups) of a linear whose config may differ from the model's: read from its qweight and scales."""
    shape = heads["qweight"]["shape"]
    words, width = (shape[0], inp) if spec.packing == "gptq" else (shape[-1], out)
    bits = next((b for b in BITS if len(shape) == 2 and words * 32 == width * b), spec.bits)
    scales = heads["scales"]["shape"]
    return bits, scales[0] if len(scales) == 2 else groups_of(inp, spec.group_size)


def linear_layout(spec: GptqSpec, prefix: str, out: int, inp: int, header_of, where) -> LinearLayout:
    """The checked layout of the quantized linear `prefix` [out, in]; `header_of(name)` gives a stored tensor's
    safetensors entry ({"dtype", "shape"}) or None, `where(name)` the file to name in errors."""
    if inp % 32 or out % 8:
        raise InvalidModel(where(f"{prefix}.qweight"), f"'{prefix}' is [{out}, {inp}]: quantized linears need inputs "
                                                       f"in multiples of 32 and outputs in multiples of 8")
    heads = {part: header_of(f"{prefix}.{part}") for part in (*GPTQ_PARTS, "g_idx")}
    for part in GPTQ_PARTS:
        if heads[part] is None:
            raise InvalidModel(where(f"{prefix}.qweight"), f"GPTQ tensor '{prefix}.{part}' is missing")
    bits, groups = _own_width(spec, heads, out, inp) if spec.per_linear else (spec.bits, None)
    groups = groups or groups_of(inp, spec.group_size)
    if not 0 < groups <= inp // 32 or (heads["g_idx"] is None and spec.per_linear and inp % (32 * groups)):
        raise InvalidModel(where(f"{prefix}.scales"), f"'{prefix}.scales' holds {groups} groups for {inp} inputs: "
                                                      f"each group must hold a whole multiple of 32 inputs")
    lay = expected(spec, out, inp, bits, groups)
    for part, shape in lay.shapes.items():
        got, dtype = tuple(heads[part]["shape"]), heads[part]["dtype"]
        want = SCALE_DTYPES if part == "scales" else ("I32",)
        if got != shape or dtype not in want:
            raise InvalidModel(where(f"{prefix}.{part}"),
                               f"'{prefix}.{part}' is {dtype}{list(got)}; {bits}-bit codes of [{out}, {inp}] in "
                               f"{groups} groups need {'/'.join(want)}{list(shape)}")
    g = heads["g_idx"]
    if g is not None and (tuple(g["shape"]) != (inp,) or g["dtype"] not in ("I32", "I64")):
        raise InvalidModel(where(f"{prefix}.g_idx"), f"'{prefix}.g_idx' is {g['dtype']}{list(g['shape'])}; "
                                                     f"it must give a group number per input: I32[{inp}]")
    return lay


def import_name(source: str) -> str:
    """The models-folder name of an import of `source` (a folder or owner/repo): its last part + "-exl2"."""
    import re
    base = source.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{base}-exl2").lstrip("._-")
    if not name or name == "exl2" or name.startswith("-"):
        raise InvalidModel(source, "cannot make a model name from it")
    return name[:150]
