"""Memory and time of the calibrated converter on a random bf16 checkpoint of a real model's shape.

    python -m bench.convert_memory --shape q125-a11 --layers 2 [--experts N] [--top-k K] [--vocab V] [--rows 16]
        [--seq-len 256] [--bpw 3] [--hessian-memory GiB] [--device cpu|cuda] [--out bench/results/]

1. Writes a Hugging Face folder (config.json, one safetensors shard per layer with an index, a tokenizer)
   of the shape (runtime/exl2/shapes.py) cut to --layers layers, with transformers' tensor names and
   random bf16 weights (N(0, 0.02); norms 1). --experts and --vocab shrink it where the full layer would
   not fit the machine or the time; the projection below scales back up. Qwen3.5's hybrid shapes are
   written as Qwen3-MoE layers of the same widths (this benchmark writes no Gated DeltaNet layers).
2. Converts it with `runtime.exl2.convert.convert` in this process on --device, while a thread samples
   the process's RSS; per layer it records wall time, the time in the experts, peak RSS during the layer
   and the peak bytes of Hessians held (the converter's own count).
3. Writes JSON to --out: the measurements, the settings, and a projection to the full model: time =
   layers x (non-expert time + expert time x full experts / experts run) + the head scaled by vocabulary;
   memory per layer = the measured peak RSS, less the converter's own estimate of what it held at this
   size, plus that estimate at the full size (weights float32, Hessians, activations, output).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import resource
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil

from runtime.exl2 import caldata, calibrate
from runtime.options import CONVERT_CALIBRATION_ROWS, CONVERT_CALIBRATION_SEQ_LEN
from runtime.exl2.shapes import QWEN35, Shape, get_shape, hf_config, param_counts, tensors

WEIGHT_STD = 0.02
HEAD_FP32_COPIES = 7.3    # RSS rise of quantize_gptq on a [16384, 4096] head / its float32 size (measured)
ROWS, SEQ_LEN = CONVERT_CALIBRATION_ROWS, CONVERT_CALIBRATION_SEQ_LEN     # the converter's defaults


def bench_shape(name: str, layers: int, experts: int | None, vocab: int | None,
                top_k: int | None = None) -> tuple[Shape, Shape, list[str]]:
    """(the shape converted here, the full shape, notes on what differs)."""
    full = get_shape(name)
    notes = []
    if full.architecture == QWEN35:
        full = replace(full, architecture="Qwen3MoeForCausalLM", full_attention_interval=0,
                       intermediate=full.expert_intermediate, shared_intermediate=0)
        notes.append("Qwen3.5's hybrid layers written as Qwen3-MoE layers of the same widths (full attention, "
                     "no shared expert): this benchmark writes no Gated DeltaNet layers")
    if full.architecture not in ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"):
        raise SystemExit(f"--shape {name}: this benchmark writes Qwen3-MoE, Qwen3 and Llama checkpoints; not "
                         f"{full.architecture}")
    s = full.with_layers(layers)
    if top_k is not None:
        if not full.is_moe or not 1 <= top_k <= full.experts_per_token:
            raise SystemExit(f"--top-k must be between 1 and {full.experts_per_token} for {name}, got {top_k}")
        s = replace(s, experts_per_token=top_k)
        notes.append(f"top-{top_k} routing instead of top-{full.experts_per_token} (fewer experts written)")
    if experts is not None:
        if not full.is_moe or not s.experts_per_token <= experts <= full.experts:
            raise SystemExit(f"--experts must be between top-k {s.experts_per_token} and {full.experts} "
                             f"for {name}, got {experts}")
        s = replace(s, experts=experts)
        if experts < full.experts:
            notes.append(f"{experts} of {full.experts} experts per layer (same widths); expert time scaled up "
                         f"by {full.experts / experts:g}; each expert sees {full.experts / experts:g}x the tokens "
                         f"it would in the full model")
    if vocab is not None and vocab != full.vocab:
        s = replace(s, vocab=vocab)
        notes.append(f"vocabulary {vocab} instead of {full.vocab}; the head's time scaled by the ratio")
    return s, full, notes


def write_checkpoint(s: Shape, out: Path, seed: int = 0) -> None:
    """A random bf16 HF folder of the shape: config.json, one shard per layer (embeddings and head in
    their own), model.safetensors.index.json, a tokenizer."""
    import torch
    from safetensors.torch import save_file

    from runtime.exl2.synth_tokenizer import write_tokenizer
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    index: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    key = None

    def flush():
        fname = f"model-{key}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        index.update({k: fname for k in shard})
        shard.clear()

    for t in tensors(s):                 # checkpoint order: embeddings, layer by layer, norm, head
        name = t.name if t.name.endswith(".weight") else f"{t.name}.weight"
        parts = name.split(".")
        k = f"layer-{int(parts[2]):05d}" if parts[1] == "layers" else "embed" if t.kind == "embed" else "head"
        if k != key and shard:
            flush()                      # one layer's tensors in memory at a time
        key = k
        if t.kind in ("norm", "centred_norm"):
            shard[name] = torch.ones(t.shape, dtype=torch.bfloat16)
        else:
            shard[name] = (torch.randn(t.shape, generator=gen) * WEIGHT_STD).to(torch.bfloat16)
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (out / "config.json").write_text(json.dumps(hf_config(s), indent=2))
    write_tokenizer(out, s.vocab, s.first_special, s.max_position, s.chat)


def estimate_layer_bytes(s: Shape, tokens: int, budget: int, bits: float) -> dict[str, int]:
    """What the converter holds while one decoder layer of the shape is calibrated (its own accounting)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    attn = h * (q + 2 * kv) + q * h
    if s.is_moe:
        mlp = s.experts * 3 * h * s.expert_intermediate + s.experts * h
        per_expert = calibrate.expert_bytes(h, s.expert_intermediate)     # Hessians, inverse, GPTQ loop
        group = min(s.experts, calibrate.experts_per_group(h, s.expert_intermediate, budget))
        experts_h = group * per_expert + calibrate.hessian_bytes(h)
        routed = tokens * h * 2 + tokens * s.experts_per_token * 8
    else:
        mlp = 3 * h * s.intermediate
        experts_h, routed = 0, 0
    dense_h = calibrate.hessian_bytes(h) + calibrate.hessian_bytes(q) + (
        0 if s.is_moe else calibrate.hessian_bytes(h) + calibrate.hessian_bytes(s.intermediate))
    widest = max(h, q, s.expert_intermediate if s.is_moe else s.intermediate)
    return {"weights_fp32": (attn + mlp) * 4, "hessians": max(dense_h, experts_h),
            "gptq_inverse": calibrate.hessian_bytes(widest) // 2,      # float32, kept for linears sharing it
            "activations": tokens * h * 4 * 2 + routed, "output": int((attn + mlp) * (bits + 0.3) / 8)}


