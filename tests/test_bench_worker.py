"""The worker benchmark, briefly, on the demo model: it drives a real worker and writes the JSON
DESIGN.md names (no timing asserts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

COMMON = {"date", "git_commit", "machine", "device", "model", "bpw", "vram_budget_gb", "context", "prompt_tokens",
          "prefill_tps", "decode_tps", "ttft_s", "roofline_tps", "draft", "baseline", "notes"}
PER_ANSWER = {"ttft_s", "decode_tps", "max_token_gap_s", "placement", "acceptance_rate", "prompt_tokens", "mode"}


def test_bench_worker_writes_the_worker_result(demo_model, tmp_path):
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "bench.worker", "--model", str(demo_model), "--backend", "cpu",
                           "--max-tokens", "3", "--turns", "2", "--out", str(out)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = out.glob("worker-*.json")
    r = json.loads(path.read_text())
    assert COMMON <= set(r) and r["worker"] is True and r["device"] == "cpu"
    # one conversation, the modes taking turns: plain first after load, the order swapped each turn
    assert [(a["mode"], a["turn"]) for a in r["answers"]] == [("none", 0), ("ngram", 0), ("ngram", 1), ("none", 1)]
    assert r["answers"][0]["after_load"] and not any(a["after_load"] for a in r["answers"][1:])
    for a in r["answers"]:
        assert PER_ANSWER <= set(a) and a["generated_tokens"] >= 1 and a["ttft_s"] > 0
        assert a["worker_decode_tps"] is None or a["worker_decode_tps"] > 0
        assert a["delta_tokens"] == a["generated_tokens"], a
    assert r["baseline"]["name"] == "none" and r["draft"]["mode"] == "ngram" and r["complete"]
    assert r["load_s"] > 0 and r["load_progress"]
    stages = r["load_stages"]                   # the worker's: every step of the load with its wall time
    assert stages and all(s["s"] >= 0 for s in stages) and stages[-1]["message"] == "Reading the tokenizer"
    assert sum(s["s"] for s in stages) <= r["load_s"] + 0.5
    assert [x[:2] for x in r["max_token_gap_s_by_answer"]] == [["none", "first_answer"], ["ngram", "first_answer"],
                                                              ["ngram", "summary"], ["none", "summary"]]
    assert "first answer vs steady" in proc.stdout and "max gap" in proc.stdout
    assert not list(out.glob("*.part"))


def test_the_result_is_written_after_every_answer(tmp_path):
    """What was measured before a time limit stops the run is on disk: the file after one answer
    is a complete JSON of that answer."""
    from bench.worker import Answer, result_of, write_result
    from runtime.options import DraftOptions
    path = tmp_path / "worker-x.json"
    base = {"model": "m", "load_stages": [{"stage": "load", "message": "Loading weights", "s": 3.0}]}
    answers = [Answer("none", 0, "first_answer", True, prompt_tokens=38, generated_tokens=5, decode_tps=40.0,
                      max_token_gap_s=0.1)]
    write_result(path, result_of(base, answers, ["none", "ngram"], DraftOptions(mode="ngram"), 5))
    r = json.loads(path.read_text())
    assert r["complete"] is False and len(r["answers"]) == 1 and r["load_stages"] == base["load_stages"]
    assert r["modes"]["none"]["decode_tps"] == 40.0 and r["speedup_ngram_vs_none"] is None
    answers.append(Answer("ngram", 0, "first_answer", False, decode_tps=60.0, acceptance_rate=0.5))
    write_result(path, result_of(base, answers, ["none", "ngram"], DraftOptions(mode="ngram"), 5))
    r = json.loads(path.read_text())
    assert len(r["answers"]) == 2 and r["speedup_ngram_vs_none"] == {"first_answer": 1.5}
    assert r["baseline"]["name"] == "none" and r["draft"]["acceptance_rate"] == 0.5
