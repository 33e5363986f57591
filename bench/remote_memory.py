"""The app's memory while a hostile remote server pours data at it, on loopback: an SSE line that never ends,
an error body that never ends, a model list that never ends. The server runs in a child process (its memory is
not counted); this process drives the remote engine's own code (`app.serve.remote_http`: the stream of an
answer, the model list) and samples its resident memory every 10 ms.

    python -m bench.remote_memory --mib 600 --out bench/results/

For each case: resident memory before and at its peak, the growth, how many bytes the server could write
before the client closed the socket, how long that took, and the error the user reads. Writes one JSON file.
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import threading
import time
from pathlib import Path

MiB = 1 << 20
PIECE = 64 * 1024
CASES = ("endless_line", "endless_error_body", "endless_model_list")


def _hostile_server(port_out, sent_out, mib: int) -> None:
    """Child process: answers every request with an endless body of the kind its path names."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def _pour(self, status: int, head: bytes) -> None:
            sent = 0
            try:
                self.send_response(status)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                self.wfile.write(head)
                piece = b"x" * PIECE
                while sent < mib * MiB:
                    self.wfile.write(piece)
                    sent += PIECE
            except OSError:
                pass
            sent_out.put(sent)

        def do_GET(self):
            self._pour(200, b'{"data": [{"id": "')

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            if "error" in self.path:
                self._pour(500, b"")
            else:
                self._pour(200, b'data: {"choices": [{"delta": {"content": "')

        def log_message(self, *args):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_out.put(srv.server_address[1])
    srv.serve_forever()


class Sampler:
    """This process's peak resident memory, sampled every 10 ms while running."""

    def __init__(self):
        import psutil
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        return {"rss_before_mib": self.base / MiB, "rss_peak_mib": self.peak / MiB,
                "rss_growth_mib": (self.peak - self.base) / MiB}


def run_case(case: str, port: int) -> dict:
    from app.serve.remote_http import RemoteConfig, RemoteError, RemoteStream, list_models, request_body
    from runtime.options import SamplingOptions
    from runtime.protocol import ChatMessage
    url = f"http://127.0.0.1:{port}/{'error/' if case == 'endless_error_body' else ''}v1"
    sampler, t0 = Sampler(), time.perf_counter()
    outcome = []
    if case == "endless_model_list":
        try:
            outcome.append(("finished", list_models(url)))
        except RemoteError as e:
            outcome.append(("error", e))
    else:
        config = RemoteConfig(url, "m")
        stream = RemoteStream(config, "r1", request_body(config, [ChatMessage("user", "hi")], SamplingOptions()),
                              lambda kind, ev: outcome.append((kind, ev)) if kind in ("finished", "error") else None)
        stream.run()
    took = time.perf_counter() - t0
    figures = sampler.stop()
    kind, ev = outcome[-1]
    return {"case": case, **figures, "seconds": took, "outcome": kind,
            "message": getattr(ev, "message", str(ev))[:300]}


def main(argv=None) -> int:
    from bench.engine import git_commit, machine
    from bench.serve_load import write
    p = argparse.ArgumentParser(prog="python -m bench.remote_memory", description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=600, help="how much each endless body may send at most (MiB)")
    p.add_argument("--out", default="bench/results", help="folder for the JSON result")
    args = p.parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    ports, sent = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_hostile_server, args=(ports, sent, args.mib), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=30)
        cases = []
        for case in CASES:
            result = run_case(case, port)
            result["server_sent_mib"] = sent.get(timeout=60) / MiB
            cases.append(result)
            print(f"{case}: +{result['rss_growth_mib']:.1f} MiB at the peak ({result['rss_peak_mib']:.0f} MiB), "
                  f"server sent {result['server_sent_mib']:.1f} MiB, {result['seconds']:.2f} s: {result['message']}")
    finally:
        server.terminate()
        server.join(10)
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(), "machine": machine(),
              "device": "cpu", "model": None, "bpw": None, "vram_budget_gb": None, "context": None,
              "prompt_tokens": None, "prefill_tps": None, "decode_tps": None, "ttft_s": None, "roofline_tps": None,
              "draft": None, "baseline": None, "endless_mib": args.mib, "cases": cases,
              "notes": "a loopback server in a child process pours up to --mib MiB of one endless line / error body / "
                       "model list; this process runs app.serve.remote_http's own client code and samples its "
                       "resident memory every 10 ms; server_sent_mib counts what the server wrote before the "
                       "client closed (socket buffers included)"}
    path = write(result, Path(args.out), "remote-memory")
    print(f"wrote {path}")
    return 0 if all(c["outcome"] == "error" for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
