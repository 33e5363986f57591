"""Load options per model (the model picker's ⚙): the fit estimate follows the options, the options the load
command takes are sent and remembered per model (a validated JSON file), and the model unloads after an
idle time and loads again for the next chat or API request. The desk tests drive the real window and
engine client against the scripted worker (offscreen)."""
from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import httpx
import pytest
from PySide6.QtCore import Qt

from app.settings import AppSettings, Settings
from runtime import paths
from runtime.modelfolder import FolderInfo
from runtime.options import DraftOptions, LoadOptions, OffloadOptions, SamplingOptions, ServeOptions
from tests.test_chat_session import make_desk  # noqa: F401 (a fixture)

GIB = 1024 ** 3
QWEN3_30B = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
             "max_position_embeddings": 40960}


def staged(bpw: float = 4.0) -> FolderInfo:
    """Qwen3-30B-A3B's real config at `bpw` (no weights needed: the estimate reads the config)."""
    return FolderInfo(Path("Qwen3-30B-A3B-exl2"), "Qwen3-30B-A3B-exl2", "Qwen3MoeForCausalLM", "qwen3_moe",
                      30_500_000_000, 3_300_000_000, bpw, 16 * GIB, 151936, 48, 128, 8, True, True, QWEN3_30B)


# -- the fit estimate -------------------------------------------------------------------------------

def test_the_fit_follows_context_cache_budgets_placement_and_engine():
    from app.load_dialog import fit_note
    info, vram, ram = staged(), 24 * GIB, 64 * GIB
    base = fit_note(info, OffloadOptions(), vram, ram, "cuda")
    assert base.ok and base.words.startswith("Fits in VRAM") and "KV cache 0.38 GiB" in base.words
    longer = fit_note(info, OffloadOptions(context_length=32768), vram, ram, "cuda")
    assert "KV cache 3.00 GiB" in longer.words
    narrower = fit_note(info, OffloadOptions(context_length=32768, kv_cache="q4"), vram, ram, "cuda")
    assert "KV cache 0.84 GiB" in narrower.words
    budget = fit_note(info, OffloadOptions(vram_budget_gb=8.0), vram, ram, "cuda")
    assert budget.ok and budget.words.startswith("Fits with expert offload") and "of 8.0 GiB (budget)" in budget.words
    pinned = fit_note(info, OffloadOptions(vram_budget_gb=8.0, placement="vram"), vram, ram, "cuda")
    assert pinned.ok is False and "every expert in VRAM" in pinned.words
    tight_ram = fit_note(info, OffloadOptions(vram_budget_gb=8.0, ram_budget_gb=2.0), vram, ram, "cuda")
    assert tight_ram.ok is False and "RAM budget" in tight_ram.words
    cpu = fit_note(info, OffloadOptions(backend="cpu"), vram, ram, "cuda")
    assert cpu.words.startswith("CPU engine") and "28.4 GiB of 64 GiB" in cpu.words
    no_gpu = fit_note(info, OffloadOptions(), 0.0, ram, "cpu")
    assert no_gpu.words.startswith("CPU engine")
    with_draft = fit_note(info, OffloadOptions(), vram, ram, "cuda", draft_bytes=2 * GIB)
    assert "draft model 2.0 GiB" in with_draft.words


def test_the_dialog_updates_the_fit_as_options_change(qtbot):
    from app.load_dialog import LoadDialog
    dialog = LoadDialog("Qwen3-30B-A3B-exl2", LoadOptions(), LoadOptions(), info=staged(),
                        memory=(24 * GIB, 64 * GIB, "NVIDIA GeForce RTX 4090"), engine="cuda")
    qtbot.addWidget(dialog)
    before = dialog.fit.text()
    dialog.fields["offload.context_length"].editor.setValue(32768)
    assert dialog.fit.text() != before and "KV cache 3.00 GiB" in dialog.fit.text()
    dialog.fields["offload.vram_budget_gb"].editor.setValue(8.0)
    assert "expert offload" in dialog.fit.text()
    combo = dialog.fields["offload.placement"].editor
    combo.setCurrentIndex(combo.findData("vram"))
    assert dialog.fit.text().startswith("⚠") and dialog.fit_ok is False
    mode = dialog.fields["draft.mode"].editor
    assert not dialog.fields["draft.draft_tokens"].editor.isEnabled()
    mode.setCurrentIndex(mode.findData("ngram"))
    assert dialog.fields["draft.draft_tokens"].editor.isEnabled() and not dialog.fields["draft.model"].editor.isEnabled()
    opts = dialog.options()
    assert (opts.offload.context_length, opts.offload.vram_budget_gb, opts.offload.placement, opts.draft.mode) == (
        32768, 8.0, "vram", "ngram")
    dialog.defaults_button.click()
    assert dialog.options() == LoadOptions()
    engine = dialog.fields["offload.backend"].editor
    engine.setCurrentIndex(engine.findData("cpu"))          # the CPU engine takes no budgets, cache width, placement
    assert dialog.fit.text().startswith("✓ CPU engine")
    assert not any(dialog.fields[p].editor.isEnabled() for p in ("offload.vram_budget_gb", "offload.kv_cache",
                                                                  "offload.placement", "offload.ram_budget_gb"))
    assert dialog.fields["offload.context_length"].editor.isEnabled()


