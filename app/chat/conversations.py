"""The conversation list on the left: new, search, open, rename, pin, delete, export.

Reads the store to list and search; every change goes out as a signal (the window confirms deletes
and asks for titles and file names). Without a search the chats are grouped under headings (`GROUPS`:
pinned ones first, then by their last message: today, yesterday, the last 7 days, older); the delegate
paints a group's heading above its first entry, so every row is a chat. A chat whose answer is being
written, or waits for another chat's, says so under its title (`set_writing`).
"""
from __future__ import annotations

import datetime
import time
from typing import Optional

import html

from PySide6.QtCore import QPoint, QPointF, QRectF, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QFont, QPalette, QTextDocument
from PySide6.QtWidgets import (QApplication, QHBoxLayout, QLineEdit, QListWidget, QListWidgetItem, QMenu,
                               QPushButton, QStyle, QStyledItemDelegate, QVBoxLayout, QWidget)

from app.store import HIT_END, HIT_START, Store

IdRole = Qt.ItemDataRole.UserRole + 1
HtmlRole = Qt.ItemDataRole.UserRole + 2      # the entry as HTML: search hits in bold
GroupRole = Qt.ItemDataRole.UserRole + 3     # the heading painted above this entry (the first of its group)
GROUPS = ("Pinned", "Today", "Yesterday", "Last 7 days", "Older")
MARKS = {"writing": "✎ writing…", "queued": "◷ queued"}     # session.writing() values, in words


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


def group_of(ts: float, now: Optional[float] = None) -> str:
    """The date heading of a chat last updated at `ts` (local calendar days; a time ahead of the clock
    is today)."""
    days = (datetime.date.fromtimestamp(now or time.time()) - datetime.date.fromtimestamp(ts)).days
    if days <= 0:
        return "Today"
    if days == 1:
        return "Yesterday"
    return "Last 7 days" if days < 7 else "Older"


def entry_html(title: str, sub: str, mark: str = "") -> str:
    """A list entry as HTML: the title, and under it the date or the search snippet with its hits in bold,
    after the writing mark if any."""
    snippet = html.escape(sub).replace(HIT_START, "<b><u>").replace(HIT_END, "</u></b>")
    if mark:
        snippet = f"<b>{html.escape(mark)}</b>" + (f" · {snippet}" if snippet else "")
    return f"{html.escape(title)}<br><small>{snippet}</small>" if snippet else html.escape(title)


def plain(text: str) -> str:
    return text.replace(HIT_START, "").replace(HIT_END, "")


class _EntryDelegate(QStyledItemDelegate):
    """Paints an entry's HTML (so a search hit shows in bold, never as markers or brackets), under its
    group's heading when it is the first of its group, as tall as its text wrapped to the list's width:
    measured at that width too (the list asks for size hints with stale widths), and clipped to its row."""

    @staticmethod
    def _heading_height(option, index) -> int:
        return int(option.fontMetrics.height() * 1.8) if index.data(GroupRole) else 0

    def _paint_heading(self, painter, option, text: str, height: int) -> None:
        painter.save()
        font = QFont(option.font)          # a copy: the entry below keeps its own font
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 0.85)
        painter.setFont(font)
        painter.setPen(option.palette.color(QPalette.ColorRole.PlaceholderText))
        r = option.rect
        painter.drawText(r.x() + 4, r.y(), r.width() - 8, height,
                         int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignBottom), text)
        painter.restore()

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
        heading = self._heading_height(option, index)
        if heading:                  # the heading stays out of the entry's own (selectable) area
            self._paint_heading(painter, option, index.data(GroupRole), heading)
            option.rect = option.rect.adjusted(0, heading, 0, 0)
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
        return QSize(int(doc.idealWidth()), int(doc.size().height()) + self._heading_height(option, index))


class ConversationList(QWidget):
    new_requested = Signal()
    open_requested = Signal(int)
    rename_requested = Signal(int)
    delete_requested = Signal(int)
    export_requested = Signal(int, str)     # conversation id, "md" | "json"
    pin_requested = Signal(int, bool)       # conversation id, pinned

    def __init__(self, store: Store, parent=None):
        super().__init__(parent)
        self.store = store
        self.new_button = QPushButton("New chat")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.new_requested)
        self.search = QLineEdit(placeholderText="Search chats  (Ctrl+F)", clearButtonEnabled=True)
        self.search.textChanged.connect(lambda _: (self._kept.clear(), self._search_timer.start()))
        self._kept: set[int] = set()           # chats made during this search, listed though they do not match
        self.writing: dict[int, str] = {}      # chat id -> "writing" | "queued" (ChatSession.writing)
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

    def set_writing(self, writing: dict[int, str]) -> None:
        """Which chats have an answer in progress ("writing") or waiting ("queued"); refresh to show it."""
        self.writing = dict(writing)

    def refresh(self, select: Optional[int] = None) -> None:
        """Reload from the store (or the search results), keeping the selection."""
        keep = select if select is not None else self.current_id()
        query = self.search.text().strip()
        rows: list[tuple[int, str, str, Optional[str]]] = []     # id, title, sub line, heading above it
        if query:
            rows = [(h.conversation_id, h.title, h.snippet, None) for h in self.store.search(query)]
            listed = {self.list.item(i).data(IdRole) for i in range(self.list.count())}
            if select is not None and select not in listed:      # a chat made while searching stays in sight
                self._kept.add(select)
            found = {row[0] for row in rows}
            for cid in sorted(self._kept - found, reverse=True):
                try:
                    rows.insert(0, (cid, self.store.conversation(cid).title, "open chat", None))
                except KeyError:
                    self._kept.discard(cid)                      # deleted meanwhile
        else:
            now, last = time.time(), None
            for c in self.store.conversations():                 # pinned first, then newest first
                group = "Pinned" if c.pinned else group_of(c.updated, now)
                rows.append((c.id, c.title, when(c.updated, now), group if group != last else None))
                last = group
        self._selecting = True
        try:
            self.list.clear()
            for cid, title, sub, heading in rows:
                mark = MARKS.get(self.writing.get(cid, ""), "")
                shown = f"{mark} · {sub}" if mark and sub else mark or sub
                item = QListWidgetItem(plain(f"{title}\n{shown}" if shown else title))   # what Ctrl+C copies
                item.setData(HtmlRole, entry_html(title, sub, mark))
                item.setData(IdRole, cid)
                item.setData(GroupRole, heading)
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
        pinned = self.store.conversation(cid).pinned
        menu = QMenu(self)
        menu.addAction("Unpin" if pinned else "Pin to top", lambda: self.pin_requested.emit(cid, not pinned))
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
