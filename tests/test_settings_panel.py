"""The settings dialog generated from the options' metadata."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from app import settings_panel as sp
from app.settings import Settings
from runtime import paths
from runtime.options import DraftOptions, LoadOptions, OffloadOptions, SamplingOptions, describe


@pytest.fixture
def panel(qtbot):
    p = sp.SettingsPanel(Settings(), has_model=True)
    qtbot.addWidget(p)
    return p


def test_every_option_has_an_editor_hint_and_default(panel):
    for group, cls in (("offload", OffloadOptions), ("draft", DraftOptions), ("sampling", SamplingOptions)):
        for name, default, meta in describe(cls):
            if f"{group}.{name}" == "sampling.stop":
                continue
            f = panel.fields[f"{group}.{name}"]
            assert meta["help"] in f.hint.text() and "Default:" in f.hint.text()
            assert f.editor.toolTip() == f.hint.text()
            assert f.value() == default
    assert panel.settings() == Settings()
    assert panel.needs_reload() == [] and not panel.reload_button.isEnabled()


def test_choice_labels(panel):
    kv = panel.fields["offload.kv_cache"].editor
    assert [kv.itemText(i) for i in range(kv.count())] == ["FP16", "Q8", "Q6", "Q4"]
    pl = panel.fields["offload.placement"].editor
    assert [pl.itemText(i) for i in range(pl.count())] == ["Auto", "All in VRAM", "CPU experts", "Stream to GPU"]
    assert panel.fields["offload.vram_budget_gb"].editor.specialValueText() == "All free VRAM"


def test_reload_options_mark_themselves_and_apply_and_reload(panel, qtbot):
    panel.fields["offload.kv_cache"].set_value("q8")
    panel.fields["offload.vram_budget_gb"].set_value(10.0)
    panel.fields["draft.draft_tokens"].set_value(6)      # not a reload option
    assert panel.needs_reload() == ["offload.vram_budget_gb", "offload.kv_cache"]
    assert panel.fields["offload.kv_cache"].status.text() == "needs reload"
    assert panel.fields["draft.draft_tokens"].status.text() == ""
    assert panel.reload_button.isEnabled()
    with qtbot.waitSignal(panel.apply_requested) as sig:
        panel.reload_button.click()
    s, reload = sig.args
    assert reload is True
    assert s.load.offload.kv_cache == "q8" and s.load.offload.vram_budget_gb == 10.0
    assert s.load.draft.draft_tokens == 6


def test_apply_without_reload(panel, qtbot):
    panel.fields["draft.adaptive"].set_value(False)
    with qtbot.waitSignal(panel.apply_requested) as sig:
        panel.apply_button.click()
    assert sig.args[1] is False and sig.args[0].load.draft.adaptive is False


def test_active_options_define_what_needs_reload(qtbot):
    active = LoadOptions(offload=OffloadOptions(kv_cache="q4"))
    p = sp.SettingsPanel(Settings(), active=active, has_model=True)
    qtbot.addWidget(p)
    assert p.needs_reload() == ["offload.kv_cache"]       # saved fp16, but the model runs q4
    assert not p.reload_button.isHidden() and p.reload_button.isEnabled()
    p.set_active(LoadOptions(), has_model=False)
    assert p.needs_reload() == [] and p.reload_button.isHidden()
    p.fields["offload.kv_cache"].set_value("q6")
    assert p.fields["offload.kv_cache"].status.text() == "used at next load"


def test_optional_number_maps_lowest_value_to_none(panel):
    f = panel.fields["offload.ram_budget_gb"]
    f.set_value(None)
    assert f.value() is None and f.editor.text() == "What is free"
    f.editor.setValue(0.0 + 0.5)
    assert f.value() == 0.5


def test_draft_mode_enables_its_editors(panel):
    assert not panel.fields["draft.model"].editor.isEnabled()
    assert not panel.fields["draft.draft_tokens"].editor.isEnabled()
    panel.fields["draft.mode"].set_value("ngram")
    assert panel.fields["draft.draft_tokens"].editor.isEnabled()
    assert not panel.fields["draft.model"].editor.isEnabled()
    panel.fields["draft.mode"].set_value("model")
    assert panel.fields["draft.model"].editor.isEnabled()
    assert panel.fields["draft.model"].status.text() == "choose a draft model"   # none picked yet
    assert not panel.apply_button.isEnabled()
    panel.fields["draft.mode"].set_value("off")
    assert panel.apply_button.isEnabled()


def test_applied_report_is_shown(panel):
    panel.show_applied({"offload.kv_cache": "ignored: the CPU engine keeps an fp16 cache",
                        "draft.mode": "applied", "offload.extra_thing": "applied"})
    assert panel.fields["offload.kv_cache"].status.text() == "ignored: the CPU engine keeps an fp16 cache"
    assert panel.fields["draft.mode"].status.text() == "applied"
    assert "offload.extra_thing: applied" in panel.applied_note.text()
    panel.fields["offload.kv_cache"].set_value("q6")            # a pending change wins over the report
    assert panel.fields["offload.kv_cache"].status.text() == "needs reload"


def _model_folder(root: Path, name: str, vocab: int) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab}))
    return d


def test_draft_picker_lists_local_models_and_uses_the_compatibility_hook(qtbot, monkeypatch):
    root = paths.models_dir()
    target = _model_folder(root, "big", 1000)
    _model_folder(root, "small", 1000)
    _model_folder(root, "other-vocab", 2000)
    (root / "not-a-model").mkdir()
    monkeypatch.setattr(sp, "_validate_function", lambda: None)   # the config.json rule only

    def same_vocab(t: Path, d: Path):
        tv = json.loads((t / "config.json").read_text())["vocab_size"]
        dv = json.loads((d / "config.json").read_text())["vocab_size"]
        return None if tv == dv else f"vocabulary {dv} differs from the model's {tv}"
    models = {m.name: m.problem for m in sp.list_local_models(root, target, same_vocab)}
    assert models == {"big": "this is the loaded model", "not-a-model": "no config.json",
                      "other-vocab": "vocabulary 2000 differs from the model's 1000", "small": None}

    p = sp.SettingsPanel(Settings(), has_model=True)
    qtbot.addWidget(p)
    p.set_draft_compatibility(same_vocab)
    p.set_target_model(target)
    combo = p.fields["draft.model"].editor
    items = {combo.itemData(i): combo.model().item(i).isEnabled() for i in range(combo.count())}
    assert items == {None: True, "big": False, "not-a-model": False, "other-vocab": False, "small": True}
    p.fields["draft.mode"].set_value("model")
    p.fields["draft.model"].set_value("small")
    assert p.settings().load.draft == DraftOptions(mode="model", model="small")
    assert p.needs_reload() == ["draft.model"]


def test_saved_draft_model_that_is_gone_stays_visible(qtbot):
    s = Settings(load=LoadOptions(draft=DraftOptions(mode="model", model="vanished")))
    p = sp.SettingsPanel(s)
    qtbot.addWidget(p)
    combo = p.fields["draft.model"].editor
    assert combo.currentText() == "vanished (not found)"
    assert p.settings().load.draft.model == "vanished"


def test_draft_picker_uses_the_model_folder_validator(demo_model, tmp_path):
    if sp._validate_function() is None:
        pytest.skip("runtime.modelfolder is not on this branch yet")
    demo = {m.name: m.problem for m in sp.list_local_models(demo_model.parent)}
    assert demo[demo_model.name] is None
    _model_folder(tmp_path, "broken", 1000)          # config.json only: no tokenizer, no weights
    (broken,) = sp.list_local_models(tmp_path)
    assert broken.problem is not None and broken.problem.startswith("config.json: "), broken.problem


def test_hub_rule_is_the_default_and_tuple_verdicts_work(qtbot, tmp_path, monkeypatch):
    rule = sp.default_draft_compatibility()
    if rule is None:
        pytest.skip("app.hub.local is not on this branch yet")
    monkeypatch.setattr(sp, "_validate_function", lambda: None)   # the config.json rule only
    target = _model_folder(tmp_path, "target", 1000)
    _model_folder(tmp_path, "other-vocab", 2000)
    models = {m.name: m.problem for m in sp.list_local_models(tmp_path, target, lambda t, d: (False, "nope"))}
    assert models["other-vocab"] == "nope"
    p = sp.SettingsPanel(Settings(), has_model=True)
    qtbot.addWidget(p)
    assert p._compatible is rule


def test_default_sampling_is_edited_and_keeps_stop_strings(qtbot):
    s = dataclasses.replace(Settings(), sampling=SamplingOptions(stop=("END",)))
    p = sp.SettingsPanel(s)
    qtbot.addWidget(p)
    p.fields["sampling.top_p"].editor.setValue(0.95)
    p.fields["sampling.seed"].set_value(7)
    out = p.settings().sampling
    assert out == SamplingOptions(top_p=0.95, seed=7, stop=("END",))
    p.fields["sampling.seed"].set_value(None)
    assert p.settings().sampling.seed is None and p.fields["sampling.seed"].editor.text() == "Random"
    assert p.needs_reload() == []          # sampling never needs a reload


def test_the_engines_word_on_the_expert_path_shows_beside_placement(panel):
    from runtime import protocol as P
    panel.show_applied({"offload.placement": "applied"})
    ev = P.Telemetry(request_id="", extra={"placement_decision": {
        "path": "cpu", "summary": "CPU expert path on: measured: 25.2 ms per decode step with the CPU path, 34.1 without"}})
    panel.show_telemetry(ev)
    text = panel.fields["offload.placement"].status.text()
    assert "CPU expert path on" in text and "34.1" in text
    panel.show_telemetry(P.Telemetry(request_id="", extra={}))      # other figures leave it alone
    assert "CPU expert path on" in panel.fields["offload.placement"].status.text()


def test_the_servers_allowed_origins_and_hosts_are_lists_checked_before_apply(panel):
    origins, hosts = panel.fields["server.allowed_origins"], panel.fields["server.allowed_hosts"]
    assert origins.editor.text() == "" and "Default: none." in origins.hint.text()
    origins.editor.setText("chrome-extension://abcdef, http://localhost:3000,")
    hosts.editor.setText("gpu-box.lan")
    assert panel.settings().server.allowed_origins == ("chrome-extension://abcdef", "http://localhost:3000")
    assert panel.settings().server.allowed_hosts == ("gpu-box.lan",)
    assert panel.apply_button.isEnabled()
    origins.editor.setText("localhost:3000/app")                  # no scheme, a path: the server would refuse it
    assert not panel.apply_button.isEnabled() and "allowed origin 'localhost:3000/app'" in origins.status.text()
    origins.editor.setText("*")
    hosts.editor.setText("http://gpu-box.lan")
    assert not panel.apply_button.isEnabled() and "allowed host" in hosts.status.text()
    hosts.editor.setText("")
    assert panel.apply_button.isEnabled() and origins.status.text() == hosts.status.text() == ""
    panel.set_settings(Settings())
    assert panel.settings() == Settings()
