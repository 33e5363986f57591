"""Worker benchmark: the real worker process, loaded and driven as the GUI drives it.

    moedesk-cli bench-worker --model NAME_OR_DIR [--vram-budget GB] [--draft both|ngram|none|mtp]
                             [--max-tokens N] [--turns N] [--out bench/results/]
    python -m bench.worker ...                          (the same)

The options take the GUI's path: the app's settings (defaults, or the user's settings file with
--settings) with the flags applied, and their `load` group sent in the load command; each answer is
a generate command with the conversation so far, as a chat session sends it. Measured on the client
side from event arrival times: time to first token, the longest gap between two token deltas after
the first (`max_token_gap_s`), decode tokens/s (tokens after the first / time from the first delta to
the last; the worker sends a delta per token, its text empty while held back, so every answer of more
than one token is timed here, `decode_source` "client"); the worker's own figures (its finished event)
and the expert placement in force (its telemetry) beside them.

The conversation: the very first answer after load, prompts of different lengths, a repetitive one
(a code edit: the answer quotes the code back) where n-gram drafting should pay, and one where drafts
rarely match. With --draft both the two modes take turns inside ONE conversation on one load: each
user turn is answered with plain decoding and with n-gram drafting (the draft mode is chosen per
generate command), plain first at the first turn (the first answer after load is plain) and the
order swapped at every turn after; the conversation goes on with the plain answer. So both modes
decode the same prompts under the same placement and conditions; the second answer of a pair
reuses the first one's prompt in the worker's cache (a short time to first token). Greedy
sampling: both modes write the same text, so their speeds compare like for like. --draft mtp does the
same with the model's own multi-token-prediction head (Qwen3.5-MoE) in place of n-grams, the model
loaded with the head.

The JSON is written again after every answer (the same file), with the load's stages and their
wall time (the worker's `load_stages`), so a time limit never loses what was measured.
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
from typing import Any, Callable, Optional

CODE = '''def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order.status == "cancelled":
            continue
        total += order.amount
        count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}
'''
NOTES = ("Meeting notes, Tuesday. Present: Ana, Bo, Chen, Dara. The release slipped a week because the "
         "installer failed on machines without a GPU driver; Bo fixed the check and added a test. Chen "
         "measured the new cache: first answers are faster, long conversations unchanged. Dara asked for "
         "a dark theme in the settings window and for the download list to show the remaining time. Ana "
         "will write the release notes; the team agreed to freeze features on Friday and to spend next "
         "week on bugs reported by the beta testers, starting with the crash when a download is paused "
         "twice and the wrong token count in the gauges after a model is unloaded. ") * 3

# (name, user message, what it is for)
CONVERSATION = [
    ("first_answer", "Write a long story about a lighthouse keeper.", "the first answer after load (short prompt)"),
    ("summary", f"Summarise these notes in five bullet points:\n\n{NOTES}", "a long prompt"),
    ("code_edit", "Rename the variable `total` to `amount_sum` in this function and give back the whole "
                  f"function, nothing else:\n\n```python\n{CODE}```", "repetitive: the answer quotes the code back"),
    ("animals", "Name twenty different animals, each with one unusual fact about it.",
     "drafts rarely match: new text"),
    ("short", "Thanks! In one sentence: which of those animals would make the best lighthouse keeper?",
     "a short follow-up"),
]


@dataclass
class Answer:
    mode: str
    turn: int
    prompt_name: str
    after_load: bool
    prompt_tokens: int = 0
    generated_tokens: int = 0                  # the worker's count (its finished event)
    delta_tokens: int = 0                      # client side: tokens the deltas covered
    ttft_s: Optional[float] = None             # client side: send -> first token delta
    decode_tps: Optional[float] = None         # client side: tokens after the first / first delta -> last
    decode_source: Optional[str] = None        # "client"; "worker" (its finished event) where the client's deltas
                                               # cannot time decoding (one delta), None for a one-token answer
    max_token_gap_s: Optional[float] = None    # client side: longest gap between deltas after the first
    worker_ttft_s: Optional[float] = None
    worker_decode_tps: Optional[float] = None
    prefill_tps: Optional[float] = None
    acceptance_rate: Optional[float] = None
    draft_speedup: Optional[float] = None      # the policy's measured windows (may span earlier answers)
    drafted_tokens: Optional[int] = None       # n-gram answers: drafts offered, drafts kept
    accepted_tokens: Optional[int] = None
    verify_forwards: Optional[int] = None      # steps that verified drafts, their rows and wall time
    verify_rows_mean: Optional[float] = None
    verify_step_s_mean: Optional[float] = None
    plain_steps: Optional[int] = None          # steps without drafts in the same answer
    plain_step_s_mean: Optional[float] = None
    draft_decisions: Optional[list] = None     # the draft policy's verdicts, "step N: ..."
    placement: Optional[str] = None
    placement_reason: Optional[str] = None
    graphs_captured: Optional[int] = None      # decode graphs held at the answer's end (CUDA engine)
    graph_error: Optional[str] = None
    idle_work: Optional[dict] = None           # the worker's idle work this answer waited behind
    expert_hit_rate: Optional[float] = None    # offload: the telemetry's at the answer's end (since load)
    cpu_expert_bytes_per_token: Optional[float] = None
    roofline: Optional[dict] = None            # bench/roofline.py's, with this answer's telemetry
    reason: str = ""
    text: str = field(default="", repr=False)


def placement_of(extra: dict) -> tuple[str, Optional[str]]:
    """The expert placement in force, from a telemetry event's engine figures."""
    decision = extra.get("placement_decision")
    if isinstance(decision, dict):
        return ("cpu path" if decision.get("path") == "cpu" else "gpu only"), decision.get("summary")
    if "cpu_expert_path" in extra:
        return ("cpu path" if extra["cpu_expert_path"] == "on" else "gpu only"), extra["cpu_expert_path"]
    if "expert_pairs" in extra:
        return "offload", None
    return "all on one device", None


