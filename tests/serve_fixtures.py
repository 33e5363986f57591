"""A real `moedesk serve` with the demo model on a free loopback port, for the server's tests."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent


def no_end_of_answer(model: Path) -> dict[str, int]:
    """A logit_bias that bans the model's end-of-answer tokens, so an answer runs to its max_tokens."""
    from runtime.tokenizer import Tokenizer
    return {str(t): -100 for t in Tokenizer.from_folder(model).eos_ids}


@contextlib.contextmanager
def running_server(demo_model: Path, home: Path, *args: str,
                   quiet_stdout: bool = False) -> Iterator[tuple[str, Path, str]]:
    """Yields (base URL, its stderr log, the served model's name); stops it with Ctrl+C (exit status 0).
    `quiet_stdout`: checks that stdout held the Serving line and nothing else (logs belong on stderr)."""
    log = home / "stderr.txt"
    env = dict(os.environ, MOEDESK_HOME=str(home), PYTHONPATH=str(ROOT))
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "app.launch", "serve", "--model", str(demo_model),
                                 "--port", "0", *args],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline()       # "Serving NAME at URL" once loaded (EOF if it failed)
    if not line.startswith("Serving"):
        proc.kill()
        pytest.fail(f"the server did not start: {line!r}\n{log.read_text()}")
    rest: list[str] = []
    reader = threading.Thread(target=lambda: rest.append(proc.stdout.read()), daemon=True)
    reader.start()                                  # whatever else it prints: never let the pipe fill
    try:
        yield line.split(" at ")[1].strip(), log, line.split()[1]
    finally:
        proc.send_signal(signal.SIGINT)             # Ctrl+C: a clean stop, the worker ended with it
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log.read_text()
    reader.join(5)
    if quiet_stdout:
        assert "".join(rest) == "", f"stdout after the Serving line: {''.join(rest)[:500]!r}"
