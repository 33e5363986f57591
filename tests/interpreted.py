"""Run a check script in a fresh Python under Triton's interpreter (TRITON_INTERPRET is read at import, so
the kernels' tests on a machine without a GPU run their code in a child process)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(code: str, says: str, timeout: float = 300) -> str:
    """Runs `code` from the repository's root with TRITON_INTERPRET=1; asserts it exits 0 and prints `says`;
    returns its output."""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert says in r.stdout, r.stdout
    return r.stdout


def run_child_pytest(test_file: str, passed: int, timeout: float = 600, stop_first: bool = True) -> None:
    """Runs `test_file`'s tests in a child pytest with TRITON_INTERPRET=1 (its kernel tests are skipped in the
    parent); asserts it exits 0 and that `passed` tests passed, so that none was skipped by mistake."""
    args = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"] + (["-x"] if stop_first else [])
    r = subprocess.run(args, cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert f"{passed} passed" in r.stdout, r.stdout[-2000:]                   # every kernel test ran


_SERVE = r"""
import contextlib, io, json, os, sys, traceback
from bench import check_experts
reply = sys.stdout
for line in sys.stdin:
    args, env = json.loads(line)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    buf, err = io.StringIO(), ""
    try:
        with contextlib.redirect_stdout(buf):
            if isinstance(args, str):                  # a check script, as `python -c`
                exec(compile(args, "<check>", "exec"), {"__name__": "__main__"})
                rc = 0
            else:
                rc = check_experts.main(args)
    except SystemExit as e:
        rc, err = (e.code if isinstance(e.code, int) else 1), traceback.format_exc()
    except BaseException:
        rc, err = 1, traceback.format_exc()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    reply.write("CHECK-REPLY " + json.dumps([rc, buf.getvalue(), err]) + "\n")
    reply.flush()
"""


class ExpertChecks:
    """`python -m bench.check_experts ARGS` (or a check script) run after run in one child under TRITON_INTERPRET=1,
    each with its own
    environment variables on top of the parent's: the answers of separate runs (exit status, output, error) without
    a Python, torch and Triton start each (about 2 s of CPU). Nothing the checks keep between runs changes a result:
    the interpreter times no launch shape, and the checks build their layers from their seeds."""

    def __init__(self, timeout: float = 300):
        self.timeout, self.proc = timeout, None

    def _start(self) -> None:
        import queue
        import threading
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE], cwd=ROOT,
                                     env=dict(os.environ, TRITON_INTERPRET="1"), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue = queue.Queue()
        out, lines = self.proc.stdout, self.lines

        def read() -> None:
            for line in out:
                lines.put(line)
            lines.put(None)                                                    # the child is gone
        threading.Thread(target=read, daemon=True).start()

    def run(self, args: list[str] | str, env: dict[str, str] | None = None):
        """The answer as subprocess.run's: returncode, stdout, stderr (the traceback, and what else the child wrote).
        args: bench.check_experts's arguments, or a check script's code (run as `python -c` would)."""
        import json
        import queue
        from types import SimpleNamespace
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps([args, env or {}]) + "\n")
        self.proc.stdin.flush()
        noise = []
        while True:
            try:
                line = self.lines.get(timeout=self.timeout)
            except queue.Empty:
                self.close()
                return SimpleNamespace(returncode=124, stdout="", stderr="".join(noise) + "timed out")
            if line is None:
                self.proc = None
                return SimpleNamespace(returncode=-1, stdout="", stderr="".join(noise) + "the child died")
            if line.startswith("CHECK-REPLY "):
                rc, out, err = json.loads(line[len("CHECK-REPLY "):])
                return SimpleNamespace(returncode=rc, stdout=out, stderr="".join(noise) + err)
            noise.append(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
