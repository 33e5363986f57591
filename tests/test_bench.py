"""moedesk-cli bench on a tiny synthetic model: the JSON schema, the baseline, errors."""
from __future__ import annotations

import argparse
import json

import pytest

from bench import engine as bench

SCHEMA = ["date", "git_commit", "machine", "device", "model", "bpw", "vram_budget_gb", "context", "prompt_tokens",
          "prefill_tps", "decode_tps", "ttft_s", "roofline_tps", "draft", "baseline", "notes"]


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-moe"])
def tiny_model(request, tmp_path_factory):
    from runtime.exl2.synth import write_synthetic
    out = tmp_path_factory.mktemp("models") / request.param
    write_synthetic(request.param, 4.0, out)
    return out


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_bench_writes_one_json_with_the_schema(tiny_model, tmp_path, capsys):
    out = tmp_path / "results"
    code = bench.run(_args("--model", str(tiny_model), "--prompt-tokens", "24", "--decode-tokens", "6",
                           "--draft", "ngram", "--note", "tiny synthetic model: random weights", "--out", str(out)))
    assert code == 0, capsys.readouterr().err
    [path] = list(out.glob("*.json"))
    data = json.loads(path.read_text())
    assert all(k in data for k in SCHEMA)
    assert data["prompt_tokens"] == 24 and data["decode_tokens"] == 6 and data["device"] in ("cpu", data["device"])
    assert data["prefill_tps"] > 0 and data["decode_tps"] > 0 and data["ttft_s"] > 0
    assert data["machine"]["cores_logical"] >= 1 and data["machine"]["ram_gb"] > 0 and data["machine"]["cpu"]
    assert data["roofline_tps"] is None or data["roofline_tps"] > 0
    assert data["draft"]["mode"] == "ngram" and "acceptance_rate" in data["draft"]
    b = data["baseline"]
    assert b["name"] == "transformers" and b["decode_tps"] > 0 and b["prefill_tps"] > 0
    assert "random weights" in data["notes"] and "decode speedup" in capsys.readouterr().out


def test_transformers_baseline_matches_the_engine_logits(tiny_model):
    """The baseline must run the same model: compare its logits with the reference engine's."""
    import torch
    from runtime.reference import load
    model = bench.transformers_model(tiny_model)
    engine, _ = load(tiny_model, precision="float32")
    ids = list(range(1, 20))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    got = engine.forward(ids).float()
    assert (ref - got).abs().max() < 1e-2 * ref.abs().max()


def test_bench_errors(tmp_path, capsys):
    assert bench.run(_args("--model", str(tmp_path / "none"), "--out", str(tmp_path))) == 1
    assert "model_not_found" in capsys.readouterr().err
    assert bench.run(_args("--model", "x", "--decode-tokens", "1")) == 2


def test_offload_bench_says_the_loads_steps_as_they_happen():
    """bench.offload printed nothing for the minutes a big model loads: each step is said as it
    starts, and the weights' module count every 10%."""
    from bench.offload import load_progress
    said = []
    progress = load_progress(said.append)
    progress("kernels", "Loading GPU kernels", 0, 1)
    progress("kernels", "Loading GPU kernels", 1, 1)
    for i in range(0, 201):
        progress("load", "Loading weights", i, 200)
    progress("load", "Placing experts", 0, 1)
    assert said[0] == "kernels: Loading GPU kernels"
    weights = [m for m in said if "Loading weights" in m]
    assert weights[0] == "load: Loading weights (0/200)" and weights[-1] == "load: Loading weights (200/200)"
    assert len(weights) == 11 and said[-1] == "load: Placing experts"


def test_offload_bench_picks_the_qwen35_engine_for_a_qwen35_folder(tiny_qwen35, tmp_path):
    """bench.offload runs Qwen3.5-MoE folders on their own engine (the exllamav2 engine has no linear
    attention)."""
    from bench.offload import engine_for
    from runtime.exl2.synth import write_synthetic
    assert engine_for(str(tiny_qwen35)) == "hybrid"
    write_synthetic("tiny-moe", 4.0, tmp_path / "moe")
    assert engine_for(str(tmp_path / "moe")) == "exl2"


