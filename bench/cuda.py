"""CUDA benchmark of the exl2 engine against exllamav2's stock path, in one process, same model, same run.

    python -m bench.cuda --model DIR --label qwen3-30b-a3b --bpw 4.0 \
        [--prompts 512,4096] [--decode 256] [--context 8192] [--baseline stock|none] \
        [--profile DIR] [--ceilings FILE] [--out bench/results/]

Figures (batch 1, greedy argmax on the GPU each step, one warm-up first):
- prefill tokens/s for each prompt length (one `prefill` of the whole prompt, cache empty: the
  last row's logits only, as the app asks for);
- time to first token: prefill of the first prompt length + the argmax of its last row;
- decode tokens/s over --decode tokens after the first prompt (each step: forward, argmax, .item());
- peak VRAM (torch's allocator peak, from load to end);
- bytes of weights read per decoded token (attention, norms, router, the 8 chosen experts, head)
  and the roofline tokens/s = measured HBM bandwidth / those bytes.
The baseline loads the same folder with exllamav2's own MoE module and its own layer loop (its
fused MoE kernel for <= 4 rows); exllamav2's dynamic generator is timed too when a tokenizer exists.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import time
from pathlib import Path
from typing import Any, Optional

import torch

from bench.engine import git_commit, machine
from bench.roofline import hbm_bandwidth, sync_time
from runtime.options import LoadOptions, OffloadOptions

GB = 1e9


def weight_bytes_per_token(engine) -> dict[str, int]:
    """Bytes of weights one decoded token reads, by part (what the kernels load, not the file size)."""
    from exllamav2.attn import ExLlamaV2Attention
    from exllamav2.linear import ExLlamaV2Linear
    from exllamav2.mlp import ExLlamaV2MLP
    from exllamav2.moe_mlp import ExLlamaV2MoEMLP
    from runtime.experts.exl2_module import OwnMoE

    def lin(l) -> int:
        if getattr(l, "q_tensors", None):
            return sum(t.numel() * t.element_size() for k, t in l.q_tensors.items()
                       if k not in ("q_invperm", "q_group_map"))
        if l.linear is not None:
            return l.linear.weight.numel() * 2
        return 0

    parts = {"attention": 0, "dense_mlp": 0, "router": 0, "experts": 0, "norms": 0, "head": 0}
    for m in engine.model.modules[1:]:
        if isinstance(m, ExLlamaV2Attention):
            parts["attention"] += sum(lin(l) for l in (m.q_proj, m.k_proj, m.v_proj, m.o_proj))
        elif isinstance(m, OwnMoE):
            parts["router"] += m.experts.router_bytes()
            parts["experts"] += m.experts.bytes_per_token(1) - m.experts.router_bytes()
        elif isinstance(m, ExLlamaV2MoEMLP):
            parts["router"] += m.gate.linear.weight.numel() * 2
            k = m.num_experts_per_token
            parts["experts"] += k * (lin(m.w1[0]) + lin(m.w3[0]) + lin(m.w2[0]))
        elif isinstance(m, ExLlamaV2MLP):
            parts["dense_mlp"] += sum(lin(l) for l in (m.gate_proj, m.up_proj, m.down_proj) if l is not None)
        elif isinstance(m, ExLlamaV2Linear):
            parts["head"] += lin(m)
        else:
            parts["norms"] += sum(p.numel() * p.element_size() for p in [getattr(m, "weight", None)] if p is not None)
    parts["total"] = sum(parts.values())
    return parts


def measure(engine, prompts: list[int], decode: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.info.vocab_size
    out: dict[str, Any] = {"prefill_tps": {}, "prefill_s": {}}
    # warm-up: compile kernels, capture the first graph buckets
    engine.reset()
    engine.forward(torch.randint(0, vocab, (64,), generator=g).tolist())
    for _ in range(4):
        engine.forward([1])
    for n in prompts:                                     # every prompt shape once, untimed (JIT, buffers)
        engine.reset()
        engine.forward(torch.randint(0, vocab, (n,), generator=g).tolist())
    for n in prompts:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        engine.reset()
        box = {}
        dt = sync_time(lambda: box.update(tok=int(engine.prefill(ids)[-1].argmax())))
        out["prefill_s"][n] = dt
        out["prefill_tps"][n] = n / dt
        if n == prompts[0]:
            out["ttft_s"] = dt
    # decode after the first prompt
    engine.reset()
    ids = torch.randint(0, vocab, (prompts[0],), generator=g).tolist()
    tok = int(engine.prefill(ids)[-1].argmax())
    for _ in range(8):                                    # capture the bucket(s) ahead, outside the clock
        tok = int(engine.forward([tok])[-1].argmax())
    engine.truncate(prompts[0])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(decode):
        tok = int(engine.forward([tok])[-1].argmax())
    dt = time.perf_counter() - t
    out["decode_tps"] = decode / dt
    out["decode_ms_per_token"] = 1e3 * dt / decode
    return out


def profile_decode(engine, path: Path, steps: int = 16) -> dict[str, Any]:
    """torch.profiler over `steps` decode steps: CUDA time per kernel, launches per token, busy fraction."""
    from torch.profiler import ProfilerActivity, profile
    tok = 1
    for _ in range(4):
        tok = int(engine.forward([tok])[-1].argmax())
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tok = int(engine.forward([tok])[-1].argmax())
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    ka = prof.key_averages()
    kern = [e for e in prof.events() if e.device_type.name == "CUDA"]
    gpu_us = sum(e.device_time for e in kern) if kern and hasattr(kern[0], "device_time") else \
        sum(getattr(e, "cuda_time", 0) for e in kern)
    table = ka.table(sort_by="self_cuda_time_total" if hasattr(ka[0], "self_cuda_time_total") else
                     "self_device_time_total", row_limit=25)
    path.write_text(table)
    return {"steps": steps, "wall_ms_per_token": 1e3 * wall / steps,
            "gpu_kernel_ms_per_token": gpu_us / 1e3 / steps,
            "kernels_per_token": len(kern) / steps,
            "gpu_busy_fraction": (gpu_us / 1e6) / wall if wall else None}


def profile_prefill(engine, path: Path, n: int) -> dict[str, Any]:
    """torch.profiler over one prefill of n tokens, as the timed prefill and the app run it (the head on the
    last row only: a forward's head over every row was 31% of a 4096-token profile's kernel time); the
    table is appended to `path`."""
    from torch.profiler import ProfilerActivity, profile
    ids = list(range(100, 100 + n))
    engine.reset()
    engine.prefill(ids)
    engine.reset()
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.prefill(ids)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    ka = prof.key_averages()
    with open(path, "a") as f:
        f.write(f"\n\n=== prefill of {n} tokens: {wall * 1e3:.1f} ms under the profiler ===\n")
        f.write(ka.table(sort_by="self_cuda_time_total" if hasattr(ka[0], "self_cuda_time_total") else
                         "self_device_time_total", row_limit=20))
    return {"tokens": n, "wall_ms": wall * 1e3}


def verify_logits(engine, rows=(1, 2, 3, 4, 5, 8), prompt: int = 64) -> dict[str, torch.Tensor]:
    """Logits of verify forwards of each row count after the same prompt (rolled back each time), and
    of the 8 rows one at a time: to compare engines and batched vs stepwise at the real shape."""
    g = torch.Generator().manual_seed(11)
    toks = torch.randint(0, engine.info.vocab_size, (prompt + max(rows),), generator=g).tolist()
    engine.reset()
    engine.forward(toks[:prompt])
    out = {}
    for r in rows:
        out[f"verify_{r}"] = engine.forward(toks[prompt:prompt + r]).float().cpu()
        engine.truncate(prompt)
    out["stepwise_8"] = torch.cat([engine.forward([t]).float().cpu() for t in toks[prompt:prompt + 8]])
    engine.reset()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def stock_generator_decode(engine, decode: int, prompt: int) -> Optional[float]:
    """exllamav2's dynamic generator (paged=False), greedy, on the stock-loaded model; None without tokenizer."""
    from exllamav2 import ExLlamaV2Tokenizer
    from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
    tok = ExLlamaV2Tokenizer(engine.model.config)
    gen = ExLlamaV2DynamicGenerator(engine.model, engine.cache, tok, paged=False)
    ids = torch.randint(100, engine.info.vocab_size - 100, (1, prompt))
    def run(n):
        job = ExLlamaV2DynamicJob(input_ids=ids, max_new_tokens=n, gen_settings=ExLlamaV2Sampler.Settings.greedy(),
                                  stop_conditions=[], decode_special_tokens=True)
        gen.enqueue(job)
        t_first = None
        count = 0
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r.get("stage") == "streaming" and "token_ids" in r:
                    count += r["token_ids"].shape[-1]
                    if t_first is None:
                        t_first = time.perf_counter()
        return count, t_first, time.perf_counter()
    run(8)
    count, t_first, t_end = run(decode + 1)
    engine.cache.current_seq_len = 0
    return (count - 1) / (t_end - t_first) if count > 1 else None


