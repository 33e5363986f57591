"""The worker benchmark's roofline on the CUDA engine: the weight bytes per token the worker reports
for an EXL2 folder (from its tensor sizes) against what the loaded modules hold, and bench-worker
writing an HBM roofline (all experts resident) and the placement's (experts offloaded)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_budget import offload_budget
from gpu_env import child_env
from runtime.options import LoadOptions, OffloadOptions

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_folder_bytes_match_the_loaded_modules(moe_2l):
    """The folder's arithmetic and bench/cuda.py's count over the loaded modules agree to within the
    repacking of the experts (scales and permutations held in another form)."""
    from bench.cuda import weight_bytes_per_token as loaded_bytes
    from runtime.backends import exl2
    from bench.weight_bytes import weight_bytes_per_token
    eng, _ = exl2.load(moe_2l, LoadOptions(offload=OffloadOptions(context_length=512)), lambda *a: None)
    try:
        live = loaded_bytes(eng)
    finally:
        eng.close()
    folder = weight_bytes_per_token(moe_2l)
    print("folder:", folder, "loaded:", live)
    assert 0.8 < folder["total"] / live["total"] < 1.25
    assert 0.8 < folder["experts"] / live["experts"] < 1.25


def _bench(model: Path, out: Path, home: Path, *flags: str) -> dict:
    env = child_env(MOEDESK_HOME=str(home))
    proc = subprocess.run([sys.executable, "-m", "bench.worker", "--model", str(model), "--backend", "cuda",
                           "--draft", "none", "--turns", "2", "--max-tokens", "16", "--out", str(out), *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    print(proc.stdout[-3000:])
    assert " roofline " in proc.stdout
    (path,) = out.glob("worker-*.json")
    return json.loads(path.read_text())


def test_bench_worker_reports_the_hbm_roofline(moe_2l, tmp_path):
    r = _bench(moe_2l, tmp_path / "out", tmp_path / "home")
    assert r["roofline_ceilings_gbps"]["hbm_copy_gbps"] > 100 and r["weight_bytes_per_token"] > 0
    assert r["roofline_tps"] == pytest.approx(r["roofline_all_resident_tps"]) and r["roofline_tps"] > 0
    assert r["roofline_note"].startswith("roofline = HBM copy bandwidth")


def test_bench_worker_reports_the_placements_roofline_with_offload(moe_8l, tmp_path):
    budget = offload_budget(moe_8l, 0.75, tmp_path / "probe")
    r = _bench(moe_8l, tmp_path / "out", tmp_path / "home", "--vram-budget", f"{budget:.3f}")
    p = r["roofline_placement"]
    assert p is not None and 0 <= p["hit_rate"] < 1, r["roofline_note"]
    assert 0 < r["roofline_tps"] <= r["roofline_all_resident_tps"]
    assert r["roofline_note"].startswith("roofline = the offloaded placement's bound")