def test_bench_spec_loads_through_the_apps_engine_choice(tiny_qwen35, tmp_path, monkeypatch):
    """bench-spec loaded with exllamav2's engine on CUDA whatever the folder, so Qwen3.5-MoE's verify cost
    could not be measured; it now opens the engine the app would (runtime/loader.open_engine) for the backend
    and the drafting asked (on Qwen3.5-MoE's GPU engine the drafting sizes the rollback window a verify stays
    in), and the verify-cost result says which engine ran (here the CPU's, Qwen3.5's reference)."""
    import json
    from bench import spec
    from runtime import loader
    asked, real = [], loader.open_engine

    def spy(model, options, progress, **kw):
        asked.append((model, options.offload.backend, options.offload.vram_budget_gb, options.draft.mode,
                      options.draft.draft_tokens))
        return real(model, options, progress, **kw)
    monkeypatch.setattr(loader, "open_engine", spy)
    p = argparse.ArgumentParser()
    spec.add_arguments(p)
    args = p.parse_args(["--model", str(tiny_qwen35), "--what", "verify", "--backend", "cpu", "--context", "32",
                         "--tokens", "8", "--out", str(tmp_path), "--draft", "mtp", "--draft-tokens", "3",
                         "--repeats", "1"])       # the plumbing, not the medians: one timed repeat
    assert spec.run(args) == 0
    assert asked == [(str(tiny_qwen35), "cpu", None, "mtp", 3)]
    (out,) = tmp_path.glob("spec-verify-cost-*.json")
    r = json.loads(out.read_text())["bench"]
    assert r["kind"] == "speculative_verify_cost" and len(r["verify_cost"]) == 9        # K = 0..8


def test_convert_quality_refuses_exllamav2s_column_without_its_folders(capsys):
    """--methods exllamav2 names a column that only exllamav2's converter's output can fill: without
    --exllamav2-dir the benchmark says so before it exports or converts anything."""
    from bench.convert_quality import main
    with pytest.raises(SystemExit) as e:
        main(["--methods", "rtn", "exllamav2", "--work", "/nonexistent/never-made"])
    assert e.value.code == 2
    assert "--methods exllamav2 needs --exllamav2-dir" in capsys.readouterr().err


