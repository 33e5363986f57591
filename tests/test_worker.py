"""The real worker process: handshake, bad commands, the channel's immunity to stray prints, exit paths."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from runtime import protocol as P
from runtime.client import WorkerClient, WorkerDied, worker_command, worker_env
from runtime.loader import NO_CUDA_NOTE, cuda_device


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    # Module scope starts before the per-test home redirection: give the worker an empty home itself.
    env = {k: v for k, v in os.environ.items() if k != "MOEDESK_MODELS"}
    env["MOEDESK_HOME"] = str(tmp_path_factory.mktemp("home"))
    with WorkerClient(env=env) as w:
        yield w


def _error(w: WorkerClient, timeout: float = 30) -> P.Error:
    ev = w.next_event(timeout)
    while isinstance(ev, P.Telemetry):
        ev = w.next_event(timeout)
    assert isinstance(ev, P.Error), ev
    return ev


def test_ready_says_which_engine(worker):
    r = worker.ready
    assert r.protocol_version == P.PROTOCOL_VERSION and r.pid > 0
    if cuda_device() is None:
        assert (r.engine, r.device, r.engine_note) == ("cpu", "cpu", NO_CUDA_NOTE)


def test_the_worker_is_named_in_process_lists(worker):
    import psutil
    proc = psutil.Process(worker.ready.pid)
    assert " ".join(proc.cmdline()).split() == ["moedesk-worker"]
    if sys.platform == "linux":
        assert proc.name() == "moedesk-worker"


@pytest.mark.parametrize("line, code", [
    ("this is not json\n", "bad_json"),
    ("[1, 2, 3]\n", "bad_json"),
    ('{"type": "launch_rockets"}\n', "unknown_command"),
    ('{"type": "generate", "request_id": 7}\n', "bad_field"),
    ('{"type": "generate", "request_id": "g", "sampling": {"max_tokens": "many"}}\n', "bad_field"),
    ('{"type": "generate", "request_id": "g", "sampling": {"temperature": -1}}\n', "bad_field"),
    ('{"type": "load", "request_id": "l"}\n', "bad_field"),
    ('{"type": "load", "request_id": "l", "model": "x", "options": {"offload": {"backend": "tpu"}}}\n', "bad_field"),
    ('{"type": "hello", "v": 99}\n', "version_mismatch"),
    ('{"type": "hello", "protocol_version": 99}\n', "version_mismatch"),
    (b'{"type": "hello", "client": "\xff\xfe"}\n', "bad_json"),     # not UTF-8
])
def test_bad_commands_get_an_error_and_the_worker_keeps_serving(worker, line, code):
    worker.send_raw(line)
    err = _error(worker)
    assert err.code == code and err.message
    worker.send(P.Hello())
    assert isinstance(worker.next_event(30), P.Ready)


def test_bad_field_error_names_the_field_and_request(worker):
    worker.send_raw('{"type": "generate", "request_id": "g1", "sampling": {"top_p": "high"}}\n')
    err = _error(worker)
    assert err.request_id == "g1" and "sampling.top_p" in err.message


def test_generate_before_load(worker):
    worker.send(P.Generate(request_id="g2", prompt="hi"))
    err = _error(worker)
    assert (err.code, err.request_id) == ("no_model", "g2")


def test_load_missing_model(worker, tmp_path):
    with pytest.raises(P.ModelLoadError) as e:
        worker.load(str(tmp_path / "nowhere"))
    assert e.value.code == "model_not_found" and "nowhere" in e.value.message
    with pytest.raises(P.ModelLoadError, match="import-demo"):
        worker.load("demo")           # MOEDESK_HOME points at an empty temp dir here


def test_cuda_backend_where_there_is_none(worker, demo_model):
    if cuda_device() is not None:
        pytest.skip("this machine has CUDA")
    opts = P.LoadOptions(offload=P._options.OffloadOptions(backend="cuda"))
    with pytest.raises(P.ModelLoadError) as e:
        worker.load(str(demo_model), opts)
    assert e.value.code == "cuda_unavailable"


def test_stats_answers_with_telemetry(worker):
    worker.send(P.Stats(request_id="s1"))
    ev = worker.next_event(30)
    assert isinstance(ev, P.Telemetry) and ev.request_id == "s1"
    assert ev.generating is False and ev.rss_bytes > 10_000_000


def test_cancel_of_unknown_generation_is_harmless(worker):
    worker.send(P.Cancel(request_id="nothing-running"))
    worker.send(P.Stats(request_id="s2"))
    assert worker.next_event(30).request_id == "s2"


def test_stray_prints_never_reach_the_channel():
    """Libraries print to stdout (exllamav2 does): those bytes must land in the log, not the channel."""
    code = ("import os, sys, runtime.worker as w\n"
            "orig = w.Worker.hello\n"
            "def hello(self, cmd):\n"
            "    print('stray print from a library', flush=True)\n"
            "    os.write(1, b'raw write to fd 1\\n')\n"
            "    orig(self, cmd)\n"
            "w.Worker.hello = hello\n"
            "sys.exit(w.main())\n")
    w = WorkerClient(command=[sys.executable, "-c", code])
    try:
        w.start()
        w.send(P.Hello())
        assert isinstance(w.next_event(30), P.Ready)
        deadline = time.time() + 10
        while "raw write to fd 1" not in w.stderr_tail() and time.time() < deadline:
            time.sleep(0.05)
        assert "stray print from a library" in w.stderr_tail() and "raw write to fd 1" in w.stderr_tail()
    finally:
        assert w.stop() == 0


def test_shutdown_exits_zero():
    w = WorkerClient()
    w.start()
    w.send(P.Shutdown())
    assert w.proc.wait(30) == 0
    with pytest.raises(WorkerDied):
        w.next_event(5)


def test_stdin_eof_ends_the_worker():
    proc = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=worker_env())
    proc.stdin.write(P.encode(P.Hello()).encode())
    proc.stdin.close()                                   # the parent "died"
    assert proc.wait(30) == 0
    lines = proc.stdout.read().decode().splitlines()
    assert json.loads(lines[0])["type"] == "ready"


def test_count_without_a_model_says_so(worker):
    worker.send(P.CountTokens(request_id="c", messages=(P.ChatMessage("user", "Hi"),)))
    err = _error(worker)
    assert (err.code, err.request_id) == ("no_model", "c")


def test_ready_reports_the_engine_libraries(worker):
    assert worker.ready.libraries["python"] and "tokenizers" in worker.ready.libraries


def test_load_stages_time_every_step_up_to_the_next():
    """Each progress step's wall time runs to the next step; a step's start and end (the same
    message at once) are one stage; the last runs to the load's end."""
    from runtime.worker import load_stages
    marks = [("load", "Starting the load", 0.0), ("load", "Loading weights", 1.0), ("load", "Loading weights", 4.0),
             ("load", "Placing experts", 10.0), ("warmup", "Preparing GPU kernels 1/2", 12.5),
             ("warmup", "Preparing GPU kernels 2/2", 13.0), ("load", "Reading the tokenizer", 20.0)]
    got = load_stages(marks, 20.25)
    assert [(s["message"], s["s"]) for s in got] == [
        ("Starting the load", 1.0), ("Loading weights", 9.0), ("Placing experts", 2.5),
        ("Preparing GPU kernels 1/2", 0.5), ("Preparing GPU kernels 2/2", 7.0), ("Reading the tokenizer", 0.25)]
    assert sum(s["s"] for s in got) == 20.25
