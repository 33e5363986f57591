"""The window at its minimum size and at 1280x800: the chat keeps its room, the gauges stay one line."""
from __future__ import annotations

import pytest

from app.main import build
from app.settings import Settings
from app.window import MIN_SIZE


@pytest.fixture
def desk(qtbot):
    d = build(Settings(), model=None)
    qtbot.addWidget(d.window)
    d.window.show()
    yield d
    d.gauges.timer.stop()
    d.store.close()


def test_the_window_shrinks_to_its_minimum_and_the_chat_stays_usable(qtbot, desk):
    win, chat = desk.window, desk.window.chat
    win.resize(300, 200)                                      # smaller than allowed: held at the minimum
    qtbot.waitUntil(lambda: (win.width(), win.height()) == MIN_SIZE, timeout=3000)
    assert MIN_SIZE[0] <= 640 and MIN_SIZE[1] <= 440
    assert chat.view.height() >= 150 and chat.view.width() >= 400      # several lines of a message
    assert chat.title.width() >= 80 and win.conversations.width() <= 200
    assert chat.input.height() >= 56 and chat.send_button.isVisible()
    assert chat.picker.isVisible() and chat.meter.isVisible()
    assert desk.gauges.height() <= 32                         # the compact line


def test_at_1280x800_the_gauges_are_one_line_until_details_open(qtbot, desk):
    win, gauges = desk.window, desk.gauges
    win.resize(1280, 800)
    qtbot.waitUntil(lambda: win.width() == 1280, timeout=3000)
    assert not gauges.details.isVisible() and gauges.height() <= 32
    compact_view = win.chat.view.height()
    assert compact_view >= 450
    gauges.details_button.click()
    qtbot.waitUntil(lambda: gauges.details.isVisible(), timeout=3000)
    assert gauges.details_button.text() == "Details ▾"
    assert all(gauges.gauges[k].isVisibleTo(gauges) for k in ("decode_tps", "ttft", "prefill_tps", "ram"))
    gauges.set_expanded(False)
    qtbot.waitUntil(lambda: not gauges.details.isVisible(), timeout=3000)
