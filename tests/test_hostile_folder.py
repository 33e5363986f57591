"""Hostile model folders: links out of the folder, absurd sizes, JSON nested too deeply, bad config fields.

Each is a named `model_invalid` error (the file and the field), found fast, never an `internal` crash; the
model manager still lists the folder with its reason so that the user can delete it.
"""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
from test_modelfolder import LLAMA, QWEN3_MOE, make_folder

from app.hub.errors import LocalModelError
from app.hub.fit import FitError, ModelShape
from app.hub.local import draft_compatibility, import_folder, list_local_models
from runtime.errors import InvalidModel
from runtime.modelfolder import ModelFolderError, validate
from runtime.tokenizer import Tokenizer

DEEP = "[" * 100_000 + "]" * 100_000
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def error(folder: Path, **kw) -> ModelFolderError:
    with pytest.raises(ModelFolderError) as e:
        validate(folder, **kw)
    assert isinstance(e.value, InvalidModel), e.value
    return e.value


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "elsewhere" / "secret.txt"
    path.parent.mkdir()
    path.write_text("root:x:0:0:the secret\n")
    return path


def tokenizer_folder(root: Path, demo_model: Path) -> Path:
    folder = make_folder(root, LLAMA)
    (folder / "tokenizer.json").write_bytes((demo_model / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return folder


# ----------------------------------------------------------------------------------------------
# Links that leave the folder

@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors",
                                  "model.safetensors.index.json", "tokenizer_config.json"])
def test_a_link_out_of_the_folder_is_refused_by_name(tmp_path, secret, name):
    folder = make_folder(tmp_path / "m", LLAMA)
    outside = tmp_path / "elsewhere" / name
    if (folder / name).exists():
        (folder / name).rename(outside)
    else:
        outside.write_text(secret.read_text())
    (folder / name).symlink_to(outside)
    e = error(folder)
    assert name in e.message and "outside the model folder" in e.message


def test_a_link_inside_the_folder_is_fine(tmp_path):
    folder = make_folder(tmp_path / "m", LLAMA)
    (folder / "weights").mkdir()
    (folder / "model.safetensors").rename(folder / "weights" / "model.safetensors")
    (folder / "model.safetensors").symlink_to(Path("weights") / "model.safetensors")
    assert validate(folder).num_layers == 2


