"""`moedesk-cli synth`: random-weight EXL2 models with the exact shapes and config of real models.

Weights are written straight in the quantized domain: codes uniformly random and centred (symmetric
about 0, so no matrix carries a common offset), packed into q_weight's words; scales are random 4-bit
qscales under a per-group maximum chosen so every linear has a weight standard deviation of about 0.02
(the usual init). Models above
1B parameters reuse a small pool of generated linears per role (expert gate/up/down, q/k/v/o) across
layers and experts, and repeat a block of 8192 embedding rows, so the 121B shape writes at disk speed;
small models get distinct tensors everywhere (tests that compare backends must see different
experts). Every expert's gate and up of a layer share one input order (q_invperm), as exllamav2's converter
writes them (Qwen3.5: each expert's gate and up, as ours does). Embeddings are N(0, 0.02),
norms 1 (Qwen3.5's, which scale by 1 + weight, 0), routers N(0, 0.02): routing is near-uniform.

    moedesk-cli synth --shape q125-a11 --bpw 3.0 --out DIR [--layers N] [--head-bits 6] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from runtime.modelfolder import MOE_ARCHITECTURES

from .shapes import SHAPES, Shape, TensorSpec, get_shape, hf_config, param_counts, tensors

WEIGHT_STD = 0.02
POOL_PER_ROLE = 8                     # generated linears per role when reusing
REUSE_ABOVE_PARAMS = 1_000_000_000
EMBED_BLOCK = 8192                    # distinct embedding rows when reusing
GROUP_SIZE = 128
README = """# {name}: synthetic, random weights

