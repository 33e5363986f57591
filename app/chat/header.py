"""The chat header's two instruments: the model picker (with eject) and the context meter.

`ModelPicker` lists model entries (`ModelEntry`; today the local models folder, `local_entries`), marks
the loaded one, and asks for loads and unloads through signals; it never talks to the engine itself.
Another kind of entry (say, a remote server) is another provider function returning more entries.

`ContextMeter` shows how many tokens the open chat and the message being typed take, out of the
loaded model's context. The worker counts them with the model's own tokenizer and chat template
(`count` in the protocol): the meter asks through `count_requested` at most every `COUNT_DEBOUNCE_MS`
while the user types, and `on_count` takes the answers; nothing waits. Its menu picks what happens
when the chat outgrows the context (`SamplingOptions.context_overflow`).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QAction, QActionGroup
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QMenu, QSizePolicy, QStyle, QStyleOptionComboBox,
                               QStylePainter, QToolButton, QWidget)

from runtime import paths
from runtime.context import answer_room
from runtime.protocol import ChatMessage, TokenCount

COUNT_DEBOUNCE_MS = 300
NO_MODEL_COUNT = "Tokens used out of the model's context: load a model to count them."
REMOTE_COUNT = "A remote server does not say how many tokens a chat takes or how long its context is."
LOADED_MARK = "● "
OVERFLOW_CHOICES = (("rolling", "Drop the oldest turns"),
                    ("keep_first", "Keep the first exchange, drop the turns after it"),
                    ("stop", "Stop: do not send, say so"))


# ----------------------------------------------------------------------------------------------
# Model picker

@dataclass(frozen=True)
class ModelEntry:
    kind: str          # "local" (a folder in the models folder)
    key: str           # what the load command takes: a folder path
    label: str         # what the list shows
    detail: str = ""   # tooltip: size, architecture, or why it cannot load
    loadable: bool = True


def local_entries(models_dir: Optional[Path] = None) -> list[ModelEntry]:
    """The local models folder, loadable models first."""
    from app.hub.local import list_local_models
    out = []
    for m in list_local_models(models_dir):
        detail = m.error if not m.loadable else f"{m.architecture or 'model'} · {m.size_bytes / 1e9:.2f} GB · {m.path}"
        out.append(ModelEntry("local", str(m.path), m.name, detail, m.loadable))
    return sorted(out, key=lambda e: (not e.loadable, e.label.lower()))


class _Combo(QComboBox):
    about_to_open = Signal()

    def showPopup(self) -> None:  # noqa: N802
        self.about_to_open.emit()      # the folder may have changed since (downloads, imports)
        super().showPopup()

    def shown_text(self) -> str:
        """The current entry as painted: cut with "…" where the box is narrow (Qt's own box just clips it)."""
        opt = QStyleOptionComboBox()
        self.initStyleOption(opt)
        room = self.style().subControlRect(QStyle.ComplexControl.CC_ComboBox, opt,
                                           QStyle.SubControl.SC_ComboBoxEditField, self).width()
        return self.fontMetrics().elidedText(self.currentText(), Qt.TextElideMode.ElideRight, max(0, room - 4))

    def paintEvent(self, _event) -> None:  # noqa: N802
        p = QStylePainter(self)
        opt = QStyleOptionComboBox()
        self.initStyleOption(opt)
        p.drawComplexControl(QStyle.ComplexControl.CC_ComboBox, opt)
        opt.currentText = self.shown_text()
        p.drawControl(QStyle.ControlElement.CE_ComboBoxLabel, opt)


class ModelPicker(QWidget):
    load_requested = Signal(str)       # an entry's key
    eject_requested = Signal()
    options_requested = Signal(str)    # the shown entry's key: its load options (app/load_dialog.py)

    def __init__(self, entries: Callable[[], Sequence[ModelEntry]] = local_entries, parent=None):
        super().__init__(parent)
        self._provider = entries
        self._listed: list[ModelEntry] = []      # from the provider
        self.entries: list[ModelEntry] = []      # what the list shows
        self.loaded: Optional[str] = None       # the loaded model's reference (Loaded.model)
        self.wanted: Optional[str] = None       # the open chat's model
        self.combo = _Combo(toolTip="The model for this chat: pick one to load it (● marks the loaded one)")
        self.combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.combo.setMinimumContentsLength(8)
        self.combo.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMaximumWidth(360)
        self.combo.about_to_open.connect(self.refresh)
        self.combo.activated.connect(self._picked)
        self.load_button = QToolButton(text="Load", toolTip="Load the model this chat used")
        self.load_button.clicked.connect(lambda: self._picked(self.combo.currentIndex()))
        self.eject_button = QToolButton(text="⏏", toolTip="Unload the model and free its memory")
        self.eject_button.clicked.connect(self.eject_requested)
        self.options_button = QToolButton(text="⚙", toolTip="Load options for this model: context length, GPU "
                                                            "budget, placement, KV cache, drafting, with the fit")
        self.options_button.clicked.connect(self._options)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        lay.addWidget(self.combo, 1)
        lay.addWidget(self.load_button)
        lay.addWidget(self.options_button)
        lay.addWidget(self.eject_button)
        self.refresh()

    def refresh(self) -> None:
        self._listed = list(self._provider())
        self._fill()

    def set_loaded(self, model: Optional[str]) -> None:
        self.loaded = model
        if model is not None:
            self.wanted = model
        self._fill()

    def set_chat_model(self, model: Optional[str]) -> None:
        """The open chat's model: selected, and offered with Load when another one is loaded."""
        self.wanted = model or self.loaded
        self._fill()

    def _index_of(self, model: Optional[str]) -> int:
        return next((i for i, e in enumerate(self.entries) if paths.same_model(e.key, model)), -1)

    def _fill(self) -> None:
        # The loaded model and the chat's own are offered even from outside the models folder.
        self.entries = list(self._listed)
        for ref in (self.loaded, self.wanted):
            if ref and self._index_of(ref) < 0:
                folder = paths.resolve_model(ref)
                if folder.is_dir():
                    self.entries.append(ModelEntry("local", ref, folder.name or ref, str(folder)))
        combo = self.combo
        combo.blockSignals(True)
        combo.clear()
        for e in self.entries:
            mark = LOADED_MARK if paths.same_model(e.key, self.loaded) else ""
            combo.addItem(mark + e.label + ("" if e.loadable else " (cannot load)"), e.key)
            combo.setItemData(combo.count() - 1, e.detail, 3)    # Qt.ToolTipRole
        if not self.entries:
            combo.addItem("No local models: Engine → Models…", None)
        wanted = self._index_of(self.wanted)
        combo.setCurrentIndex(wanted if wanted >= 0 else max(0, self._index_of(self.loaded)))
        combo.blockSignals(False)
        self.load_button.setVisible(wanted >= 0 and not paths.same_model(self.wanted, self.loaded))
        self.eject_button.setEnabled(self.loaded is not None)
        shown = combo.currentIndex()
        self.options_button.setEnabled(0 <= shown < len(self.entries) and self.entries[shown].loadable)

    def _options(self) -> None:
        index = self.combo.currentIndex()
        if 0 <= index < len(self.entries) and self.entries[index].loadable:
            self.options_requested.emit(self.entries[index].key)

    def _picked(self, index: int) -> None:
        if not 0 <= index < len(self.entries):
            return
        entry = self.entries[index]
        if not entry.loadable:
            self.combo.setToolTip(entry.detail)
            return
        self.wanted = entry.key
        if not paths.same_model(entry.key, self.loaded):
            self.load_requested.emit(entry.key)
        self._fill()


# ----------------------------------------------------------------------------------------------
# Context meter

class ContextMeter(QToolButton):
    count_requested = Signal(str, object)      # request id, tuple[ChatMessage]
    policy_chosen = Signal(str)                # a context_overflow value

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.setAutoRaise(True)
        self.context: Optional[int] = None
        self._unknown = NO_MODEL_COUNT               # why there is no count (context None)
        self.history_tokens: Optional[int] = None
        self.total_tokens: Optional[int] = None      # history plus the typed message
        self.max_tokens = 1024
        self.policy = "rolling"
        self._history: tuple[ChatMessage, ...] = ()
        self._typed = ""
        self._asked: dict[str, str] = {}             # request id -> "history" | "total"
        self._counted_history: Optional[tuple[ChatMessage, ...]] = None
        self._timer = QTimer(self, singleShot=True, interval=COUNT_DEBOUNCE_MS, timeout=self._ask)
        menu = QMenu(self)
        menu.addSection("When the chat is full")
        group = QActionGroup(self)
        self.policy_actions: dict[str, QAction] = {}
        for value, words in OVERFLOW_CHOICES:
            a = QAction(words, self, checkable=True)
            a.triggered.connect(lambda _c=False, v=value: self.policy_chosen.emit(v))
            group.addAction(a)
            menu.addAction(a)
            self.policy_actions[value] = a
        self.setMenu(menu)
        self._show()

    # -- what to count ----------------------------------------------------------------------------
    def set_model_context(self, context: Optional[int], unknown: str = NO_MODEL_COUNT) -> None:
        """The loaded model's context length (None: nothing to count with; `unknown` says why)."""
        self.context, self._unknown = context, unknown
        self._counted_history = None
        self.history_tokens = self.total_tokens = None
        self._schedule()

    def set_conversation(self, history: Sequence[ChatMessage], max_tokens: int, policy: str) -> None:
        self._history, self.max_tokens, self.policy = tuple(history), max_tokens, policy
        for value, a in self.policy_actions.items():
            a.setChecked(value == policy)
        self._schedule()

    def set_typed(self, text: str) -> None:
        self._typed = text.strip()
        self._schedule()

    def owns(self, request_id: str) -> bool:
        return request_id in self._asked

    def _schedule(self) -> None:
        self._show()
        if self.context is not None:
            self._timer.start()

    def _ask(self) -> None:
        if self._history != self._counted_history:
            self._request("history", self._history)
        if self._typed:
            self._request("total", self._history + (ChatMessage("user", self._typed),))
        else:
            self.total_tokens = None
            self._show()

    def _request(self, what: str, messages: tuple[ChatMessage, ...]) -> None:
        for rid in [r for r, w in self._asked.items() if w == what]:
            del self._asked[rid]                     # an older answer to the same question is stale
        if not messages:
            self._counted_history, self.history_tokens = (), 0
            return
        rid = f"count-{uuid.uuid4().hex[:8]}"
        self._asked[rid] = what
        if what == "history":
            self._counted_history = messages[:]
        self.count_requested.emit(rid, messages)

    def on_count(self, ev: TokenCount) -> None:
        what = self._asked.pop(ev.request_id, None)
        if what is None:
            return
        self.context = ev.context_length
        if what == "history":
            self.history_tokens = ev.tokens
        else:
            self.total_tokens = ev.tokens
        self._show()

    def on_error(self, request_id: str) -> None:
        if self._asked.pop(request_id, None) == "history":
            self._counted_history = None

    # -- what it shows ----------------------------------------------------------------------------
    @property
    def used(self) -> Optional[int]:
        return self.total_tokens if self.total_tokens is not None and self._typed else self.history_tokens

    def full(self) -> bool:
        """The next prompt plus room for the answer does not fit the context."""
        if self.context is None or self.used is None:
            return False
        return self.used + answer_room(self.context, self.max_tokens) > self.context

    def _show(self) -> None:
        if self.context is None:
            self.setText("— tokens")
            self.setToolTip(self._unknown)
            return
        used = self.used
        typed = (self.total_tokens - self.history_tokens
                 if self._typed and self.total_tokens is not None and self.history_tokens is not None else None)
        shown = "…" if used is None else f"{used:,}" if not typed else f"{used - typed:,} (+{typed:,})"
        text = f"{shown} / {self.context:,} tokens"
        words = dict(OVERFLOW_CHOICES)[self.policy]
        if self.full():
            text = "⚠ full: " + text
            tip = (f"The chat and room for the answer ({answer_room(self.context, self.max_tokens):,} tokens) do not "
                   f"fit the context. Now: {words.lower()}. Click to choose.")
        else:
            tip = (f"Tokens this chat takes as the model sees it (template included), out of its context of "
                   f"{self.context:,}; (+N): what the message being typed adds. When full: {words.lower()} "
                   f"— click to choose.")
        self.setText(text)
        self.setToolTip(tip)
        self.setStyleSheet("color: #d1242f;" if self.full() else "")
