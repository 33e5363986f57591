"""The main window: conversation list | engine banner, chat, gauges.

The window knows the chat session and the store, never the engine process: it shows engine events
through its `on_*` slots and asks for engine work through `restart_requested`. `app/main.py` wires
both to the engine client.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (QDialog, QDockWidget, QFileDialog, QFrame, QHBoxLayout, QInputDialog, QLabel,
                               QMainWindow, QMessageBox, QPlainTextEdit, QProgressBar, QPushButton, QSplitter,
                               QVBoxLayout, QWidget)

from app import help as help_windows
from app.chat.conversations import ConversationList
from app.chat.header import REMOTE_COUNT
from app.chat.panel import ChatPanel
from app.chat.session import ChatSession
from app.chat.settings_dialog import ConversationSettingsDialog
from app.engine_client import error_advice
from app.store import Store
from runtime import paths
from runtime.protocol import Loaded, Progress, Ready, Unloaded, WorkerError

STDERR_SHOWN = 12
LOAD_ERRORS = ("model_not_found", "model_invalid", "unsupported_architecture")   # "Choose a model…" helps
MIN_SIZE = (640, 440)      # the chat stays usable down to this, status bar included (tests/test_window_size.py)
FIRST_SIZE = (1280, 800)   # the first window, where the screen has the room
FRAME_ROOM = (16, 48)      # left on the screen for the window manager's frame and title bar
UNSAFE_IN_NAMES = set('<>:"/\\|?*')     # not allowed in file names on one system or another
CHATS_MIN_WIDTH = 190


class EngineBanner(QFrame):
    """The engine's state in words: what runs where, load progress, and errors with a Restart (and,
    when a model could not be loaded, a way to another one)."""
    restart_requested = Signal()
    choose_model_requested = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.headline = QLabel("Starting the engine…")
        self.headline.setWordWrap(True)
        bold = self.headline.font()
        bold.setBold(True)
        self.headline.setFont(bold)
        self.headline.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.detail = QLabel()
        self.detail.setWordWrap(True)
        self.detail.setEnabled(False)
        self.progress = QProgressBar(maximumHeight=14, textVisible=False)
        self.progress.setVisible(False)
        self.log = QPlainTextEdit(readOnly=True)
        self.log.setVisible(False)
        f = self.log.font()
        f.setFamily("monospace")
        f.setStyleHint(f.StyleHint.Monospace)
        self.log.setFont(f)
        self.restart = QPushButton("Restart engine", toolTip="Start a fresh engine process and reload the last model")
        self.restart.clicked.connect(self.restart_requested)
        self.restart.setVisible(False)
        self.choose_model = QPushButton("Choose a model…", toolTip="Open the model manager (Ctrl+M)")
        self.choose_model.clicked.connect(self.choose_model_requested)
        self.choose_model.setVisible(False)
        top = QHBoxLayout()
        top.addWidget(self.headline, 1)
        top.addWidget(self.choose_model)
        top.addWidget(self.restart)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 4, 8, 4)
        lay.addLayout(top)
        lay.addWidget(self.detail)
        lay.addWidget(self.progress)
        lay.addWidget(self.log)
        self.kind = "info"

    def show_state(self, headline: str, detail: str = "", kind: str = "info",
                   lines: Optional[list[str]] = None, choose_model: bool = False) -> None:
        """kind: "info" | "busy" (progress bar) | "error" (red, Restart, stderr lines);
        `choose_model` offers the model manager (a model that could not be loaded)."""
        self.kind = kind
        self.choose_model.setVisible(choose_model)
        self.headline.setText(headline)
        self.detail.setText(detail)
        self.detail.setVisible(bool(detail))
        self.progress.setVisible(kind == "busy")
        if kind == "busy":
            self.progress.setRange(0, 0)
        self.restart.setVisible(kind == "error")
        self.log.setVisible(bool(lines))
        if lines:
            shown = lines[-STDERR_SHOWN:]
            self.log.setPlainText("\n".join(shown))
            margins = 2 * (self.log.frameWidth() + round(self.log.document().documentMargin()))
            self.log.setFixedHeight(len(shown) * self.log.fontMetrics().lineSpacing() + margins + 2)
        # Colour only for errors: a style sheet would pin the palette and miss a theme change.
        self.setStyleSheet("EngineBanner { border: 1px solid #d1242f; }" if kind == "error" else "")
        self.headline.setStyleSheet("color: #d1242f;" if kind == "error" else "")

    def set_progress(self, done: int, total: int) -> None:
        if total > 0:
            self.progress.setRange(0, total)
            self.progress.setValue(done)
        else:
            self.progress.setRange(0, 0)


class NoticeBar(QFrame):
    """Something the user must know that the engine banner would soon overwrite (a damaged conversations
    file set aside, settings reset): stays until dismissed; several notices stack as paragraphs."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.text = QLabel(wordWrap=True)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        dismiss = QPushButton("Dismiss")
        dismiss.clicked.connect(self.clear)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(8, 4, 8, 4)
        lay.addWidget(self.text, 1)
        lay.addWidget(dismiss, 0, Qt.AlignmentFlag.AlignTop)
        self.setVisible(False)

    def add(self, headline: str, detail: str) -> None:
        shown = self.text.text()
        self.text.setText((shown + "\n\n" if shown else "") + f"{headline}: {detail}")
        self.setVisible(True)

    def clear(self) -> None:
        self.text.clear()
        self.setVisible(False)


