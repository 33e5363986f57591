"""Hostile chat templates: bounded in time, output and arithmetic, cancellable, and named by their file.

Templates compile and render in a helper process; the limit is 1 s here (MOEDESK_TEMPLATE_TIMEOUT_S).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from runtime import tuning
from runtime.errors import Cancelled, ContextOverflow, EngineError, InvalidModel
from runtime.tokenizer import Tokenizer
from runtime.tuning import Tuning

HI = [{"role": "user", "content": "hi"}]
FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
GIGABYTES = "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxxxxxxxx{% endfor %}{% endfor %}"


@pytest.fixture(autouse=True)
def _one_second():
    with tuning.use(Tuning(template_timeout_s=1.0)):
        yield


def folder_with(tmp_path: Path, demo_model: Path, template: str) -> Path:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_bytes((demo_model / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "chat_template.jinja").write_text(template)
    return folder


def render_error(tmp_path, demo_model, template: str) -> tuple[EngineError, float]:
    tok = Tokenizer.from_folder(folder_with(tmp_path, demo_model, template))
    t0 = time.perf_counter()
    with pytest.raises(EngineError) as e:
        tok.render_chat(HI)
    return e.value, time.perf_counter() - t0


def test_a_template_that_loops_for_ever_is_stopped_and_the_next_one_renders(tmp_path, demo_model):
    err, took = render_error(tmp_path, demo_model, FOREVER)
    assert isinstance(err, InvalidModel) and "chat_template.jinja" in err.message and "more than 1 s" in err.message
    assert took < 5
    ok = Tokenizer.from_folder(folder_with(tmp_path, demo_model, "{{ messages[0].content }}!"))
    assert ok.render_chat(HI) == "hi!"


def test_output_is_capped_while_it_is_written(tmp_path, demo_model):
    err, took = render_error(tmp_path, demo_model, GIGABYTES)
    assert isinstance(err, InvalidModel) and "chat_template.jinja" in err.message and "too long" in err.message
    assert took < 5


@pytest.mark.parametrize("expr", ["2 ** 10000000", "'x' * 10**10", "[1] * 10**9", "(10**9000) * (10**9000) * (10**9000) * (10**9000)"])
def test_huge_arithmetic_is_refused_and_never_folded_at_load(tmp_path, demo_model, expr):
    t0 = time.perf_counter()
    tok = Tokenizer.from_folder(folder_with(tmp_path, demo_model, "{{ " + expr + " }}"))    # compiles: no folding
    assert time.perf_counter() - t0 < 5
    err, took = render_error(tmp_path, demo_model, "{{ " + expr + " }}")
    assert isinstance(err, InvalidModel) and "chat_template.jinja" in err.message and "bound" in err.message
    assert took < 5
    del tok


def test_a_filter_folded_at_compile_time_cannot_hang_the_load(tmp_path, demo_model):
    t0 = time.perf_counter()
    with pytest.raises(EngineError) as e:
        Tokenizer.from_folder(folder_with(tmp_path, demo_model, "{{ 'x'|center(3000000000) }}")).render_chat(HI)
    assert time.perf_counter() - t0 < 8 and "chat_template.jinja" in e.value.message


def test_rendering_stops_on_cancel(tmp_path, demo_model):
    tuning.install(Tuning(template_timeout_s=60.0))          # the fixture puts the one before back
    tok = Tokenizer.from_folder(folder_with(tmp_path, demo_model, FOREVER))
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    t0 = time.perf_counter()
    with pytest.raises(Cancelled):
        tok.render_chat(HI, should_stop=cancel.is_set)
    assert time.perf_counter() - t0 < 5


def test_a_prompt_too_long_never_reaches_the_tokenizer(tmp_path, demo_model):
    from runtime.options import MAX_PROMPT_CHARS
    tok = Tokenizer.from_folder(folder_with(tmp_path, demo_model, "{{ messages[0].content }}"))
    with pytest.raises(EngineError) as e:
        tok.encode_prompt("x" * (MAX_PROMPT_CHARS + 1))
    assert isinstance(e.value, ContextOverflow)
    with pytest.raises(EngineError) as e:
        tok.render_chat([{"role": "user", "content": "x" * (MAX_PROMPT_CHARS + 1)}])
    assert isinstance(e.value, ContextOverflow) and "chat_template.jinja" in e.value.message


def test_a_template_source_too_large_is_refused(tmp_path, demo_model):
    with pytest.raises(EngineError, match="chat_template.jinja.*characters"):
        Tokenizer.from_folder(folder_with(tmp_path, demo_model, "x" * (2 << 20)))


# ----------------------------------------------------------------------------------------------
# The helper never outlives its parent, and is bounded in CPU time on its own

PARENT = f"""
import sys, threading, time
from runtime import chat_template
threading.Thread(target=chat_template.run, args=({{"template": {FOREVER!r}, "variables": {{}}}}, "t"),
                 daemon=True).start()                  # not the main thread: no parent-death signal on Linux
while chat_template._helper is None:
    time.sleep(0.02)
print(chat_template._helper.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_parent_takes_its_helper_with_it_through_the_pipe_alone():
    """Started from another thread, the helper has no parent-death signal: its stdin closing must end it."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from runtime.client import worker_env
    env = worker_env({**os.environ, "MOEDESK_TEMPLATE_TIMEOUT_S": "600"})
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, env=env)
    helper = None
    try:
        helper = psutil.Process(int(parent.stdout.readline()))
        assert "--die-with-parent" not in helper.cmdline()
        deadline = time.monotonic() + 30
        while helper.cpu_times().user < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)                                     # rendering
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while helper.is_running() and helper.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not helper.is_running() or helper.status() == psutil.STATUS_ZOMBIE, "the helper outlived its parent"
    finally:
        if helper is not None and helper.is_running():
            helper.kill()
        parent.kill()
        parent.wait()


def test_a_helper_past_its_cpu_time_stops_on_its_own():
    """A render nobody waits for (its parent stuck, the wall clock not watched) ends at its CPU budget."""
    import subprocess

    pytest.importorskip("resource")                               # RLIMIT_CPU: not on every OS
    import signal

    from runtime.chat_template import HELPER_FLAG
    from runtime.client import worker_command, worker_env
    helper = subprocess.Popen(worker_command() + [HELPER_FLAG], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=worker_env())
    try:
        assert json.loads(helper.stdout.readline()) == {"ready": True}
        helper.stdin.write(json.dumps({"template": FOREVER, "variables": {}, "cpu_s": 1}).encode() + b"\n")
        helper.stdin.flush()                                     # stdin stays open: only the CPU bound can end it
        t0 = time.perf_counter()
        assert helper.wait(timeout=30) == -signal.SIGXCPU
        assert time.perf_counter() - t0 < 10
    finally:
        helper.kill()
        helper.wait()