def ask(client, request, mode: str, turn: int, name: str, after_load: bool) -> Answer:
    """Send one generate command; time its events as they arrive."""
    from runtime import protocol as P
    a = Answer(mode, turn, name, after_load)
    arrivals: list[tuple[float, int]] = []
    extra: dict = {}
    hit_rate = None             # a field of the event itself, as the app's gauge reads it, not of its extra
    t0 = time.perf_counter()
    for ev in client.generate(request):
        now = time.perf_counter()
        if isinstance(ev, P.TokenDelta) and ev.request_id == request.request_id:
            arrivals.append((now, ev.tokens))
            a.text += ev.text
        elif isinstance(ev, P.Telemetry):
            extra = ev.extra or extra
            hit_rate = ev.expert_hit_rate if ev.expert_hit_rate is not None else hit_rate
        elif isinstance(ev, P.Error):
            raise P.exception_for(ev)
        elif isinstance(ev, P.Finished):
            s = ev.stats
            a.reason, a.prompt_tokens, a.generated_tokens = ev.reason, s.prompt_tokens, s.generated_tokens
            a.worker_ttft_s, a.worker_decode_tps, a.prefill_tps = s.ttft_s, s.decode_tps, s.prefill_tps
            if s.draft is not None:
                take_draft_stats(a, s.draft)
    a.delta_tokens = sum(n for _, n in arrivals)
    if arrivals:
        a.ttft_s = arrivals[0][0] - t0
        gaps = [b[0] - x[0] for x, b in zip(arrivals, arrivals[1:])]
        a.max_token_gap_s = max(gaps) if gaps else None
        after_first = sum(n for _, n in arrivals[1:])
        span = arrivals[-1][0] - arrivals[0][0]
        a.decode_tps = after_first / span if after_first and span > 0 else None
    a.decode_source = "client" if a.decode_tps is not None else None
    if a.decode_tps is None and a.worker_decode_tps is not None:      # every answer carries its decode
        a.decode_tps, a.decode_source = a.worker_decode_tps, "worker"
    a.placement, a.placement_reason = placement_of(extra)
    if "graph_shapes" in extra:
        a.graphs_captured = len(extra["graph_shapes"])
    a.graph_error = extra.get("graph_error")
    a.idle_work = extra.get("idle_work")
    a.expert_hit_rate = hit_rate
    a.cpu_expert_bytes_per_token = extra.get("cpu_expert_bytes_per_token")
    return a


