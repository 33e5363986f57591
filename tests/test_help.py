"""The Help menu: shortcuts from the window's actions, the shipped user guide, About with the engine's versions."""
from __future__ import annotations

import pytest

from app import help as help_windows
from app.main import build
from app.settings import Settings
from runtime.protocol import Loaded, Ready


@pytest.fixture
def window(qtbot):
    d = build(Settings(), model=None)
    qtbot.addWidget(d.window)
    yield d.window
    d.gauges.timer.stop()
    d.store.close()


def _menu_action(window, menu: str, text: str):
    for top in window.menuBar().actions():
        if top.text().replace("&", "") == menu:
            for a in top.menu().actions():
                if a.text().replace("&", "") == text:
                    return a
    raise AssertionError(f"no {menu} → {text}")


def test_shortcuts_come_from_the_actions(window):
    _menu_action(window, "Help", "Keyboard shortcuts").trigger()
    table = window.help_dialog.findChild(help_windows.QTableWidget)
    rows = {table.item(r, 0).text(): table.item(r, 1).text() for r in range(table.rowCount())}
    assert rows["Send the message"] == "Enter" and rows["Regenerate"] == "Ctrl+R"
    assert rows["New chat"] == "Ctrl+N" and rows["Keyboard shortcuts"] == "Ctrl+/"


def test_user_guide_is_shipped_and_describes_the_chat_header(window):
    _menu_action(window, "Help", "User guide").trigger()
    text = window.help_dialog.findChild(help_windows.QTextBrowser).toPlainText()
    assert "context meter" in text and "model picker" in text and "‹ 2/2 ›" in text


def test_about_shows_versions_the_worker_reported(window):
    ready = Ready(2, "0.1.0", 123, "cpu", "No CUDA device.", "cpu", {"torch": "2.11.0", "python": "3.12.1"})
    window.on_ready(ready)
    _menu_action(window, "Help", "About MoE Desk").trigger()
    text = window.help_dialog.findChild(help_windows.QLabel).text()
    assert "Engine: torch" in text and "2.11.0" in text and "PySide6" in text and "moedesk-worker 0.1.0" in text
    assert "not running" in help_windows.about_html(None, None)
    loaded = Loaded("l", "demo", "/m/demo", "LlamaForCausalLM", "cpu", 4096, 49152, 1.0)
    assert "LlamaForCausalLM" in help_windows.about_html(ready, loaded)
