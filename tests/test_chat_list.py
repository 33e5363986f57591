"""The chat list grouped by Pinned / Today / Yesterday / Last 7 days / Older, with pins kept in the store
(schema v5) and the groups' headings painted above their first chat (offscreen, scripted worker)."""
from __future__ import annotations

import sqlite3
import time

from app.chat.conversations import IdRole
from app.store import Store
from tests.test_chat_session import make_desk  # noqa: F401 (a fixture)


def test_group_of_uses_calendar_days():
    from app.chat.conversations import group_of
    now = time.mktime((2026, 3, 10, 9, 0, 0, 0, 0, -1))
    day = 86400
    assert group_of(now - 3600, now) == "Today"
    assert group_of(time.mktime((2026, 3, 10, 0, 1, 0, 0, 0, -1)), now) == "Today"
    assert group_of(time.mktime((2026, 3, 9, 23, 59, 0, 0, 0, -1)), now) == "Yesterday"
    assert group_of(now - 3 * day, now) == "Last 7 days"
    assert group_of(now - 6 * day, now) == "Last 7 days"
    assert group_of(now - 8 * day, now) == "Older"
    assert group_of(now + 600, now) == "Today"            # a clock set back: not "Older"


def _chat_at(store: Store, title: str, ts: float) -> int:
    c = store.create_conversation(title)
    store.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (ts, c.id))
    return c.id


def test_the_list_groups_chats_and_pins_them_on_top(qtbot, make_desk):
    from app.chat.conversations import GroupRole, group_of
    desk = make_desk()
    store, lst = desk.store, desk.window.conversations
    now, day = time.time(), 86400
    old = _chat_at(store, "Old one", now - 30 * day)
    week = _chat_at(store, "This week", now - 3 * day)
    yesterday = _chat_at(store, "Yesterday's", now - day - 60 if group_of(now - day - 60) == "Yesterday"
                         else now - day)
    today = _chat_at(store, "Today's", now - 1)
    desk.session.conversations_changed.emit()
    rows = [(lst.list.item(i).data(IdRole), lst.list.item(i).data(GroupRole)) for i in range(lst.list.count())]
    assert rows == [(today, "Today"), (yesterday, "Yesterday"), (week, "Last 7 days"), (old, "Older")]
    assert lst.list.count() == 4                          # headings are painted, not rows

    desk.window.conversations.pin_requested.emit(old, True)         # the list's menu: "Pin to top"
    rows = [(lst.list.item(i).data(IdRole), lst.list.item(i).data(GroupRole)) for i in range(lst.list.count())]
    assert rows[0] == (old, "Pinned") and rows[1] == (today, "Today")
    assert store.conversation(old).pinned

    # A heading takes room above its row, so the row's own highlight never covers the next title.
    lst.list.setCurrentRow(0)
    first, second = lst.list.visualItemRect(lst.list.item(0)), lst.list.visualItemRect(lst.list.item(1))
    assert first.bottom() < second.top()

    desk.window.conversations.pin_requested.emit(old, False)
    assert [lst.list.item(i).data(IdRole) for i in range(lst.list.count())][-1] == old


def test_pins_survive_a_restart_and_old_files_migrate(tmp_path):
    path = tmp_path / "c.sqlite3"
    v4 = Store(path, target_version=4)
    v4.db.execute("INSERT INTO conversations (id, title, created, updated) VALUES (1, 'Kept', 1.0, 2.0)")
    v4.db.execute("INSERT INTO conversations (id, title, created, updated) VALUES (2, 'Newer', 1.0, 3.0)")
    v4.close()
    s = Store(path)
    assert s.version() == 5
    assert [(c.title, c.pinned) for c in s.conversations()] == [("Newer", False), ("Kept", False)]
    s.set_pinned(1, True)
    s.close()
    again = Store(path)
    assert [(c.title, c.pinned) for c in again.conversations()] == [("Kept", True), ("Newer", False)]
    again.close()
    cols = [r[1] for r in sqlite3.connect(path).execute("PRAGMA table_info(conversations)")]
    assert "pinned" in cols
