"""Local models: listing, last used, import of a good and of broken folders, delete, draft pairing rule."""
import json
from pathlib import Path

import pytest
from fakehub import tiny_exl2_repo, tiny_tokenizer_json
from safetensors.numpy import load as st_load, save as st_save

from app.hub import local
from app.hub.errors import LocalModelError
from app.hub.local import (delete_model, draft_candidates, draft_compatibility, import_folder, list_local_models,
                           mark_used)


def write_model(folder: Path, branch="4.0bpw", **replace) -> Path:
    folder.mkdir(parents=True)
    files = dict(tiny_exl2_repo().branches[branch].files, **replace)
    for name, data in files.items():
        if data is not None:
            (folder / name).write_bytes(data)
    return folder


@pytest.fixture
def models(tmp_path):
    return tmp_path / "models"


def test_import_a_good_folder_copies_it_and_lists_it(tmp_path, models):
    src = write_model(tmp_path / "src" / "Tiny MoE 4bpw")
    m = import_folder(src, models_dir=models)
    assert m.loadable and m.name == "Tiny_MoE_4bpw" and m.path == models / "Tiny_MoE_4bpw"
    assert (m.architecture, m.num_params, m.bits_per_weight, m.vocab_size) == ("Qwen3MoeForCausalLM", 255360, 4.0, 1024)
    assert m.size_bytes == sum(p.stat().st_size for p in src.iterdir())
    assert src.is_dir()                                   # copied, not moved
    assert [x.name for x in list_local_models(models)] == ["Tiny_MoE_4bpw"]
    with pytest.raises(LocalModelError, match="already exists"):
        import_folder(src, models_dir=models)


def test_import_by_moving(tmp_path, models):
    src = write_model(tmp_path / "src" / "tiny")
    assert import_folder(src, move=True, models_dir=models).loadable
    assert not src.exists() and (models / "tiny" / "model.safetensors").is_file()


@pytest.mark.parametrize("broken, expected", [
    ({"tokenizer.json": None}, r"tokenizer.json.*|missing: the model has no tokenizer"),
    ({"config.json": None}, r"missing: a model folder needs config.json"),
    ({"config.json": json.dumps({"architectures": ["GPT2LMHeadModel"]}).encode()}, r"'GPT2LMHeadModel' is not supported"),
])
def test_import_a_broken_folder_names_what_is_missing(tmp_path, models, broken, expected):
    src = write_model(tmp_path / "src" / "broken", **broken)
    with pytest.raises(LocalModelError, match=expected) as e:
        import_folder(src, models_dir=models)
    assert str(src) in str(e.value)
    assert list_local_models(models) == []                # nothing half-imported


def test_import_names_the_missing_tensor(tmp_path, models):
    weights = st_load(tiny_exl2_repo().branches["4.0bpw"].files["model.safetensors"])
    weights.pop("model.layers.1.post_attention_layernorm.weight")
    src = write_model(tmp_path / "src" / "notensor", **{"model.safetensors": st_save(weights)})
    with pytest.raises(LocalModelError, match="model.layers.1.post_attention_layernorm.weight.*missing"):
        import_folder(src, models_dir=models)


def test_listing_shows_broken_folders_as_not_loadable_and_skips_staging(tmp_path, models):
    write_model(models / "good")
    write_model(models / "bad", **{"tokenizer.json": None})
    write_model(models / ".staging" / "half")
    listed = {m.name: m for m in list_local_models(models)}
    assert set(listed) == {"good", "bad"}
    assert listed["good"].loadable and not listed["bad"].loadable
    assert "tokenizer" in listed["bad"].error


def test_last_used_orders_the_table(tmp_path, models):
    write_model(models / "a")
    write_model(models / "b")
    mark_used(models / "b", when=1000.0)
    mark_used(models / "a", when=2000.0)
    assert [(m.name, m.last_used) for m in list_local_models(models)] == [("a", 2000.0), ("b", 1000.0)]
    (Path(local.paths.data_dir()) / local.LAST_USED_FILE).write_text("{not json")
    assert [m.last_used for m in list_local_models(models)] == [None, None]   # damaged file: no crash


def test_delete_only_inside_the_models_folder(tmp_path, models):
    m = write_model(models / "a")
    outside = write_model(tmp_path / "elsewhere")
    with pytest.raises(LocalModelError, match="refusing to delete"):
        delete_model(outside, models_dir=models)
    with pytest.raises(LocalModelError, match="refusing to delete"):
        delete_model(models / "a" / "..", models_dir=models)
    mark_used(m)
    delete_model(m, models_dir=models)
    assert not m.exists() and outside.exists()
    assert "a" not in local.last_used_map()


def test_draft_needs_the_same_vocabulary(tmp_path, models):
    target = write_model(models / "target-4bpw")
    same = write_model(models / "draft-6_5", branch="6_5")
    other_tok = write_model(models / "other-tokenizer", **{"tokenizer.json": tiny_tokenizer_json(1024, salt="x")})
    cfg = json.loads(tiny_exl2_repo().branches["4.0bpw"].files["config.json"])
    smaller = write_model(models / "smaller-vocab", **{"config.json": json.dumps(dict(cfg, vocab_size=512)).encode()})
    assert draft_compatibility(target, same) == (True, "same tokenizer (1024 tokens)")
    assert draft_compatibility(target, other_tok) == (
        False, "same vocabulary size but different tokens or merges (another tokenizer)")
    assert draft_compatibility(target, smaller) == (False, "vocabulary of 512 tokens, the loaded model has 1024")
    assert draft_compatibility(target, target) == (False, "it is the loaded model itself")
    rows = {m.name: (ok, why) for m, ok, why in draft_candidates(target, list_local_models(models))}
    assert {n for n, (ok, _) in rows.items() if ok} == {"draft-6_5"}
    assert set(rows) == {"target-4bpw", "draft-6_5", "other-tokenizer"}     # smaller-vocab fails validation