def take_draft_stats(a: Answer, d) -> None:
    """An answer's drafting figures from the worker's DraftStats."""
    a.acceptance_rate, a.draft_speedup = d.acceptance_rate, d.speedup
    a.drafted_tokens, a.accepted_tokens = d.drafted_tokens, d.accepted_tokens
    a.verify_forwards, a.verify_rows_mean, a.verify_step_s_mean = (d.verify_forwards, d.verify_rows_mean,
                                                                   d.verify_step_s_mean)
    a.plain_steps, a.plain_step_s_mean = d.plain_steps, d.plain_step_s_mean
    a.draft_decisions = list(d.decisions)


def draft_line(a: Answer) -> Optional[str]:
    """Where a drafting answer's time went, one line (None for plain decoding)."""
    if a.drafted_tokens is None:
        return None
    ms = lambda s: f"{1e3 * s:.1f} ms" if s is not None else "-"            # noqa: E731
    rows = f"{a.verify_rows_mean:.1f}" if a.verify_rows_mean is not None else "-"
    return (f"        drafted {a.drafted_tokens}, accepted {a.accepted_tokens}; {a.verify_forwards} verifies of "
            f"{rows} rows, {ms(a.verify_step_s_mean)} each; {a.plain_steps} plain steps, "
            f"{ms(a.plain_step_s_mean)} each; policy: {' | '.join(a.draft_decisions or []) or '-'}")


def converse(client, modes: list[str], drafts: dict, sampling, turns: int,
             on_answer: Callable[[Answer], None], roof: Callable[[Answer], None] = lambda a: None) -> list[Answer]:
    """One chat of `turns` user turns on the loaded model, each answered once per mode (the modes
    take turns: the first mode first at turn 0, the order swapped at every turn after); each request
    carries the conversation so far, which goes on with the first mode's answer. `roof` fills an
    answer's roofline before it is printed."""
    from runtime import protocol as P
    from runtime.client import new_id
    messages: list = []
    out: list[Answer] = []
    for turn, (name, text, _) in enumerate(CONVERSATION[:turns]):
        messages.append(P.ChatMessage("user", text))
        order = modes if turn % 2 == 0 else modes[::-1]
        kept = None
        for mode in order:
            req = P.Generate(request_id=new_id("bench"), messages=tuple(messages), sampling=sampling,
                             draft=drafts[mode])
            a = ask(client, req, mode, turn, name, not out)
            out.append(a)
            if mode == modes[0]:
                kept = a
            roof(a)
            print(f"  {mode:5s} {name:13s} prompt {a.prompt_tokens:5d}  ttft {a.ttft_s or 0:6.2f} s  decode "
                  f"{a.decode_tps or 0:7.1f} tok/s (worker {a.worker_decode_tps or 0:7.1f}, {a.generated_tokens} "
                  f"tokens)  max gap {1e3 * (a.max_token_gap_s or 0):7.1f} ms  acceptance "
                  f"{a.acceptance_rate if a.acceptance_rate is not None else '-'}  {a.placement}  roofline "
                  f"{roofline_text(a.roofline)}", flush=True)
            if draft_line(a):
                print(draft_line(a), flush=True)
            on_answer(a)
        messages.append(P.ChatMessage("assistant", kept.text))
    return out


def summary(answers: list[Answer]) -> dict[str, Any]:
    """A mode's figures: medians over its answers (the first after load counted like the rest)."""
    def med(key):
        vals = [getattr(a, key) for a in answers if getattr(a, key) is not None]
        return statistics.median(vals) if vals else None
    offered = sum(a.drafted_tokens or 0 for a in answers)
    kept = sum(a.accepted_tokens or 0 for a in answers)
    return {"decode_tps": med("decode_tps"), "ttft_s": med("ttft_s"), "prefill_tps": med("prefill_tps"),
            "max_token_gap_s": max((a.max_token_gap_s for a in answers if a.max_token_gap_s is not None),
                                   default=None),
            # over every draft of the mode's answers (a mean of the answers' rates weighed an answer
            # with one draft as much as one with a hundred)
            "acceptance_rate": kept / offered if offered else None,
            "drafted_tokens": offered if any(a.drafted_tokens is not None for a in answers) else None,
            "decode_tps_by_prompt": {a.prompt_name: a.decode_tps for a in answers},
            "worker_decode_tps_by_prompt": {a.prompt_name: a.worker_decode_tps for a in answers},
            "max_token_gap_s_by_prompt": {a.prompt_name: a.max_token_gap_s for a in answers},
            "placement_by_prompt": {a.prompt_name: a.placement for a in answers}}


