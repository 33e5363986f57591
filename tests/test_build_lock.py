"""A kernel build stopped midway leaves torch's baton (`lock`) behind; no later start may wait on it for
ever (runtime/build_lock.py), and no live build's baton may be taken away."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

from runtime.build_lock import BATON, LOCK, one_build

ROOT = Path(__file__).resolve().parent.parent


def _holder(folder: Path, then: str) -> subprocess.Popen:
    """A process that takes the folder's build lock, makes torch's baton as a build would, says 'held', then
    runs `then` (Python)."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from runtime.build_lock import one_build
        folder = Path({str(folder)!r})
        with one_build(folder):
            (folder / {BATON!r}).touch()
            print("held", flush=True)
            {then}
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_baton_left_by_a_stopped_build_is_removed(tmp_path):
    folder = tmp_path / "ext"
    folder.mkdir()
    (folder / BATON).touch()
    with one_build(folder) as stale:
        assert stale and not (folder / BATON).exists()
    with one_build(folder) as stale:              # nothing left behind the second time
        assert not stale
    assert (folder / LOCK).exists() and not (folder / BATON).exists()


def test_a_build_killed_while_it_held_the_lock_leaves_no_wait(tmp_path):
    folder = tmp_path / "ext"
    proc = _holder(folder, "time.sleep(600)")
    proc.send_signal(signal.SIGKILL if os.name != "nt" else signal.SIGTERM)
    proc.wait(30)
    assert (folder / BATON).exists()              # torch's baton outlived its build
    with one_build(folder) as stale:              # the system released the dead process's lock
        assert stale and not (folder / BATON).exists()


def test_a_live_build_is_waited_for_and_its_baton_left_alone(tmp_path):
    folder = tmp_path / "ext"
    proc = _holder(folder, f"time.sleep(1.0); (folder / {BATON!r}).unlink()")   # a build that ends well
    t0 = time.monotonic()
    with one_build(folder) as stale:
        waited = time.monotonic() - t0
        assert not stale, "took the lock, and the baton, while the build still held them"
    assert waited > 0.5, waited                   # the build's second: waited for, not found gone
    assert proc.wait(30) == 0


def test_the_cpu_kernel_builds_in_its_own_folder_under_the_lock(tmp_path, monkeypatch):
    """The CPU expert kernel: one folder per Python and torch build under torch's extension root, and a
    dead build's baton there no longer makes the load wait."""
    import torch
    import torch.utils.cpp_extension as cpp_extension
    from runtime.cpu import experts as ce
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    monkeypatch.setattr(ce, "_EXT", None)
    monkeypatch.setattr(ce, "_EXT_ERROR", None)
    calls = []

    module = SimpleNamespace(set_isa=lambda name: True)

    def load(name, sources, build_directory, **kw):
        assert not (Path(build_directory) / BATON).exists(), "load ran with the dead build's baton in place"
        calls.append((name, build_directory))
        return module
    monkeypatch.setattr(cpp_extension, "load", load)
    folder = ce.kernel_folder(ce.KERNEL_NAME)
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    assert folder.parent == tmp_path / f"moedesk-{py}-torch{torch.__version__}"
    assert folder.name.startswith(ce.KERNEL_NAME + "-")
    here = ce.CSRC
    monkeypatch.setattr(ce, "CSRC", tmp_path / "another-checkout" / "csrc")
    assert ce.kernel_folder(ce.KERNEL_NAME) != folder           # another checkout: its own build
    monkeypatch.setattr(ce, "CSRC", here)
    folder.mkdir(parents=True)
    (folder / BATON).touch()
    assert ce.load_kernel() is module
    assert calls and calls[0][1] == str(ce.kernel_folder(calls[0][0])) and not (folder / BATON).exists()


def test_a_file_system_that_cannot_lock_builds_unguarded(tmp_path, monkeypatch):
    from runtime import build_lock

    class Refused:
        def __init__(self, path):
            pass

        def acquire(self):
            raise NotImplementedError("FileSystem does not appear to support flock")
    monkeypatch.setattr(build_lock, "FileLock", Refused)
    (tmp_path / BATON).touch()
    with one_build(tmp_path) as stale:
        assert not stale and (tmp_path / BATON).exists()   # unknown whose: left to torch, as before
