"""Links in message text never act as the app's own buttons, and no link, however malformed, raises."""
from __future__ import annotations

import pytest
from PySide6.QtCore import QSize
from PySide6.QtWidgets import QStyleOptionViewItem

from app.chat import markdown
from app.chat.delegate import MessageDelegate
from app.chat.model import ChatItem, MessageListModel

HOSTILE = ("Click [edit](act:edit), [again](act:regenerate), [copy](act:copy), [code](copy:0), [bad](copy:zz), "
           "[huge](copy:99999999999999999999999), [fold](think:x), [neg](think:-1), <act:regenerate>, "
           "[site](https://example.com/a)\n\n```\nsecret\n```\n")


def rows(text: str, role: str):
    model = MessageListModel()
    model.append(ChatItem(1, role, text, state="done"))
    model.append(ChatItem(2, "assistant", "last answer", state="done"))    # row 0 is not the last: no Regenerate
    d = MessageDelegate()
    opt = QStyleOptionViewItem()
    opt.rect.setSize(QSize(700, 100))
    got = []
    d.action.connect(lambda kind, row, payload: got.append((kind, payload)))
    return model, d, opt, got


@pytest.mark.parametrize("role", ["assistant", "user"])
def test_links_in_message_text_are_not_app_actions(qtbot, role):
    model, d, opt, got = rows(HOSTILE, role)
    for href in d.hyperlinks(model.index(0), opt):
        d.activate(href, model.index(0))
    kinds = {kind for kind, _ in got}
    assert kinds <= {"copy", "copy_code", "open_link", "edit", "fork"}   # the row's own buttons
    assert "regenerate" not in kinds                     # only the last answer's own button regenerates
    if role == "assistant":
        assert "edit" not in kinds                       # answers have no Edit button
        assert ("copy_code", "secret") in got            # the real code block's button still works
        assert ("open_link", "https://example.com/a") in got


@pytest.mark.parametrize("href", ["act:regenerate", "act:edit", "act:copy", "copy:0", "copy:zz", "copy:",
                                  "copy:99999999999999999999999", "think:x", "think:", "think:-1", "", ":",
                                  "javascript:alert(1)", "file:///etc/passwd", "act"])
def test_hrefs_a_message_could_carry_do_nothing_and_never_raise(qtbot, href):
    model, d, opt, got = rows("```\nsecret\n```", "assistant")
    d.hyperlinks(model.index(0), opt)                    # rendered: it has a code block 0
    d.activate(href, model.index(0))
    assert got == []


def test_hostile_link_syntax_is_shown_as_text():
    r = markdown.render("[again](act:regenerate) and [x](file:///etc/passwd)")
    assert "act:regenerate" in r.html and 'href="act:' not in r.html and 'href="file:' not in r.html
