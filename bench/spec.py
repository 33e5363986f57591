"""Benchmarks of speculative decoding (not tests): `moedesk-cli bench-spec`.

    lookup      decode speed of plain greedy decoding vs n-gram drafting (adaptive; fixed K with
                --fixed-k), on a prompt where lookup pays (repeat a passage) and one where it does not
                (a story). Built for a noisy, shared machine: each mode decodes on its own copy of the
                model, and the modes take turns step by step (the first of each turn rotating), so a
                change in the machine's load hits all modes alike; each mode's time is the sum of its
                own steps. This repeats for `--rounds` rounds; the result gives per mode the median
                ratio of time per token plain/mode over the rounds, its spread, and the same from CPU
                time. The criterion "adaptive loses at most 5% where lookup does not pay" is judged
                on the medians.
    verify      time of a target forward over K+1 rows relative to the one-row step, K = 1..8, the
                experts the rows select (MoE), and the speedup at given acceptance rates; see
                bench/verify.py (with --forced-acceptance: decoding with every
                draft kept, labelled as such)

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

from bench.engine import git_commit, machine


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
class ModeRun:
    """One mode's share of a lockstep run: its steps' summed time and the tokens they produced."""
    mode: str
    tokens: list[int] = field(default_factory=list, repr=False)
    steps: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    draft: Optional[dict] = None

    @property
    def tps(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def cpu_tps(self) -> float:
        return len(self.tokens) / self.cpu_s if self.cpu_s > 0 else float("nan")


# ----------------------------------------------------------------------------------------------
# Measurements

def lockstep(engines: dict[str, Any], modes: dict[str, Any], prompt: list[int], n_tokens: int,
             repetition_penalty: float = 1.0) -> dict[str, ModeRun]:
    """Greedy decoding of n_tokens after `prompt` in every mode at once, each on its own engine,
    the modes taking turns one step each (who goes first rotates every turn). `modes` maps a name to
    DraftOptions, or None for plain decoding. Steps run the decoders of the generation loop, under
    its cache contract; the prompt (all but its last token) is prefilled untimed."""
    from runtime import generate, speculative
    from runtime.options import SamplingOptions
    opts = SamplingOptions(temperature=0.0, max_tokens=n_tokens, repetition_penalty=repetition_penalty)
    names = list(modes)
    decoders, runs = {}, {}
    for m in names:
        engine = engines[m]
        engine.reset()
        engine.prefill(prompt[:-1])
        gen = generate.make_generator(0)
        decoders[m] = (generate.PlainDecoder(engine, opts, gen) if modes[m] is None
                       else speculative.make_decoder(engine, modes[m], opts, gen))
        runs[m] = ModeRun(m)
    turn = 0
    while any(len(runs[m].tokens) < n_tokens for m in names):
        for m in names[turn % len(names):] + names[:turn % len(names)]:
            run = runs[m]
            left = n_tokens - len(run.tokens)
            if left <= 0:
                continue
            tokens = prompt + run.tokens
            w0, c0 = time.perf_counter(), time.process_time()
            new = decoders[m].step(tokens, max_new=left)
            run.wall_s += time.perf_counter() - w0
            run.cpu_s += time.process_time() - c0
            run.steps += 1
            run.tokens += new[:left]
        turn += 1
    for m in names:
        s = decoders[m].stats()
        if s is not None:
            runs[m].draft = dict(dataclasses.asdict(modes[m]), **dataclasses.asdict(s))
            runs[m].draft["acceptance_histogram"] = list(runs[m].draft["acceptance_histogram"])
    return runs


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


def figures(r: ModeRun) -> dict:
    return {"name": r.mode, "generated_tokens": len(r.tokens), "steps": r.steps, "decode_tps": r.tps,
            "cpu_tps": r.cpu_tps}


# ----------------------------------------------------------------------------------------------
# The benchmarks as the CLI runs them

def bench_lookup(engines: dict[str, Any], tokenizer: Any, model: str, out: Path, n_tokens: int, k: int,
                 say=print, only: Optional[str] = None, rounds: int = 5) -> list[Path]:
    """Plain vs n-gram drafting on each prompt, in lockstep (see `lockstep`), `rounds` times; one JSON
    file per prompt and n-gram mode. `engines` maps "plain", "adaptive" and optionally f"k{k}" (fixed K)
    to an engine each (copies of the same model); the copies rotate between the modes every round."""
    from runtime.options import DraftOptions
    if rounds < 1:
        raise ValueError(f"rounds: must be at least 1, got {rounds}")
    modes: dict[str, Optional[DraftOptions]] = {"plain": None,
                                                "adaptive": DraftOptions(mode="ngram", draft_tokens=k, adaptive=True)}
    if f"k{k}" in engines:
        modes[f"k{k}"] = DraftOptions(mode="ngram", draft_tokens=k, adaptive=False)
    names = list(modes)
    paths = []
    for name, (text, pays, penalty) in PROMPTS.items():
        if only and name != only:
            continue
        prompt = tokenizer.encode_chat([{"role": "user", "content": text}])
        lockstep(engines, modes, prompt, 8, penalty)                               # warm-up
        rounds_runs = []
        copies = [engines[m] for m in names]
        for r in range(rounds):
            # Each round the modes move on to the next copy, so a copy that happens to run faster
            # (memory placement) does not favour one mode.
            assigned = {m: copies[(i + r) % len(names)] for i, m in enumerate(names)}
            rounds_runs.append(lockstep(assigned, modes, prompt, n_tokens, penalty))
            say(f"{name}: round {r + 1}/{rounds}: " + ", ".join(
                f"{m} {rounds_runs[-1][m].tps:.2f} tok/s" for m in names))
        for m in names[1:]:
            wall = [rr[m].tps / rr["plain"].tps for rr in rounds_runs]
            cpu = [rr[m].cpu_tps / rr["plain"].cpu_tps for rr in rounds_runs]
            wall_s, cpu_s = spread(wall), spread(cpu)
            mid = sorted(range(rounds), key=lambda i: wall[i])[rounds // 2]            # the median round
            spec, plain = rounds_runs[mid][m], rounds_runs[mid]["plain"]
            same = all(rr[m].tokens == rr["plain"].tokens for rr in rounds_runs)
            verdict = criterion(wall_s, cpu_s) if m == "adaptive" else None
            notes = (f"greedy (repetition penalty {penalty}), {n_tokens} tokens, prompt '{name}' "
                     f"(lookup {'expected to pay' if pays else 'not expected to pay'}); modes {', '.join(names)} "
                     f"each on its own engine, taking turns step by step; {rounds} rounds, figures of the "
                     f"median round; speculative output {'identical to' if same else 'DIFFERENT from'} plain; "
                     f"ngram/plain tokens/s: median x{wall_s['median']:.3f} (quartiles {wall_s['q1']:.3f}.."
                     f"{wall_s['q3']:.3f}, range {wall_s['min']:.3f}..{wall_s['max']:.3f}); from CPU time "
                     f"median x{cpu_s['median']:.3f} (range {cpu_s['min']:.3f}..{cpu_s['max']:.3f})")
            result = record(engines[m], model, decode_tps=spec.tps, draft=spec.draft, baseline=figures(plain),
                            prompt_tokens=len(prompt), notes=notes,
                            bench={"kind": "speculative_lookup", "prompt": name, "lookup_expected_to_pay": pays,
                                   "tokens": n_tokens, "repetition_penalty": penalty, "rounds": rounds,
                                   "method": "lockstep: one engine per mode (rotating between modes every round), one step "
                                             "of each mode in turn",
                                   "ratio_vs_plain": wall_s["median"], "ratio_spread": wall_s,
                                   "ratios_per_round": wall, "cpu_ratio_vs_plain": cpu_s["median"],
                                   "cpu_ratio_spread": cpu_s, "cpu_ratios_per_round": cpu,
                                   "adaptive_criterion": verdict,
                                   "rounds_figures": [{x: figures(rr[x]) for x in ("plain", m)} for rr in rounds_runs],
                                   "in_request_speedups": [rr[m].draft["speedup"] for rr in rounds_runs],
                                   "identical_output": same, "text": tokenizer.decode(plain.tokens)})
            paths.append(write(out, f"spec-ngram-{m}-{name}", result))
            acc = spec.draft["acceptance_rate"]
            say(f"{name:15s} ngram {m:8s} {spec.tps:7.2f} tok/s  plain {plain.tps:7.2f} tok/s  "
                f"ratio median x{wall_s['median']:.3f} [{wall_s['min']:.3f}..{wall_s['max']:.3f}]  "
                f"CPU-time x{cpu_s['median']:.3f} [{cpu_s['min']:.3f}..{cpu_s['max']:.3f}]  "
                f"acceptance {acc if acc is not None else float('nan'):.2f}"
                + (f"  within 5%: {verdict['passes']} ({'conclusive' if verdict['conclusive'] else 'spread too wide to be sure'})"
                   if verdict else ""))
    return paths


def spread(values: list[float]) -> dict:
    """Median, quartiles and range of a list of ratios."""
    if not values:
        raise ValueError("spread: no values")
    v = sorted(values)
    q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0], v[0], v[0])
    return {"median": statistics.median(v), "q1": q1, "q3": q3, "min": v[0], "max": v[-1], "n": len(v)}


def criterion(wall: dict, cpu: Optional[dict], max_loss: float = 0.05) -> dict:
    """"Adaptive mode loses at most `max_loss`": passes when the median ratio (wall clock, and CPU time
    where measured) is at least 1 - max_loss; conclusive when the wall-clock quartiles lie on one side."""
    floor = 1.0 - max_loss
    return {"max_loss": max_loss, "wall_median_ratio": wall["median"],
            "cpu_median_ratio": cpu["median"] if cpu else None,
            "passes": wall["median"] >= floor and (cpu is None or cpu["median"] >= floor),
            "conclusive": wall["q1"] >= floor or wall["q3"] < floor}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model name, 'demo', or folder")
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu", help="engine to load it with")
    p.add_argument("--what", choices=("lookup", "verify", "all"), default="all")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate per run")
    p.add_argument("--draft-tokens", type=int, default=4, help="K for n-gram drafting (the adaptive maximum)")
    p.add_argument("--draft", choices=("off", "ngram", "mtp"), default="off",
                   help="the drafting the engine is loaded for, as the app loads it (Qwen3.5-MoE's engine: mtp "
                        "loads the head; both size the rollback window to --draft-tokens + 1)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the lookup benchmark")
    p.add_argument("--fixed-k", action="store_true", help="lookup: also run n-gram drafting with a fixed K")
    p.add_argument("--label", help="model name for the results (default: the folder's name)")
    p.add_argument("--context", type=int, default=512, help="context tokens for the verify-cost benchmark")
    p.add_argument("--repeats", type=int, default=7,
                   help="verify: timed repeats after the warm-up one, whose medians are reported")
    p.add_argument("--forced-acceptance", action="store_true",
                   help="also time decoding with every draft accepted (labelled in the results)")
    p.add_argument("--prompt", choices=sorted(PROMPTS), help="run the lookup benchmark on this prompt only")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for the reference engine (0 = all cores)")
    p.add_argument("--vram-budget", type=float, help="cuda: VRAM budget in GB (experts beyond it offloaded)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))


def run(args: argparse.Namespace) -> int:
    from runtime import paths
    from runtime.errors import EngineError
    from runtime.loader import open_engine
    from runtime.options import DraftOptions, LoadOptions, OffloadOptions
    folder = paths.resolve_model(args.model)
    label = args.label or (args.model if args.model == paths.DEMO_ALIAS else Path(folder).name)
    say = lambda msg: print(msg, flush=True)                         # noqa: E731
    lookup = args.what in ("lookup", "all")
    copies = ["plain", "adaptive"] + ([f"k{args.draft_tokens}"] if args.fixed_k else []) if lookup else ["plain"]
    engines: dict[str, Any] = {}
    try:
        for name in copies:                      # the lookup benchmark decodes on one copy per mode
            off = OffloadOptions(cpu_threads=args.threads, vram_budget_gb=args.vram_budget,
                                 context_length=max(4096, 2 * args.context), backend=args.backend)
            # the app's choice of engine for the folder (Qwen3.5-MoE's own on CUDA, exllamav2's for the others)
            draft = DraftOptions(mode=args.draft, draft_tokens=args.draft_tokens)
            engines[name], _ = open_engine(str(folder), LoadOptions(offload=off, draft=draft), lambda *a: None)
    except EngineError as e:
        for engine in engines.values():
            engine.close()
        print(f"moedesk-cli bench-spec: {e.message}", file=sys.stderr)
        return 1
    engine = engines["plain"]
    try:
        written = []
        if lookup:
            from runtime.tokenizer import Tokenizer
            written += bench_lookup(engines, Tokenizer.from_folder(folder), label, args.out,
                                    args.tokens, args.draft_tokens, say, args.prompt, args.rounds)
        if args.what in ("verify", "all"):
            from bench.verify import verify_result
            fields = verify_result(engine, args.context, args.forced_acceptance, args.tokens, say, args.repeats)
            if args.vram_budget:
                fields["vram_budget_gb"] = args.vram_budget
                fields["offload"] = {k: v for k, v in engine.telemetry().items()
                                     if k in ("expert_hit_rate", "pcie_bytes_per_token", "expert_residents")}
            written.append(write(args.out, f"spec-verify-cost-{label}", record(engine, label, **fields)))
        for p in written:
            say(f"wrote {p}")
        return 0
    finally:
        for e in engines.values():
            e.close()
