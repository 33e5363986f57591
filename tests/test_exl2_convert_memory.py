"""The converter's memory bound: experts calibrated in groups under a Hessian budget give bit-identical
models for every budget, hold fewer Hessians, and a layer's weights are read one layer at a time."""
from __future__ import annotations

import pytest
import torch

from runtime.exl2 import allocate, calibrate
from runtime.exl2 import convert as cv
from tests.convert_fixtures import TEXT, tiny_checkpoint
from tests.test_exl2_convert import _tensors

HIDDEN = INTER = 64          # the fixture's hidden size and expert width (4 experts, top-2)
HB = calibrate.hessian_bytes(HIDDEN)


def _convert(src, out, budget, measure=False):
    reports = []
    cv.convert(src, out, 3.0, calibration_text=TEXT, rows=4, seq_len=64, say=lambda m: None,
               hessian_budget=budget, progress=reports.append, measure=measure)
    return reports


@pytest.mark.parametrize("measure", [False, True])
def test_expert_groups_give_the_same_model_for_every_budget(tmp_path, measure):
    src = tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=1 if measure else 2)
    widths = len(allocate.candidates(3.0)) if measure else 1      # a group's loop runs every candidate width
    per_expert = calibrate.expert_bytes(HIDDEN, INTER, widths)     # 3 of these: 3 experts, routed or not
    runs = {}
    for budget in (1, 3 * per_expert, 1 << 40):              # 1 expert, groups of 3 + 1, all 4 at once
        reports = _convert(src, tmp_path / f"q{budget}", budget, measure)
        runs[budget] = (_tensors(tmp_path / f"q{budget}"), reports)
    assert [r["experts_per_group"] for r in runs[1][1]] == [1] * len(runs[1][1])
    assert runs[3 * per_expert][1][0]["experts_per_group"] == 3
    assert runs[1 << 40][1][0]["experts_per_group"] == 4
    ref = runs[1][0]
    for tensors, _ in runs.values():
        assert tensors.keys() == ref.keys() and all(torch.equal(tensors[k], ref[k]) for k in ref)
    # one expert's Hessians (plus the shared all-token one) at a time against all four at once;
    # q/k/v read one input and keep one Hessian: the dense linears hold two
    small = max(r["hessian_peak_bytes"] for r in runs[1][1])
    large = max(r["hessian_peak_bytes"] for r in runs[1 << 40][1])
    assert small <= 3 * HB < 5 * HB <= large, (small, large)
    assert all(r["seconds"] > 0 for r in runs[1][1])


def test_routed_tokens_and_fallback_follow_the_router():
    """An expert's gate/up Hessian sums exactly the tokens routed to it; an expert routed none falls back
    to all tokens for down_proj (the experts fed all tokens summed in one batched product: each its own)."""
    torch.manual_seed(0)
    mod = type("Experts", (torch.nn.Module,), {})()
    mod.num_experts, mod.act_fn = 3, torch.nn.functional.silu
    mod.gate_up_proj = torch.nn.Parameter(torch.randn(3, 8, 5))
    mod.down_proj = torch.nn.Parameter(torch.randn(3, 5, 4))
    inputs = calibrate.RoutedInputs(mod)
    x = torch.randn(6, 5)
    top = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]])
    inputs.add(x[:4], top[:4])
    inputs.add(x[4:], top[4:])
    assert inputs.routed_counts().tolist() == [6, 6, 0]
    gate_up, down, tokens = inputs.expert_hessians([0, 2], {0: True, 2: False})
    xs = x.half().double()
    assert torch.allclose(gate_up[0].h, 2 * xs.t() @ xs) and gate_up[0].tokens == 6
    assert 2 not in gate_up and tokens == [6, 6]                      # all tokens through expert 2

    def act(e):                                                       # its intermediate activations of x
        y = xs @ mod.gate_up_proj[e].detach().double().t()
        return torch.nn.functional.silu(y[:, :4]) * y[:, 4:]
    for i, e in enumerate((0, 2)):                                    # each its own down Hessian, in its row
        assert torch.allclose(down[i], 2 * act(e).t() @ act(e), rtol=1e-5, atol=1e-6), e


