"""Time and memory of `moedesk-cli import` on a GPTQ build of a real model's shape, written straight in the packed domain.

    python -m bench.gptq_import [--shape qwen3.5-122b-a10b] [--layers 4] [--group-size 32] [--[no-]calibrate]
        [--width W] [--mtp] [--device auto|cpu|cuda] [--work DIR] [--out bench/results/]

1. Writes a GPTQModel-style build of the shape (runtime/exl2/shapes.py) cut to --layers decoder layers: the
   routed experts as GPTQ v1 tensors (random 4-bit codes in qweight, the symmetric zero point in qzeros, fp16
   scales spread as trained weights' are, g_idx), everything else in fp16 (N(0, 0.02); norms as the model keeps
   them), one shard per layer with an index, config.json with the build's quantization_config, a tokenizer. No
   float weights of the experts are ever made: a layer of the 122B shape is written in seconds. The MTP head
   (bf16 in the Hub's builds, so quantized by the converter: a whole layer's GPTQ of 256 experts) is left out
   unless --mtp.
2. Imports it with runtime.exl2.gptq_import in this process, a thread sampling the RSS; per layer the wall time,
   the peak RSS and (CUDA) the peak GPU memory.
3. Writes JSON: the measurements, the import's own error report, and a projection to the whole model:
   time = the mean layer time x the model's layers + the rest (embeddings, head, assembly) as measured; the
   disk the whole import needs (the build, and the output about as large). The disk of the machine this runs on
   need only hold --layers layers of both (see `notes`).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.convert_memory import RssSampler
from runtime.exl2.shapes import get_shape, hf_config, param_counts, tensors

WEIGHT_STD = 0.02
SCALE_MEDIAN = 0.0035            # a 4-bit g32 step of weights ~N(0, 0.013): what trained experts' GPTQ scales are
SCALE_SPREAD = 0.3               # log-normal spread of the scales across groups and columns


def _gptq_parts(shape: tuple[int, int], group: int, gen) -> dict:
    """One linear [out, in] as a symmetric 4-bit GPTQ v1 build stores it: random codes, zero 8 stored as 7."""
    import torch
    out, inp = shape
    groups = inp // group
    return {"qweight": torch.randint(-2 ** 31, 2 ** 31, (inp // 8, out), dtype=torch.int32, generator=gen),
            "qzeros": torch.full((groups, out // 8), 0x77777777, dtype=torch.int32),
            "scales": (SCALE_MEDIAN * torch.exp(SCALE_SPREAD * torch.randn(groups, out, generator=gen))).half(),
            "g_idx": (torch.arange(inp, dtype=torch.int32) // group)}


def write_build(s, out: Path, group: int, mtp: bool, seed: int = 0) -> int:
    """The build's folder: one shard per layer (embeddings, head, MTP in their own); -> bytes written."""
    import torch
    from safetensors.torch import save_file

    from runtime.exl2.synth_tokenizer import write_tokenizer
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    index, shard, key = {}, {}, None

    def flush():
        fname = f"model-{key}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        index.update({k: fname for k in shard})
        shard.clear()

    for t in tensors(s):
        if t.name.startswith("mtp.") and not mtp:
            continue
        k = _shard_key(t)
        if k != key and shard:
            flush()
        key = k
        if t.kind == "linear" and ".experts." in t.name and not t.name.startswith("mtp."):
            shard.update({f"{t.name}.{p}": v for p, v in _gptq_parts(t.shape, group, gen).items()})
        elif t.kind in ("norm", "centred_norm"):
            shard[t.name] = (torch.ones if t.kind == "norm" else torch.zeros)(t.shape, dtype=torch.float16)
        else:
            name = t.name if t.name.endswith(".weight") or t.kind not in ("linear", "head") else f"{t.name}.weight"
            shard[name] = (torch.randn(t.shape, generator=gen) * WEIGHT_STD).to(torch.float16)
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    config = hf_config(s)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
                                     "desc_act": False, "checkpoint_format": "gptq", "pack_dtype": "int32",
                                     "lm_head": False, "meta": {"quantizer": ["gptqmodel:5.7.1"]}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(out, s.vocab, s.first_special, s.max_position, s.chat)
    return sum(p.stat().st_size for p in out.iterdir())


def _shard_key(t) -> str:
    """Which shard a tensor goes to: its layer's, the MTP head's, the embeddings' or the head's."""
    parts = t.name.split(".")
    if parts[0] == "mtp":
        return "mtp"
    if "layers" in parts:
        return f"layer-{int(parts[parts.index('layers') + 1]):05d}"
    return "embed" if t.kind == "embed" else "head"


