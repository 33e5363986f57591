"""A one-line label that cuts its text with "…" to the width the layout gives it, never mid-glyph or
silently: the whole text stays in `text()` and in its tooltip. Its size hint asks for the whole text;
it may shrink to a few characters."""
from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget

MIN_CHARS = 4          # what it keeps at its narrowest, "…" included


class ElidedLabel(QLabel):
    def __init__(self, text: str = "", parent: QWidget | None = None, tooltip: bool = True):
        super().__init__(text, parent)
        self._tooltip = tooltip
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setWordWrap(False)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 (Qt naming)
        super().setText(text)
        if self._tooltip:
            self.setToolTip(text)

    def shown_text(self) -> str:
        """What is painted: the text, cut with "…" where it does not fit."""
        return self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, self.contentsRect().width())

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        hint = super().minimumSizeHint()
        narrow = self.fontMetrics().horizontalAdvance(self.text()[:MIN_CHARS - 1] + "…")
        m = self.contentsMargins()
        return QSize(min(hint.width(), narrow + m.left() + m.right()), hint.height())

    def paintEvent(self, _event) -> None:  # noqa: N802
        p = QPainter(self)
        self.style().drawItemText(p, self.contentsRect(), int(self.alignment()), self.palette(), self.isEnabled(),
                                  self.shown_text(), self.foregroundRole())
        p.end()
