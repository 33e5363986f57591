"""The Help menu's windows: keyboard shortcuts, the user guide, and About.

The shortcuts table is read from the window's own actions (plus the message box's keys), so it cannot
drift from what the keys do. About shows the app's versions and the engine's as the worker reported
them in its `ready` event: the GUI never imports torch or exllamav2 to ask.
"""
from __future__ import annotations

import html
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

from PySide6 import __version__ as pyside_version
from PySide6.QtCore import Qt, qVersion
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QHeaderView, QLabel, QTableWidget, QTableWidgetItem,
                               QTextBrowser, QVBoxLayout, QWidget)

from app.resources import resource
from runtime.protocol import Loaded, Ready

GUIDE = "user-guide.md"
MESSAGE_BOX_KEYS = [("Send the message", "Enter"), ("New line in the message", "Shift+Enter"),
                    ("Stop the answer, or cancel an edit", "Esc")]


def app_version() -> str:
    try:
        return version("moedesk")
    except PackageNotFoundError:
        return "dev"


def shortcuts(actions: list[QAction]) -> list[tuple[str, str]]:
    """(what, keys) for every action with a shortcut, then the message box's own keys."""
    rows = [(a.text().replace("&", "").rstrip("…"), a.shortcut().toString(QKeySequence.SequenceFormat.NativeText))
            for a in actions if not a.shortcut().isEmpty()]
    return MESSAGE_BOX_KEYS + sorted(set(rows), key=lambda r: r[0].lower())


def about_html(ready: Optional[Ready], loaded: Optional[Loaded]) -> str:
    rows = [("MoE Desk", app_version()), ("Python", platform.python_version()),
            ("PySide6 / Qt", f"{pyside_version} / {qVersion()}")]
    if ready is None:
        rows.append(("Engine", "not running: its versions show once it has started"))
    else:
        where = ready.device if ready.engine == "cuda" else "CPU"
        rows.append(("Engine", f"moedesk-worker {ready.worker_version} ({ready.engine}, {where}), "
                               f"protocol {ready.protocol_version}"))
        rows += [(f"Engine: {name}", v) for name, v in sorted(ready.libraries.items())]
    if loaded is not None:
        rows.append(("Model", f"{loaded.model} ({loaded.architecture}, {loaded.backend})"))
    table = "".join(f"<tr><td>{html.escape(k)}&nbsp;&nbsp;</td><td><b>{html.escape(v)}</b></td></tr>" for k, v in rows)
    return ("<h3>MoE Desk</h3><p>Large Mixture-of-Experts models on the GPU you have; everything runs on this "
            f"machine.</p><table>{table}</table>")


def _dialog(parent: Optional[QWidget], title: str, body: QWidget, size=(520, 420)) -> QDialog:
    dlg = QDialog(parent, windowTitle=title)
    buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
    buttons.rejected.connect(dlg.reject)
    lay = QVBoxLayout(dlg)
    lay.addWidget(body, 1)
    lay.addWidget(buttons)
    dlg.resize(*size)
    return dlg


def shortcuts_dialog(parent: Optional[QWidget], actions: list[QAction]) -> QDialog:
    rows = shortcuts(actions)
    table = QTableWidget(len(rows), 2)
    table.setHorizontalHeaderLabels(["", "Keys"])
    table.verticalHeader().setVisible(False)
    table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
    table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    for r, (what, keys) in enumerate(rows):
        table.setItem(r, 0, QTableWidgetItem(what))
        table.setItem(r, 1, QTableWidgetItem(keys))
    return _dialog(parent, "Keyboard shortcuts", table)


def guide_dialog(parent: Optional[QWidget]) -> QDialog:
    browser = QTextBrowser(openExternalLinks=True)
    path = resource(GUIDE)
    browser.setSearchPaths([str(path.parent)])
    browser.setMarkdown(path.read_text(encoding="utf-8"))
    return _dialog(parent, "MoE Desk user guide", browser, (720, 640))


def about_dialog(parent: Optional[QWidget], ready: Optional[Ready], loaded: Optional[Loaded]) -> QDialog:
    label = QLabel(about_html(ready, loaded), wordWrap=True)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return _dialog(parent, "About MoE Desk", label, (480, 320))
