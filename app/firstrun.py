"""The welcome screen shown on first start: what this machine will run, and what to do about the rest.

It checks the machine (app.machine), says plainly whether the GPU engine or only the CPU demo will
work, lists each finding with advice, and offers the demo model and the model manager. Where the demo
model is not there yet, "Chat with the demo model" prepares it (app.demo_install: a child process, its
progress as a bar) and then loads it; where this installation cannot prepare it, the screen says why in
words and points to the model manager instead.
"""
from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QIcon, QPalette
from PySide6.QtWidgets import (QDialog, QFrame, QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout,
                               QWidget)

from app.machine import MachineReport, check_machine
from runtime import paths

MARK = {"ok": ("✔", "#2f9e44"), "warn": ("!", "#e67700"), "fail": ("✖", "#e03131")}


def welcome_done_marker() -> Path:
    return paths.config_dir() / "welcome-done"


def should_show_welcome() -> bool:
    return not welcome_done_marker().exists()


def mark_welcome_done() -> None:
    m = welcome_done_marker()
    m.parent.mkdir(parents=True, exist_ok=True)
    m.write_text("1\n", encoding="utf-8")


class WelcomeDialog(QDialog):
    """First-run screen. `choice` is "demo", "browse" or "close" after it is dismissed."""

    demo_requested = Signal()
    browse_requested = Signal()
    kernels_ready = Signal()          # the background build of the GPU kernels finished

    def __init__(self, report: MachineReport | None = None, parent: QWidget | None = None,
                 build_kernels: bool = True, demo: tuple[str, str] | None = None):
        super().__init__(parent)
        from app import demo_install
        self.report = report or check_machine(paths.models_dir())
        self.demo_state, why = demo or demo_install.status()     # "ready" | "importable" | "blocked"
        self.demo_job = None
        self.choice = "close"
        self.setWindowTitle("Welcome to MoE Desk")
        self.setObjectName("welcome")
        self.setMinimumWidth(620)
        try:
            from app.resources import resource
            self.setWindowIcon(QIcon(str(resource("icons", "moedesk.svg"))))
        except FileNotFoundError:
            pass

        title = QLabel("<h2>Welcome to MoE Desk</h2>")
        lead = QLabel("Large Mixture-of-Experts models on the GPU you already have. "
                      "Here is what this computer can run:")
        lead.setWordWrap(True)
        verdict = QLabel(f"<b>{self.report.summary}</b>")
        verdict.setWordWrap(True)
        verdict.setObjectName("verdict")

        checks = QFrame()
        checks.setFrameShape(QFrame.StyledPanel)
        cl = QVBoxLayout(checks)
        for f in self.report.findings:
            sym, colour = MARK[f.level]
            row = QLabel(f"<span style='color:{colour};font-weight:bold'>{sym}</span>&nbsp; {f.title}"
                         + (f"<br><span style='color:#6b7280'>{f.advice}</span>" if f.advice else ""))
            row.setWordWrap(True)
            row.setTextFormat(Qt.RichText)
            cl.addWidget(row)

        nxt = QLabel("Start with the small demo model (runs anywhere), or pick a model to download."
                     if self.report.gpu_engine else
                     "The demo model runs on the CPU. You can still browse models and download them for later.")
        nxt.setWordWrap(True)

        self.demo_btn = QPushButton("Chat with the demo model")
        self.demo_btn.setDefault(True)
        self.browse_btn = QPushButton("Browse models…")
        self.close_btn = QPushButton("Close")
        self.demo_btn.clicked.connect(self._demo_clicked)
        self.browse_btn.clicked.connect(lambda: self._finish("browse"))
        self.close_btn.clicked.connect(lambda: self._finish("close"))
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        for b in (self.close_btn, self.browse_btn, self.demo_btn):
            buttons.addWidget(b)

        self.demo_panel = self._demo_panel(why)
        lay = QVBoxLayout(self)
        for w in (title, lead, verdict, checks, nxt, self.demo_panel):
            lay.addWidget(w)
        self.kernels, self.kernel_job = self._kernel_panel(build_kernels)
        if self.kernels is not None:
            lay.insertWidget(lay.indexOf(checks) + 1, self.kernels)
        lay.addLayout(buttons)

    def _demo_panel(self, why: str) -> QFrame:
        """The demo's preparation: its progress, how it failed (with Try again), or why it cannot be done here."""
        panel = QFrame(objectName="demo-import", frameShape=QFrame.StyledPanel)
        self.demo_text = QLabel(wordWrap=True, textFormat=Qt.RichText)
        self.demo_bar = QProgressBar(textVisible=True)
        self.demo_log = QLabel(wordWrap=True, textInteractionFlags=Qt.TextSelectableByMouse)
        self.demo_log.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.demo_retry = QPushButton("Try again")
        self.demo_retry.clicked.connect(self.start_demo_import)
        lay = QVBoxLayout(panel)
        for w in (self.demo_text, self.demo_bar, self.demo_log):
            lay.addWidget(w)
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(self.demo_retry)
        lay.addLayout(row)
        self._demo_show("", bar=False)
        panel.setVisible(self.demo_state == "blocked")
        if self.demo_state == "blocked":
            self.demo_btn.setEnabled(False)
            self.demo_btn.setDefault(False)
            self.browse_btn.setDefault(True)
            self._demo_show(f"<b>The demo model cannot be prepared here:</b> {why}. Pick a model to download "
                            "instead with <b>Browse models…</b>.", bar=False)
        return panel

    def _demo_show(self, text: str, bar: bool, log: str = "", retry: bool = False) -> None:
        self.demo_text.setText(text)
        self.demo_bar.setVisible(bar)
        self.demo_log.setText(log)
        self.demo_log.setVisible(bool(log))
        self.demo_retry.setVisible(retry)
        if self.isVisible():
            self.adjustSize()         # grown to the panel: the findings above keep their lines

    def _demo_clicked(self) -> None:
        if self.demo_state == "ready":
            self._finish("demo")
        elif self.demo_state == "importable":
            self.start_demo_import()

    def start_demo_import(self, command: list[str] | None = None):
        """Prepare the demo model in the background (kept by the main window, so it goes on if this screen is
        closed); once it is there, chat with it."""
        from app.demo_install import start_import
        mark_welcome_done()
        self.demo_panel.setVisible(True)
        self.demo_btn.setEnabled(False)
        self.demo_btn.setText("Preparing the demo model…")
        self._demo_show("<b>Preparing the demo model, one time</b> (a minute or two): reading it, then writing "
                        "it for the engine.", bar=True)
        self.demo_bar.setRange(0, 0)                             # busy until the first tensor is written
        self.demo_job = job = start_import(self.parent() or self, command)
        job.step.connect(lambda words: self.demo_bar.setFormat(words))
        job.progress.connect(self._demo_progress)
        job.done.connect(self._demo_done)
        job.failed.connect(self._demo_failed)
        return job

    def _demo_progress(self, done: int, total: int) -> None:
        if total > 0:
            self.demo_bar.setRange(0, total)
            self.demo_bar.setValue(done)
            self.demo_bar.setFormat(f"Writing the demo model for the engine: {done} of {total} parts")

    def _demo_done(self, _seconds: float) -> None:
        self.demo_state = "ready"
        self._finish("demo")

    def _demo_failed(self, message: str, detail: str) -> None:
        self.demo_btn.setText("Chat with the demo model")
        self.demo_panel.setVisible(True)
        self._demo_show(f"<b>The demo model could not be prepared.</b> {message} You can try again, or pick "
                        "a model to download with <b>Browse models…</b>.", bar=False, log=detail, retry=True)

    def _kernel_panel(self, build: bool):
        """With a GPU whose kernels are not prebuilt: their one-time build, started now in the background
        (kept by the main window, so it goes on after this screen closes)."""
        k = self.report.kernels
        if k is None or k.state not in ("buildable", "building", "failed", "cached"):
            return None, None
        from app.kernel_build import KernelBuildPanel
        panel = KernelBuildPanel()
        panel.show_status(k)
        self.kernels = panel
        can_build = build and not getattr(sys, "frozen", False)
        job = self.start_kernel_build() if can_build and k.state == "buildable" else None
        if can_build:
            panel.retry_requested.connect(self.start_kernel_build)
        panel.retry.setEnabled(can_build)
        return panel, job

    def start_kernel_build(self, command: list[str] | None = None):
        from app.kernel_build import start_background_build
        self.kernel_job = start_background_build(self.kernels, self.parent() or self, command)
        self.kernel_job.done.connect(lambda _seconds: self.kernels_ready.emit())
        return self.kernel_job

    def _finish(self, choice: str) -> None:
        self.choice = choice
        mark_welcome_done()
        if choice == "demo":
            self.demo_requested.emit()
        elif choice == "browse":
            self.browse_requested.emit()
        self.accept()


