"""The converter against hostile folders (tiny checkpoints): links out of the source folder, shards named by path,
hostile safetensors headers and config.json, links on the output side, a tampered state.json. Each is refused with
one line naming the file (no traceback), before anything is allocated or written through a link."""
from __future__ import annotations

import json
import shutil
import struct

import pytest

from runtime.cli import main
from runtime.exl2 import convert as cv
from runtime.exl2 import convert_check
from tests.convert_fixtures import TEXT, link_out, tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("src") / "hf", "llama", layers=2)


@pytest.fixture
def src(tiny, tmp_path):
    return shutil.copytree(tiny, tmp_path / "hf")


def cli(capsys, model, out, *extra) -> str:
    """The converter's CLI on a tiny calibration: its one-line error (it must fail)."""
    cal = out.parent / "cal.txt"
    cal.write_text(TEXT)
    code = main(["convert", "--model", str(model), "--bpw", "4", "--out", str(out), "--calibration", str(cal),
                 "--rows", "2", "--seq-len", "32", "--no-measure", "--threads", "1", *extra])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("moedesk-cli convert: ")]
    assert len(lines) == 1, err
    return lines[0]


def convert(model, out, **kw):
    return cv.convert(model, out, 4.0, calibration_text=TEXT, rows=2, seq_len=32, measure=False, say=lambda m: None,
                      threads=1, **kw)


# -- 7. links out of the source folder, shards named by path

@pytest.mark.parametrize("name", ["chat_template.jinja", "model.safetensors", "tokenizer_config.json"])
def test_a_link_out_of_the_source_folder_is_refused_not_copied(src, tmp_path, capsys, name):
    secret = link_out(src, name, tmp_path)
    line = cli(capsys, src, tmp_path / "out")
    assert f"{src / name}: is a link to {secret}, outside the model folder" in line
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_a_link_inside_the_source_folder_is_followed(src, tmp_path):
    (src / "template.txt").write_text("{{ messages[0].content }}")
    (src / "chat_template.jinja").symlink_to("template.txt")
    out = convert(src, tmp_path / "out")
    assert (out / "chat_template.jinja").read_text() == "{{ messages[0].content }}"
    assert not (out / "chat_template.jinja").is_symlink()


def test_a_link_planted_while_it_converts_is_not_copied(src, tmp_path):
    (tmp_path / "secret").write_text("secret")
    (src / "chat_template.jinja").symlink_to(tmp_path / "secret")
    (tmp_path / "dest").mkdir()
    with pytest.raises(convert_check.ConvertError, match="chat_template.jinja: is a link to .*outside the model"):
        convert_check.copy_extras(src, ("tokenizer.json", "chat_template.jinja"), tmp_path / "dest")
    assert not (tmp_path / "dest" / "chat_template.jinja").exists()


@pytest.mark.parametrize("shard", ["ABSOLUTE", "../elsewhere/model.safetensors", "sub/../model.safetensors"])
def test_an_index_naming_shards_by_path_is_refused(src, tmp_path, capsys, shard):
    (tmp_path / "elsewhere").mkdir()
    moved = tmp_path / "elsewhere" / "model.safetensors"
    (src / "model.safetensors").rename(moved)
    shard = str(moved) if shard == "ABSOLUTE" else shard
    from safetensors import safe_open
    with safe_open(str(moved), "pt") as f:
        names = list(f.keys())
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    line = cli(capsys, src, tmp_path / "out")
    assert f"model.safetensors.index.json: lists {shard!r}, not a safetensors file in the folder" in line


# -- 8. hostile headers and configs: one line naming file and field, before any allocation

def _header(src, header: bytes, declared: int | None = None) -> None:
    body = (src / "model.safetensors").read_bytes()
    data = body[8 + struct.unpack("<Q", body[:8])[0]:]
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(header) if declared is None else declared)
                                            + header + data)


@pytest.mark.parametrize("header, declared, words", [
    (b"{}", 1 << 60, "declared length"),
    (b"not json", None, "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
    (b'{"model.norm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 99999999]}}', None,
     "'model.norm.weight' has 99999999 bytes of data"),
    (b'{"model.norm.weight": {"dtype": "Q9", "shape": [64], "data_offsets": [0, 256]}}', None, "unknown dtype"),
])
def test_hostile_safetensors_headers_are_named(src, tmp_path, capsys, header, declared, words):
    _header(src, header, declared)
    line = cli(capsys, src, tmp_path / "out")
    assert f"{src / 'model.safetensors'}: " in line and words in line


@pytest.mark.parametrize("config, words", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('[{"architectures": ["LlamaForCausalLM"]}]', "expected a JSON object at the top level"),
    ({"num_attention_heads": 0}, "'num_attention_heads' must be a positive integer"),
    ({"hidden_size": 10 ** 7}, "'hidden_size' must be a positive integer of at most 131072, got 10000000"),
    ({"num_hidden_layers": "2"}, "'num_hidden_layers' must be a positive integer"),
    ({"architectures": "LlamaForCausalLM"}, "architecture 'LlamaForCausalLM' is not supported"),
    ({"quantization_config": ["gptq"]}, "already quantized (?)"),
    ({"rope_scaling": [1]}, "'rope_scaling' must be an object"),
])
def test_hostile_configs_are_named_before_anything_is_built(src, tmp_path, capsys, config, words):
    cfg = src / "config.json"
    cfg.write_text(config if isinstance(config, str) else json.dumps({**json.loads(cfg.read_text()), **config}))
    line = cli(capsys, src, tmp_path / "out")
    assert f"{cfg}: " in line and words in line


