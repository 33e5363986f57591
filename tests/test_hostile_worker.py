"""The real worker against hostile lines: every line gets a proper event, and the worker stays alive."""
from __future__ import annotations

import os
import shutil
import time

import pytest
from test_hostile_template import FOREVER
from test_modelfolder import LLAMA, make_folder

from runtime import protocol as P
from runtime.client import WorkerClient
from runtime.options import LoadOptions, OffloadOptions, SamplingOptions

TEMPLATE_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "MOEDESK_MODELS"}
    env["MOEDESK_HOME"] = str(tmp_path_factory.mktemp("home"))
    env["MOEDESK_TEMPLATE_TIMEOUT_S"] = str(TEMPLATE_TIMEOUT_S)
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


# ----------------------------------------------------------------------------------------------
# Hostile chat templates: the worker stops them, answers the next command, and a normal model still chats

CPU = LoadOptions(offload=OffloadOptions(backend="cpu"))
ASK = (P.ChatMessage("user", "Hi"),)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny synthetic model that chats (its own ChatML template), and a copy whose template loops for ever."""
    from runtime.exl2.synth import write_synthetic
    root = tmp_path_factory.mktemp("tiny")
    write_synthetic("tiny-dense", 4.0, root / "normal")
    shutil.copytree(root / "normal", root / "looping")
    (root / "looping" / "chat_template.jinja").write_text(FOREVER)
    return root / "normal", root / "looping"


def _until(w: WorkerClient, rid: str, timeout: float = 60):
    while True:
        ev = w.next_event(timeout)
        if isinstance(ev, (P.Finished, P.Error)) and ev.request_id == rid:
            return ev


def test_a_template_that_loops_for_ever_is_stopped_and_the_worker_chats_on(worker, tiny_models):
    normal, looping = tiny_models
    worker.load(str(looping), CPU)
    t0 = time.perf_counter()
    worker.send(P.Generate(request_id="loop", messages=ASK))
    ev = _until(worker, "loop")
    assert isinstance(ev, P.Error) and ev.code == "model_invalid" and "chat_template.jinja" in ev.message, ev
    assert time.perf_counter() - t0 < TEMPLATE_TIMEOUT_S + 10
    worker.send(P.Stats(request_id="s-after"))
    assert worker.next_event(30).request_id == "s-after"
    worker.load(str(normal), CPU)
    worker.send(P.Generate(request_id="chat", messages=ASK, sampling=SamplingOptions(temperature=0.0, max_tokens=3)))
    ev = _until(worker, "chat")
    assert isinstance(ev, P.Finished) and ev.stats.generated_tokens >= 1, ev


def test_cancel_stops_a_template_still_rendering(worker, tiny_models):
    worker.load(str(tiny_models[1]), CPU)
    worker.send(P.Generate(request_id="slow", messages=ASK))
    time.sleep(0.2)
    worker.send(P.Cancel(request_id="slow"))
    ev = _until(worker, "slow")
    assert isinstance(ev, P.Finished) and ev.reason == "cancelled", ev


def test_a_model_of_odd_widths_chats_instead_of_crashing_the_worker(worker, tmp_path, demo_model):
    """Widths not a multiple of 16 (intermediate 24 here) once sent torch's int8 kernel past its rows."""
    folder = make_folder(tmp_path / "odd", {**LLAMA, "vocab_size": 49152})
    (folder / "tokenizer.json").write_bytes((demo_model / "tokenizer.json").read_bytes())
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}:")
    worker.load(str(folder), CPU)
    worker.send(P.Generate(request_id="odd", messages=ASK, sampling=SamplingOptions(temperature=0.0, max_tokens=3)))
    ev = _until(worker, "odd")
    assert isinstance(ev, P.Finished), ev


def test_lines_are_read_only_up_to_the_bound_and_a_longer_one_is_skipped_whole():
    import io
    from runtime.worker import bounded_lines
    text = b'{"a": 1}\n' + b"x" * 100 + b"\n" + b'{"b": 2}\n' + b"y" * 10 + b"\n" + b"z" * 50
    assert list(bounded_lines(io.BytesIO(text), 10)) == [b'{"a": 1}\n', None, b'{"b": 2}\n', None, None]
    assert list(bounded_lines(io.StringIO("ab\n" + "c" * 30 + "\nd\n"), 5)) == ["ab\n", None, "d\n"]


def test_a_command_line_beyond_the_bound_is_refused_and_the_worker_reads_on(worker):
    line = '{"type": "hello", "client": "' + "a" * P.MAX_LINE_BYTES + '"}\n'
    worker.send_raw(line)
    ev = _answer(worker, timeout=120)
    assert isinstance(ev, P.Error) and ev.code == "bad_json" and str(P.MAX_LINE_BYTES) in ev.message, ev
    _still_serving(worker)


def _gone(proc, timeout: float) -> bool:
    """Whether `proc` (a psutil.Process) ended within `timeout` (a zombie nobody reaped yet counts as ended)."""
    import psutil
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_worker_killed_while_a_template_renders_takes_its_helper_with_it(tmp_path, tiny_models, sig):
    """The helper once spun on at 100% CPU under PID 1 for minutes after its worker was killed."""
    import signal

    import psutil
    env = {k: v for k, v in os.environ.items() if k != "MOEDESK_MODELS"}
    env.update(MOEDESK_HOME=str(tmp_path / "home"), MOEDESK_TEMPLATE_TIMEOUT_S="600")
    w = WorkerClient(env=env)
    w.start()
    helper = None
    try:
        w.load(str(tiny_models[1]), CPU)                        # the template compiles in the helper at load
        helper = next(p for p in psutil.Process(w.proc.pid).children() if "--chat-templates" in p.cmdline())
        w.send(P.Generate(request_id="loop", messages=ASK))
        busy = helper.cpu_times().user
        deadline = time.monotonic() + 30
        while helper.cpu_times().user < busy + 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)                                     # the template is rendering
        assert helper.cpu_times().user >= busy + 0.3
        os.kill(w.proc.pid, getattr(signal, sig))
        assert _gone(helper, 5), f"the chat template helper outlived its worker ({sig})"
    finally:
        if helper is not None and helper.is_running():
            helper.kill()
        w.proc.kill()
        w.proc.wait()
