"""A bounded load test of `moedesk serve` on loopback: N concurrent streaming clients x M requests each.

    python -m bench.serve_load --model demo --clients 4 --requests 3 --max-tokens 32 --out bench/results/

Starts the server (its own worker, the engine options as `moedesk-cli chat` takes them), then each client
thread sends its requests one after another through the official `openai` client, streaming. Reports
completed and failed requests, p50/p99 of time to first token and of total time per request (the
queue wait included: the engine answers one request at a time), and each answer's decode tokens/s as
the client saw it. Not a timed test: the figures describe the machine it ran on. Writes one JSON file.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short paragraph about the history of the bicycle."


@dataclass
class Answer:
    ok: bool
    ttft_s: Optional[float] = None
    total_s: Optional[float] = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    decode_tps: Optional[float] = None      # (tokens - 1) / (last chunk - first chunk), as the client saw it
    error: str = ""
    request_id: str = ""                    # the completion's id (the server's request id)


class Server:
    """`moedesk serve` as a child process on a free loopback port, with a fresh key."""

    def __init__(self, model: str, engine_args: list[str], max_queue: int, log: Path):
        self.key = secrets.token_urlsafe(16)
        self.log = open(log, "w")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   MOEDESK_API_KEY=self.key)
        self.proc = subprocess.Popen([sys.executable, "-m", "app.serve", "--model", model, "--port", "0",
                                      "--max-queue", str(max_queue), *engine_args],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT)
        line = self.proc.stdout.readline()
        if not line.startswith("Serving"):
            self.stop()
            raise RuntimeError(f"moedesk serve did not start: {line!r}; see {log}")
        self.model, self.url = line.split()[1], line.split(" at ")[1].strip()

    def client(self, timeout: float = 600.0):
        import openai
        return openai.OpenAI(base_url=self.url, api_key=self.key, max_retries=0, timeout=timeout)

    def stop(self) -> None:
        import signal
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class ApiInThread:
    """The API (`create_app`) on uvicorn in a thread of this process, on a free loopback port, with a key."""

    def __init__(self, backend):
        from app.serve.api import create_app
        from app.serve.cli import bind, make_server, url_of
        self.key = secrets.token_urlsafe(16)
        self.sock = bind("127.0.0.1", 0)
        self.url = url_of(self.sock, "127.0.0.1")
        self.server = make_server(create_app(backend, api_key=self.key, max_queue=1), log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="api")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the API server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def log_path(name: str) -> Path:
    """Where the server's log goes (a temporary file: results folders hold results only)."""
    import tempfile
    fd, path = tempfile.mkstemp(prefix=f"moedesk-{name}-", suffix=".log")
    os.close(fd)
    return Path(path)


def stream_one(client, model: str, max_tokens: int, prompt: str = PROMPT, temperature: float = 0.0) -> Answer:
    t0 = time.perf_counter()
    first = last = None
    usage, rid = None, ""
    try:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=temperature, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            rid = rid or chunk.id
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
    except Exception as e:  # noqa: BLE001 - a failed request is a result here
        return Answer(False, total_s=time.perf_counter() - t0, error=f"{type(e).__name__}: {e}"[:300])
    end = time.perf_counter()
    n = usage.completion_tokens if usage else 0
    decode = (n - 1) / (last - first) if first is not None and n > 1 and last > first else None
    return Answer(True, None if first is None else first - t0, end - t0, n, usage.prompt_tokens if usage else 0, decode,
                  request_id=rid)


