"""The whole app with the REAL worker and the demo model (CPU reference engine), offscreen.

Send and see the streamed answer; Stop; Regenerate; edit-and-resend; the conversation survives an
app restart; killing the worker mid-answer shows the error, keeps the partial text, and Restart works.
Answers are short (small max_tokens) and greedy, so the text is known.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
from PySide6.QtCore import Qt

from app.chat.model import ContentRole
from app.main import build
from app.settings import Settings
from runtime.options import SamplingOptions

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("runtime.worker") is None,
                       reason="runtime.worker is not on this branch yet"),
]

GREEDY = SamplingOptions(temperature=0.0, max_tokens=10)
LOAD_TIMEOUT = 300_000
ANSWER_TIMEOUT = 300_000


@pytest.fixture
def open_app(qtbot, demo_model):
    """Starts the app (window + real worker) on the test's data dir; each call is a new app instance."""
    apps = []

    def start(sampling: SamplingOptions = GREEDY):
        desk = build(Settings(sampling=sampling), model=str(demo_model))
        desk.window.confirm = lambda title, question: True
        qtbot.addWidget(desk.window)
        desk.window.show()
        with qtbot.waitSignal(desk.client.loaded, timeout=LOAD_TIMEOUT):
            desk.client.start()
        apps.append(desk)
        return desk

    yield start
    for desk in apps:
        close(desk)


def close(desk) -> None:
    desk.window.close()
    desk.client.shutdown(wait=True)
    desk.gauges.timer.stop()
    desk.store.close()


def type_and_send(qtbot, desk, text: str) -> None:
    desk.window.chat.input.setPlainText(text)
    qtbot.keyClick(desk.window.chat.input, Qt.Key.Key_Return)


def wait_idle(qtbot, desk) -> None:
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=ANSWER_TIMEOUT)


def test_send_stop_regenerate_and_edit(qtbot, open_app):
    desk = open_app()
    model, panel = desk.session.model, desk.window.chat
    assert "CPU (no NVIDIA GPU found)" in desk.window.banner.headline.text()

    # Send: the answer streams into the view (several token updates) and is saved.
    updates = []
    model.dataChanged.connect(lambda a, b, roles: ContentRole in roles and updates.append((a.row(), b.row())))
    type_and_send(qtbot, desk, "What is the capital of France?")
    wait_idle(qtbot, desk)
    answer = model.items[-1]
    assert answer.state == "done", answer.error
    assert "Paris" in answer.content
    assert len(updates) >= 3 and set(updates) == {(1, 1)}     # one row per token, nothing else
    assert answer.stats.generated_tokens <= GREEDY.max_tokens
    first_answer = answer.content

    # Stop: a long answer, stopped after a few tokens, keeps what was written.
    desk.session.default_sampling = SamplingOptions(temperature=0.0, max_tokens=400)
    type_and_send(qtbot, desk, "Write a long story about a dragon.")
    qtbot.waitUntil(lambda: len(model.items[-1].content.split()) >= 2, timeout=ANSWER_TIMEOUT)
    qtbot.keyClick(panel.input, Qt.Key.Key_Escape)
    wait_idle(qtbot, desk)
    stopped = model.items[-1]
    assert stopped.state == "cancelled" and stopped.content
    assert stopped.stats.generated_tokens < 400
    assert desk.store.message(stopped.id).content == stopped.content

    # Regenerate: the stopped answer is replaced by a fresh (short) one.
    desk.session.default_sampling = SamplingOptions(temperature=0.0, max_tokens=6)
    panel.regen_button.click()
    wait_idle(qtbot, desk)
    assert model.rowCount() == 4 and model.items[-1].id != stopped.id
    assert model.items[-1].state == "done" and model.items[-1].stats.generated_tokens <= 6

    # Edit-and-resend the first question: everything after it is replaced by the new answer.
    desk.session.default_sampling = GREEDY
    desk.window.chat.view.edit_requested.emit(model.items[0].id)
    panel.input.setPlainText("What is the capital of Germany?")
    qtbot.keyClick(panel.input, Qt.Key.Key_Return)
    wait_idle(qtbot, desk)
    assert [i.role for i in model.items] == ["user", "assistant"]
    assert model.items[0].content == "What is the capital of Germany?"
    assert model.items[1].state == "done" and model.items[1].content != first_answer
    assert "Berlin" in model.items[1].content
    stored = desk.store.messages(desk.session.conversation.id)
    assert [m.content for m in stored] == [i.content for i in model.items]


def test_conversation_survives_an_app_restart(qtbot, open_app):
    desk = open_app()
    type_and_send(qtbot, desk, "What is the capital of France?")
    wait_idle(qtbot, desk)
    conv_id, texts = desk.session.conversation.id, [i.content for i in desk.session.model.items]
    close(desk)

    again = open_app()                        # a new window on the same data dir
    lst = again.window.conversations.list
    assert lst.count() == 1 and lst.item(0).text().startswith("What is the capital of France?")
    lst.setCurrentRow(0)
    assert again.session.conversation.id == conv_id
    assert [i.content for i in again.session.model.items] == texts
    # And the conversation goes on with its history.
    type_and_send(qtbot, again, "And of Italy?")
    wait_idle(qtbot, again)
    assert again.session.model.rowCount() == 4 and again.session.model.items[-1].state == "done"


def test_killed_worker_mid_answer_keeps_text_and_restart_works(qtbot, open_app):
    desk = open_app(SamplingOptions(temperature=0.0, max_tokens=400))
    model, banner = desk.session.model, desk.window.banner
    type_and_send(qtbot, desk, "Write a long story about a dragon.")
    qtbot.waitUntil(lambda: len(model.items[-1].content.split()) >= 2, timeout=ANSWER_TIMEOUT)
    qtbot.wait(1200)                          # past one flush of the streaming text
    on_disk_before = desk.store.message(model.items[-1].id).content
    assert on_disk_before                     # saved while streaming, before the kill
    os.kill(desk.client.pid(), 9)
    wait_idle(qtbot, desk)
    partial = model.items[-1]
    assert partial.state == "error" and "killed" in partial.error
    assert partial.content.startswith(on_disk_before)
    assert desk.store.message(partial.id).content == partial.content
    assert banner.kind == "error" and banner.restart.isVisible()
    assert "killed" in banner.headline.text() and banner.log.isVisible()

    with qtbot.waitSignal(desk.client.loaded, timeout=LOAD_TIMEOUT):
        banner.restart.click()                # reloads the last model
    assert banner.kind == "info" and desk.window.chat.send_button.isEnabled()
    desk.session.default_sampling = GREEDY
    type_and_send(qtbot, desk, "What is the capital of France?")
    wait_idle(qtbot, desk)
    assert model.items[-1].state == "done" and "Paris" in model.items[-1].content
    assert model.items[1].content == partial.content     # the partial answer is still shown
