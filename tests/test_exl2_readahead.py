"""The converter reads the next layer's bytes ahead (runtime/exl2/readahead.py): exactly that layer's tensors,
from the safetensors headers, and nothing from a header that is not one."""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from runtime.exl2.readahead import Readahead, layer_of, tensor_ranges


def test_layer_of_names_the_decoder_layer():
    assert layer_of("model.layers.12.mlp.experts.3.gate_proj.weight") == 12
    assert layer_of("model.language_model.layers.0.linear_attn.A_log") == 0
    assert layer_of("transformer.blocks.7.ffn.experts.mlp.w1") == 7
    assert layer_of("mtp.layers.0.mlp.gate.weight") is None and layer_of("lm_head.weight") is None


def test_reads_exactly_the_layers_tensors(tmp_path):
    a = {f"model.layers.{i}.w": torch.full((256, 64), float(i)) for i in range(3)}
    a["model.embed_tokens.weight"] = torch.zeros(100, 64)
    save_file(a, str(tmp_path / "a.safetensors"))
    b = {"model.layers.1.v": torch.ones(1000), "model.layers.2.v": torch.ones(10)}
    save_file(b, str(tmp_path / "b.safetensors"))
    shard_of = {**{k: tmp_path / "a.safetensors" for k in a}, **{k: tmp_path / "b.safetensors" for k in b}}
    ranges = tensor_ranges(tmp_path / "a.safetensors")
    start, end = ranges["model.layers.1.w"]
    raw = (tmp_path / "a.safetensors").read_bytes()[start:end]
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).view(256, 64), a["model.layers.1.w"])
    ahead = Readahead(shard_of)
    ahead.start(1)
    ahead._thread.join()
    assert ahead.bytes_read == 256 * 64 * 4 + 1000 * 4            # layer 1's two tensors, nothing else
    ahead.start(7)                                                # no such layer: nothing to read
    assert ahead._thread is None
    ahead.close()


def test_a_header_that_is_not_one_reads_nothing(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")      # a header longer than the file
    assert tensor_ranges(bad) == {}
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 10 ** 9]}}).encode()
    out = tmp_path / "out.safetensors"
    out.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)      # offsets past the end
    assert tensor_ranges(out) == {}
    assert tensor_ranges(tmp_path / "missing.safetensors") == {}
