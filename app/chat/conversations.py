"""The conversation list on the left: new, search, open, rename, delete, export.

Reads the store to list and search; every change goes out as a signal (the window confirms deletes
and asks for titles and file names).
"""
from __future__ import annotations

import time
from typing import Optional

import html

from PySide6.QtCore import QPoint, QPointF, QRectF, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QPalette, QTextDocument
from PySide6.QtWidgets import (QApplication, QHBoxLayout, QLineEdit, QListWidget, QListWidgetItem, QMenu,
                               QPushButton, QStyle, QStyledItemDelegate, QVBoxLayout, QWidget)

from app.store import HIT_END, HIT_START, Store

IdRole = Qt.ItemDataRole.UserRole + 1
HtmlRole = Qt.ItemDataRole.UserRole + 2      # the entry as HTML: search hits in bold


def when(ts: float, now: Optional[float] = None) -> str:
    """A short, human date for the list: "14:05" today, else with its date: "Mon 24 Nov", "3 Nov",
    "3 Nov 2025"."""
    now = now or time.time()
    lt, ln = time.localtime(ts), time.localtime(now)
    if lt[:3] == ln[:3]:
        return time.strftime("%H:%M", lt)
    if now - ts < 6 * 86400:
        return f"{time.strftime('%a', lt)} {lt.tm_mday} {time.strftime('%b', lt)}"
    if lt.tm_year == ln.tm_year:
        return f"{lt.tm_mday} {time.strftime('%b', lt)}"
    return f"{lt.tm_mday} {time.strftime('%b %Y', lt)}"


def entry_html(title: str, sub: str) -> str:
    """A list entry as HTML: the title, and under it the date or the search snippet with its hits in bold."""
    snippet = html.escape(sub).replace(HIT_START, "<b><u>").replace(HIT_END, "</u></b>")
    return f"{html.escape(title)}<br><small>{snippet}</small>" if sub else html.escape(title)


def plain(text: str) -> str:
    return text.replace(HIT_START, "").replace(HIT_END, "")


class _EntryDelegate(QStyledItemDelegate):
    """Paints an entry's HTML (so a search hit shows in bold, never as markers or brackets), as tall as its
    text wrapped to the list's width: measured at that width too (the list asks for size hints with
    stale widths), and clipped to its row."""

    def _doc(self, option, index, colour: str = "", width: Optional[int] = None) -> QTextDocument:
        doc = QTextDocument()
        doc.setDefaultFont(option.font)
        doc.setDocumentMargin(4)
        if colour:
            doc.setDefaultStyleSheet(f"body {{ color: {colour}; }}")
        doc.setHtml(index.data(HtmlRole) or html.escape(index.data(Qt.ItemDataRole.DisplayRole) or ""))
        doc.setTextWidth(max(40, option.rect.width() if width is None else width))
        return doc

    def paint(self, painter, option, index) -> None:
        self.initStyleOption(option, index)
        option.text = ""
        style = option.widget.style() if option.widget else QApplication.style()
        style.drawControl(QStyle.ControlElement.CE_ItemViewItem, option, painter, option.widget)
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        role = QPalette.ColorRole.HighlightedText if selected else QPalette.ColorRole.Text
        doc = self._doc(option, index, option.palette.color(role).name())
        painter.save()
        painter.translate(QPointF(option.rect.topLeft()))
        doc.drawContents(painter, QRectF(0, 0, option.rect.width(), option.rect.height()))
        painter.restore()

    def sizeHint(self, option, index) -> QSize:  # noqa: N802
        view = option.widget
        doc = self._doc(option, index, width=view.viewport().width() if view is not None else None)
        return QSize(int(doc.idealWidth()), int(doc.size().height()))


