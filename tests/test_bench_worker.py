"""The worker benchmark, briefly, on the demo model: it drives a real worker and writes the JSON
DESIGN.md names (no timing asserts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
        assert a["decode_tps"] > 0 and a["decode_source"] == "client", a      # every answer carries its decode
        if a["mode"] == "ngram":        # where the time went: drafts, verifies, plain steps, the policy's verdicts
            assert a["drafted_tokens"] >= a["accepted_tokens"] >= 0 and a["plain_steps"] >= 0
            assert a["verify_forwards"] >= 0 and a["draft_decisions"][0].startswith("step 0: ")
        else:
            assert a["drafted_tokens"] is None and a["draft_decisions"] is None
    assert r["baseline"]["name"] == "none" and r["draft"]["mode"] == "ngram" and r["complete"]
    assert r["load_s"] > 0 and r["load_progress"]
    stages = r["load_stages"]                   # the worker's: every step of the load with its wall time
    assert stages and all(s["s"] >= 0 for s in stages) and stages[-1]["message"] == "Reading the tokenizer"
    assert sum(s["s"] for s in stages) <= r["load_s"] + 0.5
    assert [x[:2] for x in r["max_token_gap_s_by_answer"]] == [["none", "first_answer"], ["ngram", "first_answer"],
                                                              ["ngram", "summary"], ["none", "summary"]]
    assert "first answer vs steady" in proc.stdout and "max gap" in proc.stdout
    # the roofline of the machine it ran on: host memory read / the reference engine's weight bytes per token
    assert r["roofline_tps"] > 0 and r["roofline_note"].startswith("roofline = host memory read")
    assert r["weight_bytes_per_token"] > 0 and r["roofline_ceilings_gbps"]["host_read_gbps"] > 0
    assert all(a["roofline"]["roofline_tps"] > 0 for a in r["answers"])
    assert proc.stdout.count(" roofline ") >= 2 * len(r["answers"]) and r["roofline_note"] in proc.stdout
    assert not list(out.glob("*.part"))


def test_bench_worker_puts_the_mtp_head_beside_plain_decoding(tiny_qwen35, tmp_path):
    """--draft mtp: the model loaded with its multi-token-prediction head, each turn answered plainly and
    with the head drafting, and the two side by side (a Qwen3.5-MoE synthetic model, the CPU engine)."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "bench.worker", "--model", str(tiny_qwen35), "--backend", "cpu",
                           "--draft", "mtp", "--draft-tokens", "2", "--max-tokens", "6", "--turns", "1",
                           "--out", str(out)], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = out.glob("worker-*.json")
    r = json.loads(path.read_text())
    assert [a["mode"] for a in r["answers"]] == ["none", "mtp"] and r["complete"]
    assert r["draft"]["mode"] == "mtp" and r["draft"]["draft_tokens"] == 2 and r["baseline"]["name"] == "none"
    assert set(r["speedup_mtp_vs_none"]) == {"first_answer"} and "mtp vs none" in proc.stdout
    mtp = r["answers"][1]
    assert mtp["drafted_tokens"] is not None and mtp["draft_decisions"][0].startswith("step 0: ")


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
    answers.append(Answer("ngram", 0, "first_answer", False, decode_tps=60.0, acceptance_rate=0.5,
                          drafted_tokens=4, accepted_tokens=2))
    write_result(path, result_of(base, answers, ["none", "ngram"], DraftOptions(mode="ngram"), 5))
    r = json.loads(path.read_text())
    assert len(r["answers"]) == 2 and r["speedup_ngram_vs_none"] == {"first_answer": 1.5}
    assert r["baseline"]["name"] == "none" and r["draft"]["acceptance_rate"] == 0.5


def test_a_modes_acceptance_counts_every_draft_and_each_answer_says_where_its_time_went():
    """The mode's acceptance is kept drafts over offered drafts of all its answers: the H200 run
    reported 0.875, the mean of 0.5, 1.0, 1.0, 1.0 where three answers drafted one token each."""
    from bench.worker import Answer, draft_line, summary, take_draft_stats
    from runtime.records import DraftStats
    a = Answer("ngram", 0, "first_answer", False)
    take_draft_stats(a, DraftStats(mode="ngram", drafted_tokens=100, accepted_tokens=50, acceptance_rate=0.5,
                                   verify_forwards=25, verify_rows_mean=5.0, verify_step_s_mean=0.025,
                                   plain_steps=40, plain_step_s_mean=0.009,
                                   decisions=("step 0: measuring plain decoding (K 4)",
                                              "step 20: drafting off: 0.70x plain decoding's tokens/s (K 4)")))
    b = Answer("ngram", 1, "summary", False)
    take_draft_stats(b, DraftStats(mode="ngram", drafted_tokens=1, accepted_tokens=1, acceptance_rate=1.0))
    assert summary([a, b])["acceptance_rate"] == 51 / 101 and summary([a, b])["drafted_tokens"] == 101
    line = draft_line(a)
    assert "25 verifies of 5.0 rows, 25.0 ms each" in line and "40 plain steps, 9.0 ms each" in line
    assert "step 20: drafting off" in line
    assert draft_line(Answer("none", 0, "first_answer", False)) is None