class RssSampler(threading.Thread):
    def __init__(self, every_s: float = 0.05):
        super().__init__(daemon=True)
        self.proc, self.every, self.peak, self.stop = psutil.Process(), every_s, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.every)

    def take(self) -> int:
        peak, self.peak = max(self.peak, self.proc.memory_info().rss), 0
        return peak


def main(argv=None) -> int:
    from bench.engine import git_commit, machine
    p = argparse.ArgumentParser(prog="python -m bench.convert_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="q125-a11")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, help="experts per layer to write (default: the shape's)")
    p.add_argument("--vocab", type=int, help="vocabulary to write (default: the shape's)")
    p.add_argument("--top-k", type=int, help="experts per token (default: the shape's; lower to write fewer experts)")
    p.add_argument("--rows", type=int, default=ROWS)
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--bpw", type=float, default=3.0)
    p.add_argument("--hessian-memory", type=float, default=calibrate.DEFAULT_HESSIAN_BUDGET / 2**30, help="GiB")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--work", help="folder for the checkpoint and the output (default: a temporary one, removed)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--note", action="append", default=[], help="a note for the JSON (repeatable)")
    args = p.parse_args(argv)

    import torch

    from runtime.exl2 import convert as cv
    s, full, notes = bench_shape(args.shape, args.layers, args.experts, args.vocab, args.top_k)
    budget = int(args.hessian_memory * 2**30)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="convert-memory-"))
    src, dst = work / "hf", work / "exl2"
    t0 = time.perf_counter()
    if not (src / "config.json").is_file():
        child = multiprocessing.get_context("spawn").Process(target=write_checkpoint, args=(s, src))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"writing the random checkpoint failed (exit {child.exitcode})")
    write_s = time.perf_counter() - t0
    if dst.exists():
        shutil.rmtree(dst)

    sampler = RssSampler()
    sampler.start()
    base_rss = sampler.take()
    layers = []
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()

    def progress(rep: dict) -> None:
        rep = dict(rep, peak_rss_bytes=sampler.take())
        if args.device.startswith("cuda"):
            rep["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        layers.append(rep)
        print(f"layer {rep['layer']}: {rep['seconds']:.1f} s (experts {rep['expert_seconds']:.1f} s), "
              f"peak RSS {rep['peak_rss_bytes'] / 2**30:.2f} GiB, Hessians {rep['hessian_peak_bytes'] / 2**30:.2f} GiB",
              flush=True)

    text, source, note = caldata.default_texts()         # the converter's default calibration set
    if note:
        print(f"note: {note}", flush=True)
    t1 = time.perf_counter()
    cv.convert(src, dst, args.bpw, calibration_text=text, calibration_source=source,
               rows=args.rows, seq_len=args.seq_len, hessian_budget=budget, device=args.device,
               progress=progress, say=lambda m: None)
    total_s = time.perf_counter() - t1
    tail_rss = sampler.take()
    sampler.stop.set()
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    tokens = qc["calibration"]["rows"] * args.seq_len

    layer_s = sum(r["seconds"] for r in layers)
    head_s = total_s - layer_s                       # embeddings, head GPTQ, assembling the folder
    scale = (full.experts / s.experts) if s.is_moe else 1.0
    per_layer = [r["seconds"] - r["expert_seconds"] + r["expert_seconds"] * scale for r in layers]
    per_layer_full_s = sum(per_layer) / len(per_layer)
    est_here = estimate_layer_bytes(s, tokens, budget, args.bpw)
    est_full = estimate_layer_bytes(full, tokens, budget, args.bpw)
    est_default = estimate_layer_bytes(full, tokens, calibrate.DEFAULT_HESSIAN_BUDGET, args.bpw)
    peak_layer_rss = max(r["peak_rss_bytes"] for r in layers)
    total, active = param_counts(full)
    result = {
        "bench": "convert_memory", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "machine": machine(), "device": args.device, "torch_threads": torch.get_num_threads(),
        "shape": args.shape, "converted": {"layers": s.layers, "experts": s.experts, "hidden": s.hidden,
                                           "expert_intermediate": s.expert_intermediate, "vocab": s.vocab},
        "full": {"layers": full.layers, "experts": full.experts, "vocab": full.vocab,
                 "params_total": total, "params_active": active},
        "settings": {"bpw": args.bpw, "rows": qc["calibration"]["rows"], "seq_len": args.seq_len,
                     "hessian_budget_bytes": budget, "experts_per_group": layers[0]["experts_per_group"]},
        "checkpoint_write_s": round(write_s, 1), "convert_s": round(total_s, 1), "head_and_assembly_s": round(head_s, 1),
        "layers": layers, "rss_before_convert_bytes": base_rss, "rss_after_layers_peak_bytes": tail_rss,
        "peak_rss_bytes_ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "experts_routed": qc.get("experts_routed"), "experts_all_token_fallback": qc.get("experts_all_token_fallback"),
        "estimate_per_layer_bytes": {"converted": est_here, "full": est_full},
        "projection": {
            "seconds_per_layer": round(per_layer_full_s, 1),
            "head_seconds": round(head_s * full.vocab / s.vocab, 1),
            "model_seconds": round(per_layer_full_s * full.layers + head_s * full.vocab / s.vocab, 1),
            "model_hours": round((per_layer_full_s * full.layers + head_s * full.vocab / s.vocab) / 3600, 2),
            "peak_rss_per_layer_bytes": int(peak_layer_rss - sum(est_here.values()) + sum(est_full.values())),
            "hessian_peak_bytes": est_full["hessians"],
            "peak_rss_per_layer_bytes_default_budget": int(peak_layer_rss - sum(est_here.values())
                                                           + sum(est_default.values())),
            "head_gptq_bytes_estimate": int(HEAD_FP32_COPIES * full.vocab * full.hidden * 4),
        },
        "notes": notes + args.note + [
            "projection: time = layers x (layer time outside the experts + expert time x full/run experts) + head "
            "time x full/run vocabulary; memory is per layer (one layer at a time): measured peak RSS - the "
            "converter's estimate here + its estimate at full size (estimate_per_layer_bytes)",
            "peak RSS includes the mapped safetensors pages of the shard being read (file-backed, reclaimable)",
            f"head_gptq_bytes_estimate: {HEAD_FP32_COPIES} float32 copies of vocab x hidden (the RSS rise measured "
            "for GPTQ of a 16384 x 4096 head), not measured at full size; rss_after_layers_peak_bytes is the "
            "peak while the head is quantized and the folder assembled at this run's vocabulary",
        ],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M")
    path = out / f"convert-memory-{args.shape}-{args.device.split(':')[0]}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    pr = result["projection"]
    print(f"wrote {path}: {pr['seconds_per_layer']} s per full layer, {pr['model_hours']} h for {full.layers} layers, "
          f"{pr['peak_rss_per_layer_bytes'] / 2**30:.1f} GiB peak RSS per layer")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
