"""The message list view: smooth pixel scrolling, follows the stream, turns link clicks into actions.

A token changes one row's text; `dataChanged` repaints that row, and a coalescing timer (one check
per frame at most) asks the delegate whether the row's height changed, and only then relayouts.
While the user is at the bottom the view follows the answer; once they scroll up it stays put.
"""
from __future__ import annotations

from PySide6.QtCore import QElapsedTimer, QModelIndex, QPoint, QTimer, QUrl, Qt, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication
from PySide6.QtWidgets import QAbstractItemView, QListView, QStyleOptionViewItem

from app.chat.delegate import MessageDelegate
from app.chat.markdown import strip_thinking
from app.chat.model import ContentRole, ErrorRole, IdRole, IsLastRole, StateRole, StatsRole

RELAYOUT_MS = 30
PRERENDER_EVERY_MS = 15     # a slice of pre-rendering this often while rows are left
PRERENDER_SLICE_MS = 8      # at most this long per slice, so the GUI keeps answering
PRERENDER_AROUND = 40       # rows rendered ahead above and below the screen
LAYOUT_EVERY_MS = 250       # corrected heights are laid out together, at most this often


def _outward(top: int, bottom: int, n: int, around: int):
    """Rows from the visible ones outward: visible first, then alternately below and above."""
    yield from range(max(0, top), min(n, bottom + 1))
    below, above = bottom + 1, top - 1
    last, first = min(n, bottom + 1 + around), max(-1, top - 1 - around)
    while below < last or above > first:
        if below < last:
            yield below
            below += 1
        if above > first:
            yield above
            above -= 1


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
        self.setLayoutMode(QListView.LayoutMode.SinglePass)   # cheap: unrendered rows are estimates
        self.setUniformItemSizes(False)
        self.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.setMouseTracking(True)
        self.setFrameShape(QListView.Shape.NoFrame)
        self.verticalScrollBar().setSingleStep(24)
        self.delegate.set_palette(self.palette())
        self.delegate.action.connect(self._on_action)
        self.delegate.height_changed.connect(self._on_height_changed)
        self._dirty_rows: set[int] = set()
        self._follow = True
        self._relayout = QTimer(self, singleShot=True, interval=RELAYOUT_MS, timeout=self._check_heights)
        self._prerender = QTimer(self, interval=PRERENDER_EVERY_MS, timeout=self._prerender_some)
        self._layout_soon = QTimer(self, singleShot=True, interval=LAYOUT_EVERY_MS, timeout=self.relayout)
        self.verticalScrollBar().valueChanged.connect(self._on_scrolled)
        self.verticalScrollBar().rangeChanged.connect(self._on_range)

    # -- the model's changes --------------------------------------------------------------------
    def dataChanged(self, top: QModelIndex, bottom: QModelIndex, roles=()) -> None:  # noqa: N802
        super().dataChanged(top, bottom, roles)
        if not roles or {ContentRole, StateRole, StatsRole, ErrorRole, IsLastRole} & set(roles):
            self._dirty_rows.update(range(top.row(), bottom.row() + 1))
            if not self._relayout.isActive():
                self._relayout.start()

    def _on_height_changed(self, row: int) -> None:
        self._dirty_rows.add(row)
        if not self._relayout.isActive():
            self._relayout.start()

    def _check_heights(self) -> None:
        """Render the changed rows that are on screen; relayout once if any height moved."""
        model, opt = self.model(), self._option()
        changed = False
        top, bottom = self._visible_rows()
        for row in sorted(self._dirty_rows):
            idx = model.index(row, 0)
            if not idx.isValid():
                continue
            if top <= row <= bottom or self.delegate.is_rendered(idx, opt.font) or row == model.rowCount() - 1:
                opt.rect = self.visualRect(idx)
                opt.rect.setWidth(self.viewport().width())
                changed |= self.delegate.exact_height(opt, idx) != self.visualRect(idx).height()
            else:
                changed = True       # an estimate changed with the text: cheap to lay out again
        self._dirty_rows.clear()
        if changed:
            self.relayout()
        self.viewport().update()

    def relayout(self) -> None:
        """Lay out again, keeping what the user looks at in place (or the end, when following)."""
        anchor, offset = self.indexAt(QPoint(1, 1)), 0
        if anchor.isValid():
            offset = self.visualRect(anchor).top()
        self.doItemsLayout()
        if self._follow:
            self.scrollToBottom()
        elif anchor.isValid():
            bar = self.verticalScrollBar()
            bar.setValue(bar.value() + self.visualRect(anchor).top() - offset)

    def _visible_rows(self) -> tuple[int, int]:
        model = self.model()
        if model is None or not model.rowCount():
            return 0, -1
        top = self.indexAt(QPoint(1, 1))
        bottom = self.indexAt(QPoint(1, self.viewport().height() - 2))
        return (top.row() if top.isValid() else 0), (bottom.row() if bottom.isValid() else model.rowCount() - 1)

    def _prerender_some(self) -> None:
        """Render the rows around the screen in short slices, so scrolling finds them exact. Heights
        that were estimates are corrected together, at most every LAYOUT_EVERY_MS."""
        model = self.model()
        if model is None:
            self._prerender.stop()
            return
        opt = self._option()
        top, bottom = self._visible_rows()
        n, clock = model.rowCount(), QElapsedTimer()
        clock.start()
        for row in _outward(top, bottom, n, PRERENDER_AROUND):
            idx = model.index(row, 0)
            if self.delegate.is_rendered(idx, opt.font):
                continue
            before = self.delegate.sizeHint(opt, idx).height()
            if self.delegate.exact_height(opt, idx) != before and not self._layout_soon.isActive():
                self._layout_soon.start()
            if clock.elapsed() >= PRERENDER_SLICE_MS:
                break
        else:
            self._prerender.stop()

    def _option(self) -> QStyleOptionViewItem:
        opt = QStyleOptionViewItem()
        self.initViewItemOption(opt)
        opt.rect.setWidth(self.viewport().width())
        return opt

    def reset(self) -> None:
        self.delegate.clear()
        self._follow = True
        super().reset()
        self._prerender.start()

    def rowsInserted(self, parent: QModelIndex, start: int, end: int) -> None:  # noqa: N802
        super().rowsInserted(parent, start, end)
        self._prerender.start()

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width():
            self._prerender.start()

    # -- following the stream -------------------------------------------------------------------
    def _on_scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._follow = value >= bar.maximum() - 4
        if not self._prerender.isActive():
            self._prerender.start()

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
