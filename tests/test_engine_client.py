"""EngineClient: line framing, death in words, supervision of scripted processes, and the real worker.

The scripted processes below are not engines: each is a few lines of Python that speak just enough
protocol (or die in a chosen way) to exercise the client's process handling deterministically.
The tests at the end run the real worker (`runtime.worker`) with the demo model.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
import textwrap

import psutil
import pytest
from PySide6.QtCore import QEventLoop, QTimer

from app import engine_client as ec
from app.engine_client import EngineClient, LineBuffer, State, describe_exit
from runtime import protocol
from runtime.options import LoadOptions, SamplingOptions
from runtime.protocol import ChatMessage


# ---- pure parts -------------------------------------------------------------------------------

def test_line_buffer_keeps_partial_lines():
    buf = LineBuffer()
    assert buf.feed(b'{"a":') == []
    assert buf.feed(b'1}\n{"b"') == [b'{"a":1}']
    assert buf.feed(b':2}\n\n{"c":3}\n') == [b'{"b":2}', b"", b'{"c":3}']
    assert buf.feed(b"tail") == [] and buf.flush() == [b"tail"] and buf.flush() == []


def test_line_buffer_any_split_point():
    stream = b'{"x":"\xc3\xa9t\xc3\xa9"}\n{"y":2}\n'
    for cut in range(len(stream) + 1):
        buf = LineBuffer()
        assert buf.feed(stream[:cut]) + buf.feed(stream[cut:]) == [b'{"x":"\xc3\xa9t\xc3\xa9"}', b'{"y":2}']


def test_describe_exit_in_words():
    assert describe_exit(9, True) == "The engine was killed (signal 9, SIGKILL)."     # nothing guessed
    assert "out-of-memory killer stopped the engine (signal 9" in describe_exit(9, True, oom_killed=True)
    assert "out-of-memory killer did not act" in describe_exit(9, True, oom_killed=False)
    assert "segmentation fault (signal 11" in describe_exit(11, True)
    assert "aborted (signal 6" in describe_exit(6, True)
    assert "exit code 3" in describe_exit(3, False)
    assert "unexpectedly (exit code 0)" in describe_exit(0, False)
    assert "signal 99" in describe_exit(99, True)


def test_worker_command_default():
    cmd = ec.worker_command()
    assert cmd[0] == sys.executable or os.path.exists(cmd[0])
    assert "runtime.worker" in " ".join(cmd) or "moedesk-worker" in " ".join(cmd)
    root = os.path.dirname(os.path.dirname(os.path.abspath(ec.__file__)))
    assert ec.worker_environment()["PYTHONPATH"].split(os.pathsep)[0] == root


# ---- scripted processes -----------------------------------------------------------------------

READY = protocol.encode(protocol.Ready(protocol_version=1, worker_version="t", pid=0, engine="cpu",
                                       engine_note="scripted", device="cpu"))


def scripted(body: str) -> list[str]:
    """A process that answers hello with ready, then runs `body` (os, sys, time, signal imported)."""
    prelude = f"import os, sys, time, signal\nsys.stdin.readline()\nsys.stdout.write({READY!r})\nsys.stdout.flush()\n"
    return [sys.executable, "-c", prelude + textwrap.dedent(body)]


@pytest.fixture
def clients(qtbot):
    made = []

    def factory(command=None):
        c = EngineClient(command)
        made.append(c)
        return c
    yield factory
    for c in made:
        c.shutdown(wait=True)


def test_partial_lines_stray_stderr_and_segfault(qtbot, clients):
    token = protocol.encode(protocol.TokenDelta(request_id="r", text="héllo"))
    cut = len(token) // 2
    c = clients(scripted(f"""
        for i in range(60):
            print("log line", i, file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.write({token[:cut]!r}); sys.stdout.flush(); time.sleep(0.3)
        sys.stdout.write({token[cut:]!r}); sys.stdout.flush()
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGSEGV)
    """))
    tokens = []
    c.token.connect(tokens.append)
    with qtbot.waitSignal(c.ready, timeout=10000):
        c.start()
    assert c.state == State.IDLE and c.ready_event.engine_note == "scripted"
    with qtbot.waitSignal(c.worker_died, timeout=10000) as died:
        pass
    code, words, lines = died.args
    assert code == signal.SIGSEGV and "segmentation fault" in words
    assert len(lines) == ec.STDERR_LINES and lines[-1] == "log line 59" and lines[0] == "log line 10"
    assert [t.text for t in tokens] == ["héllo"]
    assert c.state == State.DEAD and c.pid() is None


@pytest.mark.parametrize("kills, words", [((4, 5), "out-of-memory killer stopped the engine"),
                                          ((4, 4), "out-of-memory killer did not act"),
                                          ((None, None), "The engine was killed (signal 9, SIGKILL).")])
def test_a_killed_engine_is_blamed_on_memory_only_when_the_oom_killer_acted(qtbot, clients, monkeypatch,
                                                                              kills, words):
    readings = iter(kills)
    monkeypatch.setattr(ec, "oom_kills", lambda: next(readings))
    c = clients(scripted("os.kill(os.getpid(), signal.SIGKILL)"))
    with qtbot.waitSignal(c.worker_died, timeout=10000) as died:
        c.start()
    assert died.args[0] == signal.SIGKILL and words in died.args[1]
    assert ("memory" in died.args[1]) == (kills == (4, 5)) or "did not act" in died.args[1]


def test_exit_code_and_unreadable_line(qtbot, clients):
    c = clients(scripted("""
        print("this is not protocol", flush=True)
        time.sleep(0.2)
        sys.exit(3)
    """))
    errors = []
    c.error.connect(lambda rid, exc: errors.append(exc))
    with qtbot.waitSignal(c.worker_died, timeout=10000) as died:
        c.start()
    assert died.args[0] == 3 and "exit code 3" in died.args[1]
    assert len(errors) == 1 and errors[0].code == "bad_json" and "cannot read" in errors[0].message
    assert any("unreadable protocol line" in line for line in died.args[2])


def test_error_event_becomes_exception(qtbot, clients):
    err = protocol.encode(protocol.Error(code="no_model", message="No model is loaded.", request_id="g1"))
    c = clients(scripted(f"""
        line = sys.stdin.readline()
        assert '"generate"' in line, line
        sys.stdout.write({err!r}); sys.stdout.flush()
        sys.stdin.readline()
    """))
    with qtbot.waitSignal(c.ready, timeout=10000):
        c.start()
    with qtbot.waitSignal(c.error, timeout=10000) as sig:
        c.generate("g1", [ChatMessage("user", "hi")])
    rid, exc = sig.args
    assert rid == "g1" and isinstance(exc, protocol.GenerationRefused) and str(exc) == "No model is loaded."
    assert c.state == State.IDLE and c.generating is None
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        c.generate("g2", [("user", "hi")])


def test_failed_to_start_is_a_death_in_words(qtbot, clients):
    c = clients(["/nonexistent/moedesk-worker"])
    with qtbot.waitSignal(c.worker_died, timeout=10000) as died:
        c.start()
    assert died.args[0] == -1 and "could not be started" in died.args[1]
    with qtbot.waitSignal(c.error, timeout=5000) as sig:
        rid = c.generate("g1", [ChatMessage("user", "hi")])
    assert sig.args[0] == rid == "g1" and sig.args[1].code == ec.NOT_RUNNING
    assert "not running" in str(sig.args[1]) and c.generating is None
    c.load("demo")
    assert c.last_load[0] == "demo"       # a restart will load it


def test_shutdown_escalates_to_kill_for_a_stubborn_process(qtbot, clients, monkeypatch):
    monkeypatch.setattr(ec, "SHUTDOWN_GRACE_MS", 300)
    monkeypatch.setattr(ec, "TERMINATE_GRACE_MS", 300)
    c = clients(scripted("""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    """))
    with qtbot.waitSignal(c.ready, timeout=10000):
        c.start()
    pid = c.pid()
    died = []
    c.worker_died.connect(lambda *a: died.append(a))
    with qtbot.waitSignal(c.state_changed, timeout=5000, check_params_cb=lambda s: s == State.STOPPED):
        c.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert died == []                     # asked to stop: not a death


# ---- the real worker and the demo model -------------------------------------------------------

MESSAGES = [ChatMessage("user", "What is the capital of France?")]
GREEDY = SamplingOptions(temperature=0.0, max_tokens=24)


def wait(signal, timeout_s: float, died=None):
    """Run the event loop until `signal` fires (its arguments) or the time runs out (AssertionError)."""
    loop, got = QEventLoop(), []

    def on(*args):
        got.append(args)
        loop.quit()
    signal.connect(on)
    if died is not None:
        died.connect(on)
    QTimer.singleShot(int(timeout_s * 1000), loop.quit)
    loop.exec()
    signal.disconnect(on)
    if died is not None:
        died.disconnect(on)
    assert got, f"no signal within {timeout_s} s"
    return got[0]


@pytest.fixture(scope="module")
def live(qapp, demo_model, tmp_path_factory):
    """One real worker with the demo model loaded, shared by the tests below (loading takes a while)."""
    if importlib.util.find_spec("runtime.worker") is None:
        pytest.skip("runtime.worker is not on this branch yet")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOEDESK_HOME", str(tmp_path_factory.mktemp("home")))
        c = EngineClient()
        c.progress_seen = []
        c.progress.connect(c.progress_seen.append)
        c.start()
        wait(c.ready, 60, c.worker_died)
        c.load(str(demo_model), LoadOptions())
        (c.first_loaded,) = wait(c.loaded, 600, c.worker_died)
    yield c
    c.shutdown(wait=True)


@pytest.mark.slow
def test_real_worker_hello_load_generate(qtbot, live):
    assert live.ready_event.protocol_version == protocol.PROTOCOL_VERSION
    assert live.ready_event.pid == live.pid()
    assert live.progress_seen and all(p.request_id == live.first_loaded.request_id for p in live.progress_seen)
    loaded = live.first_loaded
    assert loaded.architecture == "LlamaForCausalLM" and loaded.vocab_size == 49152
    assert loaded.applied, "the worker says which options it applied"
    assert live.state == State.IDLE and live.loaded_event is loaded
    tokens = []
    live.token.connect(lambda t: tokens.append(t.text))
    with qtbot.waitSignal(live.finished, timeout=120000) as fin:
        live.generate("g1", MESSAGES, GREEDY)
        assert live.state == State.GENERATING
    assert fin.args[0].request_id == "g1" and len(tokens) > 1
    assert "Paris" in "".join(tokens)
    assert fin.args[0].stats.generated_tokens >= len(tokens) and live.state == State.IDLE
    with qtbot.waitSignal(live.telemetry, timeout=30000) as tel:
        live.stats("s1")
    assert isinstance(tel.args[0], protocol.Telemetry) and tel.args[0].rss_bytes > 0


@pytest.mark.slow
def test_real_worker_cancel(qtbot, live):
    tokens = []
    live.token.connect(lambda t: (tokens.append(t.text), len(tokens) == 3 and live.cancel()))
    with qtbot.waitSignal(live.finished, timeout=120000) as fin:
        live.generate("long", [ChatMessage("user", "Write a long story about a dragon.")],
                      SamplingOptions(temperature=0.0, max_tokens=400))
    assert fin.args[0].reason == "cancelled"
    assert fin.args[0].stats.generated_tokens < 400
    assert live.state == State.IDLE and live.generating is None


@pytest.mark.slow
def test_real_worker_killed_then_restart_reloads(qtbot, live, demo_model):
    pid = live.pid()
    with qtbot.waitSignal(live.worker_died, timeout=30000) as died:
        os.kill(pid, signal.SIGKILL)
    code, words, lines = died.args
    assert code == signal.SIGKILL and "memory" not in words.replace("out-of-memory killer did not act", "")
    assert any("moedesk-worker" in line for line in lines), lines    # its stderr came with the death
    assert live.state == State.DEAD and live.pid() is None
    with qtbot.waitSignal(live.loaded, timeout=600000) as sig:
        live.restart()
    assert live.pid() != pid
    assert os.path.realpath(sig.args[0].path) == os.path.realpath(demo_model)
    tokens = []
    live.token.connect(lambda t: tokens.append(t.text))
    with qtbot.waitSignal(live.finished, timeout=120000):
        live.generate("after", MESSAGES, GREEDY)
    assert "Paris" in "".join(tokens)


@pytest.mark.slow
def test_real_worker_shutdown_leaves_no_process(qtbot, live):
    proc = psutil.Process(live.pid())
    family = [proc] + proc.children(recursive=True)
    with qtbot.waitSignal(live.state_changed, timeout=10000, check_params_cb=lambda s: s == State.STOPPED):
        live.shutdown()
    gone, alive = psutil.wait_procs(family, timeout=5)
    assert alive == []


def test_app_quit_stops_the_worker(qtbot, qapp, clients):
    c = clients(scripted("""
        for line in sys.stdin:
            if '"shutdown"' in line:
                print("bye", file=sys.stderr)
                sys.exit(0)
    """))
    with qtbot.waitSignal(c.ready, timeout=10000):
        c.start()
    proc = psutil.Process(c.pid())
    died = []
    c.worker_died.connect(lambda *a: died.append(a))
    qapp.aboutToQuit.emit()                 # what QApplication does on quit
    assert c.state == State.STOPPED and c.pid() is None
    assert not proc.is_running() and died == []
    assert list(c.stderr_lines) == ["bye"]


def test_restart_of_a_running_worker_replaces_it_and_reloads(qtbot, clients):
    c = clients(scripted("""
        for line in sys.stdin:
            print("got", line.split('"type":"')[1].split('"')[0], file=sys.stderr, flush=True)
    """))
    with qtbot.waitSignal(c.ready, timeout=10000):
        c.start()
    c.load("some-model")
    first = psutil.Process(c.pid())
    died = []
    c.worker_died.connect(lambda *a: died.append(a))
    with qtbot.waitSignal(c.ready, timeout=10000):
        c.restart()
        c.restart()                        # a double click: one restart, one reload
    assert c.pid() != first.pid and not first.is_running()
    assert died == [] and c.last_load[0] == "some-model"
    qtbot.waitUntil(lambda: "got load" in c.stderr_lines, timeout=5000)
    qtbot.wait(300)
    assert list(c.stderr_lines) == ["got load"]


def test_a_second_generate_waits_for_the_first_and_a_waiting_one_cancels_at_once(qtbot, clients):
    """The chat and the local server share one worker: generates queue in the client, never 'busy'."""
    c = clients([sys.executable, "-m", "tests.fake_worker"])
    with qtbot.waitSignal(c.loaded, timeout=10000):
        c.start()
        c.load("m")
    done, errors = [], []
    c.finished.connect(lambda ev: done.append((ev.request_id, ev.reason)))
    c.error.connect(lambda rid, e: errors.append((rid, e.code)))
    say = [protocol.ChatMessage("user", "hi")]
    c.generate("a", say, SamplingOptions(max_tokens=5))
    c.generate("b", say, SamplingOptions(max_tokens=5))
    c.generate("c", say, SamplingOptions(max_tokens=5))
    c.cancel("c")
    qtbot.waitUntil(lambda: len(done) == 3, timeout=10000)
    assert done == [("c", "cancelled"), ("a", "length"), ("b", "length")] and errors == []