def test_layers_are_read_one_at_a_time_each_tensor_once(tmp_path, monkeypatch):
    src = tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=2)
    reads = []
    real = cv.Checkpoint.get_raw

    def get_raw(self, name):
        reads.append(name)
        return real(self, name)
    monkeypatch.setattr(cv.Checkpoint, "get_raw", get_raw)
    _convert(src, tmp_path / "q", 1 << 30)
    layer_of = [int(n.split(".")[2]) for n in reads if n.startswith("model.layers.")]
    assert layer_of == sorted(layer_of) and set(layer_of) == {0, 1}      # layer 0's tensors, then layer 1's
    per_layer = [n for n in reads if n.startswith("model.layers.0.")]
    assert len(per_layer) == len(set(per_layer))
    assert sum(".experts." in n for n in per_layer) == 4 * 3              # per-expert HF tensors, each once


def test_bad_budget_and_device_are_refused(tmp_path, capsys):
    src = tiny_checkpoint(tmp_path / "hf", "qwen3_moe", layers=1)
    with pytest.raises(cv.ConvertError, match="hessian_budget must be positive"):
        _convert(src, tmp_path / "q", 0)
    if not torch.cuda.is_available():
        with pytest.raises(cv.ConvertError, match="device 'cuda' is not available"):
            cv.convert(src, tmp_path / "q", 3.0, calibration_text=TEXT, device="cuda", say=lambda m: None)
    import argparse
    p = argparse.ArgumentParser()
    cv.add_arguments(p)
    args = p.parse_args(["--model", str(src), "--bpw", "3", "--out", str(tmp_path / "q"), "--hessian-memory", "-1"])
    assert cv.run(args) == 1
    assert "--hessian-memory must be a positive number of GiB, got -1.0" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_bench_converts_a_cut_down_shape_and_projects_the_full_model(tmp_path):
    import json

    from bench import convert_memory as cm
    s, full, notes = cm.bench_shape("tiny-moe", 1, 8, 512, top_k=2)
    assert (s.experts, s.experts_per_token, s.vocab, s.layers) == (8, 2, 512, 1) and full.experts == 16
    assert any("8 of 16 experts" in n for n in notes)
    with pytest.raises(SystemExit, match="--experts must be between top-k 2 and 16"):
        cm.bench_shape("tiny-moe", 1, 1, None, top_k=2)
    with pytest.raises(SystemExit, match="this benchmark writes Qwen3.5-MoE, Qwen3-MoE, Qwen3 and Llama checkpoints"):
        cm.bench_shape("tiny-mixtral", 1, None, None)
    q35, _, notes35 = cm.bench_shape("qwen3.5-122b-a10b", 2, None, 4096)
    assert (q35.architecture, q35.experts, q35.hidden, q35.expert_intermediate) == (cm.QWEN35, 256, 3072, 1024)
    assert q35.full_attention_interval == 2 and q35.first_special == 4096 - 32       # DeltaNet, then attention

    assert cm.main(["--shape", "tiny-moe", "--layers", "1", "--experts", "8", "--top-k", "2", "--vocab", "512",
                    "--rows", "2", "--seq-len", "32",
                    "--hessian-memory",     # 64 tokens: every expert falls back to all tokens
                    str(3.5 * calibrate.expert_bytes(s.hidden, s.expert_intermediate, routed=False) / 2**30),
                    "--work", str(tmp_path / "w"), "--out", str(tmp_path / "out")]) == 0
    first = next((tmp_path / "out").glob("convert-memory-tiny-moe-cpu-*.json"))
    result = json.loads(first.read_text())
    assert result["complete"] is True and len(list((tmp_path / "out").glob("*.json"))) == 1     # rewritten, not added
    (layer,) = result["layers"]
    assert layer["experts_per_group"] == 3 and 0 < layer["hessian_peak_bytes"] <= 4 * 655_360
    assert layer["peak_rss_bytes"] > 0 and result["full"]["experts"] == 16 and layer["kind"] == "decoder"
    assert {"read", "gptq", "hessians"} <= set(layer["phases"]) and "other" in result["phases_mean_s"]
    pr = result["projection"]
    per_layer = layer["seconds"] + layer["expert_seconds"]               # experts x 16/8
    assert pr["seconds_per_layer"] == pytest.approx(per_layer, abs=0.06)
    assert pr["model_seconds"] == pytest.approx(2 * per_layer + result["head_and_assembly_s"] * 1024 / 512, abs=0.5)
    assert result["experts_routed"] + result["experts_all_token_fallback"] == 8
    for key in ("date", "git_commit", "machine", "device", "model", "bpw", "vram_budget_gb", "context",
                "prompt_tokens", "prefill_tps", "decode_tps", "ttft_s", "roofline_tps", "draft", "baseline", "notes"):
        assert key in result, key

    # Qwen3.5's hybrid layers as they are: a DeltaNet layer and an attention layer, projected by kind
    assert cm.main(["--shape", "tiny-qwen3.5", "--layers", "2", "--experts", "8", "--vocab", "512", "--rows", "2",
                    "--seq-len", "32", "--work", str(tmp_path / "w35"), "--out", str(tmp_path / "out"),
                    "--baseline", str(first)]) == 0
    r35 = json.loads(next((tmp_path / "out").glob("convert-memory-tiny-qwen3.5-cpu-*.json")).read_text())
    assert [r["kind"] for r in r35["layers"]] == ["linear_attention", "full_attention"]
    pr = r35["projection"]
    assert pr["layers_by_kind"] == {"linear_attention": 3, "full_attention": 1}
    by = pr["seconds_per_layer_by_kind"]
    assert pr["mtp_seconds"] == by["full_attention"]
    assert pr["model_seconds"] == pytest.approx(3 * by["linear_attention"] + 2 * by["full_attention"]
                                                + pr["head_seconds"], abs=0.5)
    assert r35["baseline"]["seconds_per_layer"] == result["projection"]["seconds_per_layer"]