def main(argv=None) -> int:
    from bench.engine import git_commit, machine
    p = argparse.ArgumentParser(prog="python -m bench.gptq_import", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3.5-122b-a10b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--width", type=int, help="EXL2 width of the imported experts (default: the build's 4)")
    p.add_argument("--mtp", action="store_true", help="write the MTP head too (bf16: the converter quantizes it)")
    p.add_argument("--device", default="auto")
    p.add_argument("--work", help="folder for the build and the import (default: a temporary one, removed)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    import torch

    from runtime.exl2.gptq_import import import_model
    full = get_shape(args.shape)
    s = full.with_layers(args.layers)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gptq-import-"))
    mode = "calibrated" if args.calibrate else "rtn"
    src, dst = work / "gptq", work / f"exl2-{mode}"          # one staging folder per mode: a cut run resumes
    t0 = time.perf_counter()
    build_bytes = write_build(s, src, args.group_size, args.mtp) if not (src / "config.json").is_file() else \
        sum(f.stat().st_size for f in src.iterdir())
    write_s = time.perf_counter() - t0
    shutil.rmtree(dst, ignore_errors=True)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device

    sampler = RssSampler()
    sampler.start()
    base_rss, layers, last = sampler.take(), [], [time.perf_counter()]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        rep = {"layer": done - 1, "seconds": round(now - last[0], 2), "peak_rss_bytes": sampler.take()}
        if device == "cuda":
            rep["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        last[0] = now
        layers.append(rep)
        print(f"layer {done}/{total}: {rep['seconds']:.1f} s, peak RSS {rep['peak_rss_bytes'] / 2**30:.2f} GiB",
              flush=True)

    t1 = time.perf_counter()
    import_model(src, dst, calibrate=args.calibrate, width=args.width, device=device, progress=progress,
                 say=lambda m: print(m, flush=True))
    total_s = time.perf_counter() - t1
    tail_rss = sampler.take()
    sampler.stop.set()
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    out_bytes = sum(f.stat().st_size for f in dst.iterdir())
    layer_s = [r["seconds"] for r in layers]
    per_layer = sum(layer_s[1:]) / len(layer_s[1:]) if len(layer_s) > 1 else layer_s[0]    # the first warms up
    rest_s = total_s - sum(layer_s)
    total, active = param_counts(full)
    per_layer_bytes = (build_bytes - _fixed_bytes(s)) / s.layers
    result = {
        "bench": "gptq_import", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "machine": machine(), "device": device if device == "cpu" else
        torch.cuda.get_device_name(0), "model": args.shape, "bpw": qc["bits"],
        "imported": {"layers": s.layers, "experts": s.experts, "group_size": args.group_size,
                     "calibrated": args.calibrate, "mtp": args.mtp, "width": qc["imported_width"]},
        "full": {"layers": full.layers, "params_total": total, "params_active": active},
        "build_write_s": round(write_s, 1), "import_s": round(total_s, 1), "rest_s": round(rest_s, 1),
        "layers": layers, "rss_before_import_bytes": base_rss, "rss_after_layers_peak_bytes": tail_rss,
        "peak_rss_bytes_ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "build_bytes": build_bytes, "output_bytes": out_bytes, "import_report": qc["import"],
        "projection": {"seconds_per_layer": round(per_layer, 1),
                       "model_seconds": round(per_layer * full.layers + rest_s, 1),
                       "model_minutes": round((per_layer * full.layers + rest_s) / 60, 1),
                       "build_bytes": int(per_layer_bytes * full.layers + _fixed_bytes(s)),
                       "peak_rss_bytes": max(r["peak_rss_bytes"] for r in layers)},
        "notes": [f"a synthetic build of {args.shape} cut to {s.layers} of {full.layers} layers: routed experts "
                  f"4-bit GPTQ v1 (g{args.group_size}, random codes, log-normal scales), the rest fp16 N(0, 0.02)",
                  "projection: the mean layer time after the first x the model's layers + embeddings, head and "
                  "assembly as measured (they do not grow with the layers); memory is per layer (one at a time)",
                  "import_report: random codes are uniform over 0..15, so the extreme codes weigh more than in "
                  "trained weights: its added_noise is pessimistic (bench/gptq_quality.py measures a real model's)",
                  "an import resumed in this run (a cut earlier call) counts only the layers done here",
                  "disk: the import's output is about the build's size (the layer files become its shards); "
                  "a whole build and its import need about twice projection.build_bytes",
                  *([] if args.mtp else ["the MTP head left out (bf16 in the Hub's builds: its 256 experts are "
                                         "quantized by the converter, about one converted layer's time more)"])],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M")
    path = out / f"gptq-import-{args.shape}-{mode}-{device.split(':')[0]}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    pr = result["projection"]
    print(f"wrote {path}: {pr['seconds_per_layer']} s per layer, {pr['model_minutes']} min for {full.layers} layers, "
          f"peak RSS {pr['peak_rss_bytes'] / 2**30:.1f} GiB")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _fixed_bytes(s) -> int:
    """Bytes of what does not repeat per layer: embeddings and head in fp16."""
    return 2 * 2 * s.vocab * s.hidden


if __name__ == "__main__":
    sys.exit(main())
