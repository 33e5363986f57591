"""The GPU tests' synthetic models are written once per run (tests/gpu/conftest.py's cached_model): under
MOEDESK_GPU_MODELS for every pytest process of bench/gpu_suite.sh, and never taken whole when half written."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).parent / "gpu" / "conftest.py"


@pytest.fixture
def gpu_conftest():
    spec = importlib.util.spec_from_file_location("gpu_conftest_under_test", CONFTEST)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _make(calls):
    def make(out: Path):
        calls.append(out)
        (out / "config.json").write_text("{}")
    return make


def test_written_once_and_found_by_name(tmp_path, monkeypatch, gpu_conftest, tmp_path_factory):
    monkeypatch.setenv("MOEDESK_GPU_MODELS", str(tmp_path / "shared"))
    calls = []
    a = gpu_conftest.cached_model("m-2l", _make(calls), tmp_path_factory)
    b = gpu_conftest.cached_model("m-2l", _make(calls), tmp_path_factory)
    assert a == b == tmp_path / "shared" / "m-2l" and (a / "config.json").exists()
    assert len(calls) == 1 and calls[0] != a                      # written elsewhere, then renamed
    assert [p.name for p in (tmp_path / "shared").iterdir()] == ["m-2l"]


def test_without_the_variable_the_session_folder_holds_them(monkeypatch, gpu_conftest, tmp_path_factory):
    monkeypatch.delenv("MOEDESK_GPU_MODELS", raising=False)
    out = gpu_conftest.cached_model("m", _make([]), tmp_path_factory)
    assert out.parent == tmp_path_factory.getbasetemp() / "models"


def test_a_killed_writer_leaves_no_model_and_its_leftovers_go(tmp_path, monkeypatch, gpu_conftest, tmp_path_factory):
    monkeypatch.setenv("MOEDESK_GPU_MODELS", str(tmp_path))

    def dies(out: Path):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt                                   # stands for the kill mid-write

    with pytest.raises(KeyboardInterrupt):
        gpu_conftest.cached_model("m", dies, tmp_path_factory)
    assert not (tmp_path / "m").exists()

    def waits(seconds):
        raise AssertionError("waited for a leftover of its own process")
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(gpu_conftest.time, "sleep", waits)              # its own leftover is not waited for
        gpu_conftest.cached_model("m", dies, tmp_path_factory)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".m.partial-{dead.stdout.strip()}"      # a writer process that is gone
    stale.mkdir()
    live = tmp_path / f".m.partial-{os.getppid()}"              # one still running: left alone
    live.mkdir()
    monkeypatch.setattr(gpu_conftest, "WAIT_S", 1.0)              # ... and waited for, this long
    calls = []
    out = gpu_conftest.cached_model("m", _make(calls), tmp_path_factory)
    assert out == tmp_path / "m" and len(calls) == 1
    assert not stale.exists() and live.exists()


def test_a_model_another_live_process_writes_is_waited_for(tmp_path, monkeypatch, gpu_conftest, tmp_path_factory):
    """Two lanes of bench/gpu_suite.sh asking for one model: the second waits for the first's, writes none."""
    import threading
    monkeypatch.setenv("MOEDESK_GPU_MODELS", str(tmp_path))
    live = tmp_path / f".m.partial-{os.getppid()}"              # the other lane's folder, half written
    live.mkdir()

    def finish():
        (live / "config.json").write_text("{}")
        live.rename(tmp_path / "m")
    timer = threading.Timer(1.0, finish)
    timer.start()
    calls = []
    try:
        out = gpu_conftest.cached_model("m", _make(calls), tmp_path_factory)
    finally:
        timer.join()
    assert out == tmp_path / "m" and calls == [] and (out / "config.json").exists()