def test_a_model_without_experts_has_no_placement_to_choose(qtbot, demo_model):
    from app.load_dialog import LoadDialog
    dialog = LoadDialog(str(demo_model), LoadOptions(), LoadOptions(), memory=(24 * GIB, 64 * GIB, "GPU"),
                        engine="cuda")
    qtbot.addWidget(dialog)
    assert not dialog.fields["offload.placement"].editor.isEnabled()
    assert not dialog.no_experts.isHidden() and "no experts" in dialog.no_experts.text()
    assert dialog.fit.text().startswith("✓ Fits in VRAM")


# -- remembered per model ------------------------------------------------------------------------------

def test_options_are_remembered_per_model_folder(demo_model):
    from app.model_options import ModelOptions, model_key, options_path
    mine = LoadOptions(OffloadOptions(context_length=2048, kv_cache="q8"), DraftOptions(mode="ngram", draft_tokens=6))
    remembered = ModelOptions.load()
    assert remembered.get("demo") is None and remembered.warning is None
    remembered.put("demo", mine)
    again = ModelOptions.load()
    assert again.get("demo") == mine
    assert again.get(str(paths.resolve_model("demo"))) == mine          # the same folder by its path
    data = json.loads(options_path().read_text())
    assert data["version"] == 1 and list(data["models"]) == [model_key("demo")]
    again.forget("demo")
    assert ModelOptions.load().get("demo") is None


@pytest.mark.parametrize("text, where", [
    ("{not json", "not valid JSON"),
    ('{"version": 1, "models": {"/m": {"offload": {"context_length": 10}}}}', "models[/m].offload.context_length"),
    ('{"version": 1, "models": {"/m": {"offload": {"kv_cache": "fp8"}}}}', "'fp8' is not one of"),
    ('{"version": 1, "models": {"relative/m": {}}}', "absolute path"),
    ('{"version": 1, "models": {}, "extra": 1}', "unknown key"),
    ('{"version": 9, "models": {}}', "version 9"),
])
def test_a_damaged_options_file_is_set_aside_with_words(text, where):
    from app.model_options import ModelOptions, options_path
    path = options_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    remembered = ModelOptions.load()
    assert remembered.entries == {} and where in remembered.warning and "bak-" in remembered.warning
    assert not path.exists() and list(path.parent.glob("model-options.json.bak-*"))


# -- through the window --------------------------------------------------------------------------------

def desk_with(make_desk, app: AppSettings = AppSettings(), server: ServeOptions = ServeOptions()):
    desk = make_desk(settings=Settings(app=app, sampling=SamplingOptions(max_tokens=5), server=server))
    desk.memory = (24 * GIB, 64 * GIB, "NVIDIA GeForce RTX 4090")       # a staged machine for the fit
    return desk


def test_the_picker_opens_load_options_that_are_sent_and_remembered(qtbot, make_desk, demo_model):
    from app.model_options import ModelOptions
    from tests.test_desk_defects import _demo_in_models_folder
    _demo_in_models_folder(demo_model)
    desk = desk_with(make_desk)
    picker = desk.window.chat.picker
    assert desk.client.last_load[1] == LoadOptions()
    assert picker.options_button.isEnabled()
    picker.options_button.click()
    dialog = desk.load_dialog
    assert dialog is not None and dialog.isVisible() and dialog.loaded
    assert dialog.load_button.text() == "Reload with these options"
    dialog.fields["offload.context_length"].editor.setValue(1024)
    kv = dialog.fields["offload.kv_cache"].editor
    kv.setCurrentIndex(kv.findData("q8"))
    with qtbot.waitSignal(desk.client.loaded, timeout=10000):
        dialog.load_button.click()
    sent = desk.client.last_load[1]
    assert (sent.offload.context_length, sent.offload.kv_cache) == (1024, "q8")
    assert ModelOptions.load().get("demo") == sent

    # Ejected and picked again: the model loads with its own options, not the Settings' defaults.
    with qtbot.waitSignal(desk.client.unloaded, timeout=10000):
        picker.eject_requested.emit()
    with qtbot.waitSignal(desk.client.loaded, timeout=10000):
        picker.load_requested.emit(str(paths.models_dir() / paths.DEMO_MODEL_NAME))
    assert desk.client.last_load[1] == sent

    # Save with the defaults: nothing of its own is kept.
    picker.options_button.click()
    desk.load_dialog.defaults_button.click()
    desk.load_dialog.save_button.click()
    assert ModelOptions.load().get("demo") is None
    assert desk.client.last_load[1] == sent                # Save does not load


