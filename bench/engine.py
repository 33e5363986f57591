"""moedesk-cli bench: prefill and decode speed of a model on our engine, with a baseline from the same run.

    moedesk-cli bench --model NAME_OR_DIR [--engine auto|cpu|cuda] [--prompt-tokens N] [--decode-tokens N]
                      [--baseline transformers|none] [--draft none|ngram|DIR] [--draft-tokens K]
                      [--vram-budget GB] [--context N] [--note TEXT] [--out bench/results/]

Runs in this process (no worker: nothing between the engine and the clock). Greedy decoding of a
fixed number of tokens (end-of-sequence ignored) after a prompt of real English text; one warm-up
generation first. The baseline is transformers' own `generate` on the same weights (the EXL2
tensors dequantized to float32) with the same prompt. One JSON file per run, schema in
`BenchResult`; backends add their own figures under `extra` (engine.telemetry() is copied there).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

PASSAGE = ("The history of computing is a story of people finding ways to do arithmetic faster than by hand. "
           "Early mechanical calculators used gears and levers; later machines used relays, then vacuum tubes, "
           "then transistors, and finally integrated circuits holding billions of them. Each step made memory "
           "larger and cheaper, and programs grew to fill it. Today a laptop holds more memory than every "
           "computer of 1970 together, and the limit on how fast a language model writes is often not the "
           "arithmetic at all but how quickly its weights can be read from memory for every new word. ")


@dataclass
class Figures:
    prefill_tps: Optional[float]
    decode_tps: Optional[float]
    ttft_s: Optional[float]
    prompt_tokens: int
    decode_tokens: int


@dataclass
class Baseline:
    name: str
    prefill_tps: Optional[float]
    decode_tps: Optional[float]
    ttft_s: Optional[float]
    notes: str = ""


@dataclass
class BenchResult:
    date: str
    git_commit: Optional[str]
    machine: dict[str, Any]
    device: str                       # GPU name, or "cpu"
    engine: str                       # backend that ran: "cpu" (reference) | "cuda" (exl2)
    model: str
    bpw: Optional[float]
    vram_budget_gb: Optional[float]
    context: int
    prompt_tokens: int
    decode_tokens: int
    prefill_tps: Optional[float]
    decode_tps: Optional[float]
    ttft_s: Optional[float]
    roofline_tps: Optional[float]
    draft: Optional[dict[str, Any]]
    baseline: Optional[dict[str, Any]]
    notes: str
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Measuring

def prompt_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids = tokenizer.encode_prompt(PASSAGE * (1 + n // 40))
    return ids[:n]


def measure_engine(engine, tokenizer, prompt: list[int], decode_tokens: int, decoder_factory) -> tuple[Figures, Any]:
    from runtime.generate import generate, make_generator
    from runtime.options import SamplingOptions
    opts = SamplingOptions(temperature=0.0, max_tokens=decode_tokens)
    for p, n in ((prompt[:16], 4), (prompt, decode_tokens)):          # warm-up, then the measured run
        engine.reset()
        gen = make_generator(0)
        res = generate(engine, tokenizer, p, SamplingOptions(temperature=0.0, max_tokens=n),
                       decoder=decoder_factory(opts, gen), generator=gen, ignore_eos=True)
    s = res.stats
    return Figures(s.prefill_tps, s.decode_tps, s.ttft_s, s.prompt_tokens, s.generated_tokens), s.draft


def transformers_model(folder: Path):
    """transformers' model of the folder's architecture holding the folder's weights (EXL2 dequantized), fp32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from runtime.modelfolder import EXL2_PARTS, ModelFolder
    mf = ModelFolder(folder)
    cfg = {k: v for k, v in mf.config.items() if k not in ("quantization_config", "architectures", "model_type")}
    config = AutoConfig.for_model(mf.config["model_type"], **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {}
    for name in mf.info.shard_of:
        if name.endswith(".q_weight"):
            prefix = name[: -len(".q_weight")]
            state[f"{prefix}.weight"] = mf.linear(prefix)
        elif not any(name.endswith("." + part) for part in EXL2_PARTS):
            state[name] = mf.tensor(name).float()
    state = _fuse_experts(state, set(model.state_dict()))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"{folder}: transformers' model does not match the folder "
                           f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    model.tie_weights()
    mf.close()
    return model.eval()


def _fuse_experts(state: dict, wanted: set[str]) -> dict:
    """Per-expert HF tensors (`experts.E.gate_proj.weight` ...) -> the fused ones newer transformers
    expect: `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `experts.down_proj` [E, H, I]."""
    import torch
    for key in sorted(k for k in wanted if k.endswith(".experts.gate_up_proj") and k not in state):
        base = key[: -len("gate_up_proj")]
        n = 0
        while f"{base}{n}.gate_proj.weight" in state:
            n += 1
        gate_up, down = [], []
        for e in range(n):
            gate_up.append(torch.cat([state.pop(f"{base}{e}.gate_proj.weight"), state.pop(f"{base}{e}.up_proj.weight")]))
            down.append(state.pop(f"{base}{e}.down_proj.weight"))
        if n:
            state[key], state[f"{base}down_proj"] = torch.stack(gate_up), torch.stack(down)
    return state


def measure_transformers(folder: Path, prompt: list[int], decode_tokens: int) -> Baseline:
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):       # first call: the prompt; then one call per new token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model = transformers_model(folder)
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, **kwargs)          # warm-up
        clock = Clock()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, streamer=clock, **kwargs)
        t_end = time.perf_counter()
    ttft = clock.times[1] - t0
    return Baseline("transformers", len(prompt) / ttft, (decode_tokens - 1) / (t_end - clock.times[1]), ttft,
                    notes=f"transformers {__import__('transformers').__version__} generate, greedy, float32 "
                          f"weights dequantized from the same EXL2 folder, eager attention, torch threads "
                          f"{torch.get_num_threads()}")


