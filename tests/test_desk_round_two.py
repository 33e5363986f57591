"""Round two of what got in a new user's way (real widgets offscreen, the real window and engine client
against the scripted worker, tests/fake_worker.py): each test failed before its fix."""
from __future__ import annotations

import os
import signal

import pytest
from PySide6.QtWidgets import QApplication

from app.main import build
from app.settings import Settings
from runtime.protocol import Telemetry
from tests.test_chat_session import make_desk, send  # noqa: F401 (make_desk is a fixture)


@pytest.fixture
def desk(qtbot):
    """The window with no engine started."""
    d = build(Settings(), model=None)
    qtbot.addWidget(d.window)
    d.window.show()
    yield d
    d.gauges.timer.stop()
    d.store.close()


def _settle(qtbot, ms: int = 60) -> None:
    QApplication.processEvents()
    qtbot.wait(ms)


# -- the gauges dock -------------------------------------------------------------------------------

def _toggle_details(qtbot, gauges, expanded: bool) -> None:
    if gauges.details_button.isChecked() != expanded:
        gauges.details_button.click()
    qtbot.waitUntil(lambda: gauges.details.isVisible() == expanded, timeout=3000)
    _settle(qtbot)


def test_closing_details_gives_the_chat_its_room_back(qtbot, make_desk):
    d = make_desk()
    win, gauges = d.window, d.gauges
    win.resize(1280, 780)
    _settle(qtbot)
    line, view = win.gauges_dock.height(), win.chat.view.height()
    _toggle_details(qtbot, gauges, True)
    assert win.gauges_dock.height() > line + 100
    # The dock's height as a user leaves it (its separator dragged, or the window state saved and restored
    # at the next start): the main window keeps that height for it from then on.
    win.restoreState(win.saveState())
    _settle(qtbot)
    _toggle_details(qtbot, gauges, False)
    assert win.gauges_dock.height() <= line + 2 and win.chat.view.height() >= view - 2
    _toggle_details(qtbot, gauges, True)           # open across an engine restart, closed after it
    win.restoreState(win.saveState())
    with qtbot.waitSignal(d.client.loaded, timeout=30000):
        win.restart_requested.emit()
    _toggle_details(qtbot, gauges, False)
    assert win.gauges_dock.height() <= line + 2 and win.chat.view.height() >= view - 2


def test_the_cpu_busy_note_keeps_the_dock_one_line_and_is_cut_with_an_ellipsis(qtbot, desk):
    win, gauges = desk.window, desk.gauges
    win.resize(640, 440)
    _settle(qtbot)
    line = win.gauges_dock.height()
    gauges.show_telemetry(Telemetry(cpu_busy_others=3.2, cpu_threads=1))
    _settle(qtbot)
    note = gauges.cpu_note
    assert note.isVisible() and win.gauges_dock.height() == line
    assert note.geometry().right() <= gauges.details_button.geometry().left()     # in the line, not under it
    shown = note.shown_text()
    assert shown.endswith("…") and "3.2" in note.toolTip() and note.toolTip() == note.text()
    gauges.show_telemetry(Telemetry(cpu_busy_others=0.1, cpu_threads=2))
    _settle(qtbot)
    assert not note.isVisible() and win.gauges_dock.height() == line


def test_after_the_engine_dies_the_line_greys_its_last_figures(qtbot, make_desk):
    d = make_desk(max_tokens=4)
    send(qtbot, d, "Hello")
    strip = d.gauges.strip_labels
    assert "—" not in strip["decode_tps"].text() and strip["decode_tps"].isEnabled()
    with qtbot.waitSignal(d.client.worker_died, timeout=10000):
        os.kill(d.client.pid(), signal.SIGKILL)
    for key in ("decode_tps", "ttft"):
        assert not strip[key].isEnabled(), key        # as its tile: greyed, not live
    assert strip["ram"].isEnabled()


# -- the main window -------------------------------------------------------------------------------

def test_the_first_window_fits_the_screen_with_its_title_bar(qtbot, desk):
    free = desk.window.screen().availableGeometry()
    win = desk.window
    assert win.width() <= free.width() and win.height() + 24 <= free.height()    # a title bar still fits
    from app.window import first_size
    from PySide6.QtCore import QSize
    assert first_size(QSize(1920, 1080)) == (1280, 800)              # where there is room: as before
    w, h = first_size(QSize(1280, 800))
    assert h <= 800 - 40 and w <= 1280


def test_window_geometry_is_kept_under_the_apps_home(qtbot, desk):
    from runtime import paths
    desk.window.resize(700, 500)
    _settle(qtbot)
    desk.window.close()
    kept = paths.config_dir() / "window.ini"
    assert kept.is_file() and str(kept).startswith(os.environ["MOEDESK_HOME"])
    again = build(Settings(), model=None)
    qtbot.addWidget(again.window)
    again.window.restore_geometry()
    assert (again.window.width(), again.window.height()) == (700, 500)
    again.gauges.timer.stop()
    again.store.close()


def test_an_engine_error_says_what_to_do_in_words_not_its_code(qtbot, desk):
    from runtime.protocol import WorkerError
    desk.client.error.emit("load-1", WorkerError("model_not_found", "/no/such/folder: no such model folder", ""))
    detail = desk.window.banner.detail.text()
    assert "model_not_found" not in detail and "Error code" not in detail
    assert "choose one of your models" in detail
    desk.client.error.emit("x", WorkerError("internal", "the worker failed to handle a command", "Traceback…"))
    assert "internal" not in desk.window.banner.detail.text().split()


def test_the_engine_death_log_is_as_tall_as_its_lines(qtbot, desk):
    banner = desk.window.banner
    line = banner.log.fontMetrics().lineSpacing()
    desk.window.on_worker_died(9, "The engine was killed (signal 9, SIGKILL).", ["one line"])
    _settle(qtbot)
    assert banner.log.isVisible() and banner.log.height() <= 2 * line + 16
    desk.window.on_worker_died(9, "The engine was killed.", [f"line {i}" for i in range(30)])
    _settle(qtbot)
    assert 11 * line < banner.log.height() <= 12 * line + 16


def test_an_export_keeps_the_title_as_it_reads():
    from app.window import export_file_name
    assert export_file_name("Why is the sky blue? A long question about…", "md") == \
        "Why is the sky blue_ A long question about….md"
    assert export_file_name("Crème brûlée: 日本語", "json") == "Crème brûlée_ 日本語.json"
    assert export_file_name("a/b\\c\n..", "md") == "a_b_c_.md" and export_file_name(" . ", "md") == "chat.md"
