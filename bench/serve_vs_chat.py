"""Decode tokens/s through the OpenAI API (the server of `moedesk serve`, streamed through the `openai`
client) against the worker driven directly as `moedesk-cli chat` drives it: side by side, on ONE worker.

    python -m bench.serve_vs_chat --model DIR --backend cuda --max-tokens 256 --pairs 8 --out bench/results/

One worker process loads the model (a `runtime.client.WorkerClient`, as `moedesk serve` and
`moedesk-cli chat` use). This process serves it through the API's real stack (`create_app` on uvicorn,
loopback, an API key) over the same `WorkerBackend` that `moedesk serve` uses, and also drives it
directly: a generate straight to that backend, its token events read as they arrive, as the CLI reads
them. The API's client runs in a process of its own (like a user's script). Both paths therefore run on
the same engine, placement, CUDA graphs and machine state, within seconds of each other:

1. One warm-up answer per path (a CUDA engine captures its decode graphs on the first).
2. `--pairs` pairs of answers, direct and API, the order flipped every pair (D A, A D, D A, ...) so that
   a drift over time hits both alike. The figure is the median over pairs of api / direct decode tokens/s
   (client-side: (tokens - 1) / (last token's arrival - first's)), with its spread.
3. For every answer the worker's own decode tokens/s (the Finished event's stats; the server sees them
   for API answers too): client-side below worker-side means delivery overhead, worker-side lower on
   the API's answers means the engine itself ran slower beside the server.
4. `moedesk-cli chat --json` once, in a process of its own afterwards (its figure includes the
   warm-up costs, so it is recorded, not compared).

Every answer is the same request: the API's own (greedy, end of sequence honoured), copied for the direct
path so that both do the same work. Runs unattended and writes one JSON file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from bench.serve_load import (ROOT, ApiInThread, add_engine_arguments, common_fields, engine_args, shared_note,
                              stream_one, write)

PROMPT = "Explain how a mixture-of-experts language model decides which experts to use for each token."


class RecordingBackend:
    """The API's backend, passed through to `inner`, keeping each request and its Finished stats."""

    def __init__(self, inner):
        self.inner = inner
        self.requests: dict = {}
        self.finished: dict = {}

    def served_model(self):
        return self.inner.served_model()

    def start(self, request, sink) -> None:
        from runtime import protocol as P
        self.requests[request.request_id] = request

        def recording(ev) -> None:
            if isinstance(ev, P.Finished):
                self.finished[ev.request_id] = ev.stats
            sink(ev)
        self.inner.start(request, recording)

    def cancel(self, request_id: str) -> None:
        self.inner.cancel(request_id)


