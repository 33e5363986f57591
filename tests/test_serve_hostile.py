"""`moedesk serve` (the demo model on the CPU, a free loopback port, no key) against hostile clients: other Host
names (DNS rebinding), web pages of other origins (cross-site requests, preflight), clients that leave while
queued, in the prefill or in the decode, JSON nested 100,000 deep, a max_tokens beyond the context."""
from __future__ import annotations

import json
import re
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.serve_fixtures import no_end_of_answer, running_server

pytestmark = pytest.mark.slow

EXTENSION = "chrome-extension://abcdefghijklmnopabcdefghijklmnop"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def server(demo_model, tmp_path_factory):
    with running_server(demo_model, tmp_path_factory.mktemp("serve-hostile"), "--max-queue", "8",
                        "--allow-origin", EXTENSION, "--allow-host", "gpu-box.lan") as started:
        yield started


def post(url, body, timeout=60.0, **headers):
    return httpx.post(f"{url}/chat/completions", content=body if isinstance(body, bytes) else json.dumps(body),
                      headers={"content-type": "application/json", **headers}, timeout=timeout)


def ask(model, max_tokens=4, **kw):
    return {"model": model, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, **kw}


def refused(r, status, code):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]
    return error["message"]


# ---- Host and Origin ---------------------------------------------------------------------------------

def test_only_the_host_names_the_server_serves_are_answered(server):
    url, _, model = server
    port = urlsplit(url).port
    for host in ("evil.example", f"evil.example:{port}", f"localhost:{port + 1}", "localhost", f"10.0.0.1:{port}"):
        message = refused(httpx.get(f"{url}/models", headers={"host": host}), 400, "host_not_allowed")
        assert "allowed hosts" in message and "--allow-host" in message
        refused(post(url, ask(model), host=host), 400, "host_not_allowed")
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}", f"app.localhost:{port}",
                 "gpu-box.lan", "gpu-box.lan:443"):
        assert httpx.get(f"{url}/models", headers={"host": host}).status_code == 200, host