def test_the_model_unloads_when_idle_and_the_next_message_loads_it_again(qtbot, make_desk):
    desk = desk_with(make_desk, app=AppSettings(unload_idle_minutes=0.005))           # 0.3 s
    options = desk.client.last_load[1]
    with qtbot.waitSignal(desk.client.unloaded, timeout=10000):
        pass
    window = desk.window
    assert "unloaded while idle" in window.banner.headline.text()
    assert "next message" in window.banner.detail.text()
    assert desk.client.loaded_event is None and desk.unloader.asleep == ("demo", options)
    panel = window.chat
    assert panel.send_button.isEnabled()                   # the chat can still send
    panel.input.setPlainText("Are you there?")
    with qtbot.waitSignal(desk.client.loaded, timeout=10000):
        qtbot.keyClick(panel.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    answer = desk.session.model.items[-1]
    assert answer.state == "done" and answer.content.startswith("You said: Are you there?")
    assert desk.client.last_load == ("demo", options)


def test_the_server_keeps_its_model_through_an_idle_unload(qtbot, make_desk):
    from tests.test_serve_inapp import free_port
    desk = desk_with(make_desk, app=AppSettings(unload_idle_minutes=0.005),
                     server=ServeOptions(enabled=True, port=free_port()))
    with qtbot.waitSignal(desk.client.unloaded, timeout=10000):
        pass
    url = desk.server.url
    out: dict = {}

    def ask() -> None:
        out["models"] = httpx.get(f"{url}/models", timeout=10).json()
        out["answer"] = httpx.post(f"{url}/chat/completions", timeout=30, json={
            "model": "demo", "messages": [{"role": "user", "content": "wake up"}], "max_tokens": 3})
    threading.Thread(target=ask, daemon=True).start()
    qtbot.waitUntil(lambda: "answer" in out, timeout=20000)
    [listed] = out["models"]["data"]                   # still listed while unloaded, under its name or alias
    assert "demo" in [listed["id"], *listed.get("aliases", [])]
    assert out["answer"].status_code == 200
    assert out["answer"].json()["choices"][0]["message"]["content"].startswith("You said: wake up.")
    assert desk.client.loaded_event is not None


def test_no_idle_unload_while_a_load_is_in_flight(qtbot):
    """A second load sent while the first one ran: the first one's `loaded` leaves the client's state idle,
    but the second load is still running; unloading then would throw it away."""
    from PySide6.QtCore import QObject, Signal

    from app.idle_unload import IdleUnloader

    class Client(QObject):
        state_changed, loaded = Signal(str), Signal(object)
        state, loaded_event, generating, loading = "idle", object(), None, True
        last_load = ("demo", LoadOptions())
        unloads: list = []

        def unload(self):
            self.unloads.append(1)
    client = Client()
    unloader = IdleUnloader(client)
    unloader.set_minutes(0.001)
    client.state_changed.emit("idle")
    qtbot.wait(300)
    assert client.unloads == [] and unloader.asleep is None
    client.loading = False                      # the second load is done
    client.loaded.emit(object())
    qtbot.waitUntil(lambda: client.unloads == [1], timeout=3000)
    assert unloader.asleep == ("demo", LoadOptions()) and "0.06 s" in unloader.words


def test_idle_unload_is_a_validated_setting():
    from app.settings import parse_settings
    from runtime.options import OptionError
    assert parse_settings({"app": {"unload_idle_minutes": 15}}).app.unload_idle_minutes == 15.0
    with pytest.raises(OptionError, match="app.unload_idle_minutes"):
        parse_settings({"app": {"unload_idle_minutes": -1}})
    assert dataclasses.replace(AppSettings()).unload_idle_minutes == 0.0        # never, by default
