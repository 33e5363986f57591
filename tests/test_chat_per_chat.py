"""An answer belongs to its chat (against the scripted worker, offscreen): while chat A streams, a message
sent in chat B waits and says so, Stop in B never stops A, and the chat list marks the chat being written."""
from __future__ import annotations

from PySide6.QtCore import Qt

from app.chat.conversations import IdRole
from tests.test_chat_session import make_desk, send  # noqa: F401 (make_desk is a fixture)


def _answers(desk, conv_id):
    return [m for m in desk.store.messages(conv_id) if m.role == "assistant"]


def _row_text(desk, conv_id) -> str:
    lst = desk.window.conversations.list
    return next(lst.item(i).text() for i in range(lst.count()) if lst.item(i).data(IdRole) == conv_id)


def test_a_message_in_another_chat_queues_and_says_so(qtbot, make_desk):
    desk = make_desk(delay=0.03, max_tokens=60)
    panel, session, window = desk.window.chat, desk.session, desk.window
    send(qtbot, desk, "Chat A question", wait=False)
    a = session.conversation.id
    qtbot.waitUntil(lambda: "word3" in session.model.items[-1].content, timeout=10000)

    qtbot.keyClick(panel.input, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)     # Ctrl+N: a new chat
    assert session.conversation is None
    assert panel.send_button.isVisible() and panel.send_button.isEnabled()   # not A's Stop
    panel.input.setPlainText("Chat B question")
    qtbot.keyClick(panel.input, Qt.Key.Key_Return)
    b = session.conversation.id
    assert b != a and panel.input.toPlainText() == ""       # sent, not dropped
    assert "Queued" in window.statusBar().currentMessage() and "Chat A question" in window.statusBar().currentMessage()
    waiting = session.model.items[-1]
    assert waiting.role == "assistant" and waiting.state == "queued"      # B's answer says it waits
    assert "queued" in _row_text(desk, b) and "writing" in _row_text(desk, a)    # the list's marks

    # A ends first; then B's answer runs, in B, with B's question.
    qtbot.waitUntil(lambda: not session.generating, timeout=30000)
    (ans_a,), (ans_b,) = _answers(desk, a), _answers(desk, b)
    assert ans_a.state == "done" and ans_a.content.startswith("You said: Chat A question.")
    assert ans_b.state == "done" and ans_b.content.startswith("You said: Chat B question.")
    assert session.model.items[-1].content == ans_b.content and session.model.items[-1].state == "done"
    assert "writing" not in _row_text(desk, a) and "queued" not in _row_text(desk, b)


def test_stop_in_another_chat_never_stops_the_chat_writing(qtbot, make_desk):
    desk = make_desk(delay=0.03, max_tokens=60)
    panel, session = desk.window.chat, desk.session
    send(qtbot, desk, "Long answer please", wait=False)
    a = session.conversation.id
    qtbot.waitUntil(lambda: "word2" in session.model.items[-1].content, timeout=10000)
    desk.window.new_chat()
    assert not panel.stop_button.isVisible() and not session.busy       # B shows no Stop for A's answer
    qtbot.keyClick(panel.input, Qt.Key.Key_Escape)                      # Esc / Stop in B
    desk.window.stop_action.trigger()
    send(qtbot, desk, "Short one", wait=False)                          # B's own answer, queued behind A
    assert panel.stop_button.isVisible()
    panel.stop_button.click()                                           # stops B's, not A's
    qtbot.waitUntil(lambda: not session.busy, timeout=10000)
    b = session.conversation.id
    assert _answers(desk, b)[0].state == "cancelled"
    assert a in session.streams                                         # A still writes
    qtbot.waitUntil(lambda: not session.generating, timeout=30000)
    (ans_a,) = _answers(desk, a)
    assert ans_a.state == "done" and ans_a.stats.generated_tokens == 60   # the whole answer

    # Back in A the answer is whole; the window's chat is A's again.
    desk.window.conversations.select(a)
    session.open(a)
    assert session.model.items[-1].content == ans_a.content


def test_reopening_a_chat_that_writes_shows_its_answer_growing(qtbot, make_desk):
    desk = make_desk(delay=0.03, max_tokens=80)
    session = desk.session
    send(qtbot, desk, "Keep going", wait=False)
    a = session.conversation.id
    qtbot.waitUntil(lambda: "word2" in session.model.items[-1].content, timeout=10000)
    desk.window.new_chat()
    qtbot.wait(200)
    session.open(a)                                      # back to A while it writes
    assert session.busy and desk.window.chat.stop_button.isVisible()
    qtbot.waitUntil(lambda: not session.busy, timeout=30000)
    assert session.model.items[-1].state == "done" and "word79" in session.model.items[-1].content
