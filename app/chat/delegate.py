"""Paints one message: a rich-text document per row (Markdown, code, thinking, action links).

Each row's QTextDocument is cached by message id and rebuilt only when what it shows changed (text,
state, stats, folded thinking, width, theme), so scrolling a long conversation re-renders nothing.
Links in the document are the message's buttons: `act:copy`, `act:edit`, `act:regenerate`,
`copy:N` (code block N), `think:N` (fold/unfold), and ordinary http(s) links. A click on one emits
`action(kind, row, payload)`; the view turns those into clipboard copies and requests.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from PySide6.QtCore import QEvent, QModelIndex, QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QAbstractTextDocumentLayout, QColor, QPainter, QPalette, QTextDocument
from PySide6.QtWidgets import QStyledItemDelegate, QStyleOptionViewItem

from app.chat import markdown
from app.chat.model import (ContentRole, ErrorRole, IdRole, IsLastRole, ModelNameRole, RoleRole, StateRole,
                            StatsRole)

MARGIN_X, MARGIN_Y, PAD = 14, 5, 10   # outside the bubble, and inside it


@dataclass
class _Doc:
    key: tuple
    doc: QTextDocument
    rendered: markdown.Rendered


def palette_for(qpal: QPalette) -> markdown.Palette:
    dark = qpal.color(QPalette.ColorRole.Base).lightness() < 128
    return markdown.DARK if dark else markdown.LIGHT


class MessageDelegate(QStyledItemDelegate):
    action = Signal(str, int, object)    # kind, row, payload (code text, url, section number)

    def __init__(self, parent=None):
        super().__init__(parent)
        self._docs: dict[int, _Doc] = {}
        self.expanded: dict[int, set[int]] = {}     # message id -> unfolded thinking sections
        self.palette = markdown.LIGHT

    def set_palette(self, qpal: QPalette) -> None:
        self.palette = palette_for(qpal)

    def clear(self) -> None:
        self._docs.clear()

    # -- the document of a row ------------------------------------------------------------------
    def document(self, index: QModelIndex, width: int, font) -> _Doc:
        mid = index.data(IdRole)
        content = index.data(ContentRole) or ""
        role, state = index.data(RoleRole), index.data(StateRole)
        stats, error = index.data(StatsRole), index.data(ErrorRole) or ""
        expanded = frozenset(self.expanded.get(mid, ()))
        key = (content, state, stats, error, expanded, width, self.palette, bool(index.data(IsLastRole)),
               font.key())
        cached = self._docs.get(mid)
        if cached is not None and cached.key == key:
            return cached
        rendered = markdown.render(content, self.palette, expanded, plain=(role == "user"))
        doc = cached.doc if cached is not None else QTextDocument()
        doc.setDefaultFont(font)
        doc.setDocumentMargin(0)
        doc.setDefaultStyleSheet(f"a {{ color: {self.palette.link}; }} p {{ margin-top: 0; margin-bottom: 6px; }}")
        doc.setHtml(self._header(index, role, state, stats) + (rendered.html or "<p></p>")
                    + self._footer(state, error, role, content))
        doc.setTextWidth(max(50, width))
        entry = _Doc(key, doc, rendered)
        self._docs[mid] = entry
        return entry

    def _header(self, index: QModelIndex, role: str, state: str, stats) -> str:
        p = self.palette
        who = {"user": "You", "assistant": "Assistant", "system": "System"}.get(role, role)
        bits = []
        if role == "assistant":
            if index.data(ModelNameRole):
                bits.append(html.escape(index.data(ModelNameRole)))
            if state == "streaming":
                bits.append("writing…")
            elif stats is not None:
                bits.append(f"{stats.generated_tokens} tokens")
                if stats.decode_tps:
                    bits.append(f"{stats.decode_tps:.1f} tok/s")
                if stats.ttft_s is not None:
                    bits.append(f"first token {stats.ttft_s:.2f} s")
            if state == "cancelled":
                bits.append("stopped")
        links = ['<a href="act:copy">Copy</a>']
        if state != "streaming":
            if role == "user":
                links.append('<a href="act:edit">Edit</a>')
            if role == "assistant" and index.data(IsLastRole):
                links.append('<a href="act:regenerate">Regenerate</a>')
        meta = f' <span style="color:{p.muted};">· {" · ".join(bits)}</span>' if bits else ""
        return (f'<table width="100%" cellspacing="0" cellpadding="0"><tr><td><b>{who}</b>{meta}</td>'
                f'<td align="right" style="font-size: small;">{"&nbsp;&nbsp;".join(links)}</td></tr></table>'
                f'<p style="margin: 0; font-size: 4px;">&nbsp;</p>')

    def _footer(self, state: str, error: str, role: str, content: str) -> str:
        if state == "error":
            kept = " The text above was kept." if content else ""
            return (f'<p style="color:#d1242f;">⚠ {html.escape(error or "The answer was interrupted.")}'
                    f'{kept}</p>')
        if state == "streaming" and not content:
            return f'<p style="color:{self.palette.muted};">…</p>'
        return ""

    # -- Qt interface ---------------------------------------------------------------------------
    def _text_width(self, option: QStyleOptionViewItem) -> int:
        return option.rect.width() - 2 * (MARGIN_X + PAD)

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:  # noqa: N802
        d = self.document(index, self._text_width(option), option.font)
        return QSize(option.rect.width(), int(d.doc.size().height()) + 2 * (MARGIN_Y + PAD))

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        d = self.document(index, self._text_width(option), option.font)
        bubble = option.rect.adjusted(MARGIN_X, MARGIN_Y, -MARGIN_X, -MARGIN_Y)
        pal = option.palette
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        role, state = index.data(RoleRole), index.data(StateRole)
        if role == "user":
            fill = QColor(pal.color(QPalette.ColorRole.Highlight))
            fill.setAlpha(38)
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(fill)
            painter.drawRoundedRect(QRectF(bubble), 10, 10)
        elif state == "error":
            painter.setPen(QColor("#d1242f"))
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.drawRoundedRect(QRectF(bubble).adjusted(0.5, 0.5, -0.5, -0.5), 10, 10)
        else:
            base = QColor(pal.color(QPalette.ColorRole.AlternateBase))
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(base)
            painter.drawRoundedRect(QRectF(bubble), 10, 10)
        painter.translate(bubble.topLeft() + QPointF(PAD, PAD).toPoint())
        ctx = QAbstractTextDocumentLayout.PaintContext()
        ctx.palette = pal
        ctx.palette.setColor(QPalette.ColorRole.Text, pal.color(QPalette.ColorRole.Text))
        ctx.clip = QRectF(0, 0, d.doc.textWidth(), d.doc.size().height())
        d.doc.documentLayout().draw(painter, ctx)
        painter.restore()

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
        row = index.row()
        scheme, _, rest = href.partition(":")
        mid = index.data(IdRole)
        if scheme == "act":
            self.action.emit(rest, row, None)
        elif scheme == "copy":
            blocks = self._docs[mid].rendered.code_blocks if mid in self._docs else []
            n = int(rest)
            if 0 <= n < len(blocks):
                self.action.emit("copy_code", row, blocks[n])
        elif scheme == "think":
            shown = self.expanded.setdefault(mid, set())
            shown.symmetric_difference_update({int(rest)})
            self.action.emit("relayout", row, None)
        elif scheme in ("http", "https"):
            self.action.emit("open_link", row, href)

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

