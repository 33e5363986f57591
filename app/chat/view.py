"""The message list view: smooth pixel scrolling, follows the stream, turns link clicks into actions.

A token changes one row's text; `dataChanged` repaints that row, and a coalescing timer (one check
per frame at most) asks the delegate whether the row's height changed, and only then relayouts.
While the user is at the bottom the view follows the answer; once they scroll up it stays put.
"""
from __future__ import annotations

from PySide6.QtCore import QModelIndex, QTimer, QUrl, Qt, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication
from PySide6.QtWidgets import QAbstractItemView, QListView, QStyleOptionViewItem

from app.chat.delegate import MessageDelegate
from app.chat.markdown import strip_thinking
from app.chat.model import ContentRole, ErrorRole, IdRole, StateRole, StatsRole

RELAYOUT_MS = 30


class ChatView(QListView):
    edit_requested = Signal(int)         # message id
    regenerate_requested = Signal(int)   # message id of the answer to replace
    copied = Signal(str)                 # what went to the clipboard, for the status line

    def __init__(self, parent=None):
        super().__init__(parent)
        self.delegate = MessageDelegate(self)
        self.setItemDelegate(self.delegate)
        self.setVerticalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setResizeMode(QListView.ResizeMode.Adjust)
        self.setLayoutMode(QListView.LayoutMode.Batched)
        self.setBatchSize(40)
        self.setUniformItemSizes(False)
        self.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.setMouseTracking(True)
        self.setFrameShape(QListView.Shape.NoFrame)
        self.verticalScrollBar().setSingleStep(24)
        self.delegate.set_palette(self.palette())
        self.delegate.action.connect(self._on_action)
        self._dirty_rows: set[int] = set()
        self._follow = True
        self._heights: dict[int, int] = {}
        self._relayout = QTimer(self, singleShot=True, interval=RELAYOUT_MS, timeout=self._check_heights)
        self.verticalScrollBar().valueChanged.connect(self._on_scrolled)
        self.verticalScrollBar().rangeChanged.connect(self._on_range)

    # -- the model's changes --------------------------------------------------------------------
    def dataChanged(self, top: QModelIndex, bottom: QModelIndex, roles=()) -> None:  # noqa: N802
        super().dataChanged(top, bottom, roles)
        if not roles or {ContentRole, StateRole, StatsRole, ErrorRole} & set(roles):
            self._dirty_rows.update(range(top.row(), bottom.row() + 1))
            if not self._relayout.isActive():
                self._relayout.start()

    def _check_heights(self) -> None:
        changed = False
        for row in sorted(self._dirty_rows):
            idx = self.model().index(row, 0)
            if not idx.isValid():
                continue
            h = self.delegate.sizeHint(self._option(), idx).height()
            if self._heights.get(idx.data(IdRole)) != h:
                self._heights[idx.data(IdRole)] = h
                changed = True
                self.delegate.sizeHintChanged.emit(idx)
        self._dirty_rows.clear()
        if not changed:
            self.viewport().update()

    def _option(self) -> QStyleOptionViewItem:
        opt = QStyleOptionViewItem()
        self.initViewItemOption(opt)
        opt.rect.setWidth(self.viewport().width())
        return opt

    def reset(self) -> None:
        self.delegate.clear()
        self._heights.clear()
        self._follow = True
        super().reset()

    # -- following the stream -------------------------------------------------------------------
    def _on_scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._follow = value >= bar.maximum() - 4

    def _on_range(self, _min: int, maximum: int) -> None:
        if self._follow:
            self.verticalScrollBar().setValue(maximum)

    def scroll_to_end(self) -> None:
        self._follow = True
        self.scrollToBottom()

    # -- links ----------------------------------------------------------------------------------
    def mouseMoveEvent(self, event) -> None:  # noqa: N802
        idx = self.indexAt(event.position().toPoint())
        href = ""
        if idx.isValid():
            opt = self._option()
            opt.rect = self.visualRect(idx)
            href = self.delegate.anchor_at(opt, idx, event.position().toPoint())
        self.viewport().setCursor(Qt.CursorShape.PointingHandCursor if href else Qt.CursorShape.ArrowCursor)
        super().mouseMoveEvent(event)

    def _on_action(self, kind: str, row: int, payload) -> None:
        idx = self.model().index(row, 0)
        if kind == "copy":
            text = strip_thinking(idx.data(ContentRole) or "")
            QGuiApplication.clipboard().setText(text)
            self.copied.emit("Message copied")
        elif kind == "copy_code":
            QGuiApplication.clipboard().setText(payload)
            self.copied.emit("Code copied")
        elif kind == "edit":
            self.edit_requested.emit(idx.data(IdRole))
        elif kind == "regenerate":
            self.regenerate_requested.emit(idx.data(IdRole))
        elif kind == "relayout":
            self._dirty_rows.add(row)
            self._check_heights()
        elif kind == "open_link":
            QDesktopServices.openUrl(QUrl(payload))

    def changeEvent(self, event) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() == event.Type.PaletteChange:
            self.delegate.set_palette(self.palette())
            self.delegate.clear()
            self.scheduleDelayedItemsLayout()
