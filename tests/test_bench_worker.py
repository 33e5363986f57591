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
    assert [a["mode"] for a in r["answers"]] == ["none", "none", "ngram", "ngram"]
    assert r["answers"][0]["after_load"] and not any(a["after_load"] for a in r["answers"][1:])
    for a in r["answers"]:
        assert PER_ANSWER <= set(a) and a["generated_tokens"] >= 1 and a["ttft_s"] > 0
    assert r["baseline"]["name"] == "none" and r["draft"]["mode"] == "ngram"
    assert r["load_s"] > 0 and r["load_progress"]
