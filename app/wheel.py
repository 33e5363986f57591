"""The mouse wheel scrolls pages, never the value of an input the pointer happens to cross.

`scroll_past_inputs(root)` makes every combo box and spin box under `root` take wheel turns only
once it has focus (a click or Tab); before that a turn scrolls the nearest scroll area, as the user
meant, and a dialog without one ignores it.
"""
from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtWidgets import QAbstractScrollArea, QAbstractSpinBox, QApplication, QComboBox, QWidget


class _WheelGuard(QObject):
    def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802
        if event.type() != QEvent.Type.Wheel or not isinstance(obj, QWidget) or obj.hasFocus():
            return False
        area = obj.parentWidget()
        while area is not None and not isinstance(area, QAbstractScrollArea):
            area = area.parentWidget()
        if area is not None:
            QApplication.sendEvent(area.verticalScrollBar(), event)
        return True


def scroll_past_inputs(root: QWidget) -> None:
    """Guard the combo and spin boxes under `root` (call once its editors exist)."""
    guard = root.findChild(_WheelGuard) or _WheelGuard(root)
    for w in root.findChildren(QComboBox) + root.findChildren(QAbstractSpinBox):
        w.setFocusPolicy(Qt.FocusPolicy.StrongFocus)      # a turn of the wheel does not focus it
        w.removeEventFilter(guard)
        w.installEventFilter(guard)