def test_sizes_the_weights_do_not_have_are_refused_from_the_headers(src, tmp_path, capsys, monkeypatch):
    """A config within the bounds whose layers would take gigabytes: refused from the headers' shapes, before a
    layer is built (the layer builder must not even be reached)."""
    cfg = src / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "hidden_size": 1 << 17, "intermediate_size": 1 << 20}))
    monkeypatch.setattr(cv, "_new_layer", lambda *a: pytest.fail("a layer was built from the config's sizes"))
    line = cli(capsys, src, tmp_path / "out")
    assert "model.safetensors: tensor 'model.embed_tokens.weight' has shape [320, 64], the config implies " \
           "[320, 131072]" in line


# -- 8. the output side: links are never written through

def test_a_dangling_out_link_is_refused(src, tmp_path, capsys):
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    line = cli(capsys, src, tmp_path / "out")
    assert f"{tmp_path / 'out'}: is a link (to {tmp_path / 'nowhere'})" in line
    assert not (tmp_path / "nowhere").exists()


def test_a_planted_partial_link_is_never_written_through(src, tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / ".out.partial").symlink_to(victim)
    line = cli(capsys, src, tmp_path / "out")
    assert f"{tmp_path / '.out.partial'}: the conversion's staging folder is a link" in line
    assert list(victim.iterdir()) == []


def test_a_link_inside_the_staging_folder_is_never_written_through(src, tmp_path, capsys):
    staging = tmp_path / ".out.partial"
    staging.mkdir()
    victim = tmp_path / "victim.safetensors"
    victim.write_text("precious")
    (staging / "layer-00000.safetensors.tmp").symlink_to(victim)
    line = cli(capsys, src, tmp_path / "out")
    assert f"{staging / 'layer-00000.safetensors.tmp'}: a link in the conversion's staging folder" in line
    assert victim.read_text() == "precious"


# -- 8. a tampered state.json

@pytest.fixture(scope="module")
def interrupted(tiny, tmp_path_factory):
    """A staging folder left after layer 1 of 2, as the CLI's settings in `cli` make it."""
    root = tmp_path_factory.mktemp("stopped")
    with pytest.raises(cv.ConvertError, match="stopped after layer 1 of 2"):
        cv.convert(tiny, root / "out", 4.0, calibration_text=TEXT, calibration_source="cal.txt", rows=2, seq_len=32,
                   measure=False, say=lambda m: None, threads=1, stop_after_layers=1)
    return root / ".out.partial"


@pytest.mark.parametrize("change, words", [
    (lambda s: "{", "state.json: not valid JSON"),
    (lambda s: "[" * 100_000 + "]" * 100_000, "state.json: not valid JSON: nested too deeply"),
    (lambda s: [s], "state.json: the interrupted conversion's state is damaged: expected a JSON object"),
    (lambda s: {**s, "layers_done": "1"}, "'layers_done' must be a layer count of 0 to 2, got '1'"),
    (lambda s: {**s, "layers_done": 10 ** 9}, "'layers_done' must be a layer count of 0 to 2"),
    (lambda s: {**s, "layers_done": -1}, "'layers_done' must be a layer count of 0 to 2"),
    (lambda s: {**s, "rows_used": 10 ** 9}, "'rows_used' must be a count of 1 to 2"),
    (lambda s: {**s, "stats": []}, "'stats' must map names to counts"),
    (lambda s: {**s, "stats": {**s["stats"], "weights": "many"}}, "'stats' must map names to counts"),
    (lambda s: {**s, "stats": {}}, "'stats.experts_routed' must be a whole count"),
    (lambda s: {**s, "layers_done": 2}, "layer-00001.safetensors: cannot be read"),
])
def test_a_tampered_state_is_named_field_by_field(interrupted, tmp_path, capsys, change, words):
    staging = shutil.copytree(interrupted, tmp_path / ".out.partial")
    state = json.loads((staging / "state.json").read_text())
    changed = change(state)
    (staging / "state.json").write_text(changed if isinstance(changed, str) else json.dumps(changed))
    line = cli(capsys, _tiny_of(interrupted), tmp_path / "out")
    assert words in line and f"remove {staging} to start over" in line, line


def _tiny_of(staging) -> str:
    """The source the interrupted conversion was made from."""
    return json.loads((staging / "state.json").read_text())["settings"]["source"]


def test_a_hidden_state_file_of_other_shape_is_named(interrupted, tmp_path, capsys):
    import torch
    from safetensors.torch import save_file
    staging = shutil.copytree(interrupted, tmp_path / ".out.partial")
    save_file({"hidden": torch.zeros(2, 32, 7)}, str(staging / "hidden-00001.safetensors"))
    line = cli(capsys, _tiny_of(interrupted), tmp_path / "out")
    assert "hidden-00001.safetensors: the interrupted conversion's state is damaged: expected the tensor 'hidden' " \
           "of F32[2, 32, 64], got ('F32', [2, 32, 7])" in line


def test_an_untampered_state_resumes(interrupted, tmp_path, capsys):
    shutil.copytree(interrupted, tmp_path / ".out.partial")
    cal = tmp_path / "cal.txt"
    cal.write_text(TEXT)
    assert main(["convert", "--model", _tiny_of(interrupted), "--bpw", "4", "--out", str(tmp_path / "out"),
                 "--calibration", str(cal), "--rows", "2", "--seq-len", "32", "--no-measure", "--threads", "1"]) == 0
    assert "resuming after layer 1 of 2" in capsys.readouterr().out
    assert (tmp_path / "out" / "config.json").is_file() and not (tmp_path / ".out.partial").exists()