class ApiClientProcess:
    """The `openai` client in a process of its own: one streamed request per line sent, one JSON answer back."""

    def __init__(self, url: str, key: str, model: str, max_tokens: int):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.serve_vs_chat", "--api-client", url, model,
                                      str(max_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(env, MOEDESK_API_KEY=key), cwd=ROOT)

    def ask(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the API client process ended")
        return json.loads(line)

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def api_client_loop(url: str, model: str, max_tokens: int) -> int:
    """The client process: for each line on stdin, one streamed request; its Answer as one JSON line."""
    import openai
    client = openai.OpenAI(base_url=url, api_key=os.environ["MOEDESK_API_KEY"], max_retries=0, timeout=3600)
    for _ in sys.stdin:
        print(json.dumps(dataclasses.asdict(stream_one(client, model, max_tokens, PROMPT))), flush=True)
    return 0


def direct_once(backend, request) -> dict:
    """`request` straight to the worker backend; token times taken as this thread receives the events."""
    from runtime import protocol as P
    events: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    backend.start(request, events.put)
    first = last = None
    while True:
        ev = events.get(timeout=3600)
        if isinstance(ev, P.TokenDelta):
            last = time.perf_counter()
            first = first or last
        elif isinstance(ev, P.Finished):
            break
        elif isinstance(ev, P.Error):
            raise P.exception_for(ev)
    n = ev.stats.generated_tokens
    return {"completion_tokens": n, "ttft_s": None if first is None else first - t0,
            "decode_tps_client": (n - 1) / (last - first) if n > 1 and last > first else None,
            "decode_tps_worker": ev.stats.decode_tps}


def side_by_side(args: argparse.Namespace) -> dict:
    from app.serve.worker_backend import WorkerBackend
    from runtime.chat_cli import load_options
    from runtime.client import WorkerClient, new_id

    args.draft, args.draft_tokens, args.cpu_threads = "none", None, None
    say = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    with WorkerClient(client_name="bench serve_vs_chat") as worker:
        loaded = worker.load(args.model, load_options(args))
        backend = RecordingBackend(WorkerBackend(worker, loaded))
        api = ApiInThread(backend)
        client = ApiClientProcess(api.url, api.key, backend.served_model().id, args.max_tokens)
        try:
            def via_api() -> dict:
                a = client.ask()
                if not a["ok"]:
                    raise RuntimeError(f"the API request failed: {a['error']}")
                stats = backend.finished.get(a["request_id"])
                return {"completion_tokens": a["completion_tokens"], "ttft_s": a["ttft_s"],
                        "decode_tps_client": a["decode_tps"], "decode_tps_worker": stats and stats.decode_tps}
            say("warm-up: one answer through the API, one directly…")
            warm_api = via_api()
            template = next(iter(backend.requests.values()))       # the API's request: the same work for both
            direct = lambda: direct_once(backend.inner, dataclasses.replace(template, request_id=new_id("direct")))  # noqa: E731
            warm_direct = direct()
            pairs, error = [], None
            for i in range(args.pairs):
                try:
                    if i % 2 == 0:
                        d, a = direct(), via_api()
                    else:
                        a, d = via_api(), direct()
                except Exception as e:  # noqa: BLE001 - the pairs measured so far are kept and written
                    error = f"pair {i + 1}: {type(e).__name__}: {e}"[:500]
                    say(f"stopped at {error}")
                    break
                pairs.append({"first": "direct" if i % 2 == 0 else "api", "direct": d, "api": a})
                say(f"pair {i + 1}/{args.pairs}: direct {_fmt(d['decode_tps_client'])} tok/s, "
                    f"API {_fmt(a['decode_tps_client'])} tok/s (worker {_fmt(a['decode_tps_worker'])})")
        finally:
            client.stop()
            api.stop()
    return {"context": loaded.context_length, "request": dataclasses.asdict(template.sampling),
            "warmup": {"api": warm_api, "direct": warm_direct}, "pairs": pairs, "error": error}


def _fmt(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _spread(values: list[float]) -> Optional[dict]:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def _ratios(pairs: list[dict], key: str) -> list[float]:
    return [p["api"][key] / p["direct"][key] for p in pairs if p["api"][key] and p["direct"][key]]


def cli_once(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "runtime.cli", "chat", "--model", args.model, *engine_args(args), "--temperature", "0",
           "--max-tokens", str(args.max_tokens), "--json", PROMPT]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    fin = [json.loads(line) for line in r.stdout.splitlines() if '"type":"finished"' in line]
    if r.returncode != 0 or not fin:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
    stats = fin[-1]["stats"]
    return {"decode_tps": stats["decode_tps"], "ttft_s": stats["ttft_s"], "completion_tokens": stats["generated_tokens"]}


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--api-client"]:
        return api_client_loop(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    p = argparse.ArgumentParser(prog="python -m bench.serve_vs_chat", description=__doc__.splitlines()[0])
    add_engine_arguments(p)
    p.add_argument("--pairs", type=int, default=8, help="pairs of measured answers (direct and API), after warm-up")
    p.add_argument("--note", default="", help="what the notes should say, e.g. that the weights are synthetic")
    p.set_defaults(max_tokens=256)
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error("--pairs must be 1 or more")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = common_fields(args.model, args.backend, args.vram_budget)
    say = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    say("1/2 the API and the worker directly, side by side on one worker…")
    run = side_by_side(args)
    say("2/2 moedesk-cli chat --json, once…")
    cli = cli_once(args)

    pairs = run["pairs"]
    side = {path: {key: _spread([p[path][key] for p in pairs if p[path][key] is not None])
                   for key in ("decode_tps_client", "decode_tps_worker", "ttft_s")} for path in ("direct", "api")}
    ratio = _spread(_ratios(pairs, "decode_tps_client"))
    worker_ratio = _spread(_ratios(pairs, "decode_tps_worker"))
    delivery = _spread([p["api"]["decode_tps_client"] / p["api"]["decode_tps_worker"] for p in pairs
                        if p["api"]["decode_tps_client"] and p["api"]["decode_tps_worker"]])
    med = lambda path, key: (side[path][key] or {}).get("median")   # noqa: E731
    result = {**fields, "context": run["context"], "prompt_tokens": None, "prefill_tps": None,
              "decode_tps": med("api", "decode_tps_client"), "ttft_s": med("api", "ttft_s"),
              "max_tokens": args.max_tokens, "pairs_measured": len(pairs),
              "api_over_chat": ratio and ratio["median"],
              "api_over_chat_pairs": ratio, "api_over_chat_worker_side": worker_ratio,
              "api_client_over_worker": delivery, "by_path": side,
              "baseline": {"name": "the same worker driven directly, as moedesk-cli chat drives it, alternating with "
                                   "the API", "decode_tps": med("direct", "decode_tps_client"),
                           "decode_tps_worker": med("direct", "decode_tps_worker"),
                           "ttft_s": med("direct", "ttft_s"), "prefill_tps": None},
              "ttft_note": "ttft_s is client-side on both paths: from sending the request to the first token",
              "request": run["request"], "warmup": run["warmup"], "pairs": pairs, "error": run["error"], "cli_once": cli,
              "notes": "one worker serves both paths, alternating answer by answer (order flipped every pair); "
                       "decode_tps = (completion tokens - 1) / (last token's arrival - first token's) as the client "
                       "saw it; api_over_chat is the median over pairs of api / direct; api_over_chat_worker_side "
                       "the same from the worker's own decode_tps (the engine's speed), api_client_over_worker "
                       "the API client's rate over the worker's for the same answer (delivery); the server runs in "
                       "the measuring process on the same WorkerBackend as moedesk serve, its client in another "
                       "process; greedy" + (f"; {args.note}" if args.note else "")
                       + "; cli_once is one moedesk-cli chat run, warm-up included" + shared_note(fields["machine"])}
    path = write(result, out, f"serve-vs-chat-{fields['model']}-{args.backend}")
    r = ratio or {}
    print(f"decode through the API {_fmt(med('api', 'decode_tps_client'))} tok/s, direct "
          f"{_fmt(med('direct', 'decode_tps_client'))} tok/s (medians over {len(pairs)} pairs); api/direct per pair: "
          f"median {r.get('median', float('nan')):.3f}, min {r.get('min', float('nan')):.3f}, "
          f"max {r.get('max', float('nan')):.3f}; worker-side {(worker_ratio or {}).get('median', float('nan')):.3f}; "
          f"API client/worker {(delivery or {}).get('median', float('nan')):.3f}; moedesk-cli chat once: {cli}")
    print(f"wrote {path}")
    if run["error"]:
        print(f"incomplete: {run['error']}", file=sys.stderr)
    return 1 if run["error"] or not pairs else 0


if __name__ == "__main__":
    sys.exit(main())
