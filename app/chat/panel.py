"""The right side of the window: the header (title, model picker, context meter, chat settings), the
message view, and the input box with Send / Stop.

Enter sends, Shift+Enter starts a new line, Esc stops the answer (or cancels an edit). Edit-and-resend
puts a user message into the input box with a banner; sending then replaces that message.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QSizePolicy, QToolButton,
                               QVBoxLayout, QWidget)

from app.chat.drafts import Drafts
from app.chat.header import ContextMeter, ModelPicker, local_entries
from app.chat.session import ChatSession
from app.chat.view import ChatView
from app.elided import ElidedLabel

NO_MODEL_WORDS = ("No model is loaded: pick one in the model list above (or Engine → Models…, Ctrl+M), then send "
                  "again.")
LOADING_WORDS = "The model is still loading (its progress is above the chat): send again once it is ready."


class InputBox(QPlainTextEdit):
    submitted = Signal()
    escape = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setPlaceholderText("Message the model — Enter sends, Shift+Enter for a new line")
        self.setTabChangesFocus(True)
        self.setMaximumHeight(110)
        self.setMinimumHeight(56)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Maximum)

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(256, 80)       # three lines: the messages get the rest of the height

    def keyPressEvent(self, e: QKeyEvent) -> None:  # noqa: N802
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (e.modifiers() & Qt.KeyboardModifier.ShiftModifier):
            self.submitted.emit()
            return
        if e.key() == Qt.Key.Key_Escape:
            self.escape.emit()
            return
        super().keyPressEvent(e)


class ChatPanel(QWidget):
    settings_requested = Signal()

    def __init__(self, session: ChatSession, parent=None, model_entries=local_entries,
                 drafts: Optional[Drafts] = None):
        super().__init__(parent)
        self.session = session
        self.editing: Optional[int] = None      # message id being edited
        self.drafts = drafts if drafts is not None else Drafts()
        self._draft_of: Optional[int] = None    # the conversation whose draft the input box holds
        self.title = ElidedLabel("New chat")          # cut with "…" by width, whole in its tooltip
        self.title.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.title.setMinimumWidth(80)
        f = self.title.font()
        f.setPointSizeF(f.pointSizeF() * 1.15)
        f.setBold(True)
        self.title.setFont(f)
        self.settings_hint = ElidedLabel()
        self.settings_hint.setEnabled(False)
        self.settings_hint.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.settings_button = QToolButton(text="Chat settings…", autoRaise=True,
                                           toolTip="System prompt, sampling and presets for this chat (Ctrl+Shift+P)")
        self.settings_button.clicked.connect(self.settings_requested)
        self.picker = ModelPicker(model_entries)
        self.meter = ContextMeter()
        top = QHBoxLayout()
        top.addWidget(self.title, 2)
        top.addWidget(self.picker, 2)
        sub = QHBoxLayout()          # the meter's text changes width as it counts: here it moves nothing but the hint
        sub.addWidget(self.settings_hint, 1)
        sub.addWidget(self.meter)
        sub.addWidget(self.settings_button)

        self.view = ChatView()
        self.view.setModel(session.model)
        self.view.edit_requested.connect(self.begin_edit)
        self.view.regenerate_requested.connect(lambda mid: session.regenerate(mid))
        self.view.continue_requested.connect(lambda mid: session.continue_answer(mid))
        self.view.fork_requested.connect(session.fork)
        self.view.version_requested.connect(session.show_version)

        self.edit_banner = QLabel()
        self.edit_banner.setVisible(False)
        self.edit_banner.setWordWrap(True)
        self.input = InputBox()
        self.input.submitted.connect(self.submit)
        self.input.escape.connect(self.escape)
        self.send_button = QPushButton("Send", toolTip="Send (Enter)")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self.submit)
        self.stop_button = QPushButton("Stop", toolTip="Stop the answer (Esc)")
        self.stop_button.clicked.connect(session.stop)
        self.regen_button = QPushButton("Regenerate", toolTip="Write the last answer again (Ctrl+R)")
        self.regen_button.clicked.connect(lambda: session.regenerate())
        side = QVBoxLayout()
        for b in (self.send_button, self.stop_button, self.regen_button):
            side.addWidget(b)
        side.addStretch(1)
        bottom = QHBoxLayout()
        bottom.addWidget(self.input, 1)
        bottom.addLayout(side)

        line = QFrame(frameShape=QFrame.Shape.HLine, frameShadow=QFrame.Shadow.Sunken)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addLayout(top)
        lay.addLayout(sub)
        lay.addWidget(line)
        lay.addWidget(self.view, 1)
        lay.addWidget(self.edit_banner)
        lay.addLayout(bottom)

        session.busy_changed.connect(self._on_busy)
        session.conversation_changed.connect(self._on_conversation)
        self.input.textChanged.connect(lambda: self.meter.set_typed(self.input.toPlainText()))
        self.meter.policy_chosen.connect(self.set_overflow_policy)
        self.engine_ready = self.loading = False
        self._on_busy(False)
        self._on_conversation(None)
        self.input.setPlainText(self.drafts.get(None))

    # -- actions --------------------------------------------------------------------------------
    def submit(self) -> None:
        text = self.input.toPlainText()
        if not text.strip():
            return
        if not self.engine_ready and not self.session.busy:     # say why nothing is sent; the text stays
            self.session.notice.emit(LOADING_WORDS if self.loading else NO_MODEL_WORDS)
            return
        if not self.send_button.isEnabled():
            return
        if self.meter.full() and self.session.sampling().context_overflow == "stop" and self.editing is None:
            self.session.notice.emit("This chat is full: start a new chat, fork an earlier message, or let the "
                                     "oldest turns go (click the context meter).")
            return
        if self.editing is not None:
            ok = self.session.edit_and_resend(self.editing, text)
        else:
            ok = self.session.send(text)
        if ok:
            self.input.clear()
            self._end_edit()
            self.view.scroll_to_end()

    def escape(self) -> None:
        if self.session.busy:
            self.session.stop()
        elif self.editing is not None:
            self.input.clear()
            self._end_edit()

    def begin_edit(self, message_id: int) -> None:
        if self.session.busy:
            self.session.notice.emit("Stop the answer (Esc) before editing a message.")
            return
        row = self.session.model.row_of(message_id)
        self.editing = message_id
        self.input.setPlainText(self.session.model.items[row].content)
        self.edit_banner.setText("✎ Editing a message: sending replaces it and everything after it. Esc cancels.")
        self.edit_banner.setVisible(True)
        self.input.setFocus()
        self._count_again()

    def _end_edit(self) -> None:
        editing, self.editing = self.editing, None
        self.edit_banner.setVisible(False)
        if editing is not None:
            self._count_again()

    # -- state ----------------------------------------------------------------------------------
    def set_engine_ready(self, ready: bool, loading: bool = False) -> None:
        """Sending needs a loaded model that is not busy elsewhere (`loading`: one is on its way)."""
        self.engine_ready, self.loading = ready, loading
        self._on_busy(self.session.busy)

    def set_overflow_policy(self, policy: str) -> None:
        """What this chat does when it outgrows the context (kept with its other settings)."""
        conv = self.session.conversation
        sampling = dataclasses.replace(self.session.sampling(), context_overflow=policy)
        self.session.set_settings(conv.system_prompt if conv else "", sampling, conv.preset if conv else "")

    def _count_again(self) -> None:
        """The meter counts the chat as the next request would send it: up to the message being edited (the
        input box holds its new text), the question just sent included while its answer streams."""
        s = self.session.sampling()
        rows = [i for i, it in enumerate(self.session.model.items) if it.id == self.editing]
        upto = rows[0] if rows else None          # (an edit being sent has replaced its message already)
        self.meter.set_conversation(self.session.history(upto), s.max_tokens, s.context_overflow)

    def _on_busy(self, busy: bool) -> None:
        self._count_again()
        self.send_button.setEnabled(not busy and self.engine_ready)
        self.stop_button.setEnabled(busy)
        self.send_button.setVisible(not busy)       # one place for Send / Stop: the box keeps its height
        self.stop_button.setVisible(busy)
        items = self.session.model.items
        self.regen_button.setEnabled(not busy and self.engine_ready and bool(items)   # a fork may end in a question
                                     and items[-1].role in ("assistant", "user"))

    def _switch_draft(self, conv) -> None:
        """Each chat keeps its own unsent text: the input box's goes with the chat being left."""
        new = conv.id if conv is not None else None
        if new == self._draft_of:
            return
        if self._draft_of is None and new is not None and not self.session.model.items:
            self.drafts.put(None, "")            # the new chat got its id (first message or settings)
        else:
            if self.editing is None:             # an edit in progress is not a draft
                self.drafts.put(self._draft_of, self.input.toPlainText())
            self.input.setPlainText(self.drafts.get(new))
        self._draft_of = new
        self.drafts.save()

    def save_draft(self) -> None:
        """Keep the open chat's unsent text (the app is closing)."""
        if self.editing is None:
            self.drafts.put(self._draft_of, self.input.toPlainText())
        self.drafts.save()

    def _on_conversation(self, conv) -> None:
        self._switch_draft(conv)
        self.title.setText(conv.title if conv is not None else "New chat")
        hint = []
        if conv is not None and conv.preset:
            hint.append(f"preset: {conv.preset}")
        if conv is not None and conv.system_prompt:
            hint.append("system prompt set")
        s = self.session.sampling()
        hint.append(f"temperature {s.temperature:g} · max {s.max_tokens} tokens")
        self.settings_hint.setText(" · ".join(hint))
        self.settings_hint.setToolTip(" · ".join(hint))
        self.picker.set_chat_model(conv.model if conv is not None else None)
        self._end_edit()
        self._on_busy(self.session.busy)