def machine() -> dict[str, Any]:
    import psutil
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores_physical": psutil.cpu_count(logical=False), "cores_logical": psutil.cpu_count(),
            "ram_gb": round(psutil.virtual_memory().total / 1e9, 1), "load_avg_1m": round(psutil.getloadavg()[0], 2),
            "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def git_commit() -> Optional[str]:
    """The checkout's commit ("-dirty" with uncommitted changes); MOEDESK_COMMIT names it for copies
    of the tree that carry no git metadata (e.g. a tree shipped to a GPU machine)."""
    from runtime import tuning
    if tuning.commit():
        return tuning.commit()
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def roofline(engine_telemetry: dict, backend: str) -> tuple[Optional[float], str]:
    """Tokens/s if every decode step only had to read the weights once, and how it was computed
    (bench/roofline.py; the host memory bandwidth measured now)."""
    from bench.roofline import measure_ceilings, roofline as bound
    if backend != "cpu":
        return None, "roofline for this backend not computed here"
    r = bound(engine_telemetry, backend, measure_ceilings(cuda=False))
    return r["roofline_tps"], r["roofline_note"]


# ----------------------------------------------------------------------------------------------
# CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model name, 'demo', or a folder path")
    p.add_argument("--engine", choices=("auto", "cpu", "cuda"), default="cpu",
                   help="backend to measure (default cpu: the reference engine)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length in tokens (default 512)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens to generate, greedy (default 128)")
    p.add_argument("--baseline", choices=("transformers", "none"), default="transformers",
                   help="also measure transformers' generate on the same weights in the same run")
    p.add_argument("--draft", default="none", help="speculative decoding: none, ngram, or a draft model")
    p.add_argument("--draft-tokens", type=int, help="tokens drafted ahead per step")
    p.add_argument("--vram-budget", type=float, metavar="GB", help="GPU memory the engine may use")
    p.add_argument("--cpu-threads", type=int, help="CPU threads for the engine (and the baseline); default all physical cores")
    p.add_argument("--context", type=int, help="context length to load with (default: the option default, "
                                               "or prompt + decode tokens when larger)")
    p.add_argument("--note", action="append", default=[], help="free text for the notes field (repeatable)")
    p.add_argument("--out", default="bench/results/", help="folder for the JSON result (default bench/results/)")


def load_options(args: argparse.Namespace):
    from runtime.chat_cli import draft_options
    from runtime.options import LoadOptions, OffloadOptions, from_dict
    offload: dict[str, Any] = {"backend": args.engine}
    if args.vram_budget is not None:
        offload["vram_budget_gb"] = args.vram_budget
    if args.cpu_threads is not None:
        offload["cpu_threads"] = args.cpu_threads
    context = args.context or max(OffloadOptions().context_length, args.prompt_tokens + args.decode_tokens + 16)
    offload["context_length"] = context
    return LoadOptions(offload=from_dict(OffloadOptions, offload, "offload"),
                       draft=draft_options(args.draft, args.draft_tokens))


