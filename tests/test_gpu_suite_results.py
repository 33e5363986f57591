"""bench/gpu_suite.sh's per-file results (bench/gpu_suite_results.py): outcomes from a real pytest run that
the file's time limit interrupts mid-test, the interrupted test and those after it counted as not run."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import gpu_suite_results

TESTS = '''
import time
import pytest

@pytest.mark.parametrize("x", [1, 2, 3])
def test_a(x):
    assert x != 2, "boom"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_slow():
    time.sleep(60)

def test_after():
    pass
'''


def test_an_interrupted_file_keeps_what_ran(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_f.py").write_text(TESTS)
    log, xml = tmp_path / "f.log", tmp_path / "f.xml"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-u", "-m", "pytest", "tests/test_f.py", "-v", "-rA", "-p",
                                 "no:cacheprovider", f"--junitxml={xml}", "-o", "addopts=", "-o", "timeout=0"],
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while "::test_slow" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)                     # as `timeout -s INT` does at the file's limit
        proc.wait(30)
    jsonl = tmp_path / "tests.jsonl"
    counts = gpu_suite_results.main(str(log), str(xml), "test_f.py", str(jsonl))
    assert counts == "2 1 1 0 2", log.read_text()          # test_slow interrupted, test_after never started
    rows = {r["test"]: r for r in map(json.loads, jsonl.read_text().splitlines())}
    assert rows["test_slow"]["outcome"] == "interrupted" and "test_after" not in rows
    assert rows["test_a[2]"]["outcome"] == "failed" and "boom" in rows["test_a[2]"]["message"]
    assert rows["test_skipped"]["outcome"] == "skipped" and rows["test_a[1]"]["seconds"] is not None


def test_no_log_lines_and_no_xml(tmp_path):
    log = tmp_path / "f.log"
    log.write_text("ImportError while loading conftest\n")
    assert gpu_suite_results.main(str(log), str(tmp_path / "missing.xml"), "f", str(tmp_path / "t.jsonl")) \
        == "0 0 0 0 0"
    log.write_text("collected 4 items\n\ntests/gpu/test_f.py::test_a ")
    assert gpu_suite_results.main(str(log), str(tmp_path / "missing.xml"), "f", str(tmp_path / "t.jsonl")) \
        == "0 0 0 0 4"


def test_every_gpu_test_file_is_in_a_group_of_the_runner():
    """A GPU test file that bench/gpu_suite.sh does not list would never run in its calls."""
    import re
    root = Path(__file__).resolve().parents[1]
    script = (root / "bench" / "gpu_suite.sh").read_text(encoding="utf-8")
    groups = re.findall(r'^GROUP_[A-D]="([^"]*)"', script, flags=re.M | re.S)
    listed = {entry.split(":")[0] for g in groups for entry in g.split()}
    files = {p.name for p in (root / "tests" / "gpu").glob("test_*.py")}
    assert files - listed == set(), f"not in a GROUP_A..GROUP_D of bench/gpu_suite.sh: {sorted(files - listed)}"
    assert listed - files == set(), f"listed but missing: {sorted(listed - files)}"
