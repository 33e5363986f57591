"""exllamav2 (CUDA) loads what our writer writes, and its dequantized weights equal ours.

Run on the GPU test machine:  python -m pytest -m gpu tests/gpu/test_exl2_gpu.py
(skipped where CUDA is absent; exllamav2 is imported only inside the tests, as it builds its
extension at import).

For every bit width and several mixes, a one-layer Qwen3 model with random weights is quantized
with `quantize_model` (vocabulary 1000, so lm_head's 1000 outputs are padded to 1024 as exllamav2
does) and loaded whole with ExLlamaV2; then for every quantized linear:
  - `get_weight_tensor_dq()` (exllamav2's reconstruct kernel) equals our `dequantize` to within
    one fp16 rounding (we reproduce its fp16 arithmetic, so we expect bit equality);
  - its GEMM (`forward`, the kernel chosen for the bit mix) matches x @ W.T of our weights for
    1, 5 and 64 rows, to fp16 accumulation accuracy;
and the model's forward gives finite logits. The synthetic tiny-moe (16 experts) and tiny-dense
folders written by `moedesk-cli synth` load the same way, tokenizer included.
"""
from __future__ import annotations

import json

import pytest
import torch

from runtime.exl2 import format as fmt
from runtime.exl2.shapes import Shape, hf_config, tensors
from runtime.exl2.synth import write_synthetic
from runtime.exl2.synth_tokenizer import write_tokenizer
from runtime.exl2.writer import quantize_model

pytestmark = pytest.mark.gpu

BITS = [2, 3, 4, 5, 6, 8, 2.5, 3.5, 4.5, 5.5, 7.0]
TEST_SHAPE = Shape("gpu-check", "Qwen3ForCausalLM", "a one-layer Qwen3 (test)", layers=1, hidden=256, heads=4,
                   kv_heads=2, head_dim=64, intermediate=512, vocab=1000, max_position=4096)


def _write_quantized(path, bits):
    """Random fp32 weights -> quantize_model at `bits` (head too, or 6 for fractional bits)."""
    g = torch.Generator().manual_seed(int(bits * 10))

    def state_dict():
        for t in tensors(TEST_SHAPE):
            name = t.name if t.kind not in ("linear", "head") else t.name + ".weight"
            if t.kind == "norm":
                yield name, torch.ones(t.shape)
            else:
                yield name, torch.randn(t.shape, generator=g) * 0.05

    head_bits = int(bits) if bits in fmt.WIDTHS else 6
    quantize_model(state_dict(), hf_config(TEST_SHAPE), bits, head_bits, path, group_size=64)
    write_tokenizer(path, TEST_SHAPE.vocab, TEST_SHAPE.first_special, TEST_SHAPE.max_position)


def _load(path):
    pytest.importorskip("exllamav2")
    from exllamav2 import ExLlamaV2, ExLlamaV2Config
    config = ExLlamaV2Config(str(path))
    model = ExLlamaV2(config)
    model.load()
    return config, model


def _disk_tensors(path):
    from safetensors import safe_open
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for shard in set(index["weight_map"].values()):
        with safe_open(str(path / shard), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def _mlp_views(key: str, disk, ours_t: torch.Tensor) -> list[torch.Tensor]:
    """The ways exllamav2 may hold a dense MLP linear: as written, or with down_proj's input permutation
    folded out of down_proj (`unmap`) and into gate/up's output columns (exllamav2's mlp.py): then
    gate/up's columns and down's rows appear in down's packed order. Either direction is tried; random
    weights never match a wrong permutation exactly."""
    views = [ours_t]
    prefix, _, name = key.rpartition(".")
    inv = disk.get(f"{prefix}.down_proj.q_invperm")
    if name in ("gate_proj", "up_proj", "down_proj") and ".mlp.experts." not in key and inv is not None:
        inv = inv.long()
        perm = torch.argsort(inv)
        for p in (perm, inv):
            views.append(ours_t[p, :] if name == "down_proj" else ours_t[:, p])
    return views


def _check_linears(model, path, gemm: bool) -> int:
    from exllamav2.linear import ExLlamaV2Linear
    disk = _disk_tensors(path)
    checked = 0
    for key, module in model.modules_dict.items():
        if not isinstance(module, ExLlamaV2Linear) or f"{key}.q_weight" not in disk:
            continue
        assert module.is_quant(), f"{key}: exllamav2 did not load it as a quantized matrix"
        q = {k: disk[f"{key}.{k}"] for k in fmt.REQUIRED_KEYS}
        ours = fmt.dequantize(q, dtype=torch.float16, name=key)               # [N, in]
        theirs = module.get_weight_tensor_dq().cpu()                           # [in, N]
        assert theirs.shape == ours.t().shape, key
        first = None
        views = _mlp_views(key, disk, ours.t())
        for view in views:
            diff = (theirs.float() - view.float()).abs()
            ulp = view.float().abs() * 2.0 ** -11 + 2.0 ** -24
            if bool((diff <= ulp).all()):
                break
            first = first or (diff.max().item(), (diff == 0).float().mean().item())
        else:
            assert False, f"{key}: max diff {first[0]:.3g}, {first[1]:.4%} bit-equal"
        if gemm and view is views[0]:          # a folded permutation changes the output order: values checked above
            for rows in (1, 5, 64):
                x = torch.randn(rows, ours.shape[1], generator=torch.Generator().manual_seed(rows)).half()
                y = module.forward(x.cuda()).float().cpu()                     # [rows, N]
                ref = x.float() @ ours.float().t()
                err = (y - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                assert err < 2e-2, f"{key}: GEMM with {rows} rows off by {err:.3g} of the output scale"
        checked += 1
    return checked


@pytest.mark.parametrize("bits", BITS)
def test_exllamav2_reconstructs_our_weights(tmp_path, bits):
    _write_quantized(tmp_path, bits)
    config, model = _load(tmp_path)
    try:
        checked = _check_linears(model, tmp_path, gemm=True)
        assert checked == 7 + 1                                   # q k v o gate up down + lm_head
        ids = torch.randint(0, TEST_SHAPE.vocab, (1, 12))
        logits = model.forward(ids).float()
        assert logits.shape[:2] == (1, 12) and logits.shape[-1] >= TEST_SHAPE.vocab
        assert torch.isfinite(logits).all()
    finally:
        model.unload()


@pytest.mark.parametrize("shape,bpw", [("tiny-moe", 4.0), ("tiny-moe", 2.5), ("tiny-dense", 6.0)])
def test_synthetic_models_load_in_exllamav2(tmp_path, shape, bpw):
    write_synthetic(shape, bpw, tmp_path, seed=3)
    config, model = _load(tmp_path)
    try:
        checked = _check_linears(model, tmp_path, gemm=False)
        layers = config.num_hidden_layers
        per_layer = 4 + (3 * config.num_experts if shape == "tiny-moe" else 3)
        assert checked == layers * per_layer + (0 if shape == "tiny-dense" else 1)
        for rows in (1, 3, 5):                                    # fused MoE path (<= 4 rows) and the torch path
            logits = model.forward(torch.randint(0, 900, (1, rows))).float()
            assert torch.isfinite(logits).all()
        from exllamav2 import ExLlamaV2Tokenizer
        tok = ExLlamaV2Tokenizer(config)
        ids = tok.encode("<|im_start|>user\nHello, world<|im_end|>", encode_special_tokens=True)
        assert tok.decode(ids, decode_special_tokens=True)[0] == "<|im_start|>user\nHello, world<|im_end|>"
    finally:
        model.unload()
