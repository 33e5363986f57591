"""The GPU kernels' one-time build, in the background of the welcome screen.

`KernelBuild` runs `moedesk-cli setup-gpu --json` (runtime.gpu_setup) as a child process (app.child_job) and
turns its JSON lines into signals; `KernelBuildPanel` shows the states in words: building with progress, built,
failed (with the compiler's last lines and what to do). The engine keeps working on the CPU meanwhile
(runtime.loader chooses the CPU engine while a build runs).
"""
from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget

from app.child_job import ChildJob
from runtime.gpu_setup import KernelStatus


class KernelBuild(ChildJob):
    """One background build (`moedesk-cli setup-gpu --json`). Signals: progress(done, total), done(seconds),
    failed(message, detail)."""

    def __init__(self, parent: QObject | None = None, command: list[str] | None = None):
        super().__init__(command or [sys.executable, "-m", "runtime.cli", "setup-gpu", "--json"],
                         "The GPU kernel build", parent)


class KernelBuildPanel(QFrame):
    """The build's state in words, with a progress bar while it runs; after a failure, "Build again"
    (once the compiler or the GPU dependencies are installed) asks for another build."""

    retry_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("kernel-build")
        self.setFrameShape(QFrame.StyledPanel)
        self.state = ""
        self.title = QLabel()
        self.title.setWordWrap(True)
        self.title.setTextFormat(Qt.RichText)
        self.bar = QProgressBar()
        self.bar.setTextVisible(True)
        self.log = QLabel()
        self.log.setObjectName("kernel-build-log")
        self.log.setWordWrap(True)
        self.log.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.log.setFont(QFontDatabase.systemFont(QFontDatabase.FixedFont))
        self.retry = QPushButton("Build again")
        self.retry.clicked.connect(self.retry_requested)
        lay = QVBoxLayout(self)
        for w in (self.title, self.bar, self.log):
            lay.addWidget(w)
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(self.retry)
        lay.addLayout(row)

    def _show(self, state: str, title: str, bar: bool = False, log: str = "") -> None:
        self.state = state
        self.title.setText(title)
        self.bar.setVisible(bar)
        self.log.setText(log)
        self.log.setVisible(bool(log))
        self.retry.setVisible(state == "failed")

    def show_waiting(self, status: KernelStatus) -> None:
        self._show("building", "<b>Building the GPU kernels, one time</b> — in the background; "
                   "the demo model runs on the CPU meanwhile."
                   + (" No CUDA toolkit needed." if status.toolchain and status.toolchain.kind == "wheels" else ""),
                   bar=True)
        self.bar.setRange(0, 0)                                  # busy until ninja reports [n/m]

    def show_progress(self, done: int, total: int) -> None:
        if self.state != "building":
            self._show("building", "<b>Building the GPU kernels, one time</b> — in the background; "
                       "the demo model runs on the CPU meanwhile.", bar=True)
        self.bar.setRange(0, total)
        self.bar.setValue(done)
        self.bar.setFormat(f"compiled {done} of {total}")

    def show_ready(self, seconds: float = 0.0) -> None:
        took = f" (built in {seconds:.0f} s)" if seconds else ""
        self._show("ready", f"<b>GPU engine ready</b>{took}: models load on the GPU from now on "
                   "(an idle engine on the CPU restarts on the GPU).")

    def show_failed(self, message: str, detail: str) -> None:
        self._show("failed", f"<b>The GPU kernels did not build.</b> MoE Desk keeps working on the CPU. {message}",
                   log=detail)

    def show_status(self, status: KernelStatus) -> None:
        """The state as found at start (no build running from here)."""
        if status.ready:
            self.show_ready()
        elif status.state == "failed":
            self.show_failed(status.advice, status.log_tail)
        else:
            self.show_waiting(status)


def start_background_build(panel: KernelBuildPanel, owner: QObject,
                           command: list[str] | None = None) -> KernelBuild:
    """Start the build now; the panel follows it. `owner` keeps it alive (the main window: the build goes
    on after the welcome screen closes)."""
    job = KernelBuild(owner, command)
    job.progress.connect(panel.show_progress)
    job.done.connect(panel.show_ready)
    job.failed.connect(panel.show_failed)
    job.start()
    return job
