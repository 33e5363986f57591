"""The window and chat session against a scripted worker process (fast; no model).

The scripted worker (tests/fake_worker.py) speaks the real protocol through the real engine client,
so everything from the QProcess to the store is exercised; test_gui_e2e.py repeats the key flows
with the real worker and the demo model.
"""
from __future__ import annotations

import json
import os
import sqlite3
import sys

import pytest
from PySide6.QtCore import Qt

from app.chat.markdown import app_link
from app.main import build
from app.settings import Settings
from app.store import Store
from runtime.options import SamplingOptions

FAKE = [sys.executable, "-m", "tests.fake_worker"]


@pytest.fixture
def make_desk(qtbot, monkeypatch):
    made = []

    def factory(delay: float = 0.02, max_tokens: int = 40, settings: Settings | None = None):
        monkeypatch.setenv("FAKE_WORKER_DELAY", str(delay))
        settings = settings or Settings(sampling=SamplingOptions(max_tokens=max_tokens))
        desk = build(settings, worker_command=FAKE, model="demo")
        desk.window.confirm = lambda title, question: True
        qtbot.addWidget(desk.window)
        desk.window.show()
        with qtbot.waitSignal(desk.client.loaded, timeout=30000):
            desk.client.start()
        made.append(desk)
        return desk
    yield factory
    for d in made:
        if d.server is not None:
            d.server.stop()
        d.client.shutdown(wait=True)
        d.gauges.timer.stop()
        d.store.close()


def send(qtbot, desk, text: str, wait: bool = True):
    panel = desk.window.chat
    panel.input.setPlainText(text)
    qtbot.keyClick(panel.input, Qt.Key.Key_Return)
    if wait:
        qtbot.waitUntil(lambda: not desk.session.busy, timeout=20000)


def test_send_streams_into_the_view_and_store(qtbot, make_desk):
    desk = make_desk(max_tokens=12)
    panel = desk.window.chat
    assert panel.send_button.isEnabled()
    panel.input.setPlainText("Hello\nthere")     # Shift+Enter made the newline; Enter sends
    qtbot.keyClick(panel.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    assert panel.input.toPlainText().count("\n") == 2 and desk.session.model.rowCount() == 0
    panel.input.setPlainText("Hello")
    qtbot.keyClick(panel.input, Qt.Key.Key_Return)
    assert panel.input.toPlainText() == "" and desk.session.busy
    model = desk.session.model
    qtbot.waitUntil(lambda: "word3" in model.items[-1].content, timeout=10000)
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    ans = model.items[-1]
    assert ans.content == "You said: Hello." + "".join(f" word{i}" for i in range(1, 12))
    assert ans.state == "done" and ans.stats.generated_tokens == 12
    conv = desk.session.conversation
    assert conv.title == "Hello"
    stored = desk.store.messages(conv.id)
    assert [(m.role, m.content, m.state) for m in stored] == [("user", "Hello", "done"), ("assistant", ans.content, "done")]
    assert desk.window.conversations.list.count() == 1


def test_streaming_text_reaches_disk_before_the_end(qtbot, make_desk):
    desk = make_desk(delay=0.05, max_tokens=400)
    send(qtbot, desk, "Long one", wait=False)
    qtbot.waitUntil(lambda: "word30" in desk.session.model.items[-1].content, timeout=10000)
    qtbot.wait(700)      # more than one flush interval
    other = sqlite3.connect(desk.store.path)
    content, state = other.execute("SELECT content, state FROM messages WHERE role = 'assistant'").fetchone()
    assert state == "streaming" and "word30" in content
    desk.window.chat.escape()
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)