def bench(args: argparse.Namespace, say=print) -> BenchResult:
    from runtime import modelfolder
    from runtime.generate import make_decoder
    from runtime.loader import choose_backend, model_path, open_engine
    from runtime.tokenizer import Tokenizer
    options = load_options(args)
    host = machine()                       # before measuring: the load average says how busy the machine was
    folder = model_path(args.model)
    info = modelfolder.validate(folder)
    choice = choose_backend(args.engine)
    say(f"Loading {folder.name} on the {choice.backend} engine...")
    engine, applied = open_engine(args.model, options, lambda *a: None)
    draft_engine = None
    if options.draft.mode == "model":
        draft_engine, _ = open_engine(options.draft.model, dataclasses.replace(options, draft=type(options.draft)()),
                                      lambda *a: None)
    try:
        tokenizer = Tokenizer.from_folder(folder)
        prompt = prompt_ids(tokenizer, args.prompt_tokens)
        say(f"Measuring: {len(prompt)} prompt tokens, {args.decode_tokens} generated tokens (greedy)...")
        figures, draft_stats = measure_engine(
            engine, tokenizer, prompt, args.decode_tokens,
            lambda opts, gen: make_decoder(engine, opts, gen, options.draft, draft_engine))
        telemetry = engine.telemetry() or {}
    finally:
        engine.close()
        if draft_engine is not None:
            draft_engine.close()
    roof, roof_note = roofline(telemetry, engine.backend)
    baseline = None
    notes = [f"{engine.backend} engine; greedy decoding, end-of-sequence ignored; one warm-up run first",
             f"backend choice: {choice.note}", roof_note] + list(args.note)
    if args.baseline == "transformers":
        say("Measuring the baseline: transformers' generate on the same weights...")
        baseline = dataclasses.asdict(measure_transformers(folder, prompt, args.decode_tokens))
    import psutil
    import torch
    host["load_avg_1m_end"] = round(psutil.getloadavg()[0], 2)
    host["torch_threads"] = torch.get_num_threads()     # as the engine set them (the baseline ran with these too)
    busiest = max(host["load_avg_1m"], host["load_avg_1m_end"])
    if busiest > (host["cores_logical"] or 1):
        notes.append(f"the machine was shared while measuring: 1-minute load average up to {busiest:.1f} on "
                     f"{host['cores_logical']} cores, so every figure here (baseline included) is below an idle machine's")
    draft = None
    if options.draft.mode != "off":
        draft = {**dataclasses.asdict(options.draft),
                 "acceptance_rate": draft_stats.acceptance_rate if draft_stats else None,
                 "stats": dataclasses.asdict(draft_stats) if draft_stats else None}
    return BenchResult(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), git_commit=git_commit(),
        machine=host, device=choice.device, engine=engine.backend, model=info.name,
        bpw=info.bits_per_weight, vram_budget_gb=options.offload.vram_budget_gb,
        context=options.offload.context_length, prompt_tokens=figures.prompt_tokens,
        decode_tokens=figures.decode_tokens, prefill_tps=figures.prefill_tps, decode_tps=figures.decode_tps,
        ttft_s=figures.ttft_s, roofline_tps=roof, draft=draft, baseline=baseline, notes="; ".join(notes),
        extra={"applied": applied, "engine_telemetry": telemetry, "num_params": info.num_params,
               "architecture": info.architecture})


def write_result(result: BenchResult, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    path = out_dir / f"{stamp}-{result.model}-{result.engine}.json"
    path.write_text(json.dumps(dataclasses.asdict(result), indent=2, default=str) + "\n")
    return path


def run(args: argparse.Namespace) -> int:
    from runtime.errors import EngineError
    from runtime.options import OptionError
    from runtime.worker_errors import code_for
    if args.prompt_tokens < 16 or args.decode_tokens < 2:
        print("moedesk-cli bench: --prompt-tokens must be >= 16 and --decode-tokens >= 2", file=sys.stderr)
        return 2
    if args.cpu_threads is not None and args.cpu_threads < 1:
        print("moedesk-cli bench: --cpu-threads must be >= 1", file=sys.stderr)
        return 2
    try:
        result = bench(args, say=lambda m: print(m, file=sys.stderr))
    except (EngineError, OptionError) as e:
        code = code_for(e).value if isinstance(e, EngineError) else "bad_option"
        print(f"moedesk-cli bench: {code}: {e}", file=sys.stderr)
        return 1
    path = write_result(result, Path(args.out))
    fmt = lambda v: "n/a" if v is None else f"{v:.1f}"   # noqa: E731
    print(f"{result.model} on {result.engine}: prefill {fmt(result.prefill_tps)} tok/s, "
          f"decode {fmt(result.decode_tps)} tok/s, ttft {result.ttft_s:.3f} s, roofline {fmt(result.roofline_tps)} tok/s")
    if result.baseline:
        b = result.baseline
        print(f"baseline {b['name']}: prefill {fmt(b['prefill_tps'])} tok/s, decode {fmt(b['decode_tps'])} tok/s"
              + (f"; decode speedup {result.decode_tps / b['decode_tps']:.2f}x" if b["decode_tps"] else ""))
    print(f"wrote {path}")
    return 0
