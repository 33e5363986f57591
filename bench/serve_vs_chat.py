"""Decode tokens/s through the OpenAI API (`moedesk serve`, streamed through the `openai` client) against
the worker driven directly as `moedesk-cli chat` drives it, on the same model in the same run.

    python -m bench.serve_vs_chat --model DIR --backend cuda --max-tokens 256 --answers 3 --out bench/results/

1. Direct: a `runtime.client.WorkerClient` (what `moedesk-cli chat` uses) loads the model, answers one
   warm-up question (the first answer of a CUDA engine pays for capturing its decode graphs), then
   `--answers` more; decode tokens/s of each as the client saw the token events arrive, and the worker's own.
2. The same once through `moedesk-cli chat --json` itself (one process, one answer: its figure includes the
   warm-up costs, so it is recorded, not compared).
3. API: `moedesk serve` loads the same model; one warm-up request, then `--answers` streamed requests;
   decode tokens/s of each from the chunks' arrival times and the usage the server reports.

Greedy, end of sequence honoured (a synthetic model's noise rarely ends early; the token counts are
recorded). The ratio api / direct (medians) is the figure: 1.0 means the API costs nothing in decode speed.
Runs unattended and writes one JSON file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.serve_load import (ROOT, Server, add_engine_arguments, common_fields, engine_args, log_path, shared_note,
                              stream_one, write)

PROMPT = "Explain how a mixture-of-experts language model decides which experts to use for each token."


def direct(args: argparse.Namespace) -> dict:
    from runtime import protocol as P
    from runtime.chat_cli import load_options
    from runtime.client import WorkerClient, new_id
    from runtime.options import SamplingOptions

    args.draft, args.draft_tokens = "none", None
    sampling = SamplingOptions(temperature=0.0, max_tokens=args.max_tokens)
    answers = []
    with WorkerClient(client_name="bench serve_vs_chat") as client:
        loaded = client.load(args.model, load_options(args))
        for i in range(args.answers + 1):
            req = P.Generate(request_id=new_id("bench"), messages=(P.ChatMessage("user", PROMPT),), sampling=sampling)
            first = last = None
            tokens, worker = 0, None
            for ev in client.generate(req):
                if isinstance(ev, P.TokenDelta):
                    last = time.perf_counter()
                    first = first or last
                    tokens += ev.tokens
                elif isinstance(ev, P.Finished):
                    worker = ev.stats
                elif isinstance(ev, P.Error):
                    raise P.exception_for(ev)
            n = worker.generated_tokens
            answers.append({"warmup": i == 0, "completion_tokens": n, "ttft_s": worker.ttft_s,
                            "decode_tps_client": (n - 1) / (last - first) if n > 1 and last > first else None,
                            "decode_tps_worker": worker.decode_tps})
    return {"context": loaded.context_length, "answers": answers}


def cli_once(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "runtime.cli", "chat", "--model", args.model, *engine_args(args), "--temperature", "0",
           "--max-tokens", str(args.max_tokens), "--json", PROMPT]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    fin = [json.loads(line) for line in r.stdout.splitlines() if '"type":"finished"' in line]
    if r.returncode != 0 or not fin:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
    stats = fin[-1]["stats"]
    return {"decode_tps": stats["decode_tps"], "ttft_s": stats["ttft_s"], "completion_tokens": stats["generated_tokens"]}


def through_api(args: argparse.Namespace, out: Path) -> list[dict]:
    server = Server(args.model, engine_args(args), max_queue=1, log=log_path("serve-vs-chat"))
    try:
        client = server.client(timeout=3600)
        answers = []
        for i in range(args.answers + 1):
            a = stream_one(client, server.model, args.max_tokens, PROMPT)
            if not a.ok:
                raise RuntimeError(f"the API request failed: {a.error}")
            answers.append({"warmup": i == 0, "completion_tokens": a.completion_tokens, "ttft_s": a.ttft_s,
                            "decode_tps_client": a.decode_tps})
        return answers
    finally:
        server.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_vs_chat", description=__doc__.splitlines()[0])
    add_engine_arguments(p)
    p.add_argument("--answers", type=int, default=3, help="measured answers per path (after one warm-up)")
    p.add_argument("--note", default="", help="what the notes should say, e.g. that the weights are synthetic")
    p.set_defaults(max_tokens=256)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = common_fields(args.model, args.backend, args.vram_budget)
    say = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    say("1/3 the worker directly (as moedesk-cli chat drives it)…")
    chat = direct(args)
    say("2/3 moedesk-cli chat --json, once…")
    cli = cli_once(args)
    say("3/3 moedesk serve through the openai client…")
    api = through_api(args, out)

    def median(answers: list[dict], key: str):
        values = [a[key] for a in answers if not a["warmup"] and a[key] is not None]
        return statistics.median(values) if values else None
    chat_tps, api_tps = median(chat["answers"], "decode_tps_client"), median(api, "decode_tps_client")
    ratio = api_tps / chat_tps if chat_tps and api_tps else None
    result = {**fields, "context": chat["context"], "prompt_tokens": None, "prefill_tps": None,
              "decode_tps": api_tps, "ttft_s": median(api, "ttft_s"), "max_tokens": args.max_tokens,
              "api_over_chat": ratio,
              "baseline": {"name": "worker driven directly, as moedesk-cli chat", "decode_tps": chat_tps,
                           "decode_tps_worker": median(chat["answers"], "decode_tps_worker"),
                           "ttft_s": median(chat["answers"], "ttft_s"), "prefill_tps": None},
              "cli_once": cli, "chat_answers": chat["answers"], "api_answers": api,
              "notes": "decode_tps = (completion tokens - 1) / (last token's arrival - first token's), medians over the "
                       "answers after one warm-up per path; greedy"
                       + (f"; {args.note}" if args.note else "") + "; cli_once is one moedesk-cli chat run, warm-up included" + shared_note(fields["machine"])}
    path = write(result, out, f"serve-vs-chat-{fields['model']}-{args.backend}")
    fmt = lambda v: "n/a" if v is None else f"{v:.1f}"   # noqa: E731
    print(f"decode through the API {fmt(api_tps)} tok/s, direct {fmt(chat_tps)} tok/s, ratio "
          f"{'n/a' if ratio is None else f'{ratio:.3f}'}; moedesk-cli chat once: {cli}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
