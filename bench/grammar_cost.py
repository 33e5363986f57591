"""What grammar-constrained sampling costs per token (not a test): `python -m bench.grammar_cost`.

    python -m bench.grammar_cost --model demo --backend cpu --out bench/results/
    python -m bench.grammar_cost --model DIR --backend cuda --out bench/results/     # the CUDA engine

Two parts, one JSON result (the fields DESIGN.md lists, plus these):

- `libraries`: the bare per-token cost of each grammar library that imports here (llguidance, the one the
  runtime uses; xgrammar and outlines-core where installed), on the model's tokenizer, for three schemas
  (a flat object, nested arrays, a two-tool call): compile time, and per token the time to compute the
  next-token mask and apply it to a row of logits on the engine's device (`mask_and_apply`, as each library
  is meant to be used; llguidance's through runtime/constrained.py), and to advance by the token. The
  token streams are the schemas' example answers, tokenized.
- `in_situ`: the demo conversation answered through `runtime.generate` on the engine, twice in turns
  (plain, then under a JSON schema; `--rounds` rounds): decode tokens/s of each, and the time spent in the
  request's steering (mask, apply, advance) per token, measured around the calls themselves.

On a shared machine the figures move with its load: `machine.load_avg_1m` records it.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

from bench.engine import git_commit, machine

SCHEMAS = {
    "flat_object": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                     "city": {"type": "string"}},
                     "required": ["name", "age", "city"], "additionalProperties": False},
                    {"name": "Alice Smith", "age": 42, "city": "Lyon"}),
    "nested_arrays": ({"type": "object", "properties": {"people": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"], "additionalProperties": False}}}, "required": ["people"],
                       "additionalProperties": False},
                      {"people": [{"name": "Ada", "tags": ["math", "engines"]}, {"name": "Alan", "tags": ["codes"]},
                                  {"name": "Grace", "tags": ["compilers", "ships", "time"]}]}),
    "tool_call": ({"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}, "required": ["name", "arguments"],
         "additionalProperties": False},
        {"type": "object", "properties": {"name": {"const": "get_time"}, "arguments": {
            "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}},
         "required": ["name", "arguments"], "additionalProperties": False}]},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}),
}
IN_SITU_SCHEMA = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "tags": {
        "type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
    "required": ["name", "tags"], "additionalProperties": False}}
IN_SITU_ASK = "List six famous scientists as JSON, each with a name and a few tags."


def _stats(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    return {"tokens": len(us), "mean_us": round(statistics.fmean(us), 2), "p50_us": round(us[len(us) // 2], 2),
            "p99_us": round(us[min(len(us) - 1, int(len(us) * 0.99))], 2), "max_us": round(us[-1], 2)}


def _walk(tokens: list[int], mask: Callable, advance: Callable, sync: Callable, compile_s: float) -> dict:
    """Per token of `tokens`: the time to mask (and apply) and the time to advance by it."""
    masked, advanced = [], []
    for tok in tokens:
        t0 = time.perf_counter()
        mask()
        sync()
        t1 = time.perf_counter()
        advance(tok)
        masked.append(t1 - t0), advanced.append(time.perf_counter() - t1)
    return {"compile_ms": round(compile_s * 1e3, 3), "mask_and_apply": _stats(masked), "advance": _stats(advanced),
            "total": _stats([a + b for a, b in zip(masked, advanced)])}


def _timed(fn: Callable, acc: list, sync: Callable[[], None]) -> Callable:
    def run(*args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        sync()
        acc.append(time.perf_counter() - t0)
        return out
    return run


def llguidance_cost(tokenizer, vocab: int, device, sync) -> dict:
    import torch

    from runtime.constrained import Constraint, grammar_tokenizer
    from runtime.grammars import schema_grammar
    gtok = grammar_tokenizer(tokenizer, vocab)
    row = torch.randn(vocab, device=device)
    out = {}
    for name, (schema, example) in SCHEMAS.items():
        t0 = time.perf_counter()
        c = Constraint.compile(schema_grammar(schema), gtok, vocab)
        compile_s = time.perf_counter() - t0
        # what the runtime does per token: mask and apply (runtime/constrained.py), then advance
        out[name] = _walk(tokenizer.encode(json.dumps(example)), lambda: c.mask(row), c.advance, sync, compile_s)
    return out


def xgrammar_cost(tokenizer, vocab: int, device, sync) -> Optional[dict]:
    try:
        import torch
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except Exception:                        # not installed here: the result says so
        return None
    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(tokenizer.folder) / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=sorted(tokenizer.eos_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    row = torch.randn(1, vocab, device=device)
    out = {}
    for name, (schema, example) in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        compile_s = time.perf_counter() - t0
        matcher, bits = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)
        def mask(matcher=matcher, bits=bits) -> None:
            matcher.fill_next_token_bitmask(bits)
            xgr.apply_token_bitmask_inplace(row, bits.to(device))
        out[name] = _walk(tokenizer.encode(json.dumps(example)), mask, matcher.accept_token, sync, compile_s)
    return out


def in_situ(engine, tokenizer, rounds: int, sync) -> dict:
    from runtime import protocol as P
    from runtime.constrained import steering_for
    from runtime.generate import generate
    from runtime.options import SamplingOptions
    prompt = tokenizer.encode_chat([{"role": "user", "content": IN_SITU_ASK}])
    runs: dict[str, list] = {"plain": [], "constrained": []}
    steering_s: list[float] = []
    tokens = 0
    for _ in range(rounds):
        cmd = P.Generate("bench", json_schema=IN_SITU_SCHEMA)
        steer = steering_for(cmd, tokenizer, engine.info.vocab_size, prompt, 0, tokenizer.tool_format())
        steer.row = _timed(steer.row, steering_s, sync)
        steer.took = _timed(steer.took, steering_s, sync)
        sampling = SamplingOptions(temperature=0.0, max_tokens=800)
        engine.reset()
        done = generate(engine, tokenizer, prompt, sampling, steer=steer)
        if done.reason == "eos":
            json.loads(done.text)                          # the grammar held
        tokens = len(done.tokens)
        engine.reset()
        plain = generate(engine, tokenizer, prompt, SamplingOptions(temperature=0.0, max_tokens=tokens),
                         ignore_eos=True)
        runs["constrained"].append(done.stats)
        runs["plain"].append(plain.stats)
    med = {k: statistics.median(s.decode_tps for s in v) for k, v in runs.items()}
    return {"answer_tokens": tokens, "rounds": rounds, "constrained_finished": done.reason, "decode_tps_plain": round(med["plain"], 2),
            "decode_tps_constrained": round(med["constrained"], 2),
            "steering_per_token": _stats([sum(steering_s[i:i + 2]) for i in range(0, len(steering_s), 2)]),
            "prompt_tokens": len(prompt), "stats_plain": [s.__dict__ for s in runs["plain"]][:1],
            "prefill_tps": round(statistics.median(s.prefill_tps for s in runs["plain"]), 1),
            "ttft_s": round(statistics.median(s.ttft_s for s in runs["plain"]), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grammar_cost", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    import torch

    from runtime.loader import open_engine
    from runtime.options import LoadOptions, OffloadOptions
    from runtime.tokenizer import Tokenizer
    engine, _ = open_engine(args.model, LoadOptions(offload=OffloadOptions(backend=args.backend)), lambda *a: None)
    tokenizer = Tokenizer.from_folder(engine.info.path)
    device = torch.device("cuda" if args.backend == "cuda" else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    vocab = engine.info.vocab_size
    libraries: dict[str, Any] = {"llguidance": llguidance_cost(tokenizer, vocab, device, sync)}
    libraries["xgrammar"] = xgrammar_cost(tokenizer, vocab, device, sync) or "not installed"
    situ = in_situ(engine, tokenizer, args.rounds, sync)
    versions = {}
    for name in ("llguidance", "xgrammar", "outlines-core"):
        try:
            from importlib.metadata import version
            versions[name] = version(name)
        except Exception:
            versions[name] = None
    result = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"), "git_commit": git_commit(), "machine": machine(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": engine.info.name, "bpw": engine.info.bits_per_weight, "vram_budget_gb": None,
        "context": engine.info.context_length, "prompt_tokens": situ["prompt_tokens"],
        "prefill_tps": situ["prefill_tps"], "decode_tps": situ["decode_tps_constrained"], "ttft_s": situ["ttft_s"],
        "roofline_tps": None, "draft": None,
        "baseline": {"name": "plain decoding, same answer length, same run", "decode_tps": situ["decode_tps_plain"]},
        "library_versions": versions, "vocab": vocab, "libraries": libraries, "in_situ": situ,
        "notes": "Greedy; the constrained answer is a JSON array of 6 objects (schema in bench/grammar_cost.py); "
                 "the plain baseline decodes as many tokens with end-of-sequence ignored. libraries: bare costs on "
                 "the schemas' example answers; outlines-core is measured by hand (docs/api.md), it needs the "
                 "tokenizer's byte mapping done outside the library.",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M")
    path = args.out / f"grammar-cost-{engine.info.name}-{device.type}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    engine.close()
    print(json.dumps({"libraries": {k: ({s: v["total"]["p50_us"] for s, v in d.items()} if isinstance(d, dict) else d)
                                    for k, d in libraries.items()},
                      "decode_tps": [situ["decode_tps_plain"], situ["decode_tps_constrained"]],
                      "steering_p50_us": situ["steering_per_token"]["p50_us"]}))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
