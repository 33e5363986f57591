"""Model folders: validate one without torch, then read its tensors lazily.

A model folder is untrusted input. `validate(path)` checks, without importing torch, everything the
engines rely on and raises a `ModelFolderError` (runtime/errors.py) naming the file and the problem:

- config.json present, parsable, a supported architecture with the integer fields we need;
- tokenizer.json present (unless the caller loads a tokenizer-less benchmark model);
- weights as safetensors only (pickle files are refused, never opened);
- each safetensors header parsed by hand: 8-byte little-endian length, JSON, known dtypes, shapes
  whose byte size matches the offsets, offsets contiguous and within the file (a short file is
  reported as truncated);
- the shard index, when present, names shards that exist and tensors those shards hold;
- every tensor the architecture needs, stored plain (`X.weight`) or as EXL2 (`X.q_weight`, ...; the optional
  exact scales `X.q_scale_exact` F16 [groups, columns]; their values are checked where they are read).

`ModelFolder(path)` validates, then opens shards with safetensors on demand (torch imported lazily)
and gives `.tensor(name)` and `.linear(prefix)`: a dense float weight [out, in] either way.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from runtime import gptq_spec, qwen35
from runtime.errors import InvalidModel, ModelFolderError, ModelNotFound, UnsupportedArchitecture  # noqa: F401
from runtime.folder_check import (EXL2_EXACT, EXL2_PARTS, Layout, _check_number, _invalid,  # noqa: F401
                                  check_exl2_headers, check_rope)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                           "DbrxForCausalLM") + qwen35.ARCHITECTURES
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")       # per-head RMS norms of q and k


@dataclass(frozen=True)
class MoeNames:
    """Where an MoE architecture keeps its router and experts, under model.layers.N (the names exllamav2's
    architecture table and the Hub's EXL2 folders use), and which config key holds one expert's width."""
    router: str
    experts: str
    gate: str                        # the SiLU-gated projection
    up: str
    down: str
    width_key: str


MOE_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": MoeNames("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj",
                                    "moe_intermediate_size"),
    # Mixtral: w1 gate, w3 up, w2 down; every layer is MoE and intermediate_size is one expert's width
    "MixtralForCausalLM": MoeNames("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2",
                                   "intermediate_size"),
    # DBRX as exllamav2 names it (and its converter writes the Hub's EXL2 folders): the original
    # transformer.blocks.N.* layout renamed to model.layers.N.*, Wqkv split into q/k/v_proj, the stacked
    # experts split per expert (w1 gate, v1 up, w2 down as [hidden, width]); norms are bias-free LayerNorms
    "DbrxForCausalLM": MoeNames("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "v1", "w2",
                                "intermediate_size"),
    # Qwen3.5-MoE (runtime/qwen35.py): Gated DeltaNet and gated attention layers, experts + a shared expert
    **{arch: MoeNames("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj", "moe_intermediate_size")
       for arch in qwen35.ARCHITECTURES},
}

_TRANSFORMERS_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\b")


def stored_name(architecture: str, name: str) -> str:
    """A decoder-layer tensor's name as transformers' modules give it (router `mlp.gate`, experts
    `mlp.experts.E.gate_proj`, Qwen3-MoE's names) -> its name in the Hub's checkpoints and EXL2 folders of
    that architecture (Mixtral: `block_sparse_moe.gate`, `block_sparse_moe.experts.E.w1`); others unchanged."""
    moe = MOE_ARCHITECTURES.get(architecture)
    if moe is None:
        return name
    name = _TRANSFORMERS_EXPERT.sub(lambda m: f".{moe.experts}.{m[1]}.{getattr(moe, m[2])}", name)
    return name.replace(".mlp.experts.", f".{moe.experts}.").replace(".mlp.gate.", f".{moe.router}.")


# DBRX's config.json nests its sizes; they are copied under the names the other architectures use
# (config key <- (section, key)), then bounded like theirs
DBRX_KEYS = {"hidden_size": ("", "d_model"), "num_hidden_layers": ("", "n_layers"),
             "num_attention_heads": ("", "n_heads"), "max_position_embeddings": ("", "max_seq_len"),
             "num_key_value_heads": ("attn_config", "kv_n_heads"), "rope_theta": ("attn_config", "rope_theta"),
             "clip_qkv": ("attn_config", "clip_qkv"), "intermediate_size": ("ffn_config", "ffn_hidden_size"),
             "num_experts": ("ffn_config", "moe_num_experts"), "num_experts_per_tok": ("ffn_config", "moe_top_k"),
             "moe_normalize_expert_weights": ("ffn_config", "moe_normalize_expert_weights")}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER_BYTES = 100 * 1024 * 1024        # the safetensors format's own limit
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


# Every size in config.json is bounded before anything is built from it (a hostile config of 10^9 layers
# must fail at once, not after gigabytes). Ceilings are far above any released model.
CONFIG_BOUNDS = {"hidden_size": 1 << 17, "num_hidden_layers": 1024, "num_attention_heads": 1024,
                 "num_key_value_heads": 1024, "head_dim": 1 << 12, "vocab_size": 1 << 22,
                 "intermediate_size": 1 << 20, "moe_intermediate_size": 1 << 20, "num_experts": 4096,
                 "num_local_experts": 4096, "num_experts_per_tok": 4096, "max_position_embeddings": 1 << 24,
                 "decoder_sparse_step": 1024, "sliding_window": 1 << 24}
MAX_JSON_BYTES = 64 * 1024 * 1024       # a JSON file of a model folder (tokenizer.json included)



# ----------------------------------------------------------------------------------------------
# Files of an untrusted folder: no link out of it, bounded JSON

def inside(folder: Path, path: Path) -> Path:
    """`path` (a file of `folder`) unless it is a link that leads out of the folder: a model folder must not
    make us read /etc/passwd into a prompt, or copy it into the models folder."""
    if path.is_symlink():
        target = path.resolve()
        if not target.is_relative_to(Path(folder).resolve()):
            raise _invalid(path, f"is a link to {target}, outside the model folder: refused "
                                 f"(copy the file into the folder instead)")
    return path


def check_links(folder: Path) -> None:
    """No entry of the folder (the files we and exllamav2 open live there) may link outside it."""
    for entry in sorted(folder.iterdir()):
        inside(folder, entry)


def read_json(path: Path, what: str = "JSON") -> Any:
    """A JSON file of a model folder: bounded in size, and every way it can fail is a named model_invalid."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise _invalid(path, f"{size} bytes, more than the {MAX_JSON_BYTES} a model folder's JSON file may have")
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise _invalid(path, f"not valid {what} at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise _invalid(path, f"not valid {what}: nested too deeply") from None
    except (UnicodeDecodeError, OSError, ValueError) as e:      # ValueError: e.g. an integer of 5000 digits
        raise _invalid(path, f"cannot be read: {e}") from None


@dataclass
class FolderInfo:
    path: Path
    name: str
    architecture: str
    model_type: str
    num_params: int                  # parameters of the dense (dequantized) model
    active_params: int               # per token: all but the experts a token does not use
    bits_per_weight: float           # from quantization_config, else estimated from bytes on disk
    size_bytes: int                  # all files in the folder
    vocab_size: int
    num_layers: int
    num_experts: int                 # 0 for dense models
    experts_per_token: int
    is_exl2: bool
    has_tokenizer: bool
    config: dict[str, Any] = field(repr=False, default_factory=dict)
    shard_of: dict[str, str] = field(repr=False, default_factory=dict)   # tensor name -> shard file
    gptq: Any = None                 # runtime.gptq_spec.GptqSpec of a GPTQ-family build (validate(gptq=True))


# ----------------------------------------------------------------------------------------------
# Config

def read_config(folder: Path) -> dict[str, Any]:
    """config.json of `folder`, every size the engines use bounded (CONFIG_BOUNDS) and consistent, DBRX's and
    Qwen3.5's nested sizes flattened; a named model_invalid or unsupported_architecture otherwise."""
    path = folder / "config.json"
    if not path.is_file():
        raise InvalidModel(path, "missing: a model folder needs config.json")
    config = read_json(path)
    if not isinstance(config, dict):
        raise InvalidModel(path, "expected a JSON object at the top level")
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch not in SUPPORTED_ARCHITECTURES:
        got = f"architecture {arch!r}" if arch else "no 'architectures' entry"
        raise UnsupportedArchitecture(path,
                                      f"{got} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if arch in qwen35.ARCHITECTURES:
        return qwen35.read_config(config, path)
    if arch == "DbrxForCausalLM":
        _flatten_dbrx(config, path)
    if "num_experts" not in config and "num_local_experts" in config:
        config["num_experts"] = config["num_local_experts"]      # the name newer transformers write
    needed = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"]
    moe = MOE_ARCHITECTURES.get(arch)
    if moe:
        needed += ["num_experts", "num_experts_per_tok", moe.width_key]
    for key in needed:
        config_int(config, key, path)
    optional = ["num_key_value_heads", "head_dim", "max_position_embeddings", "decoder_sparse_step"]
    for key in optional + (["sliding_window"] if arch == "MixtralForCausalLM" else []):
        if config.get(key) is not None:
            config_int(config, key, path)
    if moe and config["num_experts_per_tok"] > config["num_experts"]:
        raise _invalid(path, f"'num_experts_per_tok' ({config['num_experts_per_tok']}) is more than "
                             f"'num_experts' ({config['num_experts']})")
    only = config.get("mlp_only_layers")
    if only is not None and not (isinstance(only, list) and all(type(i) is int for i in only)):
        raise _invalid(path, f"'mlp_only_layers' must be a list of layer numbers, got {only!r}")
    _check_number(config, "rms_norm_eps", path, 0.0, 1.0)
    _check_number(config, "clip_qkv", path, 0.0, 1e9)
    _check_number(config, "moe_normalize_expert_weights", path, 0.0, 1e3)
    _check_number(config, "rope_theta", path, 0.0, 1e12)
    check_rope(config, path)
    if config["hidden_size"] % config["num_attention_heads"] and not config.get("head_dim"):
        raise InvalidModel(path, "'hidden_size' is not a multiple of 'num_attention_heads'")
    if config["num_attention_heads"] % kv_heads(config):
        raise InvalidModel(path,
                           "'num_attention_heads' is not a multiple of 'num_key_value_heads'")
    return config


def _flatten_dbrx(config: dict, path: Path) -> None:
    for section in ("attn_config", "ffn_config"):
        if not isinstance(config.get(section) or {}, dict):
            raise _invalid(path, f"'{section}' must be an object, got {config[section]!r}")
    act = ((config.get("ffn_config") or {}).get("ffn_act_fn") or {"name": "silu"})
    if not isinstance(act, dict) or act.get("name") != "silu":
        raise UnsupportedArchitecture(path,
                                      f"'ffn_config.ffn_act_fn' {act!r} is not supported (only silu)")
    config.update(flat_config(config))


def flat_config(config: dict) -> dict:
    """`config` with DBRX's nested sizes copied under the names the other architectures use (unchecked;
    any other architecture's config comes back as it is)."""
    archs = config.get("architectures")
    if not (isinstance(archs, list) and archs and archs[0] == "DbrxForCausalLM"):
        return config
    flat = dict(config)
    for key, (section, name) in DBRX_KEYS.items():
        part = config.get(section) if section else config
        value = part.get(name) if isinstance(part, dict) else None
        if value is not None and flat.get(key) is None:
            flat[key] = value
    return flat


def config_int(config: dict, key: str, path: Path | str) -> int:
    """config[key] as a positive integer within CONFIG_BOUNDS, or a named error."""
    value, top = config.get(key), CONFIG_BOUNDS[key]
    if type(value) is not int or not 0 < value <= top:
        raise _invalid(path, f"'{key}' must be a positive integer of at most {top}, got {value!r}")
    return value



def kv_heads(config: dict) -> int:
    return config.get("num_key_value_heads") or config["num_attention_heads"]


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def num_experts(config: dict) -> int:
    """Experts per MoE layer, under either name transformers writes (num_experts, num_local_experts)."""
    return config.get("num_experts") or config["num_local_experts"]


def is_moe_layer(config: dict, layer: int) -> bool:
    """Qwen3-MoE: layer uses experts unless listed in mlp_only_layers or skipped by decoder_sparse_step;
    Mixtral and DBRX: every layer."""
    arch = config["architectures"][0]
    if arch not in MOE_ARCHITECTURES:
        return False
    if arch != "Qwen3MoeForCausalLM":
        return True
    step = config.get("decoder_sparse_step") or 1
    return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


# ----------------------------------------------------------------------------------------------
# What the architecture needs: plain tensors (name -> shape) and linears (prefix -> (out, in))


def layout(config: dict, present: set[str] | None = None) -> Layout:
    if config["architectures"][0] in qwen35.ARCHITECTURES:
        return qwen35.layout(config, present)
    h, v, n = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    hd, nh, nkv = head_dim(config), config["num_attention_heads"], kv_heads(config)
    qk_norm = config["architectures"][0] in QK_NORM_ARCHITECTURES
    names = MOE_ARCHITECTURES.get(config["architectures"][0])
    plain: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    linears: dict[str, tuple[int, int]] = {}
    idle = 0
    tied = config.get("tie_word_embeddings", False)
    if not tied or (present is not None and _linear_present("lm_head", present)):
        linears["lm_head"] = (v, h)
    for i in range(n):
        p = f"model.layers.{i}"
        plain[f"{p}.input_layernorm.weight"] = (h,)
        plain[f"{p}.post_attention_layernorm.weight"] = (h,)
        linears[f"{p}.self_attn.q_proj"] = (nh * hd, h)
        linears[f"{p}.self_attn.k_proj"] = (nkv * hd, h)
        linears[f"{p}.self_attn.v_proj"] = (nkv * hd, h)
        linears[f"{p}.self_attn.o_proj"] = (h, nh * hd)
        if qk_norm:
            plain[f"{p}.self_attn.q_norm.weight"] = (hd,)
            plain[f"{p}.self_attn.k_norm.weight"] = (hd,)
        if is_moe_layer(config, i):
            e, k, m = num_experts(config), config["num_experts_per_tok"], config[names.width_key]
            linears[f"{p}.{names.router}"] = (e, h)
            for j in range(e):
                linears[f"{p}.{names.experts}.{j}.{names.gate}"] = (m, h)
                linears[f"{p}.{names.experts}.{j}.{names.up}"] = (m, h)
                linears[f"{p}.{names.experts}.{j}.{names.down}"] = (h, m)
            idle += (e - min(k, e)) * 3 * m * h
        else:
            m = config["intermediate_size"]
            linears[f"{p}.mlp.gate_proj"] = (m, h)
            linears[f"{p}.mlp.up_proj"] = (m, h)
            linears[f"{p}.mlp.down_proj"] = (h, m)
    return Layout(plain, linears, idle)


def implied_tensors(config: dict, present: set[str] | None = None) -> int:
    """How many entries `layout` makes (each one at least one stored tensor), counted without building it."""
    if config["architectures"][0] in qwen35.ARCHITECTURES:
        return qwen35.implied_tensors(config, present or set())
    n = config["num_hidden_layers"]
    per_layer = 2 + 4 + (2 if config["architectures"][0] in QK_NORM_ARCHITECTURES else 0)
    moe_layers = sum(is_moe_layer(config, i) for i in range(n))
    experts = 1 + 3 * num_experts(config) if moe_layers else 0
    return 2 + n * per_layer + moe_layers * experts + (n - moe_layers) * 3


def _linear_present(prefix: str, names: set[str]) -> bool:
    return f"{prefix}.weight" in names or f"{prefix}.q_weight" in names


# ----------------------------------------------------------------------------------------------
# Safetensors headers, parsed by hand (no torch, no trust)

def read_header(path: Path) -> dict[str, dict]:
    """The tensor table of one safetensors file, checked against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InvalidModel(path,
                                   f"truncated: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise InvalidModel(path,
                                   f"corrupt safetensors header: declared length {n} bytes is implausible")
            if 8 + n > size:
                raise InvalidModel(path,
                                   f"truncated: header needs {8 + n} bytes, the file has {size}")
            raw = f.read(n)
    except OSError as e:
        raise InvalidModel(path, f"cannot be read: {e}") from None
    try:
        table = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidModel(path, f"corrupt safetensors header: not valid JSON ({e})") from None
    except RecursionError:
        raise _invalid(path, "corrupt safetensors header: not valid JSON (nested too deeply)") from None
    if not isinstance(table, dict):
        raise InvalidModel(path, "corrupt safetensors header: not a JSON object")
    table.pop("__metadata__", None)
    spans = []
    for name, entry in table.items():
        bad = _check_entry(entry)
        if bad:
            raise InvalidModel(path, f"corrupt safetensors header: tensor {name!r} {bad}")
        spans.append((entry["data_offsets"][0], entry["data_offsets"][1], name))
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise InvalidModel(path,
                               f"corrupt safetensors header: tensor {name!r} starts at byte {begin}, "
                               f"expected {end} (offsets overlap or leave a gap)")
        end = stop
    if 8 + n + end > size:
        raise InvalidModel(path,
                           f"truncated: tensor data ends at byte {8 + n + end}, the file has {size} bytes")
    return table


def _check_entry(entry: Any) -> str:
    if not isinstance(entry, dict):
        return "is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        return f"has unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return f"has an invalid shape {shape!r}"
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]):
        return f"has invalid data_offsets {offsets!r}"
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        return f"has {offsets[1] - offsets[0]} bytes of data but {dtype}{shape} needs {nbytes}"
    return ""


# ----------------------------------------------------------------------------------------------
# The folder as a whole

def weight_files(folder: Path) -> tuple[dict[str, str], dict[str, dict]]:
    """(tensor name -> shard file name, shard file name -> header), honouring the index if any."""
    index = folder / "model.safetensors.index.json"
    headers: dict[str, dict] = {}
    if index.is_file():
        data = read_json(index, "JSON index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise InvalidModel(index, "'weight_map' must map tensor names to file names")
        for shard in sorted(set(weight_map.values())):
            shard_path = folder / shard
            if Path(shard).name != shard or not shard.endswith(".safetensors"):
                raise InvalidModel(index, f"lists {shard!r}, not a safetensors file in the folder")
            if not shard_path.is_file():
                raise InvalidModel(index, f"lists shard {shard}, which is missing")
            headers[shard] = read_header(shard_path)
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise InvalidModel(folder / shard,
                                   f"tensor {name!r} is listed in {index.name} but missing from this shard")
        return dict(weight_map), headers
    files = sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise InvalidModel(folder / pickles[0],
                               "pickle weights are refused (they can run code); convert the model to safetensors")
        raise InvalidModel(folder, "no weights: no *.safetensors file in the folder")
    shard_of: dict[str, str] = {}
    for name in files:
        headers[name] = read_header(folder / name)
        for tensor in headers[name]:
            shard_of.setdefault(tensor, name)
    return shard_of, headers


def _check_tensors(lay, names: set, shard_of: dict, headers: dict, where, missing_in: Path, gptq=None) -> bool:
    """Every tensor of `lay` present with the shape the config implies (plain, or EXL2 with every part,
    its columns and permutation matching, or GPTQ-family parts where `gptq`, the folder's GptqSpec, is given);
    True when a linear is stored as EXL2."""
    for name, shape in lay.plain.items():
        if name not in names:
            raise InvalidModel(missing_in, f"tensor {name!r} is missing")
        got = tuple(headers[shard_of[name]][name]["shape"])
        if got != shape:
            raise InvalidModel(where(name),
                               f"tensor {name!r} has shape {list(got)}, the config implies {list(shape)}")
    is_exl2 = False
    for prefix, (out, inp) in lay.linears.items():
        if f"{prefix}.weight" in names:
            got = tuple(headers[shard_of[f"{prefix}.weight"]][f"{prefix}.weight"]["shape"])
            if got != (out, inp):
                raise InvalidModel(where(f"{prefix}.weight"),
                                   f"tensor '{prefix}.weight' has shape {list(got)}, the config implies {[out, inp]}")
            continue
        if f"{prefix}.qweight" in names:
            if gptq is None:
                raise UnsupportedArchitecture(where(f"{prefix}.qweight"), "a GPTQ-family build (qweight, qzeros, scales): "
                                              "import it into EXL2 first (moedesk-cli import FOLDER)")
            gptq_spec.linear_layout(gptq, prefix, out, inp, lambda n: headers[shard_of[n]][n] if n in names else None,
                                    lambda n: where(n) if n in names else missing_in)
            continue
        if f"{prefix}.q_weight" not in names:
            raise InvalidModel(missing_in, f"tensor '{prefix}.weight' is missing")
        is_exl2 = True
        check_exl2_headers(prefix, out, inp, lambda n: headers[shard_of[n]][n] if n in names else None, where)
    return is_exl2


def check_weights(folder: Path, config: dict, shard_of: dict[str, str], headers: dict[str, dict],
                  lay: Layout | None = None, spec=None) -> tuple[Layout, bool]:
    """Every tensor the config implies (`lay`; by default the architecture's layout, MTP head included) stored
    with the shape the config implies, checked on the headers before any tensor is read or built from the
    config's sizes (`spec`, a GPTQ-family build's GptqSpec: its quantized parts checked against it);
    -> (the layout, whether a linear is stored as EXL2)."""
    names = set(shard_of)
    if lay is None:
        implied = implied_tensors(config, names)
        if implied > 2 * len(names) + 1000:   # before building the layout (a missing tensor is named below)
            raise _invalid(folder / "config.json", f"{config['num_hidden_layers']} layers imply at least {implied} "
                                                   f"weight tensors; the weights hold only {len(names)}")
        lay = layout(config, names)

    def where(name: str) -> Path:
        return folder / shard_of[name]

    index = folder / "model.safetensors.index.json"
    missing_in = index if index.is_file() else folder / next(iter(headers)) if len(headers) == 1 else folder
    is_exl2 = _check_tensors(lay, names, shard_of, headers, where, missing_in, spec)
    if config["architectures"][0] in qwen35.ARCHITECTURES and qwen35.has_mtp(names):
        # the multi-token-prediction head, a draft both engines load when asked: checked as the model is
        _check_tensors(qwen35.mtp_layout(config, names), names, shard_of, headers, where, missing_in, spec)
    return lay, is_exl2


def validate(path: str | os.PathLike, require_tokenizer: bool = True, gptq: bool = False) -> FolderInfo:
    """The folder checked (see the module docstring); `gptq`: a GPTQ-family build is accepted (its quantized linears
    checked against its quantization_config, `FolderInfo.gptq` set) instead of refused: what the import reads."""
    folder = Path(path)
    if not folder.exists():
        raise ModelNotFound(folder, "no such model folder")
    if not folder.is_dir():
        raise ModelNotFound(folder, "not a folder")
    check_links(folder)
    config = read_config(folder)
    has_tokenizer = (folder / "tokenizer.json").is_file()
    if require_tokenizer and not has_tokenizer:
        raise InvalidModel(folder / "tokenizer.json", "missing: the model has no tokenizer")
    shard_of, headers = weight_files(folder)
    names = set(shard_of)
    if config["architectures"][0] == "DbrxForCausalLM" and "transformer.wte.weight" in names:
        raise UnsupportedArchitecture(folder / shard_of["transformer.wte.weight"],
                                      "DBRX weights in their original layout (transformer.blocks.*, stacked experts) are "
                                      "not read; use an EXL2 conversion, which names them as model.layers.* per expert")
    spec = gptq_spec.read_spec(config, folder / "config.json") if gptq else None
    lay, is_exl2 = check_weights(folder, config, shard_of, headers, spec=spec)

    num_params = sum(math.prod(s) for s in lay.plain.values()) + sum(o * i for o, i in lay.linears.values())
    data_bytes = sum(max((e["data_offsets"][1] for e in h.values()), default=0) for h in headers.values())
    moe = config["architectures"][0] in MOE_ARCHITECTURES
    qc = config.get("quantization_config") or {}
    bits = qc.get("bits") if isinstance(qc, dict) else None
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        bits = 8.0 * data_bytes / max(num_params, 1)
    return FolderInfo(
        path=folder, name=folder.name, architecture=config["architectures"][0],
        model_type=str(config.get("model_type", "")), num_params=num_params,
        active_params=num_params - lay.expert_params, bits_per_weight=round(float(bits), 3),
        size_bytes=sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
        vocab_size=config["vocab_size"], num_layers=config["num_hidden_layers"],
        num_experts=config["num_experts"] if moe else 0,
        experts_per_token=config["num_experts_per_tok"] if moe else 0,
        is_exl2=is_exl2 or (isinstance(qc, dict) and qc.get("quant_method") == "exl2"),
        has_tokenizer=has_tokenizer, config=config, shard_of=shard_of, gptq=spec)


# ----------------------------------------------------------------------------------------------
# Reading tensors

class ModelFolder:
    """A validated folder whose tensors are read on demand (torch and safetensors imported lazily)."""

    def __init__(self, path: str | os.PathLike, require_tokenizer: bool = False, gptq: bool = False):
        self.info = validate(path, require_tokenizer=require_tokenizer, gptq=gptq)
        self.path = self.info.path
        self.config = self.info.config
        self._handles: dict[str, Any] = {}
        self._shapes = layout(self.config, set(self.info.shard_of)).linears    # prefix -> (out, in)

    def has(self, name: str) -> bool:
        return name in self.info.shard_of

    def tensor(self, name: str):
        from safetensors import safe_open
        shard = self.info.shard_of.get(name)
        if shard is None:
            raise InvalidModel(self.path, f"tensor {name!r} is missing")
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.path / shard), framework="pt")
        return self._handles[shard].get_tensor(name)

    def linear(self, prefix: str, dtype: Optional[Any] = None, device: Any = "cpu"):
        """The dense weight [out, in] of a linear layer, stored plain or as EXL2 (dequantized on `device`)."""
        import torch
        dtype = dtype or torch.float32
        if self.has(f"{prefix}.weight"):
            return self.tensor(f"{prefix}.weight").to(device, dtype)
        from runtime.exl2.format import Exl2FormatError, dequantize
        parts = self.exl2_tensors(prefix)
        out = self._shapes[prefix][0] if prefix in self._shapes else None
        try:
            return dequantize(parts, dtype=dtype, out_features=out, name=prefix, device=device)
        except Exl2FormatError as e:
            raise InvalidModel(self.path / self.info.shard_of[f"{prefix}.q_weight"],
                               f"invalid EXL2 tensors: {e}") from None

    def exl2_tensors(self, prefix: str) -> dict:
        """The EXL2 tensor set of the linear `prefix`: its parts, and its exact scales where it has them."""
        parts = (*EXL2_PARTS, EXL2_EXACT) if self.has(f"{prefix}.{EXL2_EXACT}") else EXL2_PARTS
        return {part: self.tensor(f"{prefix}.{part}") for part in parts}

    def bias(self, prefix: str, dtype: Optional[Any] = None):
        """The bias of a linear layer, or None."""
        import torch
        return self.tensor(f"{prefix}.bias").to(dtype or torch.float32) if self.has(f"{prefix}.bias") else None

    def close(self) -> None:
        self._handles.clear()
