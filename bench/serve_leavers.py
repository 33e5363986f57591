"""A bounded load test of clients that leave: `moedesk serve` on loopback gets N requests whose clients close
the connection at once (some before the server has read them, some while queued, one in the engine), then M
normal clients ask; how long each normal client waits to be served is what is measured.

    python -m bench.serve_leavers --model demo --backend cpu --leavers 50 --clients 5 --out bench/results/

Each leaving request asks for `--leaver-tokens` (800) tokens without streaming, as a client with a short
timeout would; each normal one for `--max-tokens`. A normal client answered 503 (queue full) tries again a
quarter of a second later, as the Retry-After header asks, for at most `--timeout` seconds. The server's log
says how many requests it cancelled and after how many tokens the engine stopped. Writes one JSON file.
"""
from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

import httpx

RETRY_S = 0.25


def _request(url: str, body: dict, key: Optional[str]) -> bytes:
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {parts.path}/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def leave_at_once(url: str, model: str, clients: int = 50, max_tokens: int = 800, key: Optional[str] = None,
                  linger_s: float = 0.2) -> float:
    """`clients` requests sent together, each closed 0 to `linger_s` seconds later (spread evenly) without reading
    a byte. Returns when the last one closed (time.perf_counter())."""
    parts = urlsplit(url)
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens, "temperature": 0}
    raw = _request(url, body, key)
    ready = threading.Barrier(clients)
    closed = [0.0] * clients

    def one(i: int) -> None:
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
            try:
                ready.wait(30)
            except threading.BrokenBarrierError:
                pass
            sock.sendall(raw)
            time.sleep(linger_s * i / max(clients - 1, 1))
        closed[i] = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return max(closed)


def served(url: str, model: str, clients: int = 5, max_tokens: int = 8, key: Optional[str] = None,
           timeout: float = 120.0) -> list[dict]:
    """`clients` normal requests at once; each retries on 503 until `timeout`. Per client: ok, status, attempts,
    and served_s (seconds from its first try to its answer)."""
    body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": max_tokens, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answers: list[dict] = [{} for _ in range(clients)]

    def one(i: int) -> None:
        t0 = time.perf_counter()
        attempts, status, text = 0, None, ""
        while time.perf_counter() - t0 < timeout:
            attempts += 1
            try:
                r = httpx.post(f"{url}/chat/completions", json=body, headers=headers,
                               timeout=max(1.0, timeout - (time.perf_counter() - t0)))
                status = r.status_code
            except httpx.HTTPError as e:
                status, text = None, f"{type(e).__name__}: {e}"
                break
            if status != 503:
                text = r.json()["choices"][0]["message"]["content"] if status == 200 else r.text[:300]
                break
            time.sleep(RETRY_S)
        answers[i] = {"ok": status == 200, "status": status, "attempts": attempts,
                      "served_s": time.perf_counter() - t0, "text": text}
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return answers


def log_counts(text: str) -> dict:
    """What the server's log says about the requests it cancelled."""
    stopped = [int(n) for n in re.findall(r"the engine stopped \(cancelled\) after (\d+) tokens", text)]
    return {"requests_cancelled": text.count("client closed the connection; its request is cancelled"),
            "generations_cancelled": len(stopped), "tokens_before_stop": stopped}


def main(argv=None) -> int:
    from bench.serve_load import Server, add_engine_arguments, common_fields, engine_args, log_path, shared_note, write
    p = argparse.ArgumentParser(prog="python -m bench.serve_leavers", description=__doc__.splitlines()[0])
    add_engine_arguments(p)
    p.add_argument("--leavers", type=int, default=50, help="requests whose clients close at once")
    p.add_argument("--leaver-tokens", type=int, default=800, help="tokens each leaving request asks for")
    p.add_argument("--clients", type=int, default=5, help="normal clients asking after them, at once")
    p.add_argument("--max-queue", type=int, default=8, help="the server's queue (its default: 8)")
    p.add_argument("--timeout", type=float, default=120.0, help="how long a normal client keeps trying")
    p.set_defaults(max_tokens=8)
    args = p.parse_args(argv)
    fields = common_fields(args.model, args.backend, args.vram_budget)
    log = log_path("serve-leavers")
    server = Server(args.model, engine_args(args), max_queue=args.max_queue, log=log)
    try:
        before = served(server.url, server.model, 1, args.max_tokens, server.key, args.timeout)[0]  # warm-up, baseline
        left = leave_at_once(server.url, server.model, args.leavers, args.leaver_tokens, server.key)
        answers = served(server.url, server.model, args.clients, args.max_tokens, server.key, args.timeout)
        after_left = time.perf_counter() - left
        time.sleep(1.0)                           # the log's last lines
    finally:
        server.stop()
    counts = log_counts(Path(log).read_text())
    ok = [a for a in answers if a["ok"]]
    result = {**fields, "prompt_tokens": None, "prefill_tps": None, "decode_tps": None, "ttft_s": None,
              "baseline": {"served_s": before["served_s"], "ok": before["ok"]},
              "leavers": args.leavers, "leaver_tokens": args.leaver_tokens, "clients": args.clients,
              "max_tokens": args.max_tokens, "max_queue": args.max_queue,
              "served": len(ok), "failed": len(answers) - len(ok),
              "served_max_s": max((a["served_s"] for a in ok), default=None),
              "all_served_after_leavers_s": after_left, "answers": answers, **counts,
              "notes": "moedesk serve on loopback; leaving clients send their request and close within 0.2 s "
                       "without reading; normal clients start when the last has closed and retry a 503 every "
                       f"{RETRY_S} s; served_s counts from a client's first try; baseline: one request on the idle "
                       "server" + shared_note(fields["machine"])}
    path = write(result, Path(args.out), f"serve-leavers-{fields['model']}-{args.leavers}x{args.clients}")
    print(f"{len(ok)}/{len(answers)} normal clients served, the slowest in {result['served_max_s'] or 0:.2f} s "
          f"(idle server: {before['served_s']:.2f} s); {counts['requests_cancelled']} requests cancelled, the engine "
          f"stopped after {counts['tokens_before_stop']} tokens")
    print(f"wrote {path}")
    return 0 if len(ok) == len(answers) else 1


if __name__ == "__main__":
    sys.exit(main())
