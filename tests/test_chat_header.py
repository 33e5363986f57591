"""The chat header against the scripted worker: the context meter's counts and full-chat choice, and the
model picker (loaded mark, per-chat model, eject)."""
from __future__ import annotations

import os

import pytest
from PySide6.QtCore import Qt

from runtime.options import SamplingOptions
from tests.test_chat_session import make_desk, send  # noqa: F401  (fixture)


def test_meter_counts_the_chat_and_the_typed_message(qtbot, make_desk):
    desk = make_desk(max_tokens=5)
    meter, panel = desk.window.chat.meter, desk.window.chat
    qtbot.waitUntil(lambda: meter.text() == "0 / 2,048 tokens", timeout=5000)
    panel.input.setPlainText("one two three")
    qtbot.waitUntil(lambda: meter.text() == "0 (+7) / 2,048 tokens", timeout=5000)   # 4 + 3 words, by the worker
    send(qtbot, desk, "one two three")
    # The chat now holds the question and the answer ("You said: one two three." + 4 words).
    history = 4 + 3 + 4 + len(desk.session.model.items[1].content.split())
    qtbot.waitUntil(lambda: meter.text() == f"{history:,} / 2,048 tokens", timeout=5000)


def test_a_full_chat_is_refused_under_stop_and_sent_under_rolling(qtbot, make_desk):
    desk = make_desk(max_tokens=1000)              # room for the answer: 1,000 of 2,048
    meter, panel = desk.window.chat.meter, desk.window.chat
    notices = []
    desk.session.notice.connect(notices.append)
    panel.set_overflow_policy("stop")
    panel.input.setPlainText("word " * 1100)
    qtbot.waitUntil(meter.full, timeout=5000)
    assert "full" in meter.text()
    qtbot.keyClick(panel.input, Qt.Key.Key_Return)
    assert not desk.session.busy and notices and "full" in notices[-1]
    meter.policy_actions["rolling"].trigger()
    assert desk.session.sampling().context_overflow == "rolling"
    assert desk.store.conversation(desk.session.conversation.id).sampling.context_overflow == "rolling"
    qtbot.keyClick(panel.input, Qt.Key.Key_Return)
    assert desk.session.busy
    desk.session.stop()
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)


@pytest.fixture
def two_models(tmp_path, demo_model, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    for name in ("alpha", "beta"):
        os.symlink(demo_model, models / name)
    monkeypatch.setenv("MOEDESK_MODELS", str(models))
    return models


def test_picker_loads_marks_remembers_per_chat_and_ejects(qtbot, make_desk, two_models):
    desk = make_desk(max_tokens=3)
    picker = desk.window.chat.picker
    picker.refresh()
    assert [e.label for e in picker.entries] == ["alpha", "beta"]
    with qtbot.waitSignal(desk.client.loaded, timeout=10000):
        picker._picked(0)                          # what choosing "alpha" in the list does
    assert picker.combo.itemText(0).startswith("● ") and not picker.combo.itemText(1).startswith("● ")
    send(qtbot, desk, "first chat")
    first = desk.session.conversation
    assert desk.store.conversation(first.id).model == str(two_models / "alpha")

    desk.window.new_chat()
    with qtbot.waitSignal(desk.client.loaded, timeout=10000):
        picker._picked(1)
    send(qtbot, desk, "second chat")
    assert desk.store.conversation(desk.session.conversation.id).model == str(two_models / "beta")

    # Back to the first chat: its model is selected and offered, not loaded behind the user's back.
    desk.session.open(first.id)
    assert picker.combo.currentIndex() == 0 and picker.load_button.isVisibleTo(picker)
    with qtbot.waitSignal(desk.client.loaded, timeout=10000):
        picker.load_button.click()
    assert picker.combo.itemText(0).startswith("● ") and not picker.load_button.isVisibleTo(picker)

    with qtbot.waitSignal(desk.client.unloaded, timeout=10000):
        picker.eject_button.click()
    assert desk.window.loaded is None and not desk.window.chat.send_button.isEnabled()
    assert not any(picker.combo.itemText(i).startswith("● ") for i in range(picker.combo.count()))
    assert desk.window.chat.meter.text() == "— tokens"


def test_a_model_loaded_from_outside_the_models_folder_is_listed_and_marked(qtbot, demo_model):
    from app.chat.header import ModelPicker
    picker = ModelPicker(entries=lambda: [])
    qtbot.addWidget(picker)
    assert picker.combo.itemText(0).startswith("No local models")
    picker.set_loaded(str(demo_model))
    assert picker.combo.count() == 1 and picker.combo.itemText(0) == "● " + demo_model.name
    assert picker.eject_button.isEnabled() and not picker.load_button.isVisibleTo(picker)


def test_a_refused_count_stays_with_the_meter(qtbot, make_desk):
    """A count that meets no model (e.g. during a reload) leaves the banner alone; the meter shows its last."""
    desk = make_desk(max_tokens=5)
    meter, banner = desk.window.chat.meter, desk.window.banner
    with qtbot.waitSignal(desk.client.unloaded, timeout=10000):
        desk.client.unload()
    meter.set_model_context(2048)                 # as if the next model's figure had arrived first
    errors = []
    desk.client.error.connect(lambda rid, err: errors.append((rid, err.code)))
    desk.window.chat.input.setPlainText("hello")
    qtbot.waitUntil(lambda: bool(errors), timeout=5000)
    assert errors[0][0].startswith("count-") and errors[0][1] == "no_model"
    assert banner.kind != "error" and not meter.owns(errors[0][0])
