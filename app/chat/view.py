"""The message list view: a scroll area over the list model, laid out as a prefix sum of row heights.

Why not QListView: it asks the delegate for every row's size on each relayout (2,000 calls from C++
into Python), and a streaming answer or a freshly rendered row changes a height often. Here the
heights are a plain list; a change is one assignment and a cumulative sum, and only the rows on
screen are painted.

Rows start with an estimated height (the delegate's, from the text); a row is rendered exactly when it
comes on screen, and rows around the screen are pre-rendered in short slices. When an exact height
replaces an estimate, the first row on screen keeps its position, so nothing jumps. While the user is
at the end the view follows the stream; once they scroll up it stays put.
"""
from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from typing import Optional

from PySide6.QtCore import QElapsedTimer, QModelIndex, QPoint, QRect, QTimer, QUrl, Qt, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication, QKeySequence, QPainter
from PySide6.QtWidgets import QAbstractScrollArea, QFrame, QStyleOptionViewItem

from app.chat.delegate import MessageDelegate
from app.chat.markdown import strip_thinking
from app.chat.model import ContentRole, IdRole, MessageListModel

REPAINT_MS = 30             # streamed tokens are painted at most this often
PRERENDER_EVERY_MS = 15     # a slice of pre-rendering this often while rows are left
PRERENDER_SLICE_MS = 8      # at most this long per slice, so the GUI keeps answering
PRERENDER_AROUND = 40       # rows rendered ahead above and below the screen


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