class ConversationList(QWidget):
    new_requested = Signal()
    open_requested = Signal(int)
    rename_requested = Signal(int)
    delete_requested = Signal(int)
    export_requested = Signal(int, str)     # conversation id, "md" | "json"

    def __init__(self, store: Store, parent=None):
        super().__init__(parent)
        self.store = store
        self.new_button = QPushButton("New chat")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.new_requested)
        self.search = QLineEdit(placeholderText="Search chats  (Ctrl+F)", clearButtonEnabled=True)
        self.search.textChanged.connect(lambda _: (self._pinned.clear(), self._search_timer.start()))
        self._pinned: set[int] = set()         # chats made during this search, listed though they do not match
        self._search_timer = QTimer(self, singleShot=True, interval=150, timeout=self.refresh)
        self.list = QListWidget()
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.currentItemChanged.connect(self._on_current)
        self.list.setWordWrap(True)
        self.list.setResizeMode(QListWidget.ResizeMode.Adjust)     # entries measured again as the list narrows
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setItemDelegate(_EntryDelegate(self.list))
        buttons = QHBoxLayout()
        for label, tip, fn in (("Rename", "Rename the selected chat (F2)", self.rename_requested),
                               ("Export", "Save the selected chat as Markdown or JSON", None),
                               ("Delete", "Delete the selected chat", self.delete_requested)):
            b = QPushButton(label, toolTip=tip)
            if fn is None:
                b.clicked.connect(lambda _=False, btn=b: self._export_menu(btn))
            else:
                b.clicked.connect(lambda _=False, f=fn: self.current_id() is not None and f.emit(self.current_id()))
            buttons.addWidget(b)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 0, 6)
        lay.addWidget(self.new_button)
        lay.addWidget(self.search)
        lay.addWidget(self.list, 1)
        lay.addLayout(buttons)
        self._selecting = False
        self.refresh()

    def current_id(self) -> Optional[int]:
        item = self.list.currentItem()
        return item.data(IdRole) if item is not None else None

    def refresh(self, select: Optional[int] = None) -> None:
        """Reload from the store (or the search results), keeping the selection."""
        keep = select if select is not None else self.current_id()
        query = self.search.text().strip()
        if query:
            rows = [(h.conversation_id, h.title, h.snippet) for h in self.store.search(query)]
            listed = {self.list.item(i).data(IdRole) for i in range(self.list.count())}
            if select is not None and select not in listed:      # a chat made while searching stays in sight
                self._pinned.add(select)
            found = {cid for cid, _, _ in rows}
            for cid in sorted(self._pinned - found, reverse=True):
                try:
                    rows.insert(0, (cid, self.store.conversation(cid).title, "open chat"))
                except KeyError:
                    self._pinned.discard(cid)                    # deleted meanwhile
        else:
            rows = [(c.id, c.title, when(c.updated)) for c in self.store.conversations()]
        self._selecting = True
        try:
            self.list.clear()
            for cid, title, sub in rows:
                item = QListWidgetItem(plain(f"{title}\n{sub}" if sub else title))   # what Ctrl+C copies
                item.setData(HtmlRole, entry_html(title, sub))
                item.setData(IdRole, cid)
                item.setToolTip(title)
                self.list.addItem(item)
                if cid == keep:
                    self.list.setCurrentItem(item)
        finally:
            self._selecting = False

    def select(self, conversation_id: Optional[int]) -> None:
        self._selecting = True
        try:
            if conversation_id is None:
                self.list.setCurrentItem(None)
                self.list.clearSelection()
                return
            for i in range(self.list.count()):
                if self.list.item(i).data(IdRole) == conversation_id:
                    self.list.setCurrentRow(i)
                    return
        finally:
            self._selecting = False

    def _on_current(self, item: Optional[QListWidgetItem], _previous) -> None:
        if item is not None and not self._selecting:
            self.open_requested.emit(item.data(IdRole))

    def _menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        cid = item.data(IdRole)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.rename_requested.emit(cid))
        menu.addAction("Export as Markdown…", lambda: self.export_requested.emit(cid, "md"))
        menu.addAction("Export as JSON…", lambda: self.export_requested.emit(cid, "json"))
        menu.addSeparator()
        menu.addAction("Delete…", lambda: self.delete_requested.emit(cid))
        menu.exec(self.list.viewport().mapToGlobal(pos))

    def _export_menu(self, button) -> None:
        cid = self.current_id()
        if cid is None:
            return
        menu = QMenu(self)
        menu.addAction("Markdown…", lambda: self.export_requested.emit(cid, "md"))
        menu.addAction("JSON…", lambda: self.export_requested.emit(cid, "json"))
        menu.exec(button.mapToGlobal(QPoint(0, button.height())))
