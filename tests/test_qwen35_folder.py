"""Qwen3.5-MoE model folders: the released config as a synthetic shape, validation (every tensor, shapes,
bounded sizes), parameter counts, the fit estimate's recurrent state, the stacked-experts layout of the
released bf16 checkpoints, and a synthetic EXL2 folder through the reference engine."""
from __future__ import annotations

import json

import pytest
import torch

from app.hub.fit import ModelShape, estimate_fit
from runtime import qwen35
from runtime.exl2 import synth
from runtime.exl2.shapes import SHAPES, hf_config, param_counts, tensors
from runtime.errors import InvalidModel, ModelFolderError
from runtime.modelfolder import validate

BIG = SHAPES["qwen3.5-122b-a10b"]


def test_big_shape_writes_the_released_config_and_counts():
    cfg = hf_config(BIG)
    t = cfg["text_config"]
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["num_key_value_heads"],
            t["head_dim"], t["vocab_size"], t["num_experts"], t["num_experts_per_tok"], t["moe_intermediate_size"],
            t["shared_expert_intermediate_size"], t["linear_num_key_heads"], t["linear_num_value_heads"],
            t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"],
            t["full_attention_interval"], t["max_position_embeddings"]) == \
        (3072, 48, 32, 2, 256, 248320, 256, 8, 1024, 1024, 16, 64, 128, 128, 4, 4, 262144)
    assert t["rope_parameters"]["partial_rotary_factor"] == 0.25 and t["rope_parameters"]["rope_theta"] == 1e7
    assert t["layer_types"].count("full_attention") == 12 and t["layer_types"][3] == "full_attention"
    total, active = param_counts(BIG)
    assert abs(total - 122e9) < 0.5e9 and abs(active - 10e9) < 0.5e9        # "122B-A10B"
    flat = qwen35.read_config(cfg, "config.json")
    assert qwen35.param_counts(flat) == (total, active)
    # 36 DeltaNet layers: a [64, 128, 128] float32 state and 3 inputs of 12288 channels each
    assert qwen35.state_bytes(flat) == 36 * (64 * 128 * 128 * 4 + 3 * 12288 * 2)
    # the synth writer can write it: every quantized dimension a multiple of 32, ~46 GB at 3 bpw
    assert all(d % 32 == 0 for t in tensors(BIG) if t.kind in ("linear", "head") for d in t.shape)
    assert 44e9 < synth.estimate_bytes(BIG, 3.0, 6) < 50e9


def test_fit_estimate_counts_the_kv_of_attention_layers_and_the_state_of_the_others():
    cfg = hf_config(BIG)
    shape = ModelShape.from_config(cfg)
    assert shape.total_params() == param_counts(BIG)[0]
    assert shape.kv_elements(1000) == 2 * 12 * 2 * 256 * 1000             # 12 of 48 layers keep a KV cache
    est = estimate_fit(shape, 3.0, 32768, "fp16", 24 * 1024 ** 3, 128 * 1024 ** 3)
    assert est.kv_bytes == shape.kv_elements(32768) * 2 + qwen35.state_bytes(qwen35.read_config(cfg, "c"))
    assert est.verdict.value == "fits_offload"                              # 24 GB card + 128 GB RAM at 3 bpw


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q35") / "tiny-qwen3.5"
    synth.write_synthetic("tiny-qwen3.5", 4.0, folder, seed=3)
    return folder


def test_tiny_synthetic_folder_validates_with_its_counts(tiny):
    info = validate(tiny)
    assert info.architecture == "Qwen3_5MoeForConditionalGeneration" and info.is_exl2
    assert (info.num_experts, info.experts_per_token) == (16, 4)
    assert (info.num_params, info.active_params) == param_counts(SHAPES["tiny-qwen3.5"])


def test_tiny_synthetic_folder_runs_and_rolls_back_in_the_reference_engine(tiny):
    from runtime.reference import load
    engine, _ = load(tiny)                                    # int8, the default
    seq = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    full = engine.forward(seq)
    assert full.shape == (12, 1024) and torch.isfinite(full).all()
    engine.truncate(7)
    again = engine.forward(seq[7:])
    assert (again - full[7:]).abs().max() <= 0.05 * full.abs().max()  # int8 decode kernel vs the prefill path


def _rewrite(folder, edit) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.fixture()
def plain(tmp_path):
    """A transformers-saved tiny checkpoint (float32, per-expert tensors)."""
    from tests.test_qwen35_parity import make_model
    make_model("conditional", tmp_path)
    return tmp_path