def offer_welcome(desk, load_demo, open_models) -> WelcomeDialog | None:
    """Show the welcome screen once (first start), over the window, without blocking the event loop;
    its "Chat with the demo model" calls `load_demo(desk)`, its "Browse models…" `open_models(desk)`
    (app.main's, which wires the app: this module never imports it)."""
    if not should_show_welcome():
        return None
    dialog = WelcomeDialog(parent=desk.window)
    dialog.demo_requested.connect(lambda: load_demo(desk))
    dialog.browse_requested.connect(lambda: open_models(desk))
    dialog.kernels_ready.connect(lambda: switch_to_gpu(desk))
    dialog.finished.connect(lambda _r: mark_welcome_done())        # closed with the window's X too
    dialog.open()
    return dialog


def switch_to_gpu(desk) -> bool:
    """The GPU kernels were just built: an idle engine running on the CPU restarts (on the GPU now) and
    reloads its model. A busy one is left alone; its next start takes the GPU."""
    ready = desk.window.ready
    if ready is None or ready.engine != "cpu" or desk.session.generating:
        return False
    desk.client.restart()
    return True


def grab_welcome(path, report: MachineReport | None = None, setup=None) -> Path:
    """A PNG of the welcome screen for this machine (or for `report`; `setup(dialog)` may set a state
    first), for `make screenshots`."""
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    dialog = WelcomeDialog(report, build_kernels=False)
    if setup is not None:
        setup(dialog)
    dialog.resize(dialog.sizeHint().expandedTo(dialog.minimumSizeHint()))
    dialog.show()
    app.processEvents()
    if not dialog.grab().save(str(out)):
        raise OSError(f"could not write the screenshot {out}")
    dialog.close()
    dialog.deleteLater()
    return out