class MainWindow(QMainWindow):
    restart_requested = Signal()
    settings_requested = Signal()
    models_requested = Signal()

    def __init__(self, store: Store, session: ChatSession, gauges: Optional[QWidget] = None, parent=None):
        super().__init__(parent)
        self.setWindowTitle("MoE Desk")
        self.store, self.session = store, session
        self.confirm: Callable[[str, str], bool] = self._ask     # tests replace the dialogs
        self.conversations = ConversationList(store)
        self.banner = EngineBanner()
        self.notice = NoticeBar()
        self.chat = ChatPanel(session)
        self.ready: Optional[Ready] = None
        self.loaded: Optional[Loaded] = None
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        rl.setSpacing(0)
        rl.addWidget(self.notice)
        rl.addWidget(self.banner)
        rl.addWidget(self.chat, 1)
        split = QSplitter()
        split.addWidget(self.conversations)
        split.addWidget(right)
        split.setStretchFactor(0, 1)         # narrowing the window narrows the list too, to its minimum
        split.setStretchFactor(1, 4)
        split.setSizes([240, 1040])
        self.conversations.setMinimumWidth(CHATS_MIN_WIDTH)   # the list narrows so the chat keeps its room
        self.setCentralWidget(split)
        self.gauges_dock: Optional[QDockWidget] = None
        if gauges is not None:
            self.gauges_dock = QDockWidget("Gauges", self, objectName="gauges")
            self.gauges_dock.setWidget(gauges)
            self.gauges_dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetClosable
                                         | QDockWidget.DockWidgetFeature.DockWidgetMovable)
            self.gauges_dock.setTitleBarWidget(QWidget())     # the compact line is its own title: no bar
            self.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea, self.gauges_dock)

        self.conversations.new_requested.connect(self.new_chat)
        self.conversations.open_requested.connect(session.open)
        self.conversations.rename_requested.connect(self.rename_chat)
        self.conversations.delete_requested.connect(self.delete_chat)
        self.conversations.export_requested.connect(self.export_chat)
        self.conversations.pin_requested.connect(session.pin)
        self.banner.restart_requested.connect(self.restart_requested)
        self.banner.choose_model_requested.connect(self.models_requested)
        self.chat.settings_requested.connect(self.edit_chat_settings)
        self.chat.view.copied.connect(lambda words: self.statusBar().showMessage(words, 2000))
        session.conversations_changed.connect(self._refresh_list)
        session.conversation_changed.connect(self._on_conversation)
        session.notice.connect(lambda words: self.statusBar().showMessage(words, 5000))
        self._actions()
        # The status bar is there from the start: a first message must not push the window's content up.
        self.statusBar().setSizeGripEnabled(True)
        self.setMinimumSize(*MIN_SIZE)
        self.resize(*first_size(self.screen().availableGeometry().size()))

    # -- menus and shortcuts --------------------------------------------------------------------
    def _actions(self) -> None:
        def act(menu, text, slot, shortcut=None, tip=""):
            a = QAction(text, self, statusTip=tip)
            if shortcut:
                a.setShortcut(QKeySequence(shortcut))
            a.triggered.connect(slot)
            menu.addAction(a)
            self.addAction(a)
            return a

        bar = self.menuBar()
        file = bar.addMenu("&File")
        self.new_action = act(file, "&New chat", self.new_chat, QKeySequence.StandardKey.New)
        act(file, "Export as &Markdown…", lambda: self._export_current("md"))
        act(file, "Export as &JSON…", lambda: self._export_current("json"))
        file.addSeparator()
        act(file, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        chat = bar.addMenu("&Chat")
        self.stop_action = act(chat, "&Stop", self.chat.escape, "Esc", "Stop the answer")
        act(chat, "&Regenerate", lambda: self.session.regenerate(), "Ctrl+R")
        act(chat, "S&earch chats", self.focus_search, QKeySequence.StandardKey.Find)
        act(chat, "Re&name chat…", lambda: self._current(self.rename_chat), "F2")
        act(chat, "&Pin or unpin chat", lambda: self._current(lambda cid: self.session.pin(
            cid, not self.store.conversation(cid).pinned)), tip="Pinned chats stay on top of the list")
        act(chat, "&Delete chat…", lambda: self._current(self.delete_chat))
        act(chat, "Chat se&ttings…", self.edit_chat_settings, "Ctrl+Shift+P")
        engine = bar.addMenu("&Engine")
        act(engine, "&Models…", self.models_requested.emit, "Ctrl+M", "Local models, the Hub's EXL2 quants, downloads")
        act(engine, "&Restart engine", self.restart_requested.emit)
        # Ctrl+, everywhere (Qt's Preferences key is empty on Linux and Windows).
        act(engine, "&Settings…", self.settings_requested.emit, "Ctrl+,")
        if self.gauges_dock is not None:
            bar.addMenu("&View").addAction(self.gauges_dock.toggleViewAction())
        helpm = bar.addMenu("&Help")
        act(helpm, "&Keyboard shortcuts", lambda: self._show(help_windows.shortcuts_dialog(self, self.actions())),
            "Ctrl+/")
        act(helpm, "&User guide", lambda: self._show(help_windows.guide_dialog(self)), QKeySequence.StandardKey.HelpContents)
        helpm.addSeparator()
        act(helpm, "&About MoE Desk", lambda: self._show(help_windows.about_dialog(self, self.ready, self.loaded)))

    def _show(self, dialog: QDialog) -> None:
        self.help_dialog = dialog          # kept for tests and so that it is not collected while shown
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.show()

    def focus_search(self) -> None:
        self.conversations.search.setFocus()
        self.conversations.search.selectAll()

    def _current(self, fn) -> None:
        if self.session.conversation is not None:
            fn(self.session.conversation.id)

    # -- conversations --------------------------------------------------------------------------
    def new_chat(self) -> None:
        self.session.new_conversation()
        self.conversations.select(None)
        self.chat.input.setFocus()

    def rename_chat(self, conversation_id: int) -> None:
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:",
                                         text=self.store.conversation(conversation_id).title)
        if ok and title.strip():
            self.session.rename(conversation_id, title)

    def delete_chat(self, conversation_id: int) -> None:
        title = self.store.conversation(conversation_id).title
        if self.confirm("Delete chat", f"Delete “{title}” and all its messages? This cannot be undone."):
            self.session.delete(conversation_id)

    def export_chat(self, conversation_id: int, fmt: str, path: Optional[Path] = None) -> Optional[Path]:
        conv = self.store.conversation(conversation_id)
        if path is None:
            name, _ = QFileDialog.getSaveFileName(self, "Export chat", export_file_name(conv.title, fmt),
                                                  "Markdown (*.md)" if fmt == "md" else "JSON (*.json)")
            if not name:
                return None
            path = Path(name)
        text = self.store.export_markdown(conversation_id) if fmt == "md" else self.store.export_json(conversation_id)
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as e:
            QMessageBox.warning(self, "Export failed", f"Could not write {path}: {e.strerror or e}")
            return None
        self.statusBar().showMessage(f"Exported to {path}", 5000)
        return path

    def _export_current(self, fmt: str) -> None:
        if self.session.conversation is not None:
            self.export_chat(self.session.conversation.id, fmt)

    def edit_chat_settings(self) -> None:
        conv = self.session.conversation
        dlg = ConversationSettingsDialog(self.store, conv.system_prompt if conv else "", self.session.sampling(),
                                         conv.preset if conv else "", self.session.default_sampling, self)
        if dlg.exec() == QDialog.DialogCode.Accepted:
            prompt, sampling, preset = dlg.result_values()
            self.session.set_settings(prompt, sampling, preset)

    def _refresh_list(self) -> None:
        conv = self.session.conversation
        self.conversations.set_writing(self.session.writing())
        self.conversations.refresh(select=conv.id if conv else None)

    def _on_conversation(self, conv) -> None:
        self.setWindowTitle(f"{conv.title} — MoE Desk" if conv else "MoE Desk")
        self.conversations.select(conv.id if conv else None)

    def _ask(self, title: str, question: str) -> bool:
        return QMessageBox.question(self, title, question) == QMessageBox.StandardButton.Yes

    # -- the engine, in words -------------------------------------------------------------------
    def engine_words(self) -> str:
        r = self.ready
        if r is None:
            return "Engine starting"
        if r.engine == "cpu":
            return "CPU (no NVIDIA GPU found)"
        if r.engine == "remote":
            return f"Remote server {r.device}"
        return f"GPU engine on {r.device}"

    def on_engine_state(self, state: str) -> None:
        ready = state in ("idle", "generating") and self.loaded is not None
        self.chat.set_engine_ready(ready, loading=state == "loading")
        if state == "starting":
            self.banner.show_state("Starting the engine…", kind="busy")
        elif state == "idle" and self.loaded is None and self.banner.kind != "error":
            self.banner.show_state(self.engine_words(), "No model loaded: pick one in Engine → Models… (Ctrl+M).")

    def on_ready(self, ev: Ready) -> None:
        self.ready = ev
        self.loaded = None
        self.banner.show_state(self.engine_words(), ev.engine_note)

    def on_progress(self, ev: Progress) -> None:
        self.banner.show_state(f"{self.engine_words()} — loading", ev.message, kind="busy")
        self.banner.set_progress(ev.done, ev.total)

    def on_loaded(self, ev: Loaded) -> None:
        self.loaded = ev
        remote = ev.backend == "remote"
        self.session.model_name = ev.model      # what a chat remembers (loadable); shown by its one name
        self.chat.picker.set_loaded(ev.model)
        if remote:
            self.chat.meter.set_model_context(None, unknown=REMOTE_COUNT)
            self.banner.show_state(f"{ev.model} · {self.engine_words()}",
                                   "Answers stream from that server; memory gauges are not available for it.")
        else:
            self.chat.meter.set_model_context(ev.context_length)
            self.banner.show_state(f"{paths.display_name(ev.path or ev.model)} · {self.engine_words()}",
                                   f"{ev.architecture}, context {ev.context_length} tokens, loaded in {ev.load_s:.1f} s")
        self.chat.set_engine_ready(True)

    def on_unloaded(self, _ev: Optional[Unloaded] = None) -> None:
        self.loaded = None
        self.chat.set_engine_ready(False)
        self.chat.picker.set_loaded(None)
        self.chat.meter.set_model_context(None)
        self.banner.show_state(self.engine_words(), "No model loaded: pick one in the chat's model list or in "
                                                    "Engine → Models… (Ctrl+M).")

    def on_engine_error(self, request_id: str, err: WorkerError) -> None:
        if self.chat.meter.owns(request_id):     # a count the meter asked for: it shows "—" meanwhile
            self.chat.meter.on_error(request_id)
            return
        if self.session.issued(request_id):      # shown on the answer itself
            self.statusBar().showMessage(f"The answer stopped: {err.message}", 8000)
            return
        lines = err.detail.splitlines() if err.detail else None
        load_failed = request_id.startswith("load") or err.code in LOAD_ERRORS
        if load_failed:                          # the engine let the old model go before trying
            self.loaded = None
            self.chat.set_engine_ready(False)
            self.chat.picker.set_loaded(None)
            self.chat.meter.set_model_context(None)
        self.banner.show_state(err.message, error_advice(err.code), kind="error", lines=lines,
                               choose_model=load_failed)

    def on_worker_died(self, exit_code: int, words: str, stderr_lines: list) -> None:
        self.loaded = None
        self.chat.set_engine_ready(False)
        self.chat.picker.set_loaded(None)
        self.chat.meter.set_model_context(None)
        kept = " The conversation and the partial answer are saved." if self.session.conversation else ""
        self.banner.show_state(words, "Restart reloads the last model." + kept, kind="error",
                               lines=stderr_lines or ["(the engine wrote nothing to its error log)"])

    # -- window state ---------------------------------------------------------------------------
    def restore_geometry(self) -> None:
        s = window_state_file()
        if s.value("geometry") is not None:
            self.restoreGeometry(s.value("geometry"))
            self.restoreState(s.value("state"))

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802
        self.session.flush()
        self.chat.save_draft()
        s = window_state_file()
        s.setValue("geometry", self.saveGeometry())
        s.setValue("state", self.saveState())
        super().closeEvent(event)


def first_size(available) -> tuple[int, int]:
    """The first window's size: FIRST_SIZE, less where the screen's free area (`available`, a QSize) is
    smaller, leaving room for the window's frame and title bar; never below MIN_SIZE."""
    return (max(MIN_SIZE[0], min(FIRST_SIZE[0], available.width() - FRAME_ROOM[0])),
            max(MIN_SIZE[1], min(FIRST_SIZE[1], available.height() - FRAME_ROOM[1])))


def window_state_file() -> QSettings:
    """Where the window's size, place and docks are kept: beside the app's other settings (under
    MOEDESK_HOME when it is set), not in Qt's per-user default location."""
    return QSettings(str(paths.config_dir() / "window.ini"), QSettings.Format.IniFormat)


def export_file_name(title: str, fmt: str) -> str:
    """The file name an export of the chat `title` suggests: the title as it reads ("…" and accents kept),
    less what file systems refuse (path separators, <>:"|?*, control characters, a trailing dot or space)."""
    name = "".join("_" if c in UNSAFE_IN_NAMES or ord(c) < 32 else c for c in title)
    name = " ".join(name.split()).rstrip(" .")[:120] or "chat"
    return f"{name}.{fmt}"
