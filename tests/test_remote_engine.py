"""The remote engine's failures, each in plain words: unreachable host, TLS, 401, timeouts, a server that
drops mid-stream (the partial answer kept, marked interrupted). Scripted HTTP servers on loopback;
the happy path against the real `moedesk serve` is in test_serve.py."""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.serve import remote_http
from app.serve.remote import RemoteConfig, RemoteEngine, RemoteError, list_models, normalise_url
from runtime.protocol import ChatMessage
from runtime.options import SamplingOptions


def chunk(text=None, finish=None) -> bytes:
    delta = {"content": text} if text else {}
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


@pytest.fixture
def scripted():
    """An HTTP server on loopback whose POST answer is `script(handler)`; yields a function making one."""
    servers = []

    def make(script):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                script(self)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                script(self)

            def log_message(self, *args):
                pass
        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/v1"
    yield make
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_addresses_are_normalised():
    assert normalise_url("gpu-box:8000") == "http://gpu-box:8000/v1"
    assert normalise_url("https://h/v1/") == "https://h/v1"
    with pytest.raises(ValueError):
        normalise_url("ftp://h")


def test_unreachable_tls_and_401_in_words(scripted):
    with pytest.raises(RemoteError) as e:
        list_models(f"http://127.0.0.1:{free_port()}/v1")
    assert e.value.code == "remote_unreachable" and "Cannot reach 127.0.0.1" in e.value.message

    def unauthorised(h):
        body = json.dumps({"error": {"message": "bad key", "type": "invalid_request_error"}}).encode()
        h.send_response(401)
        h.send_header("content-length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
    url = scripted(unauthorised)
    with pytest.raises(RemoteError) as e:
        list_models(url, "k")
    assert e.value.code == "remote_auth" and "refused the API key (HTTP 401): bad key" in e.value.message

    with pytest.raises(RemoteError) as e:                  # https:// to a plain-HTTP server
        list_models(url.replace("http://", "https://"))
    assert e.value.code == "remote_tls" and "secure (TLS) connection" in e.value.message


def run_engine(qtbot, url):
    engine = RemoteEngine(RemoteConfig(url, "m"))
    events = []
    engine.token.connect(lambda ev: events.append(("token", ev.text)))
    engine.finished.connect(lambda ev: events.append(("finished", ev.reason)))
    engine.error.connect(lambda rid, err: events.append(("error", err)))
    engine.generate("r1", [ChatMessage("user", "hi")], SamplingOptions(max_tokens=5))
    qtbot.waitUntil(lambda: bool(events) and events[-1][0] in ("finished", "error"), timeout=10000)
    return engine, events


def test_a_server_that_drops_mid_stream_keeps_the_partial_answer(qtbot, scripted):
    def drops(h):
        h.send_response(200)
        h.send_header("content-type", "text/event-stream")
        h.end_headers()
        h.wfile.write(chunk("Hello") + chunk(" there"))
        h.wfile.flush()
        h.close_connection = True                       # gone before finish_reason / [DONE]
    _, events = run_engine(qtbot, scripted(drops))
    assert [e for e in events if e[0] == "token"] == [("token", "Hello"), ("token", " there")]
    err = events[-1][1]
    assert err.code == "remote_dropped" and "interrupted; the text so far is kept" in err.message


def test_a_silent_server_times_out(qtbot, scripted, monkeypatch):
    monkeypatch.setattr(remote_http, "IDLE_TIMEOUT_S", 0.5)
    stop = threading.Event()
    _, events = run_engine(qtbot, scripted(lambda h: stop.wait(5)))
    stop.set()
    assert events[-1][0] == "error" and events[-1][1].code == "remote_timeout"
    assert "sent no event for 0.5 s" in events[-1][1].message


def test_a_whole_answer_gives_stream_timing_and_stop_is_immediate(qtbot, scripted):
    release = threading.Event()

    def answers(h):
        h.send_response(200)
        h.send_header("content-type", "text/event-stream")
        h.end_headers()
        h.wfile.write(chunk("a") + chunk("b") + chunk("c"))
        h.wfile.flush()
        if "slow" in h.path:
            release.wait(5)
        usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
        h.wfile.write(chunk(None, "stop") + f"data: {json.dumps(usage)}\n\n".encode() + b"data: [DONE]\n\n")
    url = scripted(answers)
    engine = RemoteEngine(RemoteConfig(url, "m"))
    stats = []
    engine.finished.connect(lambda ev: stats.append((ev.reason, ev.stats)))
    engine.generate("r1", [ChatMessage("user", "hi")], SamplingOptions())
    qtbot.waitUntil(lambda: bool(stats), timeout=10000)
    reason, s = stats[0]
    assert reason == "eos" and s.prompt_tokens == 7 and s.generated_tokens == 3 and s.ttft_s > 0
    assert s.decode_tps is not None and s.decode_tps > 0
    # Stop while the server is silent: the answer ends as cancelled at once, not after the server's next word.
    engine.config = RemoteConfig(url.replace("/v1", "/slow/v1"), "m")
    stats.clear()
    engine.generate("r2", [ChatMessage("user", "hi")], SamplingOptions())
    engine.cancel("r2")
    qtbot.waitUntil(lambda: bool(stats), timeout=2000)
    assert stats[0][0] == "cancelled"
    release.set()