def percentile(values: list[float], p: float) -> Optional[float]:
    """Nearest-rank percentile (p in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def run_load(server: Server, clients: int, requests: int, max_tokens: int) -> tuple[list[Answer], float]:
    answers: list[Answer] = []
    lock = threading.Lock()

    def client_loop() -> None:
        c = server.client()
        for _ in range(requests):
            a = stream_one(c, server.model, max_tokens)
            with lock:
                answers.append(a)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, time.perf_counter() - t0


def common_fields(model: str, backend: str, vram_budget: Optional[float]) -> dict:
    """The fields every benchmark result carries (see the design's Interfaces)."""
    from bench.engine import git_commit, machine
    from runtime.loader import choose_backend
    from runtime.paths import resolve_model
    config = {}
    try:
        config = json.loads((resolve_model(model) / "config.json").read_text())
    except (OSError, ValueError):
        pass
    bpw = (config.get("quantization_config") or {}).get("bits")
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "machine": machine(), "device": choose_backend(backend).device,
            "model": resolve_model(model).name, "bpw": bpw, "vram_budget_gb": vram_budget, "context": None,
            "roofline_tps": None, "draft": None}


def shared_note(host: dict) -> str:
    """Words on how busy the machine was (the load average at the start and now)."""
    import psutil
    now = psutil.getloadavg()[0]
    busiest = max(now, host.get("load_avg_1m") or 0)
    if busiest <= 0.5 * (host.get("cores_logical") or 1):
        return ""
    return (f"; the machine was shared while measuring: 1-minute load average up to {busiest:.1f} on "
            f"{host.get('cores_logical')} cores, so every figure is below an idle machine's")


def engine_args(args: argparse.Namespace) -> list[str]:
    out = ["--backend", args.backend]
    if args.vram_budget is not None:
        out += ["--vram-budget", str(args.vram_budget)]
    return out


def write(result: dict, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{datetime.datetime.now().strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="model name, 'demo', or folder")
    p.add_argument("--backend", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--vram-budget", type=float, help="GPU memory the engine may use, GB")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    p.add_argument("--out", default="bench/results", help="folder for the JSON result")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.splitlines()[0])
    add_engine_arguments(p)
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=3, help="requests per client, one after another")
    args = p.parse_args(argv)
    fields = common_fields(args.model, args.backend, args.vram_budget)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = Server(args.model, engine_args(args), max_queue=args.clients, log=log_path("serve-load"))
    try:
        stream_one(server.client(), server.model, 4)           # warm-up, not counted
        answers, wall = run_load(server, args.clients, args.requests, args.max_tokens)
    finally:
        server.stop()
    ok = [a for a in answers if a.ok]
    busy = shared_note(fields["machine"])
    ttfts = [a.ttft_s for a in ok if a.ttft_s is not None]
    totals = [a.total_s for a in ok]
    decodes = [a.decode_tps for a in ok if a.decode_tps is not None]
    result = {**fields, "prompt_tokens": ok[0].prompt_tokens if ok else None, "prefill_tps": None,
              "decode_tps": statistics.median(decodes) if decodes else None,
              "ttft_s": percentile(ttfts, 50), "baseline": None,
              "clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.max_tokens,
              "completed": len(ok), "failed": len(answers) - len(ok),
              "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
              "total_p50_s": percentile(totals, 50), "total_p99_s": percentile(totals, 99),
              "wall_s": wall, "tokens_per_s_all_clients": sum(a.completion_tokens for a in ok) / wall,
              "errors": sorted({a.error for a in answers if not a.ok}),
              "answers": [asdict(a) for a in answers],
              "notes": "moedesk serve on loopback, streaming through the openai client, greedy; the engine answers one "
                       "request at a time, so time to first token and total include the wait in the queue; decode_tps "
                       "is the median of each answer's client-side rate; one warm-up request not counted" + busy}
    path = write(result, out, f"serve-load-{fields['model']}-{args.clients}x{args.requests}")
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"   # noqa: E731
    print(f"{len(ok)} completed, {len(answers) - len(ok)} failed; ttft p50 {fmt(result['ttft_p50_s'])} s, "
          f"p99 {fmt(result['ttft_p99_s'])} s; total p50 {fmt(result['total_p50_s'])} s, "
          f"p99 {fmt(result['total_p99_s'])} s; decode {fmt(result['decode_tps'])} tok/s per answer")
    print(f"wrote {path}")
    return 0 if ok and len(ok) == len(answers) else 1


if __name__ == "__main__":
    sys.exit(main())
