"""A hostile or broken remote server, scripted on loopback: endless lines and bodies, bytes dripped slowly, fields
of the wrong type, answers past max_tokens, credentials echoed back. Every answer ends (finished or error, the
text so far kept), the engine goes back to idle, the socket is closed, and no error text holds a credential."""
from __future__ import annotations

import json
import threading
import time

import pytest

from app.serve import remote_http
from app.serve.remote import RemoteConfig, RemoteEngine, RemoteError, list_models
from runtime.options import SamplingOptions
from runtime.protocol import ChatMessage
from tests.test_remote_engine import chunk, free_port, scripted  # noqa: F401 (scripted is a fixture)

MiB = 1 << 20
KEY = "sk-very-secret-key-0123456789"


class Pour:
    """What a scripted handler sent, and when the client closed the connection under it."""

    def __init__(self):
        self.sent = 0
        self.closed_at = None
        self.closed = threading.Event()

    def __call__(self, h, head: bytes, piece: bytes, total: int, every_s: float = 0.0, status: int = 200) -> None:
        """Send the headers and `head`, then `piece` again and again up to `total` bytes (bounded), each `every_s`."""
        try:
            h.send_response(status)
            h.send_header("content-type", "text/event-stream")
            h.end_headers()
            h.wfile.write(head)
            while self.sent < total:
                h.wfile.write(piece)
                h.wfile.flush()
                self.sent += len(piece)
                if every_s:
                    time.sleep(every_s)
        except (BrokenPipeError, ConnectionResetError):
            self.closed_at = time.monotonic()
            self.closed.set()


def answer_of(qtbot, url, max_tokens=5, key=None):
    """Runs one answer through a RemoteEngine; returns (engine, events) once it has ended."""
    engine = RemoteEngine(RemoteConfig(url, "m", key))
    events = []
    engine.token.connect(lambda ev: events.append(("token", ev.text)))
    engine.finished.connect(lambda ev: events.append(("finished", ev.reason, ev.stats)))
    engine.error.connect(lambda rid, err: events.append(("error", err)))
    engine.generate("r1", [ChatMessage("user", "hi")], SamplingOptions(max_tokens=max_tokens))
    qtbot.waitUntil(lambda: bool(events) and events[-1][0] in ("finished", "error"), timeout=20000)
    return engine, events


def test_an_endless_line_is_cut_off_and_its_socket_closed(qtbot, scripted):
    pour = Pour()
    url = scripted(lambda h: pour(h, chunk("Hi") + b"data: {\"x\": \"", b"x" * 65536, 64 * MiB))
    engine, events = answer_of(qtbot, url)
    assert events[0] == ("token", "Hi")
    err = events[-1][1]
    assert err.code == "remote_protocol" and "a line of over 1 MiB" in err.message and "text so far is kept" in err.message
    assert engine.state == "idle" and engine.generating is None
    assert pour.closed.wait(10) and pour.sent < 16 * MiB          # never read to its end


def test_an_endless_error_body_is_read_only_in_part(qtbot, scripted):
    pour = Pour()
    url = scripted(lambda h: pour(h, b"", (KEY + " ").encode() * 2000, 64 * MiB, status=500))
    engine, events = answer_of(qtbot, url, key=KEY)
    err = events[-1][1]
    assert err.code == "remote_http" and "answered HTTP 500" in err.message
    assert KEY not in err.message and KEY not in err.detail and len(err.message) <= remote_http.MAX_MESSAGE_CHARS
    assert engine.state == "idle"
    assert pour.closed.wait(10) and pour.sent < 16 * MiB


def test_an_endless_model_list_is_refused(scripted):
    pour = Pour()
    url = scripted(lambda h: pour(h, b'{"data": [', b'{"id": "m"},' * 4096, 64 * MiB))
    with pytest.raises(RemoteError) as e:
        list_models(url)
    assert e.value.code == "remote_protocol" and "over 4 MiB" in e.value.message
    assert pour.closed.wait(10) and pour.sent < 16 * MiB


