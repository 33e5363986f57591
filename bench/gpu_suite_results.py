"""One test file's results for bench/gpu_suite.sh: from pytest's -v log (and its JUnit XML where written),
JSON lines appended to a file, and the counts printed as "passed failed skipped errors not_run"
(not run: collected but without an outcome, the test the kill stopped included).

    python -m bench.gpu_suite_results LOG XML NAME OUT_JSONL

Outcomes come from the -v lines ("tests/gpu/f.py::test PASSED"), written as each test ends: a test that
the file's time limit stopped has its id and no outcome ("interrupted"), where the XML written on the
interrupt would call it passed. The XML adds each test's seconds and failure message.
"""
from __future__ import annotations

import json
import os
import re
import sys
import xml.etree.ElementTree as ET

LINE = re.compile(r"^tests/\S+?::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)
STARTED = re.compile(r"^tests/\S+?::(\S+) ", re.M)       # -v prints the test's id as it starts
KINDS = ("passed", "failed", "skipped", "error")


def outcomes(log_text: str) -> dict[str, str]:
    """test -> passed/failed/skipped/error, or interrupted (started, no outcome: the kill stopped it)."""
    out = dict.fromkeys(STARTED.findall(log_text), "interrupted")
    for test, what in LINE.findall(log_text):
        if out.get(test) not in ("failed", "error"):        # a teardown ERROR after PASSED stays an error
            out[test] = {"XFAIL": "skipped", "XPASS": "passed"}.get(what, what.lower())
    return out


def junit(path: str) -> dict[str, tuple[float, str]]:
    """test name -> (seconds, message of its failure, error or skip)."""
    if not (os.path.exists(path) and os.path.getsize(path)):
        return {}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:                                   # cut short by the kill
        return {}
    cases = {}
    for case in root.iter("testcase"):
        if not case.get("name"):                            # the interrupt's own entry
            continue
        el = next((e for e in (case.find(t) for t in ("failure", "error", "skipped")) if e is not None), None)
        cases[case.get("name")] = (round(float(case.get("time") or 0), 1),
                                   "" if el is None else (el.get("message") or "")[:500])
    return cases


def main(log: str, xml: str, name: str, out: str) -> str:
    text = open(log, errors="replace").read()
    seen, cases = outcomes(text), junit(xml)
    with open(out, "a") as f:
        for test in dict.fromkeys([*seen, *cases]):
            secs, msg = cases.get(test, (None, ""))
            f.write(json.dumps({"file": name, "test": test, "outcome": seen.get(test, "interrupted"),
                                "seconds": secs, "message": msg}) + "\n")
    m = re.search(r"collected (\d+) item", text)
    counts = [sum(o == k for o in seen.values()) for k in KINDS]
    not_run = max(0, int(m.group(1)) - len(seen)) + sum(o == "interrupted" for o in seen.values()) if m else 0
    return " ".join(map(str, [*counts, not_run]))


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    print(main(*sys.argv[1:]))
