"""Light and dark palettes on Qt's Fusion style, following the system's colour scheme as it changes.

`apply(app, choice)`: choice "system" follows `QStyleHints.colorScheme()` (and its change signal);
"light" / "dark" force one. Widgets that draw their own colours (the chat delegate) read the palette.
"""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

R = QPalette.ColorRole

LIGHT = {R.Window: "#f6f7f9", R.WindowText: "#1f2328", R.Base: "#ffffff", R.AlternateBase: "#f3f4f6",
         R.Text: "#1f2328", R.Button: "#eef0f3", R.ButtonText: "#1f2328", R.Highlight: "#2f6fde",
         R.HighlightedText: "#ffffff", R.ToolTipBase: "#ffffff", R.ToolTipText: "#1f2328",
         R.PlaceholderText: "#8c959f", R.Link: "#0969da", R.Mid: "#d0d7de", R.Dark: "#b0b8c1",
         R.Light: "#ffffff", R.Midlight: "#eef0f3", R.Shadow: "#8c959f", R.BrightText: "#d1242f"}
DARK = {R.Window: "#1e1f22", R.WindowText: "#e6edf3", R.Base: "#17181b", R.AlternateBase: "#25262b",
        R.Text: "#e6edf3", R.Button: "#2b2d31", R.ButtonText: "#e6edf3", R.Highlight: "#3d7bd9",
        R.HighlightedText: "#ffffff", R.ToolTipBase: "#2b2d31", R.ToolTipText: "#e6edf3",
        R.PlaceholderText: "#7d8590", R.Link: "#4493f8", R.Mid: "#3a3c42", R.Dark: "#101114",
        R.Light: "#3a3c42", R.Midlight: "#303236", R.Shadow: "#000000", R.BrightText: "#ff7b72"}


def system_is_dark() -> bool:
    return QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Dark


def palette(dark: bool) -> QPalette:
    pal = QPalette()
    for role, colour in (DARK if dark else LIGHT).items():
        pal.setColor(role, QColor(colour))
    muted = QColor("#6e7681" if dark else "#8c959f")
    for role in (R.WindowText, R.Text, R.ButtonText):
        pal.setColor(QPalette.ColorGroup.Disabled, role, muted)
    return pal


_followers: list = []     # the slot following the system scheme, so a new choice can replace it


def apply(app: QApplication, choice: str = "system") -> None:
    app.setStyle("Fusion")

    def update(*_):
        dark = system_is_dark() if choice == "system" else choice == "dark"
        app.setPalette(palette(dark))

    hints = QGuiApplication.styleHints()
    while _followers:
        hints.colorSchemeChanged.disconnect(_followers.pop())
    update()
    if choice == "system":
        hints.colorSchemeChanged.connect(update)
        _followers.append(update)