def test_stop_in_the_middle_of_a_line_closes_the_socket(qtbot, scripted):
    pour = Pour()
    url = scripted(lambda h: pour(h, chunk("Hi") + b"data: {\"x", b"x", 10_000, every_s=0.05))
    engine = RemoteEngine(RemoteConfig(url, "m"))
    got = []
    engine.token.connect(lambda ev: got.append(ev.text))
    engine.finished.connect(lambda ev: got.append(ev.reason))
    engine.generate("r1", [ChatMessage("user", "hi")], SamplingOptions())
    qtbot.waitUntil(lambda: got == ["Hi"], timeout=10000)
    engine.cancel("r1")
    qtbot.waitUntil(lambda: got == ["Hi", "cancelled"], timeout=2000)
    assert engine.state == "idle"
    assert pour.closed.wait(5)                      # the server sees the connection go, mid-line


def test_a_server_dripping_bytes_is_given_up(qtbot, scripted, monkeypatch):
    monkeypatch.setattr(remote_http, "IDLE_TIMEOUT_S", 1.0)
    pour = Pour()
    url = scripted(lambda h: pour(h, chunk("Hi"), b"x", 10_000, every_s=0.1))     # a line that never ends
    engine, events = answer_of(qtbot, url)
    err = events[-1][1]
    assert err.code == "remote_timeout" and "sent no event for 1 s" in err.message
    assert engine.state == "idle" and events[0] == ("token", "Hi")
    assert pour.closed.wait(5)


def test_a_server_sending_empty_events_meets_the_deadline(qtbot, scripted, monkeypatch):
    monkeypatch.setattr(remote_http, "ANSWER_DEADLINE_S", 1.5)
    pour = Pour()
    url = scripted(lambda h: pour(h, b"", b'data: {"choices": []}\n\n', 10_000, every_s=0.05))
    engine, events = answer_of(qtbot, url)
    err = events[-1][1]
    assert err.code == "remote_timeout" and "took over 1.5 s" in err.message
    assert engine.state == "idle"
    assert pour.closed.wait(5)


def test_the_answer_stops_at_max_tokens_when_the_server_streams_on(qtbot, scripted):
    pour = Pour()
    url = scripted(lambda h: pour(h, b"", chunk("tok "), 5000 * len(chunk("tok "))))
    engine, events = answer_of(qtbot, url, max_tokens=16)
    assert [e for e in events if e[0] == "token"] == [("token", "tok ")] * 16
    assert events[-1][:2] == ("finished", "length") and events[-1][2].generated_tokens == 16
    assert pour.closed.wait(10) and pour.sent < 5000 * len(chunk("tok "))


def test_one_huge_text_chunk_counts_against_max_tokens(qtbot, scripted):
    def one_big(h):
        h.send_response(200)
        h.end_headers()
        h.wfile.write(chunk("a") + chunk("b" * 500_000) + chunk(None, "stop") + b"data: [DONE]\n\n")
    engine, events = answer_of(qtbot, scripted(one_big), max_tokens=4)
    assert [e for e in events if e[0] == "token"] == [("token", "a")]
    assert events[-1][:2] == ("finished", "length")


BAD_FIELDS = [
    ({"choices": [], "usage": "lots"}, "usage as text"),
    ({"choices": [], "usage": {"prompt_tokens": "7"}}, "usage.prompt_tokens as text"),
    ({"choices": [], "usage": {"completion_tokens": 1e400}}, "usage.completion_tokens as a number, not a count"),
    ({"choices": [], "usage": {"completion_tokens": -3}}, "usage.completion_tokens as a number, not a count"),
    ({"choices": [{"delta": {}, "finish_reason": ["stop"]}]}, "choices[0].finish_reason as a list"),
    ({"choices": [{"delta": {"content": {"text": "x"}}}]}, "choices[0].delta.content as an object, not text"),
    ({"choices": [{"delta": {"content": 5}}]}, "choices[0].delta.content as a number, not text"),
    ({"choices": [{"delta": "x"}]}, "choices[0].delta as text"),
    ({"choices": "all"}, "choices as text"),
    (["not", "an", "object"], "an event as a list"),
]


@pytest.mark.parametrize("bad,words", BAD_FIELDS, ids=[w for _, w in BAD_FIELDS])
def test_a_field_of_the_wrong_type_ends_the_answer_in_words(qtbot, scripted, bad, words):
    def sends(h):
        h.send_response(200)
        h.end_headers()
        h.wfile.write(chunk("Hello") + f"data: {json.dumps(bad)}\n\n".encode() + chunk(None, "stop")
                      + b"data: [DONE]\n\n")
    engine, events = answer_of(qtbot, scripted(sends))
    assert events[0] == ("token", "Hello")
    err = events[-1][1]
    assert events[-1][0] == "error" and err.code == "remote_protocol", events
    assert words in err.message and "text so far is kept" in err.message
    assert engine.state == "idle" and engine.generating is None


