"""`moedesk serve` as a subprocess for the server tests: started on a free port, stopped with Ctrl+C."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def start(model: Path, home: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    """The server process, its URL once the model is loaded, and the file its stderr goes to."""
    log = home / "stderr.txt"
    env = dict(os.environ, MOEDESK_HOME=str(home), PYTHONPATH=str(ROOT))
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "app.launch", "serve", "--model", str(model), "--port", "0",
                                 *args], stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline()       # "Serving NAME at URL" once loaded (EOF if it failed)
    if not line.startswith("Serving"):
        proc.kill()
        pytest.fail(f"the server did not start: {line!r}\n{log.read_text()}")
    return proc, line, log
