"""The real worker against hostile lines: every line gets a proper event, and the worker stays alive."""
from __future__ import annotations

import json
import os

import pytest

from runtime import protocol as P
from runtime.client import WorkerClient


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "MOEDESK_MODELS"}
    env["MOEDESK_HOME"] = str(tmp_path_factory.mktemp("home"))
    with WorkerClient(env=env) as w:
        yield w


def _answer(w: WorkerClient, timeout: float = 30):
    ev = w.next_event(timeout)
    while isinstance(ev, P.Telemetry) and not ev.request_id.startswith("s-"):
        ev = w.next_event(timeout)
    return ev


def _still_serving(w: WorkerClient) -> None:
    w.send(P.Hello())
    assert isinstance(w.next_event(30), P.Ready)
    assert w.proc.poll() is None


NESTED = '{"type": "hello", "client": ' + "[" * 100_000 + "]" * 100_000 + "}\n"


@pytest.mark.parametrize("line, code, names", [
    # A lone surrogate is valid JSON but not Unicode: refused by name, never echoed raw.
    ('{"type": "stats", "request_id": "\\udcff"}\n', "bad_field", "request_id"),
    ('{"type": "generate", "request_id": "\\udcff", "prompt": "hi"}\n', "bad_field", "request_id"),
    ('{"type": "generate", "request_id": "g", "messages": [{"role": "user", "content": "a\\ud800b"}]}\n',
     "bad_field", "messages[0].content"),
    ('{"type": "generate", "request_id": "g", "sampling": {"stop": ["\\udfff"]}}\n', "bad_field", "sampling.stop"),
    ('{"type": "generate", "request_id": "g", "sampling": {"\\udcff": 1}}\n', "bad_field", "sampling"),
    ('{"type": "hello", "client": "\\udcff"}\n', "bad_field", "client"),
    # Numbers beyond what the engine can take.
    ('{"type": "generate", "request_id": "g", "prompt": "hi", "sampling": {"seed": %d}}\n' % 2**70,
     "bad_field", "sampling.seed"),
    ('{"type": "load", "request_id": "l", "model": "x", "options": {"offload": {"cpu_threads": 100000}}}\n',
     "bad_field", "offload.cpu_threads"),
    ('{"type": "load", "request_id": "l", "model": "x", "options": {"offload": {"context_length": 1e300}}}\n',
     "bad_field", "offload.context_length"),
    # Nesting deeper than the parser's recursion.
    (NESTED, "bad_json", "nested"),
])
def test_every_hostile_line_gets_a_named_error_and_the_worker_lives(worker, line, code, names):
    worker.send_raw(line)
    ev = _answer(worker)
    assert isinstance(ev, P.Error), ev
    assert ev.code == code and names in ev.message, ev
    _still_serving(worker)


def test_bounds_are_stated_in_the_error(worker):
    worker.send_raw('{"type": "generate", "request_id": "g", "prompt": "hi", "sampling": {"seed": -1}}\n')
    ev = _answer(worker)
    assert ev.code == "bad_field" and "sampling.seed" in ev.message and "minimum 0" in ev.message
    worker.send_raw('{"type": "load", "request_id": "l", "model": "x", "options": {"offload": {"cpu_threads": 100000}}}\n')
    ev = _answer(worker)
    assert ev.code == "bad_field" and "maximum" in ev.message and str(P._options.MAX_CPU_THREADS) in ev.message


def test_event_lines_are_always_valid_utf8(worker):
    """Anything echoed back (an unknown key, a request id) is escaped rather than breaking the channel."""
    worker.send_raw('{"type": "generate", "request_id": "g", "sampling": {"\\udcff": 1}}\n')
    ev = _answer(worker)
    assert ev.code == "bad_field"
    _still_serving(worker)
