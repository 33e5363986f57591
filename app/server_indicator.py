"""The local server in sight: a status-bar button that says the server runs (its address, the model it
serves, the requests in flight) and opens the request log.

    indicator = ServerIndicator(server)          # server: app.serve.inapp.LocalServer
    window.statusBar().addPermanentWidget(indicator)

Hidden while the server is off. The log (`RequestLogDialog`) lists the server's recent requests, newest
first, as they arrive and end (`app.serve.request_log.RequestHistory`).
"""
from __future__ import annotations

import time
from typing import Optional

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtWidgets import (QAbstractItemView, QApplication, QDialog, QDialogButtonBox, QHBoxLayout, QHeaderView,
                               QLabel, QPushButton, QTableWidget, QTableWidgetItem, QToolButton, QVBoxLayout)

from app.serve.request_log import RequestRecord

WIDTH_SHARE = 0.45          # of the window's width the words may take (longer ones are cut in the middle with "…")
MIN_WIDTH, MAX_WIDTH = 220, 560
COLUMNS = ("Time", "Client", "Request", "Status", "Took", "Tokens", "Ended")
ENDINGS = {"eos": "answer complete", "stop_string": "stop string", "length": "token limit", "cancelled": "cancelled"}


def host_port(url: str) -> str:
    """"http://127.0.0.1:8642/v1" -> "127.0.0.1:8642"."""
    return url.split("://", 1)[-1].split("/", 1)[0]


def summary(url: Optional[str], model: Optional[str], in_flight: int) -> str:
    """The indicator's words, e.g. "Server 127.0.0.1:8642 · demo · 1 request in flight"."""
    if url is None:
        return ""
    load = ("idle" if not in_flight else f"{in_flight} request in flight" if in_flight == 1
            else f"{in_flight} requests in flight")
    return f"Server {host_port(url)} · {model or 'no model loaded'} · {load}"


def record_cells(r: RequestRecord, now: Optional[float] = None) -> tuple[str, ...]:
    """One log row: time, client, "POST /v1/chat/completions", status, duration, tokens, how it ended."""
    took = f"{r.duration_s:.2f} s" if r.duration_s is not None else f"{(now or time.time()) - r.started:.0f} s…"
    status = str(r.status) if r.status is not None else ("running" if r.running else "no response")
    tokens = "" if r.tokens is None else f"{r.tokens}" + (f" at {r.decode_tps:.1f} tok/s" if r.decode_tps else "")
    return (time.strftime("%H:%M:%S", time.localtime(r.started)), r.client, f"{r.method} {r.path}", status, took,
            tokens, ENDINGS.get(r.outcome, r.outcome))


class RequestLogDialog(QDialog):
    """The server's recent requests, newest first, updated as they come and go."""

    def __init__(self, server, parent=None):
        super().__init__(parent)
        self.server = server
        self.setWindowTitle("Local server: requests")
        self.resize(820, 420)
        self.heading = QLabel(wordWrap=True)
        self.heading.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        copy = QPushButton("Copy address", toolTip="The base URL OpenAI clients use")
        copy.clicked.connect(lambda: QApplication.clipboard().setText(self.server.url or ""))
        top = QHBoxLayout()
        top.addWidget(self.heading, 1)
        top.addWidget(copy, 0, Qt.AlignmentFlag.AlignTop)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        head = self.table.horizontalHeader()
        head.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        head.setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        self.empty = QLabel("No requests yet. Point an OpenAI client at the address above.")
        self.empty.setEnabled(False)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        clear = buttons.addButton("Clear", QDialogButtonBox.ButtonRole.ResetRole)
        clear.setToolTip("Forget the requests that ended")
        clear.clicked.connect(server.history.clear)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.empty)
        lay.addWidget(buttons)
        server.history.changed.connect(self.refresh)
        server.status.connect(lambda _w: self.refresh())
        server.backend.model_changed.connect(self.refresh)
        self.refresh()

    def refresh(self) -> None:
        s, history = self.server, self.server.history
        model = s.backend.served_model()
        if s.url is None:
            self.heading.setText(f"The local server is not running. {s.words}")
        else:
            self.heading.setText(f"Serving {model.id if model else 'no model (load one)'} at {s.url} · "
                                 f"{history.in_flight} in flight · {history.served} served")
        records = list(reversed(history.records()))
        now = time.time()
        self.table.setRowCount(len(records))
        for row, r in enumerate(records):
            for col, text in enumerate(record_cells(r, now)):
                item = QTableWidgetItem(text)
                if col == 2 and r.request_id:
                    item.setToolTip(f"Request id {r.request_id}")
                self.table.setItem(row, col, item)
        self.empty.setVisible(not records)


class ServerIndicator(QToolButton):
    """Status-bar words while the local server runs; a click opens the request log."""

    def __init__(self, server, parent=None):
        super().__init__(parent)
        self.server = server
        self.dialog: Optional[RequestLogDialog] = None
        self.setAutoRaise(True)
        self.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        self.clicked.connect(self.show_log)
        server.status.connect(lambda _w: self.refresh())
        server.history.changed.connect(self.refresh)
        server.backend.model_changed.connect(self.refresh)
        self.refresh()

    def showEvent(self, event) -> None:  # noqa: N802
        self.window().installEventFilter(self)          # the room for the words follows the window's width
        super().showEvent(event)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # noqa: N802
        if event.type() == QEvent.Type.Resize:
            self.refresh()
        return False

    def refresh(self) -> None:
        s = self.server
        model = s.backend.served_model()
        words = summary(s.url, model.id if model else None, s.history.in_flight)
        shown = ("● " if s.history.in_flight else "○ ") + words
        room = int(min(MAX_WIDTH, max(MIN_WIDTH, self.window().width() * WIDTH_SHARE)))
        self.setText(self.fontMetrics().elidedText(shown, Qt.TextElideMode.ElideMiddle, room) if words else "")
        self.setVisible(bool(words))
        if words:
            self.setToolTip(f"The local OpenAI-compatible server runs at {s.url}, serving "
                            f"{model.id if model else 'no model yet'}: {s.history.in_flight} request(s) in "
                            f"flight, {s.history.served} served. Click for the request log.")

    def show_log(self) -> RequestLogDialog:
        if self.dialog is None:
            self.dialog = RequestLogDialog(self.server, self.window())
        self.dialog.show()
        self.dialog.raise_()
        return self.dialog
