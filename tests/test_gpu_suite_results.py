"""bench/gpu_suite.sh's per-file results (bench/gpu_suite_results.py): outcomes from a real pytest run that
the file's time limit interrupts mid-test, the interrupted test and those after it counted as not run."""
from __future__ import annotations

import json
import os
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
        deadline = time.monotonic() + 300                   # a loaded machine starts pytest slowly
        while "::test_slow" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert "::test_slow" in log.read_text(), log.read_text()      # interrupted mid-test, not at start-up
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)                     # as `timeout -s INT` does at the file's limit
        proc.wait(120)
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


LANE_TEST = '''
import os, time
from pathlib import Path
import pytest

pytestmark = pytest.mark.gpu
FLAGS = Path(os.environ["LANE_FLAGS"])


def test_me():
    me, other = "{me}", "{other}"
    (FLAGS / f"{{me}}.start").write_text(os.environ["MOEDESK_HOME"])
    if other:                                   # passes only while the other file's process runs too
        deadline = time.monotonic() + 60
        while not (FLAGS / f"{{other}}.start").exists():
            assert time.monotonic() < deadline, f"{{other}} never ran beside {{me}}"
            time.sleep(0.05)
    else:                                       # a solo file: every shared file has ended
        assert (FLAGS / "a.end").exists() and (FLAGS / "b.end").exists()
    (FLAGS / f"{{me}}.end").touch()
'''


def test_lanes_run_shared_files_side_by_side_and_solo_files_alone(tmp_path):
    """LANES=2: the two shared files run in two processes at once (each waits for the other to start), the
    solo file after both have ended; every file's summary line and its whole log are kept; each file's
    process has a MOEDESK_HOME of its own."""
    root = Path(__file__).resolve().parents[1]
    gpu, flags, out = tmp_path / "tests" / "gpu", tmp_path / "flags", tmp_path / "out"
    gpu.mkdir(parents=True), flags.mkdir()
    for me, other in (("a", "b"), ("b", "a"), ("c", "")):
        (gpu / f"test_{me}.py").write_text(LANE_TEST.format(me=me, other=other))
    env = {**os.environ, "OUT": str(out), "LANES": "2", "SOLO": "test_c.py", "LIMIT": "200",
           "FILES": "test_c.py:90 test_a.py:90 test_b.py:60", "WORK": str(tmp_path / "work"), "LANE_FLAGS": str(flags),
           "PYTHON": sys.executable, "PYTHONPATH": str(root), "MOEDESK_COMMIT": "test"}
    proc = subprocess.run(["bash", str(root / "bench" / "gpu_suite.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert sorted(line.split(":")[0] for line in summary) == ["test_a.py", "test_b.py", "test_c.py"], summary
    assert all(" 1 passed, 0 failed" in line for line in summary), (summary, (out / "pytest.log").read_text())
    assert summary[-1].startswith("test_c.py")
    log = (out / "pytest.log").read_text()
    assert "lane 0: test_a.py:90" in log and "lane 1: test_b.py:60" in log and "alone: test_c.py:90" in log
    assert log.count("test session starts") == 3
    homes = {(flags / f"{me}.start").read_text() for me in "abc"}           # one of its own per file, gone after
    assert len(homes) == 3 and not any(Path(h).exists() for h in homes), homes