def model_list(data):
    def answer(h):
        body = json.dumps(data).encode()
        h.send_response(200)
        h.send_header("content-length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
    return answer


@pytest.mark.parametrize("data,words", [
    ({"data": [{"id": 1}]}, "data[0].id is a number"),
    ({"data": [{"id": "m"}, {"id": None}]}, "data[1].id is null"),
    ({"data": [{"id": "a\nb"}]}, "data[0].id is not a model name"),
    ({"data": [{"id": "x" * 600}]}, "data[0].id is not a model name"),
    ({"data": {"id": "m"}}, "'data' is an object, not a list"),
    ({"data": [{"id": f"m{i}"} for i in range(100_000)]}, "it lists 100000 models"),
    ({"data": [{"id": f"m{i}"} for i in range(400_000)]}, "over 4 MiB"),
])
def test_model_lists_are_checked_and_the_engine_leaves_starting(qtbot, scripted, data, words):
    url = scripted(model_list(data))
    with pytest.raises(RemoteError) as e:
        list_models(url)
    assert e.value.code == "remote_protocol" and words in e.value.message
    engine = RemoteEngine(RemoteConfig(url, "m"))
    errors = []
    engine.error.connect(lambda rid, err: errors.append(err))
    engine.start()
    qtbot.waitUntil(lambda: bool(errors), timeout=20000)
    assert engine.state == "idle" and engine.loaded_event is None and words in errors[0].message


def test_a_missing_model_names_a_few_of_many(qtbot, scripted):
    engine = RemoteEngine(RemoteConfig(scripted(model_list({"data": [{"id": f"m{i}"} for i in range(3000)]})), "x"))
    errors = []
    engine.error.connect(lambda rid, err: errors.append(err))
    engine.start()
    qtbot.waitUntil(lambda: bool(errors), timeout=20000)
    assert "does not list the model 'x'" in errors[0].message and "and 2990 more" in errors[0].message
    assert len(errors[0].message) <= remote_http.MAX_MESSAGE_CHARS


def test_credentials_never_appear_in_error_texts(qtbot, scripted):
    with pytest.raises(RemoteError) as e:            # a password in the address, a host that does not answer
        list_models(f"http://alice:pa55-word@127.0.0.1:{free_port()}/v1")
    assert e.value.code == "remote_unreachable"
    for text in (e.value.message, e.value.detail):
        assert "pa55-word" not in text and "alice" not in text

    def echoes(h):                                   # a 401 that quotes the key it was sent
        said = f"invalid key {h.headers['authorization']} " + "y" * 100_000
        body = json.dumps({"error": {"message": said}}).encode()
        h.send_response(401)
        h.send_header("content-length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
    with pytest.raises(RemoteError) as e:
        list_models(scripted(echoes), KEY)
    assert e.value.code == "remote_auth" and "invalid key Bearer ***" in e.value.message
    assert len(e.value.message) <= remote_http.MAX_MESSAGE_CHARS

    def stream_error(h):                             # an error event in the stream that quotes it too
        h.send_response(200)
        h.end_headers()
        h.wfile.write(chunk("Hi") + f'data: {{"error": {{"message": "quota of {KEY} is spent"}}}}\n\n'.encode())
    url = scripted(stream_error).replace("http://", "http://bob:hunter2-pass@")
    engine, events = answer_of(qtbot, url, key=KEY)
    err = events[-1][1]
    assert err.code == "remote_error" and "quota of *** is spent" in err.message
    assert all(s not in err.message + err.detail for s in (KEY, "hunter2-pass", "bob:"))

    checked = RemoteEngine(RemoteConfig(scripted(model_list({"data": [{"id": "m"}]})).replace(
        "http://", "http://bob:hunter2-pass@"), "m"))
    loaded = []
    checked.loaded.connect(loaded.append)
    checked.start()
    qtbot.waitUntil(lambda: bool(loaded), timeout=20000)          # the address the app shows has no password
    assert "hunter2" not in checked.ready_event.engine_note + loaded[0].path