def test_a_chat_template_linked_out_is_never_rendered(tmp_path, secret, demo_model):
    folder = tokenizer_folder(tmp_path / "m", demo_model)
    (folder / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(ModelFolderError) as e:
        Tokenizer.from_folder(folder).render_chat([{"role": "user", "content": "hi"}])
    assert "chat_template.jinja" in e.value.message and "outside the model folder" in e.value.message


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_the_tokenizer_reads_no_file_linked_out(tmp_path, secret, demo_model, name):
    folder = tokenizer_folder(tmp_path / "m", demo_model)
    outside = tmp_path / "elsewhere" / name
    if (folder / name).exists():
        (folder / name).rename(outside)
    else:
        outside.write_text("{}")
    (folder / name).symlink_to(outside)
    with pytest.raises(ModelFolderError, match="outside the model folder"):
        Tokenizer.from_folder(folder)


@pytest.mark.parametrize("link", ["file", "folder"])
def test_import_copies_no_link_target_from_outside(tmp_path, secret, link):
    src = make_folder(tmp_path / "src", LLAMA)
    (src / "extra").mkdir()
    (src / "extra" / "notes.txt").symlink_to(secret if link == "file" else secret.parent)
    models = tmp_path / "models"
    with pytest.raises(LocalModelError, match="outside"):
        import_folder(src, models_dir=models)
    assert not any(p.is_file() and "the secret" in p.read_text(errors="replace")
                   for p in models.rglob("*")) if models.exists() else True


# ----------------------------------------------------------------------------------------------
# Absurd sizes, found before anything is built from them

@pytest.mark.parametrize("config, field", [
    ({**LLAMA, "num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({**QWEN3_MOE, "num_experts": 10**7}, "num_experts"),
    ({**LLAMA, "vocab_size": 10**12}, "vocab_size"),
    ({**LLAMA, "hidden_size": 2**40, "num_attention_heads": 1}, "hidden_size"),
    ({**LLAMA, "max_position_embeddings": -4096}, "max_position_embeddings"),
    ({**LLAMA, "rms_norm_eps": "tiny"}, "rms_norm_eps"),
    ({**LLAMA, "rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ({**LLAMA, "rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}, "rope_scaling.factor"),
    ({**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope_scaling.factor"),
    ({**LLAMA, "rope_scaling": "yes"}, "rope_scaling"),
    ({**QWEN3_MOE, "mlp_only_layers": "0"}, "mlp_only_layers"),
    ({**QWEN3_MOE, "num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_absurd_or_malformed_config_fields_are_named(tmp_path, config, field):
    folder = make_folder(tmp_path / "m", LLAMA if "num_experts" not in config else QWEN3_MOE)
    (folder / "config.json").write_text(json.dumps(config))
    t0 = time.perf_counter()
    e = error(folder)
    assert time.perf_counter() - t0 < 1.0
    assert "config.json" in e.message and f"'{field}'" in e.message, e.message


def test_many_layers_of_many_experts_against_tiny_weights_fail_fast(tmp_path):
    """Within every bound, yet 1000 layers of 4000 experts would be 12 million layout entries."""
    folder = make_folder(tmp_path / "m", QWEN3_MOE)
    (folder / "config.json").write_text(json.dumps({**QWEN3_MOE, "num_hidden_layers": 1000, "num_experts": 4000}))
    t0 = time.perf_counter()
    e = error(folder)
    assert time.perf_counter() - t0 < 1.0 and "imply" in e.message


def test_the_fit_estimate_bounds_config_figures():
    cfg = {**QWEN3_MOE, "num_hidden_layers": 10**9}
    with pytest.raises(FitError, match="num_hidden_layers"):
        ModelShape.from_config(cfg)
    with pytest.raises(FitError, match="num_key_value_heads"):
        ModelShape.from_config({**QWEN3_MOE, "num_key_value_heads": "four"})


# ----------------------------------------------------------------------------------------------
# JSON nested too deeply: a named error, and the model manager still lists the folder

def _deep_header(path: Path) -> None:
    raw = ('{"a": ' + DEEP + "}").encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "model.safetensors.index.json"])
def test_deeply_nested_json_is_a_named_error(tmp_path, name):
    folder = make_folder(tmp_path / "m", LLAMA)
    if name == "model.safetensors":
        _deep_header(folder / name)
    else:
        (folder / name).write_text(DEEP)
    e = error(folder)
    assert name in e.message and "nested too deeply" in e.message


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_deeply_nested_tokenizer_files_are_named_errors(tmp_path, demo_model, name):
    folder = tokenizer_folder(tmp_path / "m", demo_model)
    (folder / name).write_text(DEEP)
    with pytest.raises(ModelFolderError, match=f"{name}.*nested too deeply"):
        Tokenizer.from_folder(folder)


def test_the_model_list_shows_broken_folders_with_their_reason(tmp_path):
    models = tmp_path / "models"
    make_folder(models / "good", LLAMA)
    (make_folder(models / "deep", LLAMA) / "config.json").write_text(DEEP)
    (make_folder(models / "huge", LLAMA) / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 10**9}))
    listed = {m.name: m for m in list_local_models(models)}
    assert listed["good"].loadable
    assert "nested too deeply" in listed["deep"].error and "num_hidden_layers" in listed["huge"].error


def test_draft_pairing_survives_a_deeply_nested_tokenizer(tmp_path):
    a, b = make_folder(tmp_path / "a", LLAMA), make_folder(tmp_path / "b", LLAMA)
    (b / "tokenizer.json").write_text(DEEP)
    ok, why = draft_compatibility(a, b)
    assert not ok and "tokenizer.json" in why


def test_the_model_manager_opens_with_a_broken_folder_and_can_delete_it(qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from app.models_dialog import ModelManagerDialog
    models = tmp_path / "models"
    deep = make_folder(models / "deep", LLAMA)
    (deep / "config.json").write_text(DEEP)
    (deep / "moedesk-source.json").write_text(DEEP)
    d = ModelManagerDialog(models_dir=models)
    qtbot.addWidget(d)
    try:
        assert d.local_table.rowCount() == 1
        monkeypatch.setattr("app.models_dialog.QMessageBox.question", lambda *a: QMessageBox.Yes)
        d.local_table.selectRow(0)
        d.delete_button.click()
        assert not deep.exists() and d.local_table.rowCount() == 0
    finally:
        d.shutdown()