def test_web_pages_of_other_origins_never_reach_the_engine(server):
    url, log, model = server
    said = "refused a request from the web page origin"
    before = log.read_text().count(said)
    for origin in ("http://evil.example", "null", "http://localhost:3000", "chrome-extension://other"):
        # A "simple" cross-site POST (no preflight): text/plain, as a page's fetch or form would send it.
        r = httpx.post(f"{url}/chat/completions", content=json.dumps(ask(model, 400)),
                       headers={"content-type": "text/plain", "origin": origin}, timeout=10)
        message = refused(r, 403, "origin_not_allowed")
        assert "allowed origins" in message and "--allow-origin" in message
        assert "access-control-allow-origin" not in r.headers
        preflight = httpx.options(f"{url}/chat/completions", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
        refused(preflight, 403, "origin_not_allowed")
        assert "access-control-allow-origin" not in preflight.headers
    refused(httpx.get(f"{url}/models", headers={"origin": "http://evil.example"}), 403, "origin_not_allowed")
    assert log.read_text().count(said) == before + 9          # each refused before any route ran


def test_an_allowed_origin_gets_cors_and_the_servers_own_origin_is_fine(server):
    url, _, model = server
    preflight = httpx.options(f"{url}/chat/completions", headers={
        "origin": EXTENSION, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type, x-stainless-os"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == EXTENSION
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "x-stainless-os" in preflight.headers["access-control-allow-headers"]
    r = post(url, ask(model), origin=EXTENSION)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == EXTENSION
    assert r.json()["choices"][0]["message"]["content"]
    own = f"http://{urlsplit(url).netloc}"
    assert httpx.get(f"{url}/models", headers={"origin": own}).status_code == 200


# ---- bad bodies ----------------------------------------------------------------------------------------

def test_json_nested_100000_deep_is_a_400_in_openais_shape(server):
    url, _, _ = server
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        message = refused(post(url, body), 400, "invalid_json")
        assert "nested too deeply" in message


def test_max_tokens_beyond_the_context_is_refused(server):
    url, _, model = server
    r = post(url, ask(model, 4_194_304))
    message = refused(r, 400, None)
    assert r.json()["error"]["param"] == "max_tokens" and "more than this model's context of 4096" in message


# ---- clients that leave ------------------------------------------------------------------------------

def send_and_keep(url, body: dict) -> socket.socket:
    """A raw HTTP request whose answer is never read: the caller closes the socket (the client leaves)."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sock.sendall(f"POST {parts.path}/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_for_log(log, start: int, pattern: str, count: int = 1, timeout: float = 60.0) -> list:
    """The matches of `pattern` in the log after offset `start`, once there are `count` (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        found = re.findall(pattern, log.read_text()[start:])
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.fixture(scope="module")
def endless(demo_model):
    """The long answers ban the end of answer, so they run to max_tokens: the integer CPU kernel decodes fast
    enough that a greedy story could end on its own before its client left it."""
    return {"logit_bias": no_end_of_answer(demo_model)}


def test_a_plain_client_that_leaves_mid_answer_is_cancelled(server, endless):
    url, log, model = server
    start = len(log.read_text())
    sock = send_and_keep(url, ask(model, 3000, messages=STORY, **endless))
    time.sleep(2.0)                                   # well into the answer (the prompt is short)
    sock.close()
    assert wait_for_log(log, start, r"client closed the connection; its request is cancelled")
    stopped = wait_for_log(log, start, r"the engine stopped \(cancelled\) after (\d+) tokens")
    assert stopped and 0 < int(stopped[0]) < 3000, log.read_text()[start:]
    assert "Paris" in post(url, ask(model, 12)).json()["choices"][0]["message"]["content"]


def test_clients_that_leave_while_queued_free_the_queue(server, endless):
    url, log, model = server
    start = len(log.read_text())
    running = send_and_keep(url, ask(model, 3000, stream=True, messages=STORY, **endless))     # holds the engine
    time.sleep(1.0)
    queued = [send_and_keep(url, ask(model, 800, messages=STORY, **endless)) for _ in range(8)]      # fills the queue (8)
    time.sleep(0.3)               # they leave well before the running answer's turn ends (fair.TURN_S after its start)
    for sock in queued:
        sock.close()
    assert len(wait_for_log(log, start, r"client closed the connection", count=8, timeout=20)) == 8
    # Not refused: served at the running answer's next turn (app/serve/fair.py).
    r = post(url, ask(model, 12), timeout=120)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    running.close()               # back on the engine after that turn
    stopped = wait_for_log(log, start, r"the engine stopped \(cancelled\)")
    assert len(stopped) == 1, log.read_text()[start:]          # only the running one: no queued one reached the engine


def test_a_streaming_client_that_leaves_in_the_prefill_is_cancelled_before_its_first_token(server):
    url, log, model = server
    start = len(log.read_text())
    long_prompt = [{"role": "user", "content": "word " * 3500}]         # about seven prefill chunks on the CPU
    sock = send_and_keep(url, ask(model, 50, stream=True, messages=long_prompt))
    time.sleep(1.5)
    sock.close()
    stopped = wait_for_log(log, start, r"the engine stopped \(cancelled\) after (\d+) tokens")
    assert stopped == ["0"], log.read_text()[start:]
    assert "Paris" in post(url, ask(model, 12)).json()["choices"][0]["message"]["content"]


def test_fifty_clients_that_leave_at_once_do_not_hold_the_server(server):
    """The load test, bounded: 50 requests opened and dropped, then normal clients are all served."""
    from bench.serve_leavers import leave_at_once, log_counts, served
    url, log, model = server
    start = len(log.read_text())
    leave_at_once(url, model, clients=50, max_tokens=800)
    answers = served(url, model, clients=3, max_tokens=8, timeout=60)     # each retries a 503 for 60 s at most
    assert [a["ok"] for a in answers] == [True] * 3, answers
    assert all("Paris" in a["text"] for a in answers)
    counts = log_counts(log.read_text()[start:])
    assert counts["requests_cancelled"] >= 1 and all(n < 800 for n in counts["tokens_before_stop"]), counts
