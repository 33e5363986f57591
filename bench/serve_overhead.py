"""What `moedesk serve` costs per streamed token, without a model: the real API (Starlette, uvicorn, the
server-sent events) in front of a token source that emits TokenDelta events at a fixed rate, streamed
through the official `openai` client.

    python -m bench.serve_overhead --rates 500 2000 0 --tokens 3000 --out bench/results/

For each rate (tokens/s; 0: as fast as the server takes them) a server process is started with a
`PacedBackend`, answers one warm-up request, then one streamed request of `--tokens` tokens. Recorded
per rate: the rate the client saw ((tokens - 1) / (last chunk - first chunk)), the CPU time of the
server process per token (user + system, from the operating system, over the whole request), and the
client's own CPU time per token. Beside them, the same source drained through the API's engine side in
this process with no HTTP (`without_http`): the share that is the hand-over from the source's thread to
the event loop. The figure that matters beside an engine: the server's CPU per token (at 250 tokens/s a
token takes 4 ms) and the rate at 0 (the most the path can carry).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from app.serve.api import ServedModel, Sink
from runtime import protocol as P

MODEL = "paced"


class PacedBackend:
    """An engine stand-in for measuring the server: each request gets `max_tokens` TokenDelta events
    ("t0 ", "t1 ", ...) at `rate` tokens/s (0: back to back) from a thread of its own, then Finished."""

    def __init__(self, rate: float, context_length: int = 1 << 20):
        self.rate = rate
        self.model = ServedModel(MODEL, context_length, int(time.time()))
        self._cancelled: set[str] = set()

    def served_model(self) -> Optional[ServedModel]:
        return self.model

    def start(self, request: P.Generate, sink: Sink) -> None:
        threading.Thread(target=self._emit, args=(request, sink), daemon=True).start()

    def cancel(self, request_id: str) -> None:
        self._cancelled.add(request_id)

    def _emit(self, request: P.Generate, sink: Sink) -> None:
        rid, n = request.request_id, request.sampling.max_tokens
        t0 = time.perf_counter()
        done, reason = 0, "length"
        for i in range(n):
            if rid in self._cancelled:
                reason = "cancelled"
                break
            if self.rate > 0:
                wait = t0 + i / self.rate - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
            sink(P.TokenDelta(request_id=rid, text=f"t{i} "))
            done += 1
        total = time.perf_counter() - t0
        stats = P.GenerationStats(prompt_tokens=1, generated_tokens=done, ttft_s=0.0, prefill_tps=None,
                                  decode_tps=(done - 1) / total if done > 1 and total > 0 else None, total_s=total)
        sink(P.Finished(request_id=rid, reason=reason, stats=stats))


def expected_text(n: int) -> str:
    return "".join(f"t{i} " for i in range(n))


def serve(rate: float) -> None:
    """The server process: print the URL, serve until killed."""
    from app.serve.api import create_app
    from app.serve.cli import bind, make_server, url_of
    sock = bind("127.0.0.1", 0)
    server = make_server(create_app(PacedBackend(rate), max_queue=1), log_level="warning")
    print(url_of(sock, "127.0.0.1"), flush=True)
    server.run(sockets=[sock])


def stream(client, tokens: int) -> dict:
    """One streamed chat request; the client-side figures and the text."""
    first = last = None
    parts, usage = [], None
    cpu0 = time.process_time()
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                                max_tokens=tokens, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            parts.append(chunk.choices[0].delta.content)
    n = usage.completion_tokens if usage else 0
    return {"text": "".join(parts), "chunks": len(parts), "completion_tokens": n,
            "client_tps": (n - 1) / (last - first) if n > 1 and last > first else None,
            "client_cpu_us_per_token": (time.process_time() - cpu0) / n * 1e6 if n else None}


def measure(rate: float, tokens: int) -> dict:
    import openai
    import psutil
    proc = subprocess.Popen([sys.executable, "-m", "bench.serve_overhead", "--serve", str(rate)],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        url = proc.stdout.readline().strip()
        if not url.startswith("http"):
            raise RuntimeError(f"the measuring server did not start: {url!r}")
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        stream(client, 20)                                          # warm-up: imports, first connection
        server = psutil.Process(proc.pid)
        before = server.cpu_times()
        got = stream(client, tokens)
        after = server.cpu_times()
    finally:
        proc.kill()
        proc.wait()
    cpu = (after.user - before.user) + (after.system - before.system)
    return {"rate": rate, "tokens": tokens, "in_order": got.pop("text") == expected_text(tokens), **got,
            "server_cpu_us_per_token": cpu / tokens * 1e6}


def without_http(rate: float, tokens: int) -> dict:
    """The same source through the API's engine side only (`Api._generation`: the hand-over from the source's
    thread to the event loop), no HTTP: the CPU per token every cross-thread delivery pays on this machine."""
    import asyncio
    import resource
    from app.serve.api import Api
    from runtime.options import SamplingOptions

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    async def drain() -> int:
        request = P.Generate(request_id="floor", prompt="go",
                             sampling=SamplingOptions(temperature=0.0, max_tokens=tokens))
        return len([ev async for ev in Api(PacedBackend(rate), None, 1)._generation(request)
                    if isinstance(ev, P.TokenDelta)])
    c0 = cpu()
    n = asyncio.run(drain())
    return {"rate": rate, "tokens": n, "cpu_us_per_token": (cpu() - c0) / n * 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[500, 2000, 0],
                   help="tokens/s the stand-in engine emits (0: as fast as the server takes them)")
    p.add_argument("--tokens", type=int, default=3000, help="tokens per measured request")
    p.add_argument("--out", default="bench/results", help="folder for the JSON result")
    p.add_argument("--serve", type=float, help=argparse.SUPPRESS)       # the server child
    args = p.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    from bench.serve_load import shared_note, write
    from bench.engine import git_commit, machine
    import datetime
    host = machine()
    runs = [measure(rate, args.tokens) for rate in args.rates]
    floor = [without_http(rate, args.tokens) for rate in args.rates]
    for f in floor:
        print(f"rate {f['rate']:g}/s without HTTP (the thread hand-over alone): {f['cpu_us_per_token']:.0f} us/token")
    for r in runs:
        print(f"rate {r['rate']:g}/s: client saw {r['client_tps']:.0f} tok/s, server CPU "
              f"{r['server_cpu_us_per_token']:.0f} us/token, client CPU {r['client_cpu_us_per_token']:.0f} us/token, "
              f"in order: {r['in_order']}")
    fastest = max((r for r in runs if r["rate"] == 0), key=lambda r: r["client_tps"] or 0, default=None)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_commit": git_commit(), "machine": host, "device": "cpu", "model": "none (a paced token source)",
              "bpw": None, "vram_budget_gb": None, "context": None, "prompt_tokens": 1, "prefill_tps": None,
              "decode_tps": fastest["client_tps"] if fastest else None, "ttft_s": None, "roofline_tps": None,
              "draft": None, "baseline": None, "runs": runs, "without_http": floor,
              "notes": "moedesk serve's API (Starlette, uvicorn, server-sent events) on loopback in front of a stand-in "
                       "engine emitting one-token deltas at a fixed rate, streamed through the openai client; "
                       "decode_tps is the client-side rate with the source unpaced (rate 0), the most the path "
                       "carries; server_cpu_us_per_token is the server process's user+system CPU over the request "
                       "divided by its tokens (the source's thread included); without_http is the same source drained through the "
                       "API's engine side in one process with no HTTP, the share of the CPU per token that is the "
                       "thread-to-event-loop hand-over" + shared_note(host)}
    print(f"wrote {write(result, Path(args.out), 'serve-overhead-cpu')}")
    return 0 if all(r["in_order"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