def test_sampling_is_greedy_unless_a_temperature_is_asked():
    import argparse
    import pytest
    from bench.worker import add_arguments, how_sampled, sampling_for, settings_for
    p = argparse.ArgumentParser()
    add_arguments(p)
    settings = settings_for(p.parse_args(["--model", "demo"]))
    greedy = sampling_for(settings, p.parse_args(["--model", "demo", "--max-tokens", "7"]))
    assert greedy.temperature == 0.0 and greedy.max_tokens == 7 and greedy.seed == 0
    hot = sampling_for(settings, p.parse_args(["--model", "demo", "--temperature", "1.0"]))
    assert hot.temperature == 1.0 and "temperature 1" in how_sampled(1.0) and how_sampled(0.0) == "Greedy"
    with pytest.raises(ValueError, match="between 0 and 2"):
        sampling_for(settings, p.parse_args(["--model", "demo", "--temperature", "-1"]))


GB = 1e9
CEILINGS = {"host_read_gbps": 50.0, "hbm_copy_gbps": 4000.0, "pinned_h2d_gbps": 50.0}


def test_the_roofline_is_the_machines_bandwidth_over_the_bytes_a_token_reads():
    from bench.roofline import roofline
    cpu = roofline({"weight_bytes_per_token": 1e9}, "cpu", CEILINGS)
    assert cpu["roofline_tps"] == pytest.approx(50.0) and "host memory read 50.0 GB/s" in cpu["roofline_note"]
    cuda = roofline({"weight_bytes_per_token": 2e9}, "cuda", CEILINGS)
    assert cuda["roofline_tps"] == pytest.approx(2000.0) == cuda["roofline_all_resident_tps"]
    assert "HBM copy bandwidth 4000 GB/s" in cuda["roofline_note"] and cuda["roofline_placement"] is None
    no_gpu = roofline({"weight_bytes_per_token": 2e9}, "cuda", {"host_read_gbps": 50.0})
    assert no_gpu["roofline_tps"] is None and "no CUDA device" in no_gpu["roofline_note"]
    none = roofline({}, "cpu", CEILINGS)
    assert none["roofline_tps"] is None and "reports no weight bytes" in none["roofline_note"]


def test_with_offload_the_roofline_is_the_placements():
    """Dense 1 GB and 2 GB of top-k experts a token, 75% of picks resident: 1.5 GB from HBM, 0.5 GB
    over PCIe (the slower part: 10 ms); with the CPU path taking 0.2 GB of the cold bytes, PCIe 6 ms."""
    from bench.roofline import roofline
    tel = {"weight_bytes_per_token": 3e9, "expert_hit_rate": 0.75,
           "weight_bytes_per_token_parts": {"experts": 2e9, "total": 3e9}}
    r = roofline(tel, "cuda", CEILINGS)
    p = r["roofline_placement"]
    assert p["hbm_bytes_per_token"] == pytest.approx(2.5e9) and p["pcie_bytes_per_token"] == pytest.approx(0.5e9)
    assert r["roofline_tps"] == pytest.approx(100.0) == p["overlapped_tps"]
    assert p["serial_tps"] == pytest.approx(1 / (2.5e9 / 4e12 + 0.01))
    assert r["roofline_all_resident_tps"] == pytest.approx(4000 / 3) and "hit rate 75.0%" in r["roofline_note"]
    cpu = roofline(dict(tel, cpu_expert_bytes_per_token=0.2e9), "cuda", CEILINGS)["roofline_placement"]
    assert cpu["pcie_bytes_per_token"] == pytest.approx(0.3e9) and cpu["overlapped_tps"] == pytest.approx(1 / 0.006)
    # the hit rate without the bytes by part: the all-resident bound, said to be an upper bound
    bare = roofline({"weight_bytes_per_token": 3e9, "expert_hit_rate": 0.75}, "cuda", CEILINGS)
    assert bare["roofline_tps"] == pytest.approx(4000 / 3) and "upper bound" in bare["roofline_note"]