def test_stop_regenerate_and_edit_and_resend(qtbot, make_desk):
    desk = make_desk(delay=0.03, max_tokens=300)
    model, panel = desk.session.model, desk.window.chat
    send(qtbot, desk, "First", wait=False)
    qtbot.waitUntil(lambda: "word5" in model.items[-1].content, timeout=10000)
    qtbot.keyClick(panel.input, Qt.Key.Key_Escape)          # Esc stops
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    stopped = model.items[-1]
    assert stopped.state == "cancelled" and "word5" in stopped.content and "word299" not in stopped.content
    assert desk.store.message(stopped.id).state == "cancelled"

    # Regenerate replaces the last answer with a new one.
    desk.session.default_sampling = SamplingOptions(max_tokens=5)
    assert panel.regen_button.isEnabled()
    panel.regen_button.click()
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    assert model.rowCount() == 2 and model.items[-1].id != stopped.id
    assert model.items[-1].content == "You said: First. word1 word2 word3 word4"
    assert [m.id for m in desk.store.messages(desk.session.conversation.id)] == [i.id for i in model.items]

    # A second exchange, then edit the first question: everything after it is replaced.
    send(qtbot, desk, "Second")
    assert model.rowCount() == 4
    first_id = model.items[0].id
    desk.window.chat.view.edit_requested.emit(first_id)
    assert panel.input.toPlainText() == "First" and panel.edit_banner.isVisible()
    panel.input.setPlainText("First, edited")
    qtbot.keyClick(panel.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    assert [(i.role, i.content.split(" word")[0]) for i in model.items] == [
        ("user", "First, edited"), ("assistant", "You said: First, edited.")]
    edited = model.items[0]
    assert edited.id != first_id and (edited.slot, edited.version, edited.versions) == (first_id, 2, 2)
    assert not panel.edit_banner.isVisible()
    assert len(desk.store.messages(desk.session.conversation.id)) == 2

    # The old version comes back with everything that followed it (‹ 1/2 ›), and goes again.
    panel.view.version_requested.emit(edited.id, -1)
    assert [i.content.split(" word")[0] for i in model.items] == [
        "First", "You said: First.", "Second", "You said: Second."]
    assert (model.items[1].version, model.items[1].versions) == (2, 2)     # the regenerated answer
    panel.view.version_requested.emit(model.items[0].id, +1)
    assert [i.content.split(" word")[0] for i in model.items] == ["First, edited", "You said: First, edited."]


def test_killed_worker_keeps_partial_answer_and_restart_works(qtbot, make_desk):
    desk = make_desk(delay=0.03, max_tokens=500)
    model, banner = desk.session.model, desk.window.banner
    send(qtbot, desk, "Doomed", wait=False)
    qtbot.waitUntil(lambda: "word10" in model.items[-1].content, timeout=10000)
    os.kill(desk.client.pid(), 9)
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    ans = model.items[-1]
    assert ans.state == "error" and "killed" in ans.error and "word10" in ans.content
    saved = desk.store.message(ans.id)
    assert (saved.state, saved.content) == ("error", ans.content)
    assert banner.kind == "error" and banner.restart.isVisible() and "killed" in banner.headline.text()
    assert not desk.window.chat.send_button.isEnabled()
    with qtbot.waitSignal(desk.client.loaded, timeout=30000) as sig:
        banner.restart.click()
    assert sig.args[0].model == "demo"                        # restart reloads the last model
    assert banner.kind == "info" and desk.window.chat.send_button.isEnabled()
    desk.session.default_sampling = SamplingOptions(max_tokens=3)
    send(qtbot, desk, "Again")
    assert model.items[-1].state == "done" and model.items[-2].content == "Again"
    assert model.items[1].content == ans.content              # the partial answer is still there


def test_conversations_search_rename_export_delete(qtbot, make_desk, tmp_path):
    desk = make_desk(max_tokens=4)
    send(qtbot, desk, "About mushrooms")
    first = desk.session.conversation.id
    desk.window.new_chat()
    assert desk.session.conversation is None and desk.session.model.rowCount() == 0
    send(qtbot, desk, "About trains")
    lst = desk.window.conversations
    assert lst.list.count() == 2
    desk.session.rename(first, "Fungi")
    lst.search.setText("mushroom")
    qtbot.waitUntil(lambda: lst.list.count() == 1, timeout=3000)
    assert lst.list.item(0).text().startswith("Fungi")
    lst.list.setCurrentRow(0)                                  # opening from the list
    assert desk.session.conversation.id == first and desk.session.model.items[0].content == "About mushrooms"
    md = desk.window.export_chat(first, "md", tmp_path / "f.md")
    assert "# Fungi" in md.read_text() and "About mushrooms" in md.read_text()
    js = json.loads(desk.window.export_chat(first, "json", tmp_path / "f.json").read_text())
    assert js["messages"][0]["content"] == "About mushrooms"
    desk.window.confirm = lambda title, question: False      # "No" keeps it
    desk.window.delete_chat(first)
    assert len(desk.store.conversations()) == 2
    desk.window.confirm = lambda title, question: "Fungi" in question
    desk.window.delete_chat(first)
    assert [c.title for c in desk.store.conversations()] == ["About trains"]
    assert desk.session.conversation is None


def test_per_conversation_settings_travel_with_the_request(qtbot, make_desk):
    desk = make_desk()
    requests = []
    desk.session.generate_requested.connect(lambda rid, msgs, s: requests.append((msgs, s)))
    desk.session.set_settings("Answer briefly.", SamplingOptions(temperature=0.1, max_tokens=3, seed=5), "brief")
    send(qtbot, desk, "Hi")
    msgs, sampling = requests[-1]
    assert [(m.role, m.content) for m in msgs] == [("system", "Answer briefly."), ("user", "Hi")]
    assert (sampling.temperature, sampling.max_tokens, sampling.seed) == (0.1, 3, 5)
    conv = Store(desk.store.path).conversation(desk.session.conversation.id)
    assert conv.preset == "brief" and conv.sampling.seed == 5


def test_engine_state_in_words(qtbot, make_desk):
    desk = make_desk()
    text = desk.window.banner.headline.text()
    assert "CPU (no NVIDIA GPU found)" in text and "SmolLM2-135M-Instruct" in text     # its one name


def test_a_refused_answer_is_shown_on_the_message_not_as_an_engine_failure(qtbot, make_desk):
    from runtime.protocol import WorkerError
    desk = make_desk(delay=0.05, max_tokens=300)
    send(qtbot, desk, "Hello", wait=False)
    rid = desk.session.stream.request_id
    desk.client.error.emit(rid, WorkerError("context_overflow", "The conversation does not fit the context.", ""))
    assert not desk.session.busy
    ans = desk.session.model.items[-1]
    assert ans.state == "error" and ans.error == "The conversation does not fit the context."
    assert desk.window.banner.kind == "info"
    assert "does not fit" in desk.window.statusBar().currentMessage()
    # An error about no chat request (e.g. a failed load) goes to the banner with Restart.
    desk.client.error.emit("load-1", WorkerError("model_invalid", "config.json is missing", "detail line"))
    assert desk.window.banner.kind == "error" and "config.json" in desk.window.banner.headline.text()


def test_settings_apply_saves_hides_gauges_and_reloads(qtbot, make_desk):
    import dataclasses
    from app.main import apply_settings
    from app.settings import load_settings
    desk = make_desk()
    s = desk.settings
    new = dataclasses.replace(s, app=dataclasses.replace(s.app, show_gauges=False),
                              sampling=dataclasses.replace(s.sampling, temperature=0.25),
                              load=dataclasses.replace(s.load, offload=dataclasses.replace(s.load.offload,
                                                                                           context_length=2048)))
    with qtbot.waitSignal(desk.client.loaded, timeout=30000):
        apply_settings(desk, new, reload=True)
    assert desk.client.last_load[1].offload.context_length == 2048
    assert desk.session.default_sampling.temperature == 0.25
    assert not desk.window.gauges_dock.isVisible()
    assert load_settings().settings == new
    desk.window.settings_requested.emit()                     # the panel opens without blocking
    from app.settings_panel import SettingsPanel
    assert any(isinstance(w, SettingsPanel) and w.isVisible() for w in desk.window.findChildren(SettingsPanel))


def _links(desk, row: int) -> list[str]:
    view = desk.window.chat.view
    return view.delegate.hyperlinks(desk.session.model.index(row, 0), view._option())


def test_versions_continue_and_fork_from_the_message_links(qtbot, make_desk):
    desk = make_desk(delay=0.03, max_tokens=300)
    model, panel = desk.session.model, desk.window.chat
    send(qtbot, desk, "Tell", wait=False)
    qtbot.waitUntil(lambda: "word5" in model.items[-1].content, timeout=10000)
    panel.escape()
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    stopped = model.items[-1]
    assert app_link("continue") in _links(desk, 1) and app_link("fork") in _links(desk, 1)

    # Continue: the same message goes on where it stopped.
    desk.session.default_sampling = SamplingOptions(max_tokens=3)
    n = stopped.content.count(" word")
    panel.view.continue_requested.emit(stopped.id)
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    assert model.rowCount() == 2 and model.items[-1].id == stopped.id and model.items[-1].state == "done"
    assert model.items[-1].content.endswith(f" word{n + 1} word{n + 2} word{n + 3}")
    assert desk.store.message(stopped.id).content == model.items[-1].content
    assert app_link("continue") not in _links(desk, 1)

    # Regenerate keeps the old answer as version 1 of 2, with its arrows.
    panel.regen_button.click()
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    assert (model.items[-1].version, model.items[-1].versions) == (2, 2)
    assert app_link("older") in _links(desk, 1) and app_link("newer") not in _links(desk, 1)
    panel.view.version_requested.emit(model.items[-1].id, -1)
    assert model.items[-1].id == stopped.id and app_link("newer") in _links(desk, 1)

    # Fork from the question: a new chat holding it, which Regenerate answers.
    original = desk.session.conversation.id
    panel.view.fork_requested.emit(model.items[0].id)
    assert desk.session.conversation.id != original and desk.session.conversation.title.endswith("(fork)")
    assert [i.content for i in model.items] == ["Tell"]
    assert panel.regen_button.isEnabled()
    panel.regen_button.click()
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    assert model.items[-1].content.startswith("You said: Tell.")
    assert len(desk.store.messages(original)) == 2