def model_bpw(path: str) -> Optional[float]:
    try:
        qc = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("quantization_config") or {}
        return float(qc["bits"]) if "bits" in qc else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def settings_for(args: argparse.Namespace):
    """The app's settings (its file with --settings, else defaults) with the flags applied: what the
    GUI would hold after the user set them in the settings panel."""
    from app.settings import Settings, load_settings
    from runtime.chat_cli import draft_options
    settings = load_settings(args.settings).settings if args.settings else Settings()
    off = {"backend": args.backend}
    if args.vram_budget is not None:
        off["vram_budget_gb"] = args.vram_budget
    if args.placement:
        off["placement"] = args.placement
    load = dataclasses.replace(settings.load, offload=dataclasses.replace(settings.load.offload, **off),
                               draft=draft_options({"none": "none", "mtp": "mtp"}.get(args.draft, "ngram"),
                                                   args.draft_tokens))
    return dataclasses.replace(settings, load=load)


def run(args: argparse.Namespace) -> int:
    from runtime import protocol as P
    from bench.engine import git_commit, machine
    from bench.roofline import measure_ceilings_apart, roofline
    from bench.weight_bytes import decode_weight_bytes
    from runtime.client import WorkerClient
    from runtime.options import DraftOptions, from_dict
    if args.turns < 1 or args.turns > len(CONVERSATION):
        print(f"bench-worker: --turns must be 1..{len(CONVERSATION)}", file=sys.stderr)
        return 2
    settings = settings_for(args)
    try:
        sampling = sampling_for(settings, args)
    except ValueError as e:
        print(f"bench-worker: {e}", file=sys.stderr)
        return 2
    modes = {"both": ["none", "ngram"], "none": ["none"], "ngram": ["ngram"], "mtp": ["none", "mtp"]}[args.draft]
    drafting = settings.load.draft                   # the drafting mode's options (n-gram, or MTP with --draft mtp)
    drafts = {"none": from_dict(DraftOptions, {"mode": "off"}, "draft"), "ngram": drafting, "mtp": drafting}
    progress: list[dict] = []
    ceilings = measure_ceilings_apart(args.backend)     # before the load, in a child: no CUDA context here
    t_start = time.perf_counter()

    def on_progress(ev: P.Progress) -> None:
        progress.append({"t_s": round(time.perf_counter() - t_start, 3), "stage": ev.stage, "message": ev.message})
        if ev.stage == "warmup" or ev.done in (0, ev.total):
            print(f"  load: {ev.message}", flush=True)

    with WorkerClient(client_name="moedesk-cli bench-worker") as client:
        ready = client.start()
        t0 = time.perf_counter()
        loaded = client.load(args.model, settings.load, on_progress=on_progress)
        load_s = time.perf_counter() - t0
        load_extra = load_telemetry(client, loaded.request_id)
        load_extra.update(decode_weight_bytes(loaded.path, load_extra) or {})    # the roofline's divisor
        stages = load_extra.get("load_stages") or []
        print(f"loaded {loaded.model} in {load_s:.1f} s ({ready.engine} on {ready.device}); kernels compiled "
              f"during the load: {load_extra.get('kernels_compiled_in_load')}", flush=True)
        for st in sorted(stages, key=lambda x: -x["s"])[:8]:
            print(f"  load stage {st['s']:8.1f} s  {st['message']}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = args.out / f"worker-{args.label or Path(loaded.path).name}-{ready.device.replace(' ', '_')}-{stamp}.json"
        base = {"git_commit": git_commit(), "machine": machine(), "device": ready.device,
                "model": args.label or loaded.model, "bpw": model_bpw(loaded.path), "vram_budget_gb": args.vram_budget,
                "context": loaded.context_length, "load_s": load_s, "worker_load_s": loaded.load_s,
                "load_stages": stages, "kernels_compiled_in_load": load_extra.get("kernels_compiled_in_load"),
                "placement_at_load": load_extra.get("placement_decision"), "load_progress": progress,
                "applied": loaded.applied, "temperature": args.temperature, "roofline_ceilings_gbps": ceilings,
                "weight_bytes_per_token": load_extra.get("weight_bytes_per_token"),
                "weight_bytes_per_token_parts": load_extra.get("weight_bytes_per_token_parts"),
                "notes": (f"Through the real worker process ({ready.engine}: {ready.engine_note}); options from the "
                          f"app's settings ({'file ' + str(args.settings) if args.settings else 'defaults'}) with the "
                          f"flags applied, sent in the load command as the GUI does. {how_sampled(args.temperature)}, at most {args.max_tokens} "
                          f"tokens per answer, {args.turns} user turns answered by each mode ({', '.join(modes)}) in "
                          "one conversation on one load, taking turns (the first answer after load plain); the "
                          "second answer of a pair reuses the prompt cached by the first. Timings on the client side "
                          "from event arrival. " + (args.note or ""))}
        answers: list[Answer] = []

        def on_answer(a: Answer) -> None:
            answers.append(a)
            write_result(path, result_of(base, answers, modes, drafting, args.turns))

        def roof(a: Answer) -> None:
            tel = dict(load_extra, expert_hit_rate=a.expert_hit_rate,
                       cpu_expert_bytes_per_token=a.cpu_expert_bytes_per_token)
            if a.expert_hit_rate is None:
                tel.pop("expert_hit_rate")
            a.roofline = roofline(tel, loaded.backend, ceilings)

        converse(client, modes, drafts, sampling, args.turns, on_answer, roof)
    result = result_of(base, answers, modes, drafting, args.turns)
    print_summary(result)
    print(f"wrote {path}")
    return 0


def load_telemetry(client, request_id: str, timeout: float = 30.0) -> dict:
    """The engine figures the worker sends right after `loaded` (they carry `load_stages`)."""
    from runtime import protocol as P
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ev = client.next_event(max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            break
        if isinstance(ev, P.Telemetry) and ev.request_id == request_id:
            return ev.extra or {}
    return {}


DRAFTING = ("ngram", "mtp")       # the drafting modes a run sets beside plain decoding ("none")


def result_of(base: dict, answers: list[Answer], modes: list[str], draft, turns: int) -> dict:
    """The result so far (after any number of answers): the DESIGN.md fields, each mode's figures,
    side by side per prompt, and every answer. draft: the drafting mode's options (n-gram or MTP)."""
    done = [m for m in modes if any(a.mode == m for a in answers)]
    by_mode = {m: summary([a for a in answers if a.mode == m]) for m in done}
    drafting = next((m for m in DRAFTING if m in by_mode), None)
    main_mode = drafting or (done[0] if done else modes[0])
    main = by_mode.get(main_mode) or summary([])
    base_mode = "none" if drafting and "none" in by_mode else None
    first = answers[0] if answers else None
    roof = (answers[-1].roofline if answers else None) or {}
    speedup = None
    if drafting and "none" in by_mode:
        plain, drafted = by_mode["none"]["decode_tps_by_prompt"], by_mode[drafting]["decode_tps_by_prompt"]
        speedup = {n: drafted[n] / plain[n] for n in plain if plain[n] and drafted.get(n)}
    return dict(base, **{
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "prompt_tokens": first.prompt_tokens if first else None, "prefill_tps": main["prefill_tps"],
        "decode_tps": main["decode_tps"], "ttft_s": first.ttft_s if first else None,
        # the roofline with the last answer's telemetry (with offload its hit rate is the latest)
        "roofline_tps": roof.get("roofline_tps"), "roofline_note": roof.get("roofline_note", "roofline not computed"),
        "roofline_all_resident_tps": roof.get("roofline_all_resident_tps"),
        "roofline_placement": roof.get("roofline_placement"),
        "draft": (dict(dataclasses.asdict(draft), acceptance_rate=main["acceptance_rate"]) if drafting else None),
        "baseline": dict(name=base_mode, **by_mode[base_mode]) if base_mode else None,
        "worker": True, "complete": len(answers) == turns * len(modes),
        "modes": by_mode, f"speedup_{drafting or 'ngram'}_vs_none": speedup,
        "first_answer_vs_steady": _first_vs_steady(answers),
        "max_token_gap_s_by_answer": [[a.mode, a.prompt_name, a.max_token_gap_s] for a in answers],
        "answers": [dataclasses.asdict(a) for a in answers],
        "prompts": {name: why for name, _, why in CONVERSATION[:turns]},
    })


def write_result(path: Path, result: dict) -> None:
    """Write (again) the whole result: a new file beside it, then renamed over it."""
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    tmp.replace(path)


def roofline_text(roof: Optional[dict]) -> str:
    return f"{roof['roofline_tps']:.1f} tok/s" if roof and roof.get("roofline_tps") else "-"


def print_summary(r: dict) -> None:
    for a in r["answers"]:
        fraction = (f" ({a['decode_tps'] / a['roofline']['roofline_tps']:.1%} of it)"
                    if a["decode_tps"] and a["roofline"] and a["roofline"].get("roofline_tps") else "")
        print(f"  decode {a['mode']:5s} {a['prompt_name']:13s} {a['decode_tps'] or 0:7.1f} tok/s, roofline "
              f"{roofline_text(a['roofline'])}{fraction}")
    print(f"  {r['roofline_note']}")
    first = r["answers"][0] if r["answers"] else None
    if first and first["ttft_s"] is not None and first["worker_ttft_s"] is not None:
        print(f"first answer's first token: {first['ttft_s']:.2f} s here, {first['worker_ttft_s']:.2f} s in the "
              f"worker (+{first['ttft_s'] - first['worker_ttft_s']:.2f} s on the way)")
    ratio = r["first_answer_vs_steady"]
    print(f"first answer vs steady (decode tok/s, same mode): {ratio:.2f}" if ratio is not None
          else "first answer vs steady: not measured (fewer than two answers of the first mode)")
    for mode, prompt, gap in r["max_token_gap_s_by_answer"]:
        print(f"  max gap {mode:5s} {prompt:13s} {1e3 * gap:7.1f} ms" if gap is not None
              else f"  max gap {mode:5s} {prompt:13s}       -")
    for mode in DRAFTING:
        for prompt, x in (r.get(f"speedup_{mode}_vs_none") or {}).items():
            print(f"  {mode} vs none {prompt:13s} x{x:.2f}")


def _first_vs_steady(answers: list[Answer]) -> Optional[float]:
    """The first answer's decode tokens/s over the median of the same mode's later answers."""
    if not answers:
        return None
    later = [a.decode_tps for a in answers[1:] if a.mode == answers[0].mode and a.decode_tps]
    if not answers[0].decode_tps or not later:
        return None
    return answers[0].decode_tps / statistics.median(later)


def sampling_for(settings, args):
    """The answers' sampling: the app's settings with greedy decoding (both modes write the same text,
    so their speeds compare like for like), or `--temperature` above 0 (seed 0): on a synthetic model's
    random weights that is text where n-gram drafts rarely match, the case where drafting must cost
    little (its greedy text repeats with a short period, where drafts always match)."""
    t = args.temperature
    if not 0.0 <= t <= 2.0:
        raise ValueError(f"--temperature must be between 0 and 2 (got {t:g})")
    return dataclasses.replace(settings.sampling, temperature=t, max_tokens=args.max_tokens, seed=0)


def how_sampled(temperature: float) -> str:
    return "Greedy" if temperature == 0 else f"Sampled at temperature {temperature:g} (seed 0; the modes' texts differ)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model name, 'demo', or folder")
    p.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto", help="engine backend")
    p.add_argument("--vram-budget", type=float, metavar="GB", help="GPU memory the engine may use")
    p.add_argument("--placement", choices=("auto", "vram", "cpu", "stream"), help="expert placement")
    p.add_argument("--draft", choices=("both", "ngram", "none", "mtp"), default="both",
                   help="both: the conversation with plain decoding, then with n-gram drafting (side by side); mtp: "
                        "plain decoding and the model's own multi-token-prediction head (Qwen3.5-MoE) side by side")
    p.add_argument("--draft-tokens", type=int, help="drafts per step (n-gram or MTP)")
    p.add_argument("--max-tokens", type=int, default=160, help="longest answer in tokens")
    p.add_argument("--turns", type=int, default=len(CONVERSATION), help="answers per conversation")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (both modes write the same text); above 0 on a synthetic model: text where "
                        "n-gram drafts rarely match")
    p.add_argument("--settings", type=Path, help="the app's settings file to start from (default: defaults)")
    p.add_argument("--label", help="model name for the results")
    p.add_argument("--note", help="added to the result's notes")
    p.add_argument("--out", type=Path, default=Path("bench/results"))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
