"""Model folder validation: every bad input gets an error that names the file and the problem."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime.errors import InvalidModel, ModelNotFound, UnsupportedArchitecture
from runtime.modelfolder import FolderInfo, ModelFolder, ModelFolderError, layout, read_header, validate

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40,
         "intermediate_size": 24, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 16,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "vocab_size": 40, "intermediate_size": 24, "moe_intermediate_size": 8, "num_experts": 4,
             "num_experts_per_tok": 2, "tie_word_embeddings": True}
# as transformers writes it: num_local_experts, intermediate_size is one expert's width
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 16,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40,
           "intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}
# DBRX's nested config; its weights under exllamav2's names (as the EXL2 folders hold them)
DBRX = {"architectures": ["DbrxForCausalLM"], "model_type": "dbrx", "d_model": 16, "n_layers": 2, "n_heads": 4,
        "vocab_size": 40, "max_seq_len": 64, "attn_config": {"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 500000},
        "ffn_config": {"ffn_hidden_size": 8, "moe_num_experts": 6, "moe_top_k": 4, "moe_normalize_expert_weights": 1}}


def _dbrx_flat(**over):
    """DBRX as the model folder reads it (layout() takes the flattened config)."""
    return {**DBRX, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 8, "num_experts": 6, "num_experts_per_tok": 4, **over}


def make_folder(root: Path, config: dict, drop: str | None = None, shards: int = 1) -> Path:
    """A small valid folder with random weights for `config` (optionally without tensor `drop`)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text("{}")
    lay = layout(config)
    tensors = {name: torch.randn(shape) for name, shape in lay.plain.items()}
    tensors.update({f"{p}.weight": torch.randn(o, i) for p, (o, i) in lay.linears.items()})
    tensors.pop(drop, None)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"))
        return root
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(root / file))
        weight_map.update({n: file for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def error(path, **kw) -> ModelFolderError:
    with pytest.raises(ModelFolderError) as e:
        validate(path, **kw)
    return e.value


def test_valid_dense_folder(tmp_path):
    info = validate(make_folder(tmp_path / "m", LLAMA))
    assert isinstance(info, FolderInfo)
    assert (info.architecture, info.num_layers, info.vocab_size, info.num_experts) == ("LlamaForCausalLM", 2, 40, 0)
    assert info.num_params == info.active_params
    assert info.num_params == 40 * 16 * 2 + 16 + 2 * (2 * 16 + 16 * 16 * 2 + 2 * 8 * 16 + 3 * 24 * 16)
    assert info.bits_per_weight == 32.0 and not info.is_exl2 and info.has_tokenizer
    assert info.size_bytes > info.num_params * 4


def test_valid_moe_folder_counts_active_params(tmp_path):
    info = validate(make_folder(tmp_path / "m", QWEN3_MOE, shards=3))
    assert info.num_experts == 4 and info.experts_per_token == 2
    assert info.num_params - info.active_params == 2 * (4 - 2) * 3 * 8 * 16


def test_valid_mixtral_folder_counts_active_params(tmp_path):
    info = validate(make_folder(tmp_path / "m", MIXTRAL, shards=2))
    assert (info.architecture, info.num_experts, info.experts_per_token) == ("MixtralForCausalLM", 4, 2)
    per_layer = 2 * 16 + 16 * 16 * 2 + 2 * 8 * 16 + 4 * 16 + 4 * 3 * 8 * 16     # norms, attention, router, experts
    assert info.num_params == 2 * 40 * 16 + 16 + 2 * per_layer
    assert info.num_params - info.active_params == 2 * (4 - 2) * 3 * 8 * 16


def test_valid_dbrx_folder_reads_its_nested_config(tmp_path):
    folder = make_folder(tmp_path / "m", _dbrx_flat())
    (folder / "config.json").write_text(json.dumps(DBRX))
    info = validate(folder)
    assert (info.architecture, info.num_layers, info.num_experts, info.experts_per_token) == \
           ("DbrxForCausalLM", 2, 6, 4)
    assert info.config["clip_qkv"] == 8 and info.config["rope_theta"] == 500000
    assert info.num_params - info.active_params == 2 * (6 - 4) * 3 * 8 * 16
    assert ModelFolder(folder).linear("model.layers.1.block_sparse_moe.experts.5.v1").shape == (8, 16)


@pytest.mark.parametrize("edit, expected", [
    (lambda c: c["ffn_config"].update(moe_num_experts=1 << 20), "num_experts"),
    (lambda c: c["ffn_config"].update(moe_top_k=7), "num_experts_per_tok"),
    (lambda c: c["attn_config"].update(kv_n_heads=3), "num_key_value_heads"),
    (lambda c: c["attn_config"].update(clip_qkv=-1), "clip_qkv"),
    (lambda c: c.update(attn_config=[1]), "attn_config"),
    (lambda c: c["ffn_config"].update(ffn_act_fn={"name": "gelu"}), "ffn_act_fn"),
])
def test_dbrx_config_checked(tmp_path, edit, expected):
    folder = make_folder(tmp_path / "m", _dbrx_flat())
    config = json.loads(json.dumps(DBRX))
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    e = error(folder)
    assert expected in e.message and "config.json" in e.message


def test_dbrx_original_layout_named(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DBRX))
    (folder / "tokenizer.json").write_text("{}")
    save_file({"transformer.wte.weight": torch.zeros(40, 16)}, str(folder / "model.safetensors"))
    e = error(folder)
    assert isinstance(e, UnsupportedArchitecture) and "transformer.blocks" in e.message and "EXL2" in e.message


@pytest.mark.parametrize("key, value", [("sliding_window", 0), ("sliding_window", "4096"),
                                        ("num_local_experts", 1 << 20), ("num_experts_per_tok", 5)])
def test_mixtral_config_sizes_bounded(tmp_path, key, value):
    folder = make_folder(tmp_path / "m", MIXTRAL)
    (folder / "config.json").write_text(json.dumps({**MIXTRAL, key: value}))
    e = error(folder)
    assert isinstance(e, InvalidModel) and "config.json" in e.message
    assert key in e.message or "num_experts" in e.message


def test_missing_folder(tmp_path):
    e = error(tmp_path / "nope")
    assert isinstance(e, ModelNotFound) and "nope" in e.message


def test_missing_config(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    (folder / "config.json").unlink()
    e = error(folder)
    assert isinstance(e, InvalidModel) and "config.json" in e.message and "missing" in e.message


def test_unparsable_config_names_line_and_column(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    (folder / "config.json").write_text('{\n  "architectures": ["LlamaForCausalLM"],\n  "hidden_size": ,\n}')
    e = error(folder)
    assert "config.json" in e.message and "line 3, column 18" in e.message


def test_config_missing_field(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    (folder / "config.json").write_text(json.dumps({**LLAMA, "hidden_size": "16"}))
    e = error(folder)
    assert "config.json" in e.message and "'hidden_size' must be a positive integer" in e.message


def test_missing_tokenizer(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    (folder / "tokenizer.json").unlink()
    e = error(folder)
    assert isinstance(e, InvalidModel) and "tokenizer.json" in e.message
    assert validate(folder, require_tokenizer=False).has_tokenizer is False


def test_unsupported_architecture_names_supported_ones(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    (folder / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["FalconForCausalLM"]}))
    e = error(folder)
    assert isinstance(e, UnsupportedArchitecture)
    assert "FalconForCausalLM" in e.message and "config.json" in e.message
    assert "MixtralForCausalLM" in e.message and "Qwen3MoeForCausalLM" in e.message


def test_pickle_weights_refused_without_opening(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 not opened")
    e = error(folder)
    assert "pytorch_model.bin" in e.message and "pickle" in e.message


def test_no_weights(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    (folder / "model.safetensors").unlink()
    assert "no *.safetensors" in error(folder).message


def _rewrite_header(path: Path, edit) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header = edit(header)
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


@pytest.mark.parametrize("edit, expected", [
    (lambda h: b"{not json", "not valid JSON"),
    (lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"], "dtype": "F17"}}, "unknown dtype 'F17'"),
    (lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"], "shape": [16, -1]}}, "invalid shape"),
    (lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"], "shape": [17]}}, "needs 68"),
    (lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"],
                                           "data_offsets": [h["model.norm.weight"]["data_offsets"][1], 0]}},
     "invalid data_offsets"),
])
def test_corrupt_header(tmp_path, edit, expected):
    folder = make_folder(tmp_path / "m", LLAMA)
    _rewrite_header(folder / "model.safetensors", edit)
    e = error(folder)
    assert isinstance(e, InvalidModel) and "model.safetensors" in e.message
    assert "corrupt safetensors header" in e.message and expected in e.message


def test_overlapping_offsets(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)

    def overlap(h):
        a, b = "model.norm.weight", "model.layers.0.input_layernorm.weight"
        h[b] = {**h[b], "data_offsets": list(h[a]["data_offsets"])}
        return h
    _rewrite_header(folder / "model.safetensors", overlap)
    assert "overlap" in error(folder).message


def test_implausible_header_length(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 60) + path.read_bytes()[8:])
    assert "implausible" in error(folder).message


@pytest.mark.parametrize("keep", [5, 100, -10])
def test_truncated_file(tmp_path, keep):
    folder = make_folder(tmp_path / "m", LLAMA)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    e = error(folder)
    assert isinstance(e, InvalidModel) and "model.safetensors" in e.message and "truncated" in e.message


def test_index_lists_missing_shard(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA, shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    e = error(folder)
    assert "model.safetensors.index.json" in e.message and "model-00002-of-00002.safetensors" in e.message
    assert "missing" in e.message


def test_index_tensor_not_in_shard(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA, shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    e = error(folder)
    assert "model-00001-of-00002.safetensors" in e.message and "model.extra.weight" in e.message


def test_index_may_not_escape_folder(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA, shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../outside.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "not a safetensors file in the folder" in error(folder).message


@pytest.mark.parametrize("config, drop", [
    (LLAMA, "model.layers.1.self_attn.k_proj.weight"),
    (LLAMA, "model.layers.0.post_attention_layernorm.weight"),
    (LLAMA, "lm_head.weight"),
    (QWEN3_MOE, "model.layers.1.self_attn.q_norm.weight"),
    (QWEN3_MOE, "model.layers.0.mlp.experts.3.down_proj.weight"),
    (QWEN3_MOE, "model.layers.1.mlp.gate.weight"),
    (MIXTRAL, "model.layers.1.block_sparse_moe.experts.2.w3.weight"),
    (MIXTRAL, "model.layers.0.block_sparse_moe.gate.weight"),
    (_dbrx_flat(), "model.layers.1.block_sparse_moe.experts.5.v1.weight"),
    (_dbrx_flat(), "model.layers.0.self_attn.k_proj.weight"),
])
def test_missing_tensor(tmp_path, config, drop):
    e = error(make_folder(tmp_path / "m", config, drop=drop))
    assert isinstance(e, InvalidModel) and drop in e.message and "missing" in e.message


def test_missing_tensor_in_sharded_folder_names_index(tmp_path):
    e = error(make_folder(tmp_path / "m", LLAMA, drop="model.norm.weight", shards=2))
    assert "model.safetensors.index.json" in e.message and "model.norm.weight" in e.message


def test_shape_mismatch_with_config(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    (folder / "config.json").write_text(json.dumps({**LLAMA, "intermediate_size": 32}))
    e = error(folder)
    assert "mlp.gate_proj.weight" in e.message and "[32, 16]" in e.message


def test_exl2_linear_with_missing_part(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA, drop="model.layers.0.mlp.up_proj.weight")
    from safetensors.torch import load_file
    tensors = load_file(str(folder / "model.safetensors"))
    p = "model.layers.0.mlp.up_proj"
    tensors.update({f"{p}.q_weight": torch.zeros(6, 24, dtype=torch.int32), f"{p}.q_scale": torch.zeros(1, 3, dtype=torch.int32),
                    f"{p}.q_scale_max": torch.ones(1, dtype=torch.float16),
                    f"{p}.q_groups": torch.tensor([8, 0], dtype=torch.int16)})
    save_file(tensors, str(folder / "model.safetensors"))
    e = error(folder)
    assert f"{p}.q_invperm" in e.message and "EXL2" in e.message


def _with_exl2_expert(folder: Path, exact) -> str:
    """One expert projection of the folder ([32, 32]: one group of 32 rows) stored as EXL2 with `exact` as its
    q_scale_exact; -> its prefix."""
    from safetensors.torch import load_file
    from runtime.exl2 import format as fmt
    p = "model.layers.0.mlp.experts.1.down_proj"
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update({f"{p}.{k}": v for k, v in fmt.quantize(tensors.pop(f"{p}.weight"), 4, 32).items()})
    tensors[f"{p}.q_scale_exact"] = exact
    save_file(tensors, str(folder / "model.safetensors"))
    return p


def test_exact_scales_are_checked_and_read(tmp_path):
    cfg = {**QWEN3_MOE, "hidden_size": 32, "head_dim": 8, "moe_intermediate_size": 32}
    good = make_folder(tmp_path / "good", cfg)
    exact = (torch.rand(1, 32) * 0.1 + 0.01).half()
    p = _with_exl2_expert(good, exact)
    mf = ModelFolder(good)
    assert set(mf.exl2_tensors(p)) == {"q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "q_scale_exact"}
    from runtime.exl2 import format as fmt
    parts = mf.exl2_tensors(p)
    assert torch.equal(mf.linear(p), fmt.dequantize(parts, out_features=32))          # the exact scales', not
    assert not torch.equal(mf.linear(p), fmt.dequantize({k: v for k, v in parts.items() if k != "q_scale_exact"}))
    for name, bad, words in [("dtype", exact.float(), "F32[1, 32]; it must hold an fp16 scale per group and column: "
                                                      "F16[1, 32]"),
                             ("shape", exact[:, :16].contiguous(), "F16[1, 16]")]:
        folder = make_folder(tmp_path / name, cfg)
        _with_exl2_expert(folder, bad)
        e = error(folder)
        assert f"'{p}.q_scale_exact' is {words}" in e.message and e.file.endswith("model.safetensors")
    folder = make_folder(tmp_path / "nan", cfg)
    _with_exl2_expert(folder, torch.full((1, 32), float("nan")).half())
    with pytest.raises(ModelFolderError, match="q_scale_exact: holds scales that are not finite numbers"):
        ModelFolder(folder).linear(p)


def test_model_folder_reads_lazily(tmp_path):
    folder = make_folder(tmp_path / "m", QWEN3_MOE, shards=2)
    mf = ModelFolder(folder)
    w = mf.linear("model.layers.0.mlp.experts.1.up_proj")
    assert w.shape == (8, 16) and w.dtype == torch.float32
    assert mf.linear("model.layers.0.self_attn.o_proj", dtype=torch.bfloat16).dtype == torch.bfloat16
    assert mf.tensor("model.norm.weight").shape == (16,)
    assert mf.bias("model.layers.0.self_attn.q_proj") is None
    with pytest.raises(ModelFolderError):
        mf.tensor("model.nothing")


def test_read_header_matches_safetensors(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    header = read_header(folder / "model.safetensors")
    assert header["model.norm.weight"]["shape"] == [16] and header["model.norm.weight"]["dtype"] == "F32"


def test_validate_does_not_import_torch(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    code = ("import sys; from runtime.modelfolder import validate; validate(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'safetensors' not in sys.modules, 'safetensors imported'")
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code, str(folder)], cwd=root, check=True)


def test_tensor_dropped_from_single_shard_index_names_index(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA, shards=1)
    from safetensors.torch import load_file
    names = list(load_file(str(folder / "model.safetensors")))
    weight_map = {n: "model.safetensors" for n in names if n != "model.norm.weight"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    e = error(folder)
    assert "model.safetensors.index.json" in e.message and "'model.norm.weight' is missing" in e.message
