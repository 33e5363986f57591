"""Paints one message: a rich-text document per row (Markdown, code, thinking, action links).

Each row's QTextDocument is cached by message id and rebuilt only when what it shows changed (text,
state, stats, folded thinking, width, theme), so scrolling a long conversation re-renders nothing.
The app's buttons are links of the per-process scheme `markdown.app_link` makes (copy, edit, regenerate,
continue, fork, older / newer (its versions), code block N, thinking section N); any other link is the
message's own and only http(s) ones open, in the browser. A click on one emits `action(kind, row, payload)`;
the view turns those into clipboard copies and requests. A link written in a message can never be a button,
and no href raises.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Optional
from PySide6.QtCore import QEvent, QModelIndex, QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import (QAbstractTextDocumentLayout, QColor, QFontMetrics, QPainter, QPalette, QTextCharFormat,
                           QTextCursor, QTextDocument)
from PySide6.QtWidgets import QStyledItemDelegate, QStyleOptionViewItem

from app.chat import markdown
from app.chat.model import IN_PROGRESS, QUEUED, ChatItem, IdRole, ItemRole
from runtime import paths

MARGIN_X, MARGIN_Y, PAD = 14, 5, 10   # outside the bubble, and inside it


@dataclass
class _Doc:
    key: tuple           # what the HTML was made from
    doc: QTextDocument
    rendered: markdown.Rendered


def palette_for(qpal: QPalette) -> markdown.Palette:
    dark = qpal.color(QPalette.ColorRole.Base).lightness() < 128
    return markdown.DARK if dark else markdown.LIGHT


class MessageDelegate(QStyledItemDelegate):
    """Rows not rendered yet get an estimated height (cheap, from the text); a row is rendered exactly
    when the view shows it or pre-renders it, and from then on its size hint is exact."""
    action = Signal(str, int, object)    # kind, row, payload (code text, url, section number)

    def __init__(self, parent=None):
        super().__init__(parent)
        self._docs: dict[int, _Doc] = {}
        self._estimates: dict[int, tuple[tuple, int]] = {}
        self._sizes: dict[int, tuple[tuple, int]] = {}     # message id -> (what decides it, height)
        self.expanded: dict[int, set[int]] = {}     # message id -> unfolded thinking sections
        self.palette = markdown.LIGHT
        self.selection: Optional[tuple[int, int, int]] = None   # (message id, anchor, cursor) in its document

    def set_palette(self, qpal: QPalette) -> None:
        self.palette = palette_for(qpal)

    def clear(self) -> None:
        self._docs.clear()
        self._estimates.clear()
        self._sizes.clear()

    # -- the document of a row ------------------------------------------------------------------
    def _key(self, it: ChatItem, index: QModelIndex, font) -> tuple:
        return (it.content, it.state, it.stats, it.error, frozenset(self.expanded.get(it.id, ())), self.palette,
                index.row() == index.model().rowCount() - 1, font.key(), it.version, it.versions)

    def is_rendered(self, index: QModelIndex, font) -> bool:
        it: ChatItem = index.data(ItemRole)
        cached = self._docs.get(it.id)
        return cached is not None and cached.key == self._key(it, index, font)

    def document(self, index: QModelIndex, width: int, font) -> _Doc:
        it: ChatItem = index.data(ItemRole)
        key = self._key(it, index, font)
        width = max(50, width)
        cached = self._docs.get(it.id)
        if cached is not None and cached.key == key:
            if cached.doc.textWidth() != width:
                cached.doc.setTextWidth(width)
            return cached
        rendered = markdown.render(it.content, self.palette, key[4], plain=(it.role == "user"))
        doc = cached.doc if cached is not None else QTextDocument(self)
        doc.setDefaultFont(font)
        doc.setDocumentMargin(0)
        doc.setDefaultStyleSheet(f"a {{ color: {self.palette.link}; }} p {{ margin-top: 0; margin-bottom: 6px; }}")
        doc.setHtml(self._header(it, key[6]) + (rendered.html or "<p></p>") + self._footer(it))
        doc.setTextWidth(width)
        entry = _Doc(key, doc, rendered)
        self._docs[it.id] = entry
        return entry

    def estimate(self, index: QModelIndex, width: int, font) -> int:
        """Height of the text without rendering it: wrapped lines times the line height, plus the header."""
        it: ChatItem = index.data(ItemRole)
        key = (len(it.content), it.state, width, font.key())
        known = self._estimates.get(it.id)
        if known is not None and known[0] == key:
            return known[1]
        fm = QFontMetrics(font)
        per_line = max(10, width // max(1, fm.averageCharWidth()))
        lines, in_code = 0.0, False
        for line in it.content.splitlines() or [""]:
            if line.startswith("```"):
                in_code = not in_code
                lines += 1.2
            elif not line.strip():
                lines += 0.0 if in_code else 0.5
            else:
                lines += 1 if in_code else -(-len(line) // per_line)
        h = int((lines + 2.2) * fm.lineSpacing()) + (fm.lineSpacing() if it.state == "error" else 0)
        self._estimates[it.id] = (key, h)
        return h

    def _header(self, it: ChatItem, is_last: bool) -> str:
        p = self.palette
        who = {"user": "You", "assistant": "Assistant", "system": "System"}.get(it.role, it.role)
        bits = []
        if it.role == "assistant":
            if it.model:
                bits.append(html.escape(paths.display_name(it.model)))
            if it.state == "streaming":
                bits.append("writing…")
            elif it.state == QUEUED:
                bits.append("queued: starts when the answer in another chat ends")
            elif it.stats is not None:
                bits.append(f"{it.stats.generated_tokens} tokens")
                if it.stats.decode_tps:
                    bits.append(f"{it.stats.decode_tps:.1f} tok/s")
                if it.stats.ttft_s is not None:
                    bits.append(f"first token {it.stats.ttft_s:.2f} s")
            if it.state == "cancelled":
                bits.append("stopped")
        link = markdown.app_link
        links = []
        if it.versions > 1 and it.state not in IN_PROGRESS:
            # The arrows as targets a pointer finds: large, with room on either side inside the link.
            bare = 'style="text-decoration: none;"'
            older = (f'<a {bare} href="{link("older")}">&nbsp;‹&nbsp;</a>' if it.version > 1
                     else '<span>&nbsp;‹&nbsp;</span>')
            newer = (f'<a {bare} href="{link("newer")}">&nbsp;›&nbsp;</a>' if it.version < it.versions
                     else '<span>&nbsp;›&nbsp;</span>')
            links.append(f'<span style="font-size: xx-large;">{older}</span>{it.version}/{it.versions}'
                         f'<span style="font-size: xx-large;">{newer}</span>')
        links.append(f'<a href="{link("copy")}">Copy</a>')
        if it.state not in IN_PROGRESS:
            if it.role == "user":
                links.append(f'<a href="{link("edit")}">Edit</a>')
            if it.role == "assistant" and is_last:
                if it.state in ("cancelled", "error") and it.content:
                    links.append(f'<a href="{link("continue")}">Continue</a>')
                links.append(f'<a href="{link("regenerate")}">Regenerate</a>')
            links.append(f'<a href="{link("fork")}">Fork</a>')
        meta = f' <span style="color:{p.muted};">· {" · ".join(bits)}</span>' if bits else ""
        return (f'<table width="100%" cellspacing="0" cellpadding="0"><tr><td><b>{who}</b>{meta}</td>'
                f'<td align="right" style="font-size: small;">{"&nbsp; ".join(links)}</td></tr></table>'
                f'<p style="margin: 0; font-size: 4px;">&nbsp;</p>')

    def _footer(self, it: ChatItem) -> str:
        if it.state == "error":
            kept = " The text above was kept." if it.content else ""
            return (f'<p style="color:#d1242f;">⚠ {html.escape(it.error or "The answer was interrupted.")}'
                    f'{kept}</p>')
        if it.state in IN_PROGRESS and not it.content:
            return f'<p style="color:{self.palette.muted};">…</p>'
        return ""

    # -- Qt interface ---------------------------------------------------------------------------
    def _text_width(self, option: QStyleOptionViewItem) -> int:
        return max(50, option.rect.width() - 2 * (MARGIN_X + PAD))

    def exact_height(self, option: QStyleOptionViewItem, index: QModelIndex) -> int:
        """Renders the row if needed; later size hints for it are exact."""
        width = self._text_width(option)
        d = self.document(index, width, option.font)
        h = int(d.doc.size().height()) + 2 * (MARGIN_Y + PAD)
        it: ChatItem = index.data(ItemRole)
        self._sizes[it.id] = ((it.content, it.state, it.stats, it.error, width,
                               frozenset(self.expanded.get(it.id, ()))), h)
        return h

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:  # noqa: N802
        """Exact once rendered; until then an estimate (rendering 2,000 answers up front would stall).
        Called for every row at each layout, so the answer is cached by what decides it."""
        it: ChatItem = index.data(ItemRole)
        width = self._text_width(option)
        sig = (it.content, it.state, it.stats, it.error, width, frozenset(self.expanded.get(it.id, ())))
        known = self._sizes.get(it.id)
        if known is not None and known[0] == sig:
            return QSize(option.rect.width(), known[1])
        cached = self._docs.get(it.id)
        if cached is not None and cached.key[:5] == sig[:4] + sig[5:]:
            h = self.exact_height(option, index)
        else:
            h = self.estimate(index, width, option.font) + 2 * (MARGIN_Y + PAD)
        self._sizes[it.id] = (sig, h)
        return QSize(option.rect.width(), h)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        d = self.document(index, self._text_width(option), option.font)
        it: ChatItem = index.data(ItemRole)
        bubble = option.rect.adjusted(MARGIN_X, MARGIN_Y, -MARGIN_X, -MARGIN_Y)
        pal = option.palette
        painter.save()
        painter.setClipRect(option.rect)
        base = pal.color(QPalette.ColorRole.Base)
        if it.role == "user":
            _bubble(painter, bubble, _mix(base, pal.color(QPalette.ColorRole.Highlight), 0.15))
        elif it.state == "error":
            _bubble(painter, bubble, QColor("#d1242f"))
            _bubble(painter, bubble.adjusted(1, 1, -1, -1), pal.color(QPalette.ColorRole.AlternateBase))
        else:
            _bubble(painter, bubble, pal.color(QPalette.ColorRole.AlternateBase))
        painter.translate(bubble.topLeft() + QPointF(PAD, PAD).toPoint())
        ctx = QAbstractTextDocumentLayout.PaintContext()
        ctx.palette = pal
        ctx.clip = QRectF(0, 0, d.doc.textWidth(), d.doc.size().height())
        if self.selection is not None and self.selection[0] == it.id:
            sel = QAbstractTextDocumentLayout.Selection()
            sel.cursor = self._cursor(d.doc, self.selection[1], self.selection[2])
            fmt = QTextCharFormat()
            fmt.setBackground(pal.color(QPalette.ColorRole.Highlight))
            fmt.setForeground(pal.color(QPalette.ColorRole.HighlightedText))
            sel.format = fmt
            ctx.selections = [sel]
        d.doc.documentLayout().draw(painter, ctx)
        painter.restore()

    # -- text selection (within one message) ----------------------------------------------------
    @staticmethod
    def _cursor(doc: QTextDocument, anchor: int, position: int) -> QTextCursor:
        last = max(0, doc.characterCount() - 1)
        c = QTextCursor(doc)
        c.setPosition(min(max(anchor, 0), last))
        c.setPosition(min(max(position, 0), last), QTextCursor.MoveMode.KeepAnchor)
        return c

    def position_at(self, option: QStyleOptionViewItem, index: QModelIndex, pos) -> int:
        """The character position in a row's document nearest to `pos` (view coordinates)."""
        d = self.document(index, self._text_width(option), option.font)
        origin = option.rect.topLeft() + QPointF(MARGIN_X + PAD, MARGIN_Y + PAD).toPoint()
        return d.doc.documentLayout().hitTest(QPointF(pos - origin), Qt.HitTestAccuracy.FuzzyHit)

    def end_position(self, option: QStyleOptionViewItem, index: QModelIndex) -> int:
        return max(0, self.document(index, self._text_width(option), option.font).doc.characterCount() - 1)

    def word_at(self, option: QStyleOptionViewItem, index: QModelIndex, pos) -> tuple[int, int]:
        d = self.document(index, self._text_width(option), option.font)
        c = self._cursor(d.doc, self.position_at(option, index, pos), self.position_at(option, index, pos))
        c.select(QTextCursor.SelectionType.WordUnderCursor)
        return c.selectionStart(), c.selectionEnd()

    def selected_text(self, option: QStyleOptionViewItem, index: QModelIndex) -> str:
        """The selected text of the row `index`, as plain text ("" when it holds no selection)."""
        it: ChatItem = index.data(ItemRole)
        if self.selection is None or self.selection[0] != it.id:
            return ""
        d = self.document(index, self._text_width(option), option.font)
        text = self._cursor(d.doc, self.selection[1], self.selection[2]).selectedText()
        return text.replace("\u2029", "\n").replace("\u2028", "\n").replace("\xa0", " ")

    def anchor_at(self, option: QStyleOptionViewItem, index: QModelIndex, pos) -> str:
        """The link under `pos` (view coordinates), or ""."""
        d = self.document(index, self._text_width(option), option.font)
        origin = option.rect.topLeft() + QPointF(MARGIN_X + PAD, MARGIN_Y + PAD).toPoint()
        return d.doc.documentLayout().anchorAt(QPointF(pos - origin))

    def editorEvent(self, event, model, option, index) -> bool:  # noqa: N802
        if event.type() != QEvent.Type.MouseButtonRelease or event.button() != Qt.MouseButton.LeftButton:
            return False
        href = self.anchor_at(option, index, event.position().toPoint())
        if not href:
            return False
        self.activate(href, index)
        return True

    def activate(self, href: str, index: QModelIndex) -> None:
        row, mid = index.row(), index.data(IdRole)
        action = markdown.app_action(href)
        if action is None:                                  # a link from the message's text
            if href.partition(":")[0].lower() in markdown.MESSAGE_LINK_SCHEMES:
                self.action.emit("open_link", row, href)
            return
        kind, n = action
        if kind in ("copy", "edit", "regenerate", "continue", "fork", "older", "newer") and n is None:
            self.action.emit(kind, row, None)
        elif kind == "code" and n is not None:
            blocks = self._docs[mid].rendered.code_blocks if mid in self._docs else []
            if n < len(blocks):
                self.action.emit("copy_code", row, blocks[n])
        elif kind == "think" and n is not None:
            shown = self.expanded.setdefault(mid, set())
            shown.symmetric_difference_update({n})
            self.action.emit("relayout", row, None)

    def hyperlinks(self, index: QModelIndex, option: QStyleOptionViewItem) -> list[str]:
        """Every link of a row's document, in order (used by tests and keyboard access)."""
        d = self.document(index, self._text_width(option), option.font)
        out, block = [], d.doc.begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                frag = it.fragment()
                if frag.isValid() and frag.charFormat().isAnchor():
                    href = frag.charFormat().anchorHref()
                    if not out or out[-1] != href:
                        out.append(href)
                it += 1
            block = block.next()
        return out


RADIUS = 10


def _mix(a: QColor, b: QColor, t: float) -> QColor:
    """Opaque blend of two colours (t of b)."""
    return QColor(round(a.red() + (b.red() - a.red()) * t), round(a.green() + (b.green() - a.green()) * t),
                  round(a.blue() + (b.blue() - a.blue()) * t))


def _bubble(painter: QPainter, rect, colour: QColor) -> None:
    """A filled rounded rectangle. Antialiasing a tall path is slow in the raster engine, so only the
    two end strips are drawn as rounded shapes; the middle is a plain fill."""
    r = RADIUS
    if rect.height() <= 4 * r:
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(colour)
        painter.drawRoundedRect(QRectF(rect), r, r)
        return
    painter.fillRect(rect.adjusted(0, r, 0, -r), colour)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(colour)
    painter.drawRoundedRect(QRectF(rect.x(), rect.y(), rect.width(), 2 * r + 2), r, r)
    painter.drawRoundedRect(QRectF(rect.x(), rect.bottom() + 1 - 2 * r - 2, rect.width(), 2 * r + 2), r, r)