This folder was written by `moedesk-cli synth --shape {name} --bpw {bpw}`. It has exactly the tensor
shapes and config.json of {like} ({layers} layers; {total} parameters, {active} active per token),
quantized as EXL2 at {bpw} bits per weight (head {head_bits} bits), but its weights are random:
its text is noise and its routing near-uniform. It exists to measure speed and memory, not quality.
"""


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _random_rows(out, make, step: int | None = None):
    """Fill `out` a block of rows at a time (bounded temporaries for 150k-row tensors)."""
    step = step or max(1, (1 << 24) // max(1, out[0].numel()))
    for r in range(0, out.shape[0], step):
        out[r:r + step] = make(min(step, out.shape[0] - r))
    return out


def _random_linear(out: int, inp: int, bits: float, gen) -> dict:
    """EXL2 tensors of a random linear [out, in]: random centred codes, scales giving std ~ WEIGHT_STD.

    The codes of a b-bit group are drawn uniformly from -(2**(b-1) - 1) .. 2**(b-1) - 1, symmetric about
    0. Uniformly random bits (the codes -2**(b-1) .. 2**(b-1) - 1) have a mean of -0.5 steps, 0.22 of
    their standard deviation at 3 bits: every weight matrix then carried a common offset that a wide
    input adds up coherently (K times, against sqrt(K) for the random part), and a real-width Mixtral's
    activations left fp16's range within two layers (1e5 against 65504), which no fp16 engine can
    follow. Each group is packed on its own (its rows are whole words), so temporaries stay small."""
    import torch
    from . import format as fmt
    from .bitpack import pack_codes, pack_scales

    mix, props = fmt.resolve_bits(bits)
    groups = fmt.plan_groups(inp, mix, props, {b: GROUP_SIZE for b in mix})
    words = []
    for b, rows in groups:
        m = (1 << (b - 1)) - 1
        codes = torch.randint(-m, m + 1, (rows, out), generator=gen, dtype=torch.int64) + (1 << (b - 1))
        words.append(pack_codes(codes, b))
    q_weight = torch.cat(words, dim=0)
    qscale = torch.randint(9, 17, (len(groups), out), generator=gen)
    mean_sq = sum(q * q for q in range(9, 17)) / 8 / 256          # E[(qscale)^2 / 256]
    qsm = [WEIGHT_STD / (mean_sq * math.sqrt(((1 << (b - 1)) - 1) * (1 << (b - 1)) / 3)) for b, _ in groups]
    qgroups, qrow = [], 0
    for b, r in groups:
        qgroups += [b, qrow]
        qrow += r * b // 32
    return {
        "q_weight": q_weight,
        "q_scale": pack_scales(qscale),
        "q_scale_max": torch.tensor(qsm, dtype=torch.float16),
        "q_groups": torch.tensor(qgroups, dtype=torch.int16),
        "q_invperm": torch.randperm(inp, generator=gen).to(torch.int32),
    }


def _input_order_key(s: Shape, t: TensorSpec) -> str | None:
    """Which experts' gate and up projections share one input order (q_invperm), as the converter that writes
    such folders makes them: a GPTQ permutation follows the Hessian of the input, and exllamav2's converter
    (the Hub's EXL2 MoE folders) quantizes every expert's gate and up of a layer with one Hessian, ours
    (Qwen3.5, runtime/exl2/convert.py) each expert's gate and up with that expert's. None: its own."""
    names = MOE_ARCHITECTURES.get(s.architecture)
    if names is None or not t.role.startswith("expert.") or t.role[7:] not in (names.gate, names.up):
        return None
    layer, _, rest = t.name.partition(f".{names.experts}.")
    return layer if not s.is_hybrid else f"{layer}.{rest.split('.')[0]}"


def write_synthetic(shape: Shape | str, bpw: float, out_dir: str | Path, *, layers: int | None = None,
                    head_bits: int | None = None, seed: int = 0, max_shard_bytes: int | None = None,
                    progress: Callable[[int, int], None] | None = None):
    """Write the model folder; returns writer.WrittenModel. progress: (tensors done, total)."""
    import torch
    from .format import resolve_bits
    from .synth_tokenizer import write_tokenizer
    from .writer import DEFAULT_SHARD_BYTES, ModelWriter, quantization_config

    s = (get_shape(shape) if isinstance(shape, str) else shape).with_layers(layers)
    resolve_bits(float(bpw), name="--bpw")
    head_bits = head_bits if head_bits is not None else (8 if bpw > 6 else 6)
    resolve_bits(head_bits, name="--head-bits")
    if any(d % 32 for t in tensors(s) if t.kind in ("linear", "head") for d in t.shape):
        raise ValueError(f"shape {s.name}: linear dimensions must be multiples of 32")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    total_params, active = param_counts(s)
    reuse = total_params > REUSE_ABOVE_PARAMS
    gen = torch.Generator().manual_seed(seed)
    pool: dict[tuple, list[dict]] = {}
    specs = list(tensors(s))

    orders: dict[str, torch.Tensor] = {}

    def linear(t: TensorSpec, bits: float) -> dict:
        d = _linear(t, bits)
        key = _input_order_key(s, t)
        if key is not None:                     # one input order where the converter uses one Hessian
            d = dict(d, q_invperm=orders.setdefault(key, d["q_invperm"]))
        return d

    def _linear(t: TensorSpec, bits: float) -> dict:
        if not reuse or t.kind == "head":
            return _random_linear(*t.shape, bits, gen)
        key = (t.role, t.shape, bits)
        variants = pool.setdefault(key, [])
        if len(variants) < POOL_PER_ROLE:
            variants.append(_random_linear(*t.shape, bits, gen))
            return variants[-1]
        return variants[int(torch.randint(0, POOL_PER_ROLE, (1,), generator=gen))]

    def random_fp16(shape: tuple[int, ...]) -> torch.Tensor:
        """N(0, WEIGHT_STD) rows; large models repeat a block of EMBED_BLOCK rows (writes at disk speed)."""
        block = None
        if reuse and shape[0] > EMBED_BLOCK:
            block = (torch.randn((EMBED_BLOCK, *shape[1:]), generator=gen) * WEIGHT_STD).to(torch.float16)

        def rows(n: int) -> torch.Tensor:
            if block is not None:
                return block[:n]
            return (torch.randn((n, *shape[1:]), generator=gen) * WEIGHT_STD).to(torch.float16)
        return _random_rows(torch.empty(shape, dtype=torch.float16), rows, EMBED_BLOCK if block is not None else None)

    with ModelWriter(out, max_shard_bytes or DEFAULT_SHARD_BYTES) as w:
        for i, t in enumerate(specs):
            if t.kind in ("linear", "head"):
                w.add_all(t.name, linear(t, head_bits if t.kind == "head" else float(bpw)))
            elif t.kind == "norm":
                w.add(t.name, torch.ones(t.shape, dtype=torch.float16))
            elif t.kind == "centred_norm":                      # Qwen3.5's norms scale by 1 + weight
                w.add(t.name, torch.zeros(t.shape, dtype=torch.float16))
            else:                                               # embeddings, router
                w.add(t.name, random_fp16(t.shape))
            if progress is not None:
                progress(i + 1, len(specs))
        config = hf_config(s)
        config["torch_dtype"] = "float16"
        config["quantization_config"] = quantization_config(bpw, head_bits)
        config["synthetic"] = f"synthetic, random weights: shape {s.name} ({s.like}); see README.md"
        result = w.finish(config)
    write_tokenizer(out, s.vocab, s.first_special, s.max_position, s.chat)
    (out / "README.md").write_text(README.format(name=s.name, bpw=bpw, like=s.like, layers=s.layers,
                                                 total=_count(total_params), active=_count(active),
                                                 head_bits=head_bits))
    return result


# ---------------------------------------------------------------------------------------------
# CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES), help="model shape to imitate")
    parser.add_argument("--bpw", required=True, type=float, help="bits per weight of the linears, 2.0..8.0")
    parser.add_argument("--out", required=True, help="output folder (created; must be empty)")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--head-bits", type=int, default=None, help="lm_head bits (default 6, 8 above 6 bpw)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-gb", type=float, default=4.0, help="safetensors shard size in GB")


def estimate_bytes(s: Shape, bpw: float, head_bits: int) -> int:
    """Rough size on disk: codes plus ~4/128 bpw of scales, fp16 for the rest."""
    total = 0
    for t in tensors(s):
        n = math.prod(t.shape)
        bits = bpw if t.kind == "linear" else head_bits if t.kind == "head" else 16
        total += n * (bits + (4 / GROUP_SIZE if t.kind in ("linear", "head") else 0)) / 8
    return int(total)


def run(args: argparse.Namespace) -> int:
    from .format import resolve_bits
    try:
        s = get_shape(args.shape).with_layers(args.layers)
        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"{out} is not empty; choose a new folder")
        head_bits = args.head_bits if args.head_bits is not None else (8 if args.bpw > 6 else 6)
        resolve_bits(float(args.bpw), name="--bpw")
        resolve_bits(head_bits, name="--head-bits")
        need = estimate_bytes(s, args.bpw, head_bits)
        probe = out if out.exists() else next(p for p in (out, *out.parents) if p.exists())
        free = shutil.disk_usage(probe).free
        if need > free:
            raise ValueError(f"{s.name} at {args.bpw} bpw needs about {need / 1e9:.1f} GB; "
                             f"{probe} has {free / 1e9:.1f} GB free")
        total, active = param_counts(s)
        print(f"synth: {s.name} ({s.like}), {s.layers} layers, {_count(total)} params "
              f"({_count(active)} active) at {args.bpw} bpw -> {out} (~{need / 1e9:.2f} GB)", file=sys.stderr)
        t0, last = time.monotonic(), [0.0]

        def progress(done: int, n: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 2 or done == n:
                last[0] = now
                print(f"synth: {done}/{n} tensors, {now - t0:.0f} s", file=sys.stderr)

        res = write_synthetic(s, args.bpw, out, head_bits=args.head_bits, seed=args.seed,
                              max_shard_bytes=int(args.shard_gb * 1e9), progress=progress)
    except ValueError as e:
        print(f"moedesk-cli synth: {e}", file=sys.stderr)
        return 2
    dt = time.monotonic() - t0
    print(json.dumps({"path": str(res.path), "shards": len(res.shards), "tensors": res.num_tensors,
                      "bytes": res.total_bytes, "seconds": round(dt, 1),
                      "gb_per_s": round(res.total_bytes / 1e9 / max(dt, 1e-9), 2)}))
    return 0
