"""`moedesk serve`: the OpenAI-compatible server without the GUI, in front of its own worker process.

    moedesk serve --model NAME_OR_DIR [--port P] [--host H] [--api-key K] [--max-queue N]
                  [--allow-origin ORIGIN]... [--allow-host NAME]...
                  [--backend auto|cuda|cpu] [--vram-budget GB] [--draft none|ngram|DIR] [--draft-tokens K]

Binds 127.0.0.1 by default; any other address needs an API key (`--api-key`, or the environment
variable MOEDESK_API_KEY, which keeps it out of the process list). `--port 0` picks a free port.
It answers only to localhost and its own addresses, and to no web page: `--allow-origin` lets a page or
browser extension in by its origin, `--allow-host` adds a host name (see `app.serve.guard`).
Once the model is loaded it prints one line, `Serving MODEL at http://HOST:PORT/v1`, on stdout.
Exit status 0 after Ctrl+C; 1 with a one-line error on stderr when the model cannot be loaded,
the address cannot be bound, or the engine process dies.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import socket
import sys
from typing import Optional, Sequence

from runtime import tuning
from runtime.options import ServeOptions

DEFAULTS = ServeOptions()
KEY_ENV = "MOEDESK_API_KEY"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (raises OSError in words from the system)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


def make_server(app, log_level: str = "info"):
    """A uvicorn server for the ASGI `app` (run it with `server.run(sockets=[sock])`); its logs, the
    request lines included, go to stderr (stdout carries only the `Serving ...` line)."""
    import copy

    import uvicorn
    from uvicorn.config import LOGGING_CONFIG
    logs = copy.deepcopy(LOGGING_CONFIG)
    for handler in logs["handlers"].values():
        handler["stream"] = "ext://sys.stderr"
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5,
                                         log_config=logs))


def add_arguments(p: argparse.ArgumentParser) -> None:
    from runtime.chat_cli import add_engine_arguments
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this computer only)")
    p.add_argument("--port", type=int, default=DEFAULTS.port, help=f"TCP port (default {DEFAULTS.port}; 0: any free one)")
    p.add_argument("--api-key", help=f"key clients must send (Authorization: Bearer KEY); or set {KEY_ENV}")
    p.add_argument("--max-queue", type=int, default=DEFAULTS.max_queue,
                   help=f"requests that may wait for the engine (default {DEFAULTS.max_queue})")
    p.add_argument("--allow-origin", action="append", default=list(DEFAULTS.allowed_origins), metavar="ORIGIN",
                   help="a web page or browser extension that may use the server, e.g. chrome-extension://ID or "
                        "http://localhost:3000 (repeat for more; * for any page); by default none")
    p.add_argument("--allow-host", action="append", default=list(DEFAULTS.allowed_hosts), metavar="NAME",
                   help="another host name the server answers to (a reverse proxy's, a LAN name; repeat for more)")


def run(args: argparse.Namespace) -> int:
    from app.serve import guard
    from app.serve.api import create_app
    from app.serve.worker_backend import WorkerBackend, served_model
    from runtime import protocol as P
    from runtime.chat_cli import load_options
    from runtime.client import WorkerClient
    from runtime.options import OptionError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s", stream=sys.stderr)
    key = args.api_key or tuning.api_key(KEY_ENV)
    if not is_loopback(args.host) and not key:
        return _fail(f"listening on {args.host} lets other devices in: give --api-key KEY (or set {KEY_ENV})")
    if args.max_queue < 0:
        return _fail("--max-queue must be 0 or more")
    try:
        guard.parse_origins(args.allow_origin)
        guard.parse_hosts(args.allow_host)
    except ValueError as e:
        return _fail(str(e))
    try:
        options = load_options(args)
    except OptionError as e:
        return _fail(f"bad option {e}")
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        return _fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    client = WorkerClient(client_name="moedesk serve")
    backend = None
    try:
        ready = client.start()
        print(f"moedesk serve: {ready.engine_note} Loading {args.model}…", file=sys.stderr, flush=True)
        loaded = client.load(args.model, options, on_progress=_progress_printer())
        backend = WorkerBackend(client, loaded, on_death=lambda words: _stop(server, words))
        server = make_server(create_app(backend, api_key=key, max_queue=args.max_queue, allowed_origins=args.allow_origin,
                                        allowed_hosts=args.allow_host))
        print(f"Serving {served_model(loaded).id} at {url_of(sock, args.host)}", flush=True)
        server.run(sockets=[sock])
        return 1 if getattr(server, "moedesk_failure", None) else 0
    except P.WorkerError as e:
        return _fail(f"{e.code}: {e.message}")
    except TimeoutError as e:
        return _fail(f"timeout: {e}")
    finally:
        sock.close()
        if backend is not None:
            backend.close()
        client.stop()


def _progress_printer():
    """Load progress on stderr, one line per new message (not one per tensor)."""
    last = [""]

    def show(ev) -> None:
        if ev.message and ev.message != last[0]:
            last[0] = ev.message
            print(f"moedesk serve: {ev.message}", file=sys.stderr, flush=True)
    return show


def _stop(server, words: str) -> None:
    print(f"moedesk serve: {words}", file=sys.stderr, flush=True)
    server.moedesk_failure = words
    server.should_exit = True


def _fail(message: str) -> int:
    print("moedesk serve: " + " ".join(message.split()), file=sys.stderr)
    return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="moedesk serve", description="An OpenAI-compatible server for a local model.")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