def test_bench_converts_deltanet_layers_alone_and_says_what_it_projects(tmp_path):
    """One Gated DeltaNet layer (the kind of most of Qwen3.5's layers) in one GPU call: the attention layers and
    the MTP head are projected at its time, and the JSON names the kind it did not measure."""
    import json

    from bench import convert_memory as cm
    with pytest.raises(SystemExit, match="--deltanet-only needs a hybrid shape .* got --layers 4"):
        cm.bench_shape("tiny-qwen3.5", 4, None, None, deltanet_only=True)
    with pytest.raises(SystemExit, match="--deltanet-only needs a hybrid shape"):
        cm.bench_shape("tiny-moe", 1, None, None, deltanet_only=True)
    assert cm.main(["--shape", "tiny-qwen3.5", "--layers", "1", "--deltanet-only", "--experts", "8", "--vocab", "512",
                    "--rows", "2", "--seq-len", "32", "--work", str(tmp_path / "w"), "--out", str(tmp_path)]) == 0
    r = json.loads(next(tmp_path.glob("convert-memory-tiny-qwen3.5-cpu-*.json")).read_text())
    assert [x["kind"] for x in r["layers"]] == ["linear_attention"]
    pr = r["projection"]
    assert pr["kinds_at_measured_mean"] == ["full_attention"]
    by = pr["seconds_per_layer_by_kind"]
    assert list(by) == ["linear_attention"] and pr["layers_by_kind"] == {"linear_attention": 3, "full_attention": 1}
    assert pr["mtp_seconds"] == pytest.approx(by["linear_attention"], abs=0.11)
    assert pr["seconds_per_layer"] == pytest.approx(by["linear_attention"], abs=0.11)
    assert pr["model_seconds"] == pytest.approx(5 * pr["seconds_per_layer"] + pr["head_seconds"], abs=0.5)
    assert any("all Gated DeltaNet" in n for n in r["notes"])