def test_an_answer_takes_the_hit_rate_from_the_telemetry_event():
    """The worker sends the expert hit rate as a field of its Telemetry event (the app's gauge reads it
    there), not in `extra`: read from `extra`, every offloaded answer of the H200 runs had none, so the
    worker benchmark gave the all-resident roofline at a 24 GB budget instead of the placement's."""
    from bench.worker import ask
    from runtime import protocol as P
    from runtime.records import GenerationStats

    class Client:
        def generate(self, request):
            rid = request.request_id
            yield P.Telemetry(request_id=rid, extra={"expert_pairs": 0})      # no pick counted yet: no rate
            yield P.Telemetry(request_id=rid, expert_hit_rate=0.25, extra={"expert_pairs": 8})
            yield P.TokenDelta(request_id=rid, text="a")
            yield P.TokenDelta(request_id=rid, text="b")
            yield P.Telemetry(request_id=rid, expert_hit_rate=0.375,
                              extra={"expert_pairs": 16, "cpu_expert_bytes_per_token": 1e6})
            yield P.Finished(request_id=rid, reason="length", stats=GenerationStats(3, 2, 0.1, 30.0, 20.0, 0.2))
    a = ask(Client(), P.Generate(request_id="r1", prompt="x"), "none", 0, "first_answer", True)
    assert a.expert_hit_rate == 0.375 and a.cpu_expert_bytes_per_token == 1e6
    assert a.placement == "offload" and a.generated_tokens == 2 and a.text == "ab"


def test_the_result_carries_the_last_answers_roofline():
    from bench.worker import Answer, result_of
    from runtime.options import DraftOptions
    a = Answer("none", 0, "first_answer", True, decode_tps=40.0,
               roofline={"roofline_tps": 80.0, "roofline_note": "roofline = x", "roofline_all_resident_tps": 80.0,
                         "roofline_placement": None})
    r = result_of({}, [a], ["none"], DraftOptions(), 1)
    assert r["roofline_tps"] == 80.0 and r["roofline_note"] == "roofline = x"
    assert result_of({}, [], ["none"], DraftOptions(), 1)["roofline_tps"] is None


def test_ceilings_measured_in_a_child_and_a_failure_leaves_no_roofline(monkeypatch):
    """The worker benchmark measures bandwidths in a child process (no CUDA context of its own while the
    worker runs); a child that fails leaves the roofline uncomputed and says so, never a crash."""
    import subprocess
    from bench import roofline
    got = roofline.measure_ceilings_apart("cpu")
    assert set(got) == {"host_read_gbps"} and got["host_read_gbps"] > 0

    def boom(*a, **k):
        raise subprocess.CalledProcessError(1, a[0])
    monkeypatch.setattr(roofline.subprocess, "run", boom)
    assert roofline.measure_ceilings_apart("cuda") == {}
    r = roofline.roofline({"weight_bytes_per_token": 1e8}, "cpu", {})
    assert r["roofline_tps"] is None and "not computed" in r["roofline_note"]


class _Events:
    """A client whose answer arrives as the scripted events, a few ms apart."""

    def __init__(self, events):
        self.events = events

    def generate(self, request):
        import time
        for ev in self.events:
            time.sleep(0.002)
            yield ev


def test_every_answer_carries_its_decode_figure():
    """Tokens arriving one by one are timed on the client side; an answer whose deltas came in one lump
    (its text held back by an older worker) still carries a decode figure: the worker's, marked as such."""
    from bench.worker import ask
    from runtime import protocol as P
    from runtime.options import SamplingOptions
    req = P.Generate(request_id="r", messages=(P.ChatMessage("user", "hi"),), sampling=SamplingOptions())
    done = P.Finished("r", "length", P.GenerationStats(3, 6, 0.2, 50.0, 37.3, 0.4))
    steady = ask(_Events([P.TokenDelta("r", "", 1)] * 5 + [P.TokenDelta("r", "ab", 1), done]), req, "none", 0,
                 "first_answer", True)
    assert steady.decode_source == "client" and steady.decode_tps > 0 and steady.delta_tokens == 6
    lump = ask(_Events([P.TokenDelta("r", "abcdef", 6), done]), req, "none", 0, "first_answer", True)
    assert lump.decode_tps == 37.3 and lump.decode_source == "worker"
    one = ask(_Events([P.TokenDelta("r", "a", 1), P.Finished("r", "eos", P.GenerationStats(3, 1, 0.2, 50.0, None,
                                                                                            0.2))]),
              req, "none", 0, "first_answer", True)
    assert one.decode_tps is None and one.decode_source is None