class ChatView(QAbstractScrollArea):
    edit_requested = Signal(int)         # message id
    regenerate_requested = Signal(int)   # message id of the answer to replace
    continue_requested = Signal(int)     # message id of the stopped answer to go on with
    fork_requested = Signal(int)         # message id: a new chat up to it
    version_requested = Signal(int, int) # message id, -1 (older) or +1 (newer)
    copied = Signal(str)                 # what went to the clipboard, for the status line

    def __init__(self, parent=None):
        super().__init__(parent)
        self.delegate = MessageDelegate(self)
        self._model: Optional[MessageListModel] = None
        self.heights: list[int] = []
        self.tops: list[int] = [0]        # tops[r]: y of row r; tops[-1]: total height
        self._follow = True
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setFocusPolicy(Qt.FocusPolicy.ClickFocus)     # a click focuses it, for Ctrl+C of a selection
        self._selecting: Optional[int] = None                # the row a mouse drag selects in
        self.viewport().setMouseTracking(True)
        self.verticalScrollBar().setSingleStep(24)
        self.verticalScrollBar().valueChanged.connect(self._on_scrolled)
        self.delegate.set_palette(self.palette())
        self.delegate.action.connect(self._on_action)
        self._repaint = QTimer(self, singleShot=True, interval=REPAINT_MS, timeout=self._refresh_rows)
        self._dirty: set[int] = set()
        self._prerender = QTimer(self, interval=PRERENDER_EVERY_MS, timeout=self._prerender_some)

    # -- the model ------------------------------------------------------------------------------
    def setModel(self, model: MessageListModel) -> None:  # noqa: N802
        self._model = model
        model.modelReset.connect(self._reset)
        model.rowsInserted.connect(lambda _p, first, last: self._inserted(first, last))
        model.rowsRemoved.connect(lambda _p, first, last: self._removed(first, last))
        model.dataChanged.connect(self._changed)
        self._reset()

    def model(self) -> Optional[MessageListModel]:
        return self._model

    def _reset(self) -> None:
        self.delegate.clear()
        self.delegate.selection, self._selecting = None, None
        opt = self._option()
        n = self._model.rowCount()
        self.heights = [self.delegate.sizeHint(opt, self._model.index(r, 0)).height() for r in range(n)]
        self._follow = True
        self._relayout(anchor=None)
        self._prerender.start()

    def _inserted(self, first: int, last: int) -> None:
        opt = self._option()
        self.heights[first:first] = [self.delegate.sizeHint(opt, self._model.index(r, 0)).height()
                                     for r in range(first, last + 1)]
        self._relayout(self._anchor())
        self._prerender.start()

    def _removed(self, first: int, last: int) -> None:
        del self.heights[first:last + 1]
        self._relayout(self._anchor())

    def _changed(self, top: QModelIndex, bottom: QModelIndex, roles=()) -> None:
        self._dirty.update(range(top.row(), bottom.row() + 1))
        if not self._repaint.isActive():
            self._repaint.start()

    def _refresh_rows(self) -> None:
        """Rows whose data changed: exact height if on screen, else the (cheap) estimate."""
        opt, (first, last) = self._option(), self.visible_rows()
        anchor = self._anchor()
        for row in self._dirty:
            if row < len(self.heights):
                idx = self._model.index(row, 0)
                on_screen = first <= row <= last
                self.heights[row] = (self.delegate.exact_height(opt, idx) if on_screen
                                     else self.delegate.sizeHint(opt, idx).height())
        self._dirty.clear()
        self._relayout(anchor)

    # -- layout ---------------------------------------------------------------------------------
    def _option(self) -> QStyleOptionViewItem:
        opt = QStyleOptionViewItem()
        opt.initFrom(self)
        opt.font = self.font()
        opt.rect = QRect(0, 0, self.viewport().width(), 0)
        return opt

    def _anchor(self) -> Optional[tuple[int, int]]:
        """(first row on screen, its offset from the top of the screen), to keep it in place."""
        if not self.heights:
            return None
        value = self.verticalScrollBar().value()
        row = max(0, min(len(self.heights) - 1, bisect_right(self.tops, value) - 1))
        return row, self.tops[row] - value

    def _relayout(self, anchor: Optional[tuple[int, int]]) -> None:
        self.tops = [0, *accumulate(self.heights)]
        bar = self.verticalScrollBar()
        bar.blockSignals(True)
        bar.setRange(0, max(0, self.tops[-1] - self.viewport().height()))
        bar.setPageStep(self.viewport().height())
        if self._follow:
            bar.setValue(bar.maximum())
        elif anchor is not None and anchor[0] < len(self.heights):
            bar.setValue(self.tops[anchor[0]] - anchor[1])
        bar.blockSignals(False)
        self.viewport().update()

    def visible_rows(self) -> tuple[int, int]:
        if not self.heights:
            return 0, -1
        value = self.verticalScrollBar().value()
        first = max(0, bisect_right(self.tops, value) - 1)
        last = max(first, min(len(self.heights) - 1, bisect_right(self.tops, value + self.viewport().height()) - 1))
        return first, last

    def visualRect(self, index: QModelIndex) -> QRect:  # noqa: N802
        r = index.row()
        return QRect(0, self.tops[r] - self.verticalScrollBar().value(), self.viewport().width(), self.heights[r])

    def indexAt(self, pos: QPoint) -> QModelIndex:  # noqa: N802
        y = pos.y() + self.verticalScrollBar().value()
        row = bisect_right(self.tops, y) - 1
        if self._model is None or not 0 <= row < len(self.heights):
            return QModelIndex()
        return self._model.index(row, 0)

    def _exact_on_screen(self) -> None:
        """Render the rows on screen; where a height was an estimate, lay out again (twice at most)."""
        opt = self._option()
        for _ in range(3):
            first, last = self.visible_rows()
            anchor, moved = self._anchor(), False
            for row in range(first, last + 1):
                h = self.delegate.exact_height(opt, self._model.index(row, 0))
                if h != self.heights[row]:
                    self.heights[row], moved = h, True
            if not moved:
                return
            self._relayout(anchor)

    def _prerender_some(self) -> None:
        if self._model is None:
            self._prerender.stop()
            return
        opt, clock = self._option(), QElapsedTimer()
        clock.start()
        first, last = self.visible_rows()
        anchor, moved = self._anchor(), False
        for row in _outward(first, last, len(self.heights), PRERENDER_AROUND):
            idx = self._model.index(row, 0)
            if self.delegate.is_rendered(idx, opt.font):
                continue
            h = self.delegate.exact_height(opt, idx)
            if h != self.heights[row]:
                self.heights[row], moved = h, True
            if clock.elapsed() >= PRERENDER_SLICE_MS:
                break
        else:
            self._prerender.stop()
        if moved:
            self._relayout(anchor)

    # -- painting and events --------------------------------------------------------------------
    def paintEvent(self, event) -> None:  # noqa: N802
        if self._model is None or not self.heights:
            return
        self._exact_on_screen()
        painter = QPainter(self.viewport())
        opt = self._option()
        first, last = self.visible_rows()
        for row in range(first, last + 1):
            idx = self._model.index(row, 0)
            opt.rect = self.visualRect(idx)
            self.delegate.paint(painter, opt, idx)
        painter.end()

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width() and self._model is not None:
            anchor = self._anchor()
            opt = self._option()
            self.heights = [self.delegate.sizeHint(opt, self._model.index(r, 0)).height()
                            for r in range(len(self.heights))]
            self._relayout(anchor)
            self._prerender.start()
        else:
            self._relayout(self._anchor())

    def scrollContentsBy(self, dx: int, dy: int) -> None:  # noqa: N802
        self.viewport().update()

    def _on_scrolled(self, value: int) -> None:
        self._follow = value >= self.verticalScrollBar().maximum() - 4
        if not self._prerender.isActive():
            self._prerender.start()

    def scroll_to_end(self) -> None:
        self._follow = True
        self._relayout(None)

    def scrollToBottom(self) -> None:  # noqa: N802
        self.scroll_to_end()

    def _href_at(self, pos: QPoint) -> tuple[QModelIndex, str]:
        idx = self.indexAt(pos)
        if not idx.isValid():
            return idx, ""
        opt = self._option()
        opt.rect = self.visualRect(idx)
        return idx, self.delegate.anchor_at(opt, idx, pos)

    def viewportEvent(self, event) -> bool:  # noqa: N802
        t = event.type()
        if t == event.Type.MouseMove:
            pos = event.position().toPoint()
            if self._selecting is not None and event.buttons() & Qt.MouseButton.LeftButton:
                self._drag_to(pos)
                return True
            _, href = self._href_at(pos)
            self.viewport().setCursor(Qt.CursorShape.PointingHandCursor if href else Qt.CursorShape.IBeamCursor)
        elif t == event.Type.MouseButtonPress and event.button() == Qt.MouseButton.LeftButton:
            idx, href = self._href_at(event.position().toPoint())
            self._select(idx, event.position().toPoint(), start=not href)
        elif t == event.Type.MouseButtonDblClick and event.button() == Qt.MouseButton.LeftButton:
            idx = self.indexAt(event.position().toPoint())
            if idx.isValid():
                opt = self._option()
                opt.rect = self.visualRect(idx)
                self.delegate.selection = (idx.data(IdRole), *self.delegate.word_at(opt, idx, event.position().toPoint()))
                self.viewport().update()
                return True
        elif t == event.Type.MouseButtonRelease and event.button() == Qt.MouseButton.LeftButton:
            self._selecting = None
            idx, href = self._href_at(event.position().toPoint())
            if href and not self.selected_text():
                self.delegate.activate(href, idx)
                return True
        return super().viewportEvent(event)

    # -- selecting text with the mouse, copying it with Ctrl+C ----------------------------------
    def _select(self, idx: QModelIndex, pos: QPoint, start: bool) -> None:
        """A press: a selection starts in the row under the pointer (none on a link or outside rows)."""
        self.delegate.selection, self._selecting = None, None
        if start and idx.isValid():
            opt = self._option()
            opt.rect = self.visualRect(idx)
            at = self.delegate.position_at(opt, idx, pos)
            self.delegate.selection, self._selecting = (idx.data(IdRole), at, at), idx.row()
        self.viewport().update()

    def _drag_to(self, pos: QPoint) -> None:
        """Extend the selection; past the row's top or bottom it runs to the row's start or end."""
        row = self._selecting
        if row is None or row >= len(self.heights) or self.delegate.selection is None:
            return
        idx = self._model.index(row, 0)
        opt = self._option()
        opt.rect = self.visualRect(idx)
        if pos.y() < opt.rect.top():
            at = 0
        elif pos.y() > opt.rect.bottom():
            at = self.delegate.end_position(opt, idx)
        else:
            at = self.delegate.position_at(opt, idx, pos)
        mid, anchor, _ = self.delegate.selection
        self.delegate.selection = (mid, anchor, at)
        self.viewport().update()

    def selected_text(self) -> str:
        sel = self.delegate.selection
        if sel is None or self._model is None or sel[1] == sel[2]:
            return ""
        try:
            row = self._model.row_of(sel[0])
        except KeyError:             # the message is gone (another chat opened, regenerated)
            return ""
        idx = self._model.index(row, 0)
        opt = self._option()
        opt.rect = self.visualRect(idx)
        return self.delegate.selected_text(opt, idx)

    def keyPressEvent(self, event) -> None:  # noqa: N802
        if event.matches(QKeySequence.StandardKey.Copy) and self.selected_text():
            QGuiApplication.clipboard().setText(self.selected_text())
            self.copied.emit("Copied")
            return
        super().keyPressEvent(event)

    def _on_action(self, kind: str, row: int, payload) -> None:
        idx = self._model.index(row, 0)
        if kind == "copy":
            QGuiApplication.clipboard().setText(strip_thinking(idx.data(ContentRole) or ""))
            self.copied.emit("Message copied")
        elif kind == "copy_code":
            QGuiApplication.clipboard().setText(payload)
            self.copied.emit("Code copied")
        elif kind == "edit":
            self.edit_requested.emit(idx.data(IdRole))
        elif kind == "regenerate":
            self.regenerate_requested.emit(idx.data(IdRole))
        elif kind == "continue":
            self.continue_requested.emit(idx.data(IdRole))
        elif kind == "fork":
            self.fork_requested.emit(idx.data(IdRole))
        elif kind in ("older", "newer"):
            self.version_requested.emit(idx.data(IdRole), -1 if kind == "older" else 1)
        elif kind == "relayout":
            self._changed(idx, idx)
        elif kind == "open_link":
            QDesktopServices.openUrl(QUrl(payload))

    def changeEvent(self, event) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() == event.Type.PaletteChange and self._model is not None:
            self.delegate.set_palette(self.palette())
            self._reset()
