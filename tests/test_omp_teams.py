"""bench/omp_teams.py (a diagnosis: a docked OpenMP team slows the CPU expert kernel's calls) runs its
three cases in their own processes and writes what it measured (no timing asserts)."""
from __future__ import annotations

import json

import pytest


def test_the_three_cases_run_apart_and_say_their_threads(tmp_path, capsys):
    from bench import omp_teams
    from runtime.cpu import experts as ce
    if (why := ce.kernel_unavailable_reason()):
        pytest.skip(f"the CPU expert kernel is unavailable here: {why}")
    out = tmp_path / "omp.json"
    assert omp_teams.main(["--threads", "2", "--docked", "2", "--shape", "tiny-moe", "--pool-mb", "1",
                           "--calls", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    cases = {c["case"]: c for c in r["cases"]}
    assert list(cases) == ["clean", "docked", "on_cores"] and r["threads"] == 2
    assert all(c["ms_per_call"] > 0 and len(c["runs_ms"]) == 3 for c in cases.values())
    # two other teams of 2 left docked: each keeps its grower and one worker alive; on_cores leaves none
    assert cases["docked"]["process_threads"] >= cases["clean"]["process_threads"] + 4
    assert cases["on_cores"]["process_threads"] == cases["clean"]["process_threads"]
    assert "docked / clean: x" in capsys.readouterr().out