def test_bench_keeps_the_layers_of_a_run_cut_short(tmp_path, monkeypatch):
    """A run stopped before its end (a GPU call's time limit) leaves the JSON of the layers it finished."""
    import functools
    import json

    from bench import convert_memory as cm
    monkeypatch.setattr(cv, "convert", functools.partial(cv.convert, stop_after_layers=1))
    with pytest.raises(cv.ConvertError, match="stopped after layer 1 of 2"):
        cm.main(["--shape", "tiny-moe", "--layers", "2", "--experts", "4", "--top-k", "2", "--vocab", "512",
                 "--rows", "2", "--seq-len", "32", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "out")])
    (path,) = (tmp_path / "out").glob("convert-memory-tiny-moe-cpu-*.json")
    result = json.loads(path.read_text())
    assert result["complete"] is False and [r["layer"] for r in result["layers"]] == [0]
    pr = result["projection"]
    assert pr["head_seconds"] is None and result["convert_s"] is None
    assert pr["model_seconds"] == pytest.approx(2 * pr["seconds_per_layer"], abs=0.2)     # the layers alone
    assert any("cut after 1 of 2 layers" in n for n in result["notes"])


def test_gpu_speed_script_takes_its_steps_and_runs_its_check_on_the_cpu(tmp_path):
    """bench/gpu_convert_speed.sh: steps as arguments (unknown ones refused before anything runs), -n prints the
    speed step's command, and its check step runs the same path on the CPU and writes the JSON into $OUT."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OUT=str(tmp_path / "out"), ROOT=str(tmp_path / "root"), PYTHON=sys.executable,
               PYTHONPATH=str(repo))

    def script(*args):
        return subprocess.run(["bash", "bench/gpu_convert_speed.sh", *args], cwd=repo, env=env, text=True,
                              capture_output=True, timeout=300)

    assert "bench/gpu_convert_speed.sh speed" in script("--help").stdout
    bad = script("speed", "sped")
    assert bad.returncode == 2 and "unknown step or option 'sped'" in bad.stderr
    assert not (tmp_path / "out").exists()
    dry = script("-n", "speed")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    cmd = next(line for line in dry.stdout.splitlines() if "would run:" in line)
    for arg in ("bench.convert_memory", "--shape qwen3.5-122b-a10b", "--layers 1", "--deltanet-only",
                "--vram-gb 24", f"--out {tmp_path / 'out'}", "--device cuda"):
        assert arg in cmd
    assert not list((tmp_path / "out").glob("*.json")) and not (tmp_path / "root" / "done" / "speed").exists()
    check = script("check")
    assert check.returncode == 0, check.stdout + check.stderr
    (path,) = (tmp_path / "out").glob("convert-memory-tiny-qwen3.5-cpu-*.json")
    r = json.loads(path.read_text())
    assert r["complete"] and r["projection"]["kinds_at_measured_mean"] == ["full_attention"]
    assert r["baseline"]["model_hours"] == 21.23
    assert "h projected (baseline 21.23 h)" in check.stdout
    assert "convert_memory check: exit 0" in (tmp_path / "out" / "gpu_convert_speed.log").read_text()


def test_new_layer_is_built_without_initialising_and_keeps_unsaved_buffers():
    class Plain(torch.nn.Module):
        def __init__(self, cfg, layer_idx):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

    class WithBuffer(Plain):
        def __init__(self, cfg, layer_idx):
            super().__init__(cfg, layer_idx)
            self.register_buffer("table", torch.arange(3.0), persistent=False)

    plain = cv._new_layer(Plain, None, 0, "cpu")
    assert plain.lin.weight.device.type == "cpu" and not plain.training
    buffered = cv._new_layer(WithBuffer, None, 0, "cpu")
    assert buffered.table.tolist() == [0.0, 1.0, 2.0]                 # built for real, not left empty