def test_convert_quality_counts_the_head_apart_and_unties_a_quantized_one(tmp_path):
    """exllamav2's converter quantizes lm_head even where it is tied to the embeddings. The evaluation then
    computes with both, as exllamav2 does (loaded into the tied model, the dequantized head had replaced the
    embeddings too), and counts the head's bits apart from the decoder's (what -b and --bpw count)."""
    import torch
    import transformers as tf
    from bench.convert_quality import load_exl2_into
    from runtime.exl2.writer import quantize_model
    from tests.convert_fixtures import tiny_checkpoint
    from tests.test_exl2_convert import _stored_bpw, _tensors
    src = tiny_checkpoint(tmp_path / "hf", "llama", layers=1)
    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.model.embed_tokens.weight = model.lm_head.weight         # tied, as the demo model is
    original = {k: v.clone() for k, v in model.state_dict().items()}
    config = json.loads((src / "config.json").read_text())
    quantize_model(original, config, 4.0, 6, tmp_path / "q")        # untied config: lm_head quantized at 6
    tensors = _tensors(tmp_path / "q")
    decoder, head = load_exl2_into(model, original, tmp_path / "q")
    assert decoder == pytest.approx(_stored_bpw(tensors)) and 6 < head < 7.5
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"].float())
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_offload_bench_measures_all_in_vram_with_its_baseline(tiny_qwen35, monkeypatch, tmp_path):
    """bench.offload --all-in-vram: a load without a budget (every expert in VRAM), time to first token for the
    prompt, decode next to the roofline of the weight bytes per token, and decode without the graphs as its
    baseline, the graphs put back after; a model whose experts are offloaded is refused."""
    import types
    import torch
    from bench import offload
    from runtime.backends import hybrid
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)        # the timers' sync, on the CPU here
    loaded, decodes, engines, closed_with = [], [], [], []

    class Graphs:                                  # stands for the decode graphs (the CPU engine has none)
        vocab, steps = 0, 0

        def captured(self):
            return [(256, 1)]

        def step(self, ids, at, keep):             # a replay: the warm-up's one-row steps
            self.steps += 1
            return torch.zeros(len(ids), self.vocab)
    graphs = Graphs()

    def fake_decode(engine, tok, n, seed=5):       # decode's own timing is the GPU's; here: with what graphs
        decodes.append((n, engine.graphs))
        return 100.0 + n, tok
    monkeypatch.setattr(offload, "decode", fake_decode)

    def load(path, options, progress, host_experts=None):
        loaded.append(options.offload.vram_budget_gb)
        engine, applied = hybrid.load(path, options, progress, device="cpu", host_experts=host_experts)
        engine.graphs, graphs.vocab = graphs, engine.info.vocab_size
        engines.append(engine)
        real_close = engine.close
        engine.close = lambda: (closed_with.append(engine.graphs), real_close())
        return engine, applied
    backend = types.SimpleNamespace(load=load)
    a = argparse.Namespace(model=str(tiny_qwen35), context=256, placement="auto", prompt=24, decode=3, no_naive=False,
                           naive_decode=2, profile=None)
    r = offload.measure_all_in_vram(backend, a, hbm=2e12, hbm_run=1e12, progress=lambda m: None)
    assert loaded == [None]
    assert r["ttft_s"] > 0 and r["prefill_tps"] == pytest.approx(24 / r["ttft_s"]) and r["decode_tps"] == 103
    assert r["hbm_bytes_per_token"] == engines[0]._bytes_per_token
    assert r["roofline"]["tps"] == pytest.approx(2e12 / r["hbm_bytes_per_token"]) and r["decode_graphs"]
    assert r["roofline_measured_ceilings"]["tps"] == pytest.approx(r["roofline"]["tps"] / 2)
    assert r["naive"] == {"name": "the layer loop, no decode graphs", "decode_tps": 102.0, "decode_tokens": 2}
    # warm-up and timed decode with the graphs; the baseline's warm-up and its timed run without
    assert decodes == [(11, graphs), (3, graphs), (2, None), (2, None)] and graphs.steps == 4
    assert closed_with[0] is graphs and engines[0].model is None                  # put back, then closed

    profiled = []
    monkeypatch.setattr("bench.cuda.profile_decode", lambda engine, path: profiled.append(path) or {"steps": 16})
    r = offload.measure_all_in_vram(backend, argparse.Namespace(**{**vars(a), "profile": str(tmp_path / "prof")}),
                                    hbm=2e12, hbm_run=1e12, progress=lambda m: None)
    assert r["profile"] == {"steps": 16} and profiled == [tmp_path / "prof" / f"offload-{tiny_qwen35.name}-all.txt"]

    with pytest.raises(SystemExit, match="do not all fit in VRAM"):
        offload.measure_all_in_vram(types.SimpleNamespace(load=lambda p, o, pr: load(p, o, pr, host_experts=True)),
                                    a, 2e12, 1e12, lambda m: None)


def test_offload_bench_refuses_no_budget_without_all_in_vram(capsys):
    """An empty --budgets measures the all-in-VRAM load alone; without --all-in-vram it would measure nothing,
    and is refused before any model is read."""
    from bench import offload
    with pytest.raises(SystemExit):
        offload.main(["--model", "/nonexistent", "--budgets", ""])
    assert "--budgets is empty" in capsys.readouterr().err


def test_the_prefill_profile_runs_the_prefill_the_app_runs(tmp_path, monkeypatch):
    """bench.cuda's prefill profile times `prefill` (the head on the last row), as its timed prefill does:
    through `forward` the head ran over every row, 31% of a 4096-token profile's kernel time."""
    import torch
    from bench import cuda
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []

    class Engine:
        def reset(self):
            calls.append("reset")

        def prefill(self, ids):
            calls.append(("prefill", len(ids)))
            return torch.zeros(1, 8)

        def forward(self, ids):
            raise AssertionError("the profile ran a forward over every row's logits")
    r = cuda.profile_prefill(Engine(), tmp_path / "p.txt", 12)
    assert calls == ["reset", ("prefill", 12), "reset", ("prefill", 12)] and r["tokens"] == 12
    assert "prefill of 12 tokens" in (tmp_path / "p.txt").read_text()
