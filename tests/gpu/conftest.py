"""GPU test fixtures: random-weight EXL2 models written by the project's writer, once per session.

- `moe_2l`, `dense_2l`, `llama_2l`: the real shapes of Qwen3-30B-A3B (128 experts, top-8, hidden
  2048), Qwen3-0.6B and SmolLM2-135M (Llama), cut to 2 layers (`synth --layers 2`): the engine-vs-reference checks run on real
  widths, where exllamav2's kernels are meant to run.
- `tiny_moe`, `tiny_dense`: miniature models (hidden 256) for load, cache and memory checks. On
  these, exllamav2's own single-token path disagreed with its batched path by 0.2-0.4 (relative,
  logits) on the test machine, so they are not used for logit comparisons.

Every synthetic model is written once: in this session's temporary folder, or, with
MOEDESK_GPU_MODELS=DIR set, under DIR, where the later pytest processes of a run (bench/gpu_suite.sh
runs one per file) find it (a folder appears there under its final name only once complete).
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

MODELS_ENV = "MOEDESK_GPU_MODELS"
WAIT_S = 900            # how long to wait for another live process writing the same model, then write it too


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def cached_model(name: str, make: Callable[[Path], object], tmp_path_factory) -> Path:
    """The model folder `name`, written by make(folder) the first time it is asked for (see the module's
    docstring for where). A folder gets its final name only once make returned, so a run killed halfway
    leaves a partial folder that the next writer of that name removes, never a model that looks whole. While
    another live process writes it (bench/gpu_suite.sh's lanes), this one waits for it (at most WAIT_S)."""
    shared = os.environ.get(MODELS_ENV)
    root = Path(shared) if shared else tmp_path_factory.getbasetemp() / "models"
    out = root / name
    if out.is_dir():
        return out
    root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + WAIT_S
    while True:
        writing = False
        for part in root.glob(f".{name}.partial-*"):
            pid = part.name.rsplit("-", 1)[1]
            if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
                writing = True                              # another process of the run (a lane) writes it
            else:
                shutil.rmtree(part, ignore_errors=True)     # left by a killed process, or by this one failing
        if out.is_dir():
            return out
        if not writing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    part = root / f".{name}.partial-{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir()
    make(part)
    try:
        part.rename(out)
    except OSError:                                         # another process finished it first
        if not out.is_dir():
            raise
        shutil.rmtree(part, ignore_errors=True)
    return out


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """synthetic(name, make) -> folder: cached_model for the test files' own models."""
    return lambda name, make: cached_model(name, make, tmp_path_factory)

TINY = {
    "moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 128,
            "num_experts_per_tok": 8, "moe_intermediate_size": 128, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": []},
    "dense": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
}


def make_model(kind: str, out: Path, bits: float = 4.0, seed: int = 0) -> Path:
    from runtime.exl2.writer import quantize_model
    cfg = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 128, "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16", "attention_bias": False,
           **TINY[kind]}
    g = torch.Generator().manual_seed(seed)
    H, V, D = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]

    def lin(o, i):
        return torch.randn(o, i, generator=g) / i ** 0.5

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    def tensors():
        yield "model.embed_tokens.weight", torch.randn(V, H, generator=g).half()
        for l in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{l}."
            yield p + "input_layernorm.weight", norm(H).half()
            yield p + "post_attention_layernorm.weight", norm(H).half()
            yield p + "self_attn.q_proj.weight", lin(cfg["num_attention_heads"] * D, H)
            yield p + "self_attn.k_proj.weight", lin(cfg["num_key_value_heads"] * D, H)
            yield p + "self_attn.v_proj.weight", lin(cfg["num_key_value_heads"] * D, H)
            yield p + "self_attn.o_proj.weight", lin(H, cfg["num_attention_heads"] * D)
            yield p + "self_attn.q_norm.weight", norm(D).half()
            yield p + "self_attn.k_norm.weight", norm(D).half()
            if kind == "moe":
                I = cfg["moe_intermediate_size"]
                yield p + "mlp.gate.weight", (torch.randn(cfg["num_experts"], H, generator=g) * 0.5).half()
                for e in range(cfg["num_experts"]):
                    yield p + f"mlp.experts.{e}.gate_proj.weight", lin(I, H)
                    yield p + f"mlp.experts.{e}.up_proj.weight", lin(I, H)
                    yield p + f"mlp.experts.{e}.down_proj.weight", lin(H, I)
            else:
                I = cfg["intermediate_size"]
                yield p + "mlp.gate_proj.weight", lin(I, H)
                yield p + "mlp.up_proj.weight", lin(I, H)
                yield p + "mlp.down_proj.weight", lin(H, I)
        yield "model.norm.weight", norm(H).half()
        yield "lm_head.weight", lin(V, H)

    quantize_model(tensors(), cfg, bits, 6, out, group_size=32)
    return out


def synth_model(shape: str, layers: int, bpw: float, out: Path) -> Path:
    import argparse
    from runtime.exl2 import synth
    parser = argparse.ArgumentParser()
    synth.add_arguments(parser)
    args = parser.parse_args(["--shape", shape, "--bpw", str(bpw), "--layers", str(layers), "--out", str(out)])
    if synth.run(args) != 0:
        pytest.fail(f"synth {shape} failed")
    return out


def _synth(tmp_path_factory, shape: str, layers: int, bpw: float = 4.0) -> Path:
    return cached_model(f"{shape}-{layers}l-{bpw}bpw", lambda out: synth_model(shape, layers, bpw, out),
                        tmp_path_factory)


@pytest.fixture(scope="session")
def moe_2l(tmp_path_factory) -> Path:
    return _synth(tmp_path_factory, "qwen3-30b-a3b", 2)


@pytest.fixture(scope="session")
def moe_8l(tmp_path_factory) -> Path:
    """Eight layers: the fewest where offload saves memory (staging for C experts, double-buffered, plus
    E + 1 - C resident per layer cost a 2-layer model all its experts' codes, whatever C)."""
    return _synth(tmp_path_factory, "qwen3-30b-a3b", 8)


@pytest.fixture(scope="session")
def dense_2l(tmp_path_factory) -> Path:
    return _synth(tmp_path_factory, "qwen3-0.6b", 2)


@pytest.fixture(scope="session")
def llama_2l(tmp_path_factory) -> Path:
    return _synth(tmp_path_factory, "smollm2-135m", 2)


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    return cached_model("tiny-moe-128x8", lambda out: make_model("moe", out), tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory) -> Path:
    return cached_model("tiny-dense", lambda out: make_model("dense", out), tmp_path_factory)


@pytest.fixture
def routing(monkeypatch):
    """The MoE layers' picks, recorded or replayed (routing_replay.Routing), for one test: installed before
    the test's engines load (graphs captured at load hold its copies)."""
    from routing_replay import Routing
    r = Routing(monkeypatch)
    yield r
    r.undo()


@pytest.fixture
def references(moe_2l, dense_2l, llama_2l):
    """kind -> the float32 reference, on the GPU (the CPU's weights and arithmetic there, without TF32);
    closed after the test, its VRAM given back."""
    from runtime import reference
    from runtime.options import LoadOptions
    paths = {"moe": moe_2l, "dense": dense_2l, "llama": llama_2l}
    engines = {}

    def get(kind):
        if kind not in engines:
            engines[kind] = reference.load(paths[kind], LoadOptions(), lambda *a: None, precision="float32",
                                           device="cuda")[0]
        return engines[kind]
    yield get
    for eng in engines.values():
        eng.close()
    engines.clear()
    torch.cuda.empty_cache()
