"""Time and memory of the calibrated converter on a random bf16 checkpoint of a real model's shape.

    python -m bench.convert_memory --shape qwen3.5-122b-a10b --layers 2 [--experts N] [--top-k K] [--vocab V]
        [--deltanet-only] [--rows 32] [--seq-len 512] [--bpw 3] [--hessian-memory GiB] [--device cpu|cuda]
        [--vram-gb G] [--baseline RESULT.json] [--distinct-experts N] [--out bench/results/]

1. Writes a Hugging Face folder (config.json, one safetensors shard per layer with an index, a tokenizer)
   of the shape (runtime/exl2/shapes.py) cut to --layers layers, with the Hub's tensor names and random bf16
   weights (N(0, 0.02); norms 1, Qwen3.5's (1 + w) norms 0). Qwen3.5's hybrid layers are written as they are
   (Gated DeltaNet and gated attention; cut to fewer layers than its attention interval, the last layer is the
   attention one, or none with --deltanet-only); its MTP head is not written. The experts' weights are drawn for
   --distinct-experts experts and repeated (drawing 2.4 B numbers a layer took longer than converting them). --experts and --vocab shrink
   the model where the full one would not fit the machine or the time; the projection scales back up.
2. Converts it with `runtime.exl2.convert.convert` in this process on --device (--vram-gb caps the GPU memory
   torch may take, to show what a smaller card holds), while a thread samples the process's RSS; per layer it
   records wall time, the seconds of each step (read, forward, hessians, prepare, gptq, allocate, dequantize),
   peak RSS, peak GPU memory and the peak bytes of Hessians held (the converter's own count).
3. Writes JSON to --out: the measurements, the settings, and a projection to the full model: time = for each
   kind of layer (Qwen3.5: DeltaNet, attention) its measured mean x the full model's count of that kind (the
   experts' share x full / converted experts), plus the MTP head as one more attention layer where the full model
   has one, plus the head scaled by vocabulary (a kind not converted here is counted at the mean of the layers that
   were: "kinds_at_measured_mean"); memory per layer = the measured peak RSS, less the converter's
   own estimate of what it held at this size, plus that estimate at the full size. --baseline names an earlier
   result of this benchmark, whose projection is set beside this one ("baseline"). The JSON is written after
   every layer too ("complete": false, the head left out of the projection), so a run stopped by a time limit
   keeps the layers it finished.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil

from runtime.exl2 import allocate, caldata, calibrate
from runtime.exl2.readahead import layer_of
from runtime.exl2.shapes import QWEN35, Shape, _layer_types, get_shape, hf_config, param_counts, tensors
from runtime.options import CONVERT_CALIBRATION_ROWS, CONVERT_CALIBRATION_SEQ_LEN

WEIGHT_STD = 0.02
HEAD_FP32_COPIES = 7.3    # RSS rise of quantize_gptq on a [16384, 4096] head / its float32 size (measured)
ROWS, SEQ_LEN = CONVERT_CALIBRATION_ROWS, CONVERT_CALIBRATION_SEQ_LEN     # the converter's defaults


def bench_shape(name: str, layers: int, experts: int | None, vocab: int | None,
                top_k: int | None = None, deltanet_only: bool = False) -> tuple[Shape, Shape, list[str]]:
    """(the shape converted here, the full shape, notes on what differs)."""
    full = get_shape(name)
    notes = []
    if full.architecture not in ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", QWEN35):
        raise SystemExit(f"--shape {name}: this benchmark writes Qwen3.5-MoE, Qwen3-MoE, Qwen3 and Llama "
                         f"checkpoints; not {full.architecture}")
    s = full.with_layers(layers)
    if deltanet_only:
        if not full.is_hybrid or layers >= full.full_attention_interval:
            raise SystemExit(f"--deltanet-only needs a hybrid shape and fewer layers than its attention interval "
                             f"({full.full_attention_interval or 'none'} for {name}), got --layers {layers}")
        notes.append(f"{layers} of {full.layers} layers, all Gated DeltaNet (the kind of "
                     f"{_layer_types(full).count('linear_attention')} of them); the gated-attention layers and the "
                     f"MTP head are projected at the DeltaNet layers' time")
    elif full.is_hybrid and layers < full.full_attention_interval:
        s = replace(s, full_attention_interval=layers)
        notes.append(f"{layers} of {full.layers} layers, the last one gated attention and the others Gated DeltaNet "
                     f"(the model has one attention layer in {full.full_attention_interval})")
    if full.is_hybrid:
        notes.append("no MTP head written; the projection counts it as one more attention layer")
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
        s = replace(s, vocab=vocab, special_base=0)
        notes.append(f"vocabulary {vocab} instead of {full.vocab}; the head's time scaled by the ratio")
    return s, full, notes


def write_checkpoint(s: Shape, out: Path, seed: int = 0, distinct_experts: int = 0) -> None:
    """A random bf16 HF folder of the shape: config.json, one shard per layer (embeddings and head in
    their own), model.safetensors.index.json, a tokenizer. `distinct_experts` > 0: the experts' weights drawn for
    that many experts and repeated."""
    import torch
    from safetensors.torch import save_file

    from runtime.exl2.synth_tokenizer import write_tokenizer
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    index: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    pool: dict[str, list[torch.Tensor]] = {}       # role -> the distinct experts' weights drawn so far
    key = None

    def flush():
        fname = f"model-{key}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        index.update({k: fname for k in shard})
        shard.clear()

    for t in tensors(s):                 # checkpoint order: embeddings, layer by layer, norm, head
        if t.name.startswith("mtp."):
            continue
        name = f"{t.name}.weight" if t.kind in ("linear", "head") else t.name
        layer = layer_of(name)
        k = f"layer-{layer:05d}" if layer is not None else "embed" if t.kind == "embed" else "head"
        if k != key and shard:
            flush()                      # one layer's tensors in memory at a time
        key = k
        if t.kind in ("norm", "centred_norm"):
            zero = t.kind == "centred_norm" and s.is_hybrid          # stored w, used as 1 + w
            shard[name] = (torch.zeros if zero else torch.ones)(t.shape, dtype=torch.bfloat16)
        elif distinct_experts > 0 and t.role.startswith("expert."):
            drawn = pool.setdefault(t.role, [])
            if len(drawn) < distinct_experts:
                drawn.append((torch.randn(t.shape, generator=gen) * WEIGHT_STD).to(torch.bfloat16))
            shard[name] = drawn[int(name.split(".experts.")[1].split(".")[0]) % distinct_experts].clone()
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
        widths = len(allocate.candidates(bits))                            # the measured allocation's loop
        per_expert = calibrate.expert_bytes(h, s.expert_intermediate, widths)    # Hessians, inverses, GPTQ loop
        group = min(s.experts, calibrate.experts_per_group(h, s.expert_intermediate, budget, widths))
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


def project(layers: list[dict], s: Shape, full: Shape, head_s: float | None) -> dict:
    """The full model's conversion time from the measured layers (see the module's docstring, step 3); head_s
    None (a run cut before the head): the head left out of model_seconds."""
    scale = (full.experts / s.experts) if s.is_moe else 1.0
    per_kind: dict[str, list[float]] = {}
    for r in layers:
        per_kind.setdefault(r["kind"], []).append(r["seconds"] + r["expert_seconds"] * (scale - 1))
    mean = {k: sum(v) / len(v) for k, v in per_kind.items()}
    overall = sum(sum(v) for v in per_kind.values()) / len(layers)
    kinds = _layer_types(full) if full.is_hybrid else ["decoder"] * full.layers
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    unmeasured = [k for k in counts if k not in mean]             # counted at the measured layers' mean
    mtp = mean.get("full_attention", overall) if full.is_hybrid else 0.0       # one more attention layer
    layers_s = sum(n * mean.get(k, overall) for k, n in counts.items()) + mtp
    head = None if head_s is None else head_s * full.vocab / s.vocab
    total = layers_s + (head or 0.0)
    return {"seconds_per_layer": round((layers_s - mtp) / full.layers, 1),
            "seconds_per_layer_by_kind": {k: round(v, 1) for k, v in mean.items()},
            "layers_by_kind": counts, "kinds_at_measured_mean": unmeasured, "mtp_seconds": round(mtp, 1),
            "head_seconds": None if head is None else round(head, 1),
            "model_seconds": round(total, 1), "model_hours": round(total / 3600, 2)}


def phases(layers: list[dict]) -> dict[str, float]:
    """Mean seconds per step over the measured layers; 'other' is the rest (the forward runs of transformers'
    layers, writing the layer's files)."""
    out: dict[str, float] = {}
    for r in layers:
        for k, v in r.get("phases", {}).items():
            out[k] = out.get(k, 0.0) + v / len(layers)
        out["other"] = out.get("other", 0.0) + (r["seconds"] - sum(r.get("phases", {}).values())) / len(layers)
    return {k: round(v, 2) for k, v in out.items()}


def baseline(path: str | None) -> dict | None:
    """An earlier result of this benchmark, as the baseline figures beside this run's."""
    if not path:
        return None
    old = json.loads(Path(path).read_text())
    pr = old["projection"]
    return {"name": f"{Path(path).name} (commit {str(old.get('git_commit'))[:12]}, {old.get('device')}, "
                    f"shape {old.get('shape')})", "seconds_per_layer": pr["seconds_per_layer"],
            "model_hours": pr["model_hours"], "converted": old.get("converted"), "machine": old.get("machine")}


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def result(run: dict, end: dict | None) -> dict:
    """The JSON of a run: after each layer (end None: the layers so far, the head not reached) and at the end
    (end: the conversion's seconds, the RSS after the layers, the converted model's quantization_config)."""
    import torch

    from bench.engine import git_commit, machine
    args, s, full, layers, budget = run["args"], run["shape"], run["full"], run["layers"], run["budget"]
    qc = (end or {}).get("quantization_config", {})
    tokens = qc.get("calibration", {}).get("rows", args.rows) * args.seq_len
    head_s = None if end is None else end["convert_s"] - sum(r["seconds"] for r in layers)   # embeddings, head, assembly
    est_budget = budget or calibrate.DEFAULT_HESSIAN_BUDGET
    est_here = estimate_layer_bytes(s, tokens, est_budget, args.bpw)
    est_full = estimate_layer_bytes(full, tokens, est_budget, args.bpw)
    peak_layer_rss = max(r["peak_rss_bytes"] for r in layers)
    total, active = param_counts(full)
    cut = [] if end else [f"cut after {len(layers)} of {s.layers} layers (the run was stopped or is still going): the "
                          f"head and assembly not reached, left out of model_seconds"]
    return {
        "bench": "convert_memory", "complete": end is not None,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "machine": machine(), "device": run["device"], "model": args.shape,
        "bpw": args.bpw, "vram_budget_gb": args.vram_gb if run["device"] != "cpu" else None, "context": None,
        "prompt_tokens": None, "prefill_tps": None, "decode_tps": None, "ttft_s": None, "roofline_tps": None,
        "draft": None, "baseline": baseline(args.baseline), "torch_threads": torch.get_num_threads(),
        "shape": args.shape,
        "converted": {"layers": s.layers, "experts": s.experts, "hidden": s.hidden,
                      "expert_intermediate": s.expert_intermediate, "vocab": s.vocab},
        "full": {"layers": full.layers, "experts": full.experts, "vocab": full.vocab,
                 "params_total": total, "params_active": active},
        "settings": {"bpw": args.bpw, "rows": tokens // args.seq_len, "seq_len": args.seq_len,
                     "measured_allocation": qc.get("measured_allocation"), "hessian_budget_bytes": budget,
                     "experts_per_group": layers[0]["experts_per_group"], "distinct_experts": args.distinct_experts},
        "checkpoint_write_s": run["checkpoint_write_s"],
        "convert_s": None if end is None else round(end["convert_s"], 1),
        "head_and_assembly_s": None if head_s is None else round(head_s, 1),
        "phases_mean_s": phases(layers), "layers": layers, "rss_before_convert_bytes": run["rss_before_convert_bytes"],
        "rss_after_layers_peak_bytes": (end or {}).get("rss_after_layers_peak_bytes"),
        "peak_rss_bytes_ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "experts_routed": qc.get("experts_routed"), "experts_all_token_fallback": qc.get("experts_all_token_fallback"),
        "estimate_per_layer_bytes": {"converted": est_here, "full": est_full},
        "projection": dict(project(layers, s, full, head_s), **{
            "peak_rss_per_layer_bytes": int(peak_layer_rss - sum(est_here.values()) + sum(est_full.values())),
            "hessian_peak_bytes": est_full["hessians"],
            "head_gptq_bytes_estimate": int(HEAD_FP32_COPIES * full.vocab * full.hidden * 4)}),
        "notes": run["notes"] + args.note + cut + [
            "projection: time = per kind of layer its measured mean (experts' time x full/run experts) x the full "
            "model's count of that kind, + the MTP head as one more attention layer (Qwen3.5), + head time x full/run "
            "vocabulary; memory is per layer (one layer at a time): measured peak RSS - the converter's estimate "
            "here + its estimate at full size (estimate_per_layer_bytes)",
            "the checkpoint was just written, so its layers are read from the page cache, not the disk; on a model "
            "larger than the RAM the converter reads each next layer from disk while it quantizes this one",
            "peak RSS includes the mapped safetensors pages of the shard being read (file-backed, reclaimable)",
            f"head_gptq_bytes_estimate: {HEAD_FP32_COPIES} float32 copies of vocab x hidden (the RSS rise measured "
            "for GPTQ of a 16384 x 4096 head on the CPU), not measured at full size",
        ] + (["synthetic weights: the experts' are drawn for --distinct-experts experts and repeated; the router is "
              "random, so every expert gets its own tokens"] if s.is_moe else []),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.convert_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3.5-122b-a10b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, help="experts per layer to write (default: the shape's)")
    p.add_argument("--vocab", type=int, help="vocabulary to write (default: the shape's)")
    p.add_argument("--top-k", type=int, help="experts per token (default: the shape's; lower to write fewer experts)")
    p.add_argument("--deltanet-only", action="store_true",
                   help="Qwen3.5 cut to fewer layers than its attention interval: all of them Gated DeltaNet "
                        "(default: the last one gated attention)")
    p.add_argument("--rows", type=int, default=ROWS)
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--bpw", type=float, default=3.0)
    p.add_argument("--hessian-memory", type=float, help="GiB (default: the converter's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--vram-gb", type=float, help="cap the GPU memory torch may take at this many GiB")
    p.add_argument("--distinct-experts", type=int, default=16, help="experts drawn at random, the rest repeat them")
    p.add_argument("--baseline", help="an earlier result JSON of this benchmark to set beside this one")
    p.add_argument("--work", help="folder for the checkpoint and the output (default: a temporary one, removed)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--note", action="append", default=[], help="a note for the JSON (repeatable)")
    args = p.parse_args(argv)

    import torch

    from runtime.exl2 import convert as cv
    s, full, notes = bench_shape(args.shape, args.layers, args.experts, args.vocab, args.top_k, args.deltanet_only)
    budget = None if args.hessian_memory is None else int(args.hessian_memory * 2**30)
    cuda = args.device.startswith("cuda")
    if args.vram_gb and cuda:
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_gb * 2**30 / torch.cuda.mem_get_info()[1]))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="convert-memory-"))
    src, dst = work / "hf", work / "exl2"
    t0 = time.perf_counter()
    if not (src / "config.json").is_file():
        child = multiprocessing.get_context("spawn").Process(target=write_checkpoint,
                                                             args=(s, src, 0, args.distinct_experts))
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
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M")
    path = Path(args.out) / f"convert-memory-{args.shape}-{args.device.split(':')[0]}-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    run = {"args": args, "shape": s, "full": full, "notes": notes, "layers": layers, "budget": budget,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "checkpoint_write_s": round(write_s, 1),
           "rss_before_convert_bytes": base_rss}

    def progress(rep: dict) -> None:
        rep = dict(rep, peak_rss_bytes=sampler.take())
        if cuda:
            rep["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        layers.append(rep)
        print(f"layer {rep['layer']} ({rep['kind']}): {rep['seconds']:.1f} s (experts {rep['expert_seconds']:.1f} s; "
              + ", ".join(f"{k} {v:.1f}" for k, v in rep["phases"].items())
              + f"), peak RSS {rep['peak_rss_bytes'] / 2**30:.2f} GiB"
              + (f", peak GPU {rep['peak_cuda_bytes'] / 2**30:.2f} GiB" if cuda else ""), flush=True)
        _write(path, result(run, None))             # a run cut by a time limit keeps the layers it finished

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
    res = result(run, {"convert_s": total_s, "rss_after_layers_peak_bytes": tail_rss, "quantization_config": qc})
    _write(path, res)
    pr = res["projection"]
    print(f"wrote {path}: {pr['seconds_per_layer']} s per full layer ({pr['seconds_per_layer_by_kind']}), "
          f"{pr['model_hours']} h for {full.layers} layers and the head, "
          f"{pr['peak_rss_per_layer_bytes'] / 2**30:.1f} GiB peak RSS per layer"
          + (f"; baseline {res['baseline']['model_hours']} h" if res["baseline"] else ""))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