def _config_edit(folder, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


P = "model.language_model.layers"


@pytest.mark.parametrize("edit, problem", [
    (lambda t: t.pop(f"{P}.1.linear_attn.A_log"), f"tensor '{P}.1.linear_attn.A_log' is missing"),
    (lambda t: t.pop(f"{P}.3.self_attn.q_norm.weight"), "q_norm.weight' is missing"),
    (lambda t: t.pop(f"{P}.0.mlp.experts.5.down_proj.weight"), "experts.5.down_proj.weight' is missing"),
    (lambda t: t.pop(f"{P}.2.mlp.shared_expert_gate.weight"), "shared_expert_gate.weight' is missing"),
    (lambda t: t.update({f"{P}.0.linear_attn.conv1d.weight": torch.zeros(160, 1, 3)}),
     "conv1d.weight' has shape [160, 1, 3], the config implies [160, 1, 4]"),
    (lambda t: t.update({f"{P}.3.self_attn.q_proj.weight": torch.zeros(128, 64)}),
     "q_proj.weight' has shape [128, 64], the config implies [256, 64]"),
])
def test_a_missing_or_misshapen_tensor_is_named(plain, edit, problem):
    _rewrite(plain, edit)
    with pytest.raises(InvalidModel) as e:
        validate(plain, require_tokenizer=False)
    assert problem in e.value.message


@pytest.mark.parametrize("edit, problem", [
    (lambda c: c.update(text_config=[1]), "'text_config' must be an object"),
    (lambda c: c["text_config"].update(linear_num_value_heads=3), "not a multiple of 'linear_num_key_heads'"),
    (lambda c: c["text_config"].update(linear_num_value_heads=10 ** 9), "'linear_num_value_heads' must be a positive"),
    (lambda c: c["text_config"].update(linear_conv_kernel_dim=0), "'linear_conv_kernel_dim' must be a positive"),
    (lambda c: c["text_config"].update(layer_types=["full_attention"]), "'layer_types' must list 4 entries"),
    (lambda c: c["text_config"].update(num_experts_per_tok=7), "is more than 'num_experts'"),
    (lambda c: c["text_config"]["rope_parameters"].update(partial_rotary_factor=2), "'partial_rotary_factor'"),
    (lambda c: c["text_config"].update(hidden_act="gelu"), "activation 'gelu' is not supported"),
])
def test_a_bad_config_is_refused_by_name(plain, edit, problem):
    _config_edit(plain, edit)
    with pytest.raises(ModelFolderError) as e:
        validate(plain, require_tokenizer=False)
    assert problem in e.value.message


def test_stacked_experts_of_the_released_checkpoints_load_and_match(plain):
    """Experts as the bf16 releases store them (gate_up_proj [E, 2I, H], down_proj [E, H, I]): same counts,
    same logits as the per-expert folder."""
    from runtime.reference import load
    ref_engine, _ = load(plain, precision="float32")
    seq = list(range(3, 40, 3))
    ref = ref_engine.forward(seq)
    before = validate(plain, require_tokenizer=False)

    def stack(t):
        for i in range(4):
            e = f"{P}.{i}.mlp.experts"
            gate_up = [torch.cat([t.pop(f"{e}.{j}.gate_proj.weight"), t.pop(f"{e}.{j}.up_proj.weight")]) for j in range(6)]
            t[f"{e}.gate_up_proj"] = torch.stack(gate_up)
            t[f"{e}.down_proj"] = torch.stack([t.pop(f"{e}.{j}.down_proj.weight") for j in range(6)])
    _rewrite(plain, stack)
    after = validate(plain, require_tokenizer=False)
    assert (after.num_params, after.active_params) == (before.num_params, before.active_params)
    engine, _ = load(plain, precision="float32")
    # equal up to float32 rounding: the engine's thread count follows the machine's load (cpu_load's
    # governor), and another team size sums in another order (1.8e-6 seen beside another job)
    assert (engine.forward(seq) - ref).abs().max() < 1e-5


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_reduced_precisions_stay_as_close_as_transformers_own_bfloat16(plain, precision):
    """This random model is sensitive (transformers' own bf16 forward is ~0.6 of the logit scale away from
    float32 at its worst row): ours at reduced precision must be no further than 1.5 times that (2.5 at int8), and
    agree on the top token as often, less a margin."""
    import copy

    import transformers

    from runtime.reference import load
    from tests.test_qwen35_parity import _tokens, oracle
    model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(plain).eval()
    seq = _tokens(48, 3)
    ref = oracle(model, seq)
    theirs = oracle(copy.deepcopy(model).to(torch.bfloat16), seq)
    engine, _ = load(plain, precision=precision)
    got = torch.cat([engine.forward(seq[:40]), engine.forward(seq[40:46]), engine.forward([seq[46]]),
                     engine.forward([seq[47]])])
    scale = ref.abs().max()
    ours_rel, theirs_rel = ((got - ref).abs().max() / scale).item(), ((theirs - ref).abs().max() / scale).item()
    # int8 also rounds the activations to 8 bits per group (the integer CPU kernel): 1.2 of the logit scale at this
    # random model's worst row where bf16 gives 0.6; the top token must still agree as often
    factor = 2.5 if precision == "int8" else 1.5
    assert ours_rel < factor * theirs_rel, f"{precision}: {ours_rel:.3f} of the logit scale, transformers' bf16 {theirs_rel:.3f}"
    agree, theirs_agree = ((x.argmax(-1) == ref.argmax(-1)).float().mean().item() for x in (got, theirs))
    assert agree >= theirs_agree - 0.1


def test_tiny_synthetic_folder_answers_through_the_worker(tiny):
    from runtime import protocol as P
    from runtime.client import WorkerClient, new_id
    from runtime.options import SamplingOptions
    with WorkerClient() as w:
        loaded = w.load(str(tiny))
        assert loaded.backend == "cpu" and loaded.vocab_size == 1024
        req = P.Generate(request_id=new_id("t"), messages=(P.ChatMessage("user", "Hi"),),
                         sampling=SamplingOptions(temperature=0.0, max_tokens=6))
        finished = None
        for ev in w.generate(req, timeout=120):
            if isinstance(ev, P.Error):
                raise P.exception_for(ev)
            if isinstance(ev, P.Finished):
                finished = ev
    assert finished is not None and 0 < finished.stats.generated_tokens <= 6


def test_a_config_implying_far_more_tensors_than_stored_fails_before_the_layout_is_built(plain):
    """4096 experts per layer, stored per expert (the folder stacks none): refused from the count of the
    expert tensors, before a name is built for each."""
    _config_edit(plain, lambda c: c["text_config"].update(num_experts=4096))
    with pytest.raises(ModelFolderError) as e:
        validate(plain, require_tokenizer=False)
    assert "4 layers imply at least 49" in e.value.message


def test_on_a_gpu_machine_cuda_and_auto_run_it_in_the_hybrid_engine(tiny, monkeypatch):
    """On a GPU machine the backends "cuda" and "auto" both hand an EXL2 Qwen3.5 folder to the hybrid
    engine (run here on the CPU: its load is called with the device forced)."""
    from runtime import loader
    from runtime.backends import hybrid
    from runtime.options import LoadOptions, OffloadOptions
    monkeypatch.setattr(loader, "cuda_device", lambda: "a test GPU")
    monkeypatch.setattr(loader, "kernels_building", lambda: False)
    calls = []
    real = hybrid.load

    def on_cpu(path, options, progress):
        calls.append(path)
        return real(path, options, progress, device="cpu")
    monkeypatch.setattr(hybrid, "load", on_cpu)
    assert loader.choose_backend("auto").backend == "cuda"
    for backend in ("auto", "cuda"):
        engine, applied = loader.open_engine(str(tiny), LoadOptions(offload=OffloadOptions(backend=backend)),
                                             lambda *a: None, require_tokenizer=False)
        try:
            assert calls.pop() == tiny and isinstance(engine, hybrid.HybridExl2Engine), backend
            assert applied["offload.backend"].startswith("applied: cuda (Using the GPU engine on a test GPU")
            assert engine.info.num_experts == 16 and engine.forward([1, 2, 3]).shape == (3, 1024)
        finally:
            engine.close()
    assert calls == []


def test_auto_backend_on_a_gpu_machine_runs_a_plain_folder_on_the_cpu_and_says_why(plain, monkeypatch):
    from runtime import loader
    from runtime.options import LoadOptions, OffloadOptions
    monkeypatch.setattr(loader, "cuda_device", lambda: "a test GPU")
    monkeypatch.setattr(loader, "kernels_building", lambda: False)
    engine, applied = loader.open_engine(str(plain), LoadOptions(offload=OffloadOptions(backend="auto")),
                                         lambda *a: None, require_tokenizer=False)
    try:
        assert applied["offload.backend"].startswith("applied: cpu (The GPU engine runs "
                                                     "Qwen3_5MoeForConditionalGeneration from EXL2 folders only")
        assert engine.backend == "cpu" and type(engine).__name__ == "HybridEngine"
        assert type(engine).__module__ == "runtime.reference.hybrid"
    finally:
        engine.close()