def bench_one(path: str, moe: str, graphs: bool, context: int, prompts: list[int], decode: int,
              profile_to: Optional[Path]) -> dict[str, Any]:
    from runtime.backends import exl2
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    opts = LoadOptions(offload=OffloadOptions(context_length=context))
    t = time.perf_counter()
    engine, _ = exl2.load(path, opts, lambda *a: None, moe=moe, graphs=graphs)
    load_s = time.perf_counter() - t
    try:
        res = measure(engine, prompts, decode)
        res["load_s"] = load_s
        res["bytes_per_token"] = weight_bytes_per_token(engine)
        res["peak_vram_gb"] = torch.cuda.max_memory_allocated() / GB
        res["graphs"] = engine.graphs is not None
        res["telemetry"] = engine.telemetry()
        res["verify_logits"] = verify_logits(engine)
        if profile_to is not None:
            engine.reset()
            engine.forward(list(range(100, 100 + prompts[0])))
            res["profile"] = profile_decode(engine, profile_to)
            res["profile_prefill"] = profile_prefill(engine, profile_to, prompts[-1])
        if moe == "stock":
            try:
                res["generator_decode_tps"] = stock_generator_decode(engine, decode, prompts[0])
            except Exception as e:                      # no tokenizer, or the generator refused
                res["generator_decode_tps"] = None
                res["generator_error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        engine.close()
        gc.collect()
        torch.cuda.empty_cache()
    return res


def _plain(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "verify_logits"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="CUDA benchmark: exl2 engine vs exllamav2 stock")
    ap.add_argument("--model", required=True)
    ap.add_argument("--label", required=True, help="model name or shape for the results")
    ap.add_argument("--bpw", type=float)
    ap.add_argument("--prompts", default="512,4096")
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--baseline", choices=("stock", "none"), default="stock")
    ap.add_argument("--stock-decode", type=int, help="decode tokens for the (slow) stock baseline")
    ap.add_argument("--stock-prompts", help="prompt lengths for the stock baseline (default: --prompts)")
    ap.add_argument("--stock-profile", action="store_true", help="profile the stock baseline too")
    ap.add_argument("--eager", action="store_true", help="also time our engine without the decode graphs")
    ap.add_argument("--profile", help="folder for profiler tables")
    ap.add_argument("--ceilings", help="file with ceilings.py's output, copied into the result")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    prompts = [int(p) for p in a.prompts.split(",")]
    prof = Path(a.profile) if a.profile else None
    if prof:
        prof.mkdir(parents=True, exist_ok=True)
    bw = hbm_bandwidth()
    runs: dict[str, dict] = {}
    if a.baseline == "stock":
        sp = [int(p) for p in a.stock_prompts.split(",")] if a.stock_prompts else prompts
        runs["stock"] = bench_one(a.model, "stock", False, a.context, sp, a.stock_decode or a.decode,
                                  prof / f"profile_{a.label}_stock.txt" if prof and a.stock_profile else None)
        print("stock:", json.dumps(_plain(runs["stock"]), default=str), flush=True)
    if a.eager:
        runs["eager"] = bench_one(a.model, "own", False, a.context, prompts[:1], a.decode, None)
        print("eager:", json.dumps(_plain(runs["eager"]), default=str), flush=True)
    ours = bench_one(a.model, "own", True, a.context, prompts, a.decode,
                     prof / f"profile_{a.label}_graph.txt" if prof else None)
    print("ours:", json.dumps(_plain(ours), default=str), flush=True)
    checks = {}
    v = ours["verify_logits"]
    checks["ours_batched8_vs_stepwise"] = _rel(v["verify_8"], v["stepwise_8"])
    if "stock" in runs:
        sv = runs["stock"]["verify_logits"]
        checks["stock_batched8_vs_stepwise"] = _rel(sv["verify_8"], sv["stepwise_8"])
        for k in v:
            checks[f"stock_vs_ours_{k}"] = _rel(sv[k], v[k])
    print("checks:", json.dumps(checks), flush=True)

    def figures(r):
        b = r["bytes_per_token"]["total"]
        return {"prefill_tps": r["prefill_tps"][prompts[0]], "decode_tps": r["decode_tps"], "ttft_s": r["ttft_s"],
                "prefill_tps_by_prompt": r["prefill_tps"], "peak_vram_gb": r["peak_vram_gb"],
                "weight_bytes_per_token": r["bytes_per_token"], "roofline_tps": bw / b,
                "roofline_fraction": r["decode_tps"] / (bw / b), "profile": r.get("profile"),
                "load_s": r["load_s"]}

    f = figures(ours)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "machine": machine(), "device": torch.cuda.get_device_name(0),
        "engine": "cuda", "model": a.label, "bpw": a.bpw, "vram_budget_gb": None, "context": a.context,
        "prompt_tokens": prompts[0], "decode_tokens": a.decode,
        "prefill_tps": f["prefill_tps"], "decode_tps": f["decode_tps"], "ttft_s": f["ttft_s"],
        "roofline_tps": f["roofline_tps"], "draft": None,
        "baseline": ({"name": "exllamav2 0.3.2 stock MoE module and layer loop", **figures(runs["stock"]),
                      "generator_decode_tps": runs["stock"].get("generator_decode_tps"),
                      "generator_error": runs["stock"].get("generator_error")} if "stock" in runs else None),
        "notes": ("Synthetic random-weight EXL2 model (speed only; near-uniform routing). Batch 1, greedy "
                  "argmax on the GPU. Roofline = HBM copy bandwidth (read+write) / weight bytes per token; "
                  "KV cache reads not counted. " + a.note),
        "extra": {"ours": f, "eager": figures(runs["eager"]) if "eager" in runs else None,
                  "logit_checks": checks, "telemetry": ours.get("telemetry"),
                  "profile_prefill": ours.get("profile_prefill"),
                  "hbm_copy_gbps": bw / GB,
                  "ceilings": Path(a.ceilings).read_text() if a.ceilings and Path(a.ceilings).exists() else None},
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"cuda-{a.label}-{a.bpw}bpw-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    (out / name).write_text(json.dumps(result, indent=1, default=str))
    print(f"\n{a.label} {a.bpw} bpw: decode {f['decode_tps']:.1f} tok/s (roofline {f['roofline_tps']:.0f}, "
          f"{100 * f['roofline_fraction']:.1f}%), prefill {', '.join(f'{k}: {v:.0f}' for k, v in f['prefill_tps_by_prompt'].items())} tok/s, "
          f"ttft {f['ttft_s'] * 1e3:.1f} ms, peak {f['peak_vram_gb']:.1f} GB")
    if "stock" in runs:
        s = figures(runs["stock"])
        print(f"stock: decode {s['decode_tps']:.1f} tok/s, prefill {', '.join(f'{k}: {v:.0f}' for k, v in s['prefill_tps_by_prompt'].items())} tok/s, "
              f"generator {runs['stock'].get('generator_decode_tps')}")
    print("wrote", out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
