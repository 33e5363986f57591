"""Benchmarks of speculative decoding (not tests): `moedesk-cli bench-spec`.

    lookup      tokens/s of plain greedy decoding vs n-gram drafting (adaptive, and fixed K), on a
                prompt where lookup pays (repeat a passage) and one where it does not (a story)
    verify      time of a target forward over K+1 rows relative to one row, K = 1..8, and from it
                the speedup a given acceptance rate would buy; `--forced-acceptance` also decodes
                with every draft accepted (random-weight models accept nothing useful) to time the
                verify path end to end -- labelled as such in the results

Each result is one JSON file in --out with the fields DESIGN.md lists (date, git_commit, machine,
device, model, bpw, ..., draft, baseline, notes) plus the benchmark's own figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from runtime.bench import git_commit, machine


PASSAGE = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the bay. Every evening the keeper "
    "climbed the one hundred and twelve steps to the lamp room, trimmed the wick, polished the great "
    "lens and wound the clockwork that turned it. Ships passing in the night saw two white flashes "
    "every ten seconds and knew where they were. In winter the storms came from the west and the "
    "spray reached the gallery rail; in summer the keeper grew beans in a sheltered corner of the "
    "yard and read the newspapers that the supply boat brought once a fortnight."
)
PROMPTS = {
    # name -> (user message, where lookup is expected to pay, repetition penalty)
    "repeat_passage": (f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}", True, 1.0),
    # Greedy decoding of a small model soon loops (and lookup then pays); the penalty keeps the
    # story from repeating itself, which is the case lookup cannot help.
    "free_story": ("Write a short story about a fox who learns to play the violin.", False, 1.3),
}


@dataclass
class DecodeFigures:
    name: str
    prompt_tokens: int
    generated_tokens: int
    prefill_tps: Optional[float]
    decode_tps: Optional[float]
    ttft_s: Optional[float]
    draft: Optional[dict] = None
    tokens: list[int] = field(default_factory=list, repr=False)


@dataclass
class VerifyCost:
    k: int
    rows: int
    seconds: float                  # median time of a forward over `rows` rows
    relative: float                 # seconds / seconds of one row


# ----------------------------------------------------------------------------------------------
# Measurements

def decode_run(engine: Any, tokenizer: Any, prompt: list[int], n_tokens: int, draft_opts: Any = None,
               name: str = "plain", repetition_penalty: float = 1.0) -> DecodeFigures:
    """Greedy decoding of exactly n_tokens after `prompt` (end-of-sequence ignored), through the
    generation loop, with a plain or speculative decoder."""
    from runtime import generate, speculative
    from runtime.options import SamplingOptions
    opts = SamplingOptions(temperature=0.0, max_tokens=n_tokens, repetition_penalty=repetition_penalty)
    gen = generate.make_generator(0)
    decoder = None if draft_opts is None else speculative.make_decoder(engine, draft_opts, opts, gen)
    engine.reset()
    result = generate.generate(engine, tokenizer, prompt, opts, decoder=decoder, generator=gen, ignore_eos=True)
    s = result.stats
    draft = None
    if s.draft is not None:
        draft = dict(dataclasses.asdict(draft_opts), **dataclasses.asdict(s.draft))
        draft["acceptance_histogram"] = list(draft["acceptance_histogram"])
    return DecodeFigures(name, s.prompt_tokens, s.generated_tokens, s.prefill_tps, s.decode_tps, s.ttft_s,
                         draft, list(result.tokens))


def verify_cost(engine: Any, context: int, k_max: int = 8, repeats: int = 7, seed: int = 0) -> list[VerifyCost]:
    """Median time of forward over K+1 rows at a context of `context` tokens, for K = 0..k_max.
    Row counts are interleaved within each repeat so drift hits them alike."""
    import torch
    from runtime.speculative.core import timed_forward
    g = torch.Generator().manual_seed(seed)
    vocab = engine.info.vocab_size
    engine.reset()
    engine.forward(torch.randint(0, vocab, (context,), generator=g).tolist())
    times: dict[int, list[float]] = {r: [] for r in range(1, k_max + 2)}
    for rep in range(repeats + 1):                                  # the first round warms up
        for rows in times:
            _, dt = timed_forward(engine, torch.randint(0, vocab, (rows,), generator=g).tolist())
            engine.truncate(context)
            if rep:
                times[rows].append(dt)
    one = statistics.median(times[1])
    return [VerifyCost(r - 1, r, statistics.median(t), statistics.median(t) / one) for r, t in times.items()]


def speedup_at(costs: list[VerifyCost], acceptance: float, draft_cost: float = 0.0) -> dict[int, float]:
    """Expected speedup over plain decoding for each K at a per-token acceptance rate, with a draft
    costing `draft_cost` target-rows per drafted token: (1 + a + ... + a^K) / (rel(K+1) + K * draft_cost)."""
    out = {}
    for c in costs:
        if c.k == 0:
            continue
        tokens = sum(acceptance ** i for i in range(c.k + 1))
        out[c.k] = tokens / (c.relative + c.k * draft_cost)
    return out


def forced_acceptance_decode(engine: Any, prompt: list[int], k: int, n_tokens: int, seed: int = 0) -> float:
    """Tokens/s of the verify path with every draft accepted (FORCED: drafts are random tokens kept
    regardless of the target). k = 0 is plain decoding. Times forward + argmax, as a step would."""
    import torch
    g = torch.Generator().manual_seed(seed)
    engine.reset()
    engine.forward(prompt[:-1])
    pending, produced = prompt[-1], 0
    t0 = time.perf_counter()
    while produced < n_tokens:
        drafts = torch.randint(0, engine.info.vocab_size, (k,), generator=g).tolist()
        logits = engine.forward([pending] + drafts)                 # [k+1, V]
        pending = int(torch.argmax(logits[-1]))
        produced += k + 1
    return produced / (time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------
# Result files (machine and commit as `moedesk-cli bench` records them)

def device_name(engine: Any) -> str:
    if getattr(engine, "backend", "cpu") == "cuda":
        import torch
        return torch.cuda.get_device_name()
    return "cpu"


def record(engine: Any, model: str, **fields: Any) -> dict:
    """A result with the common fields first; `fields` fill in or add the rest."""
    info = engine.info
    base = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "machine": machine(), "device": device_name(engine),
        "model": model, "bpw": info.bits_per_weight, "vram_budget_gb": None,
        "context": info.context_length, "prompt_tokens": None, "prefill_tps": None, "decode_tps": None,
        "ttft_s": None, "roofline_tps": None, "draft": None, "baseline": None, "notes": "",
    }
    base.update(fields)
    return base


def write(out_dir: Path, stem: str, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{stem}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def figures(f: DecodeFigures) -> dict:
    return {"name": f.name, "prompt_tokens": f.prompt_tokens, "generated_tokens": f.generated_tokens,
            "prefill_tps": f.prefill_tps, "decode_tps": f.decode_tps, "ttft_s": f.ttft_s}


# ----------------------------------------------------------------------------------------------
# The benchmarks as the CLI runs them

def bench_lookup(engine: Any, tokenizer: Any, model: str, out: Path, n_tokens: int, k: int,
                 say=print, only: Optional[str] = None, rounds: int = 3) -> list[Path]:
    """Plain vs n-gram (adaptive, and fixed K) on each prompt; one JSON file per prompt and mode.
    The three runs alternate for `rounds` rounds and each ratio is taken within a round, so a
    machine whose load changes between runs skews the medians less."""
    from runtime.options import DraftOptions
    paths = []
    modes = {"adaptive": DraftOptions(mode="ngram", draft_tokens=k, adaptive=True),
             f"k{k}": DraftOptions(mode="ngram", draft_tokens=k, adaptive=False)}
    for name, (text, pays, penalty) in PROMPTS.items():
        if only and name != only:
            continue
        prompt = tokenizer.encode_chat([{"role": "user", "content": text}])
        decode_run(engine, tokenizer, prompt, 8)                           # warm-up
        plains: list[DecodeFigures] = []
        specs: dict[str, list[DecodeFigures]] = {m: [] for m in modes}
        ratios: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(rounds):
            plains.append(decode_run(engine, tokenizer, prompt, n_tokens, repetition_penalty=penalty))
            for m, opts in modes.items():
                specs[m].append(decode_run(engine, tokenizer, prompt, n_tokens, opts, name="ngram",
                                           repetition_penalty=penalty))
                ratios[m].append(specs[m][-1].decode_tps / plains[-1].decode_tps)
        plain = _median_run(plains)
        for m in modes:
            spec = _median_run(specs[m])
            ratio = statistics.median(ratios[m])
            same = all(s.tokens == plain.tokens for s in specs[m])
            in_request = [s.draft["speedup"] for s in specs[m] if s.draft["speedup"] is not None]
            notes = (f"greedy (repetition penalty {penalty}), {n_tokens} tokens, prompt '{name}' "
                     f"(lookup {'expected to pay' if pays else 'not expected to pay'}); {rounds} alternating "
                     f"rounds, figures of the median run; speculative output "
                     f"{'identical to' if same else 'DIFFERENT from'} plain; median decode_tps ratio "
                     f"ngram/plain {ratio:.3f} (per round: {', '.join(f'{r:.3f}' for r in ratios[m])})")
            result = record(engine, model, prompt_tokens=spec.prompt_tokens, prefill_tps=spec.prefill_tps,
                            decode_tps=spec.decode_tps, ttft_s=spec.ttft_s, draft=spec.draft,
                            baseline=figures(plain), notes=notes,
                            bench={"kind": "speculative_lookup", "prompt": name, "lookup_expected_to_pay": pays,
                                   "tokens": n_tokens, "repetition_penalty": penalty, "rounds": rounds,
                                   "ratio_vs_plain": ratio, "ratios_per_round": ratios[m],
                                   "in_request_speedups": in_request, "identical_output": same,
                                   "text": tokenizer.decode(plain.tokens)})
            paths.append(write(out, f"spec-ngram-{m}-{name}", result))
            acc = spec.draft["acceptance_rate"]
            say(f"{name:15s} ngram {m:8s} {spec.decode_tps:7.1f} tok/s  plain {plain.decode_tps:7.1f} tok/s  "
                f"median ratio x{ratio:.3f} (rounds {', '.join(f'{r:.2f}' for r in ratios[m])})  acceptance "
                f"{acc if acc is not None else float('nan'):.2f}  in-request speedup {in_request}")
    return paths


def _median_run(runs: list[DecodeFigures]) -> DecodeFigures:
    return sorted(runs, key=lambda r: r.decode_tps)[len(runs) // 2]


def bench_verify(engine: Any, model: str, out: Path, context: int, forced: bool, n_tokens: int,
                 say=print) -> Path:
    costs = verify_cost(engine, context)
    rows = [dataclasses.asdict(c) for c in costs]
    table = {f"{a:.1f}": {str(k): round(v, 3) for k, v in speedup_at(costs, a).items()}
             for a in (0.5, 0.6, 0.7, 0.8, 0.9)}
    for c in costs:
        say(f"K={c.k}  rows={c.rows}  {c.seconds * 1e3:8.2f} ms  x{c.relative:.2f} of one row")
    bench = {"kind": "speculative_verify_cost", "context_tokens": context, "verify_cost": rows,
             "expected_speedup_by_acceptance": table}
    notes = ("verify cost: forward over K+1 random token ids at a context of random ids; "
             "expected speedups assume a free draft (n-gram) and independent acceptance")
    draft = None
    decode_tps = baseline = None
    if forced:
        plain_tps = forced_acceptance_decode(engine, list(range(1, context + 1)), 0, n_tokens)
        forced_tps = {k: forced_acceptance_decode(engine, list(range(1, context + 1)), k, n_tokens)
                      for k in (1, 2, 4, 8)}
        best = max(forced_tps, key=forced_tps.get)
        decode_tps, baseline = forced_tps[best], {"name": "plain", "decode_tps": plain_tps}
        draft = {"mode": "forced_acceptance", "draft_tokens": best, "acceptance_rate": 1.0,
                 "decode_tps_by_k": forced_tps}
        notes += "; FORCED ACCEPTANCE: every draft kept regardless of the target, to time the verify path only"
        for k, tps in forced_tps.items():
            say(f"forced acceptance K={k}: {tps:.1f} tok/s (plain {plain_tps:.1f})")
    result = record(engine, model, prompt_tokens=context, decode_tps=decode_tps, draft=draft,
                    baseline=baseline, notes=notes, bench=bench)
    return write(out, "spec-verify-cost", result)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model name, 'demo', or folder")
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu", help="engine to load it with")
    p.add_argument("--what", choices=("lookup", "verify", "all"), default="all")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate per run")
    p.add_argument("--draft-tokens", type=int, default=4, help="K for the fixed-K n-gram run")
    p.add_argument("--context", type=int, default=512, help="context tokens for the verify-cost benchmark")
    p.add_argument("--forced-acceptance", action="store_true",
                   help="also time decoding with every draft accepted (labelled in the results)")
    p.add_argument("--prompt", choices=sorted(PROMPTS), help="run the lookup benchmark on this prompt only")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for the reference engine (0 = all cores)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))


def run(args: argparse.Namespace) -> int:
    from runtime import paths
    from runtime.engine import EngineError
    from runtime.options import LoadOptions, OffloadOptions
    folder = paths.resolve_model(args.model)
    loader = _backend(args.backend)
    say = lambda msg: print(msg, flush=True)                         # noqa: E731
    try:
        engine, _ = loader.load(folder, LoadOptions(offload=OffloadOptions(cpu_threads=args.threads)), lambda *a: None)
    except EngineError as e:
        print(f"moedesk-cli bench-spec: {e.message}", file=sys.stderr)
        return 1
    try:
        written = []
        if args.what in ("lookup", "all"):
            from runtime.tokenizer import Tokenizer
            written += bench_lookup(engine, Tokenizer.from_folder(folder), args.model, args.out,
                                    args.tokens, args.draft_tokens, say, args.prompt)
        if args.what in ("verify", "all"):
            written.append(bench_verify(engine, args.model, args.out, args.context, args.forced_acceptance,
                                        args.tokens, say))
        for p in written:
            say(f"wrote {p}")
        return 0
    finally:
        engine.close()


def _backend(name: str):
    if name == "cuda":
        from runtime.backends import exl2
        return exl2
    from runtime import reference
    return reference
