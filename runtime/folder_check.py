"""What every model folder check shares: the error it raises (runtime/errors.py), numbers and rope fields checked by name,
the layout of a model's tensors and an EXL2 linear's headers (no torch)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.errors import InvalidModel

EXL2_PARTS = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")
# Optional: exact fp16 scales [G, N], one per group and column, that readers computing a dense scale per group and
# column take instead of q_scale / q_scale_max (runtime/exl2/format.py's docstring; written by the GPTQ import)
EXL2_EXACT = "q_scale_exact"


def _invalid(file: Path | str, problem: str) -> InvalidModel:
    return InvalidModel(file, problem)


def _check_number(params: dict, key: str, path: Path | str, low: float, high: float, where: str = "") -> None:
    """An optional number: low < value <= high (a string or a negative epsilon is refused by name)."""
    value = params.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
        raise _invalid(path, f"'{where}{key}' must be a number above {low:g} and at most {high:g}, got {value!r}")


def check_rope(config: dict, path: Path | str) -> dict:
    """The rope scaling parameters (`rope_scaling` merged over `rope_parameters`), each field the known
    types use present and in range; which types an engine supports is the engine's business."""
    params: dict = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            raise _invalid(path, f"'{key}' must be an object, got {value!r}")
        params.update(value or {})
    where = "rope_scaling." if isinstance(config.get("rope_scaling"), dict) else "rope_parameters."
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if not isinstance(rope_type, str):
        raise _invalid(path, f"'{where}rope_type' must be text, got {rope_type!r}")
    needed = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    for key in needed.get(rope_type, ()):
        if key not in params:
            raise _invalid(path, f"'{where}{key}' is missing: rope type {rope_type!r} needs it")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        _check_number(params, key, path, 0.0, 1e9, where)
    if not isinstance(params.get("truncate", True), bool):
        raise _invalid(path, f"'{where}truncate' must be true or false, got {params['truncate']!r}")
    if rope_type == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise _invalid(path, f"'{where}high_freq_factor' must be above low_freq_factor")
    _check_number(params, "rope_theta", path, 0.0, 1e12, where)
    return params


@dataclass
class Layout:
    plain: dict[str, tuple[int, ...]]
    linears: dict[str, tuple[int, int]]
    expert_params: int = 0           # parameters of the experts a token does not use, summed over layers


def check_exl2_headers(prefix: str, out: int, inp: int, header_of, where) -> None:
    """The headers of the EXL2 linear `prefix` [out, in]: every part present, columns and permutation as the
    config implies, the optional exact scales F16 [groups, columns]. `header_of(name)` gives a stored tensor's
    safetensors entry ({"dtype", "shape"}) or None, `where(name)` the file to name."""
    heads = {part: header_of(f"{prefix}.{part}") for part in (*EXL2_PARTS, EXL2_EXACT)}
    for part in EXL2_PARTS:
        if heads[part] is None:
            raise _invalid(where(f"{prefix}.q_weight"), f"EXL2 tensor '{prefix}.{part}' is missing")
    perm, qw = heads["q_invperm"]["shape"], heads["q_weight"]["shape"]
    if perm != [inp] or len(qw) != 2 or not out <= qw[1] <= -(-out // 32) * 32:   # columns padded to 32
        raise _invalid(where(f"{prefix}.q_weight"), f"EXL2 linear '{prefix}' has q_weight {qw} / q_invperm {perm}, "
                                                   f"the config implies {out} outputs and {inp} inputs")
    exact = heads[EXL2_EXACT]
    want = [heads["q_scale_max"]["shape"][0] if len(heads["q_scale_max"]["shape"]) == 1 else -1, qw[1]]
    if exact is not None and (exact["dtype"] != "F16" or exact["shape"] != want):
        raise _invalid(where(f"{prefix}.{EXL2_EXACT}"), f"'{prefix}.{EXL2_EXACT}' is {exact['dtype']}{exact['shape']}; "
                                                        f"it must hold an fp16 scale per group and column: F16{want}")
