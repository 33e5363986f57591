"""The model manager's "Convert to EXL2…": the form that picks a source and a width, and the conversions table
(conversions, and imports of GPTQ-family builds: progress, time left, pause, resume, cancel).

The work itself is `app.hub.convert.ConvertManager` (download of a Hub original, then `moedesk-cli convert` in
its own process); this module only shows it. Events come from background threads as a queued signal.
"""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QButtonGroup, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog, QGridLayout,
                               QLabel, QLineEdit, QPushButton, QRadioButton, QVBoxLayout)

from app.hub.convert import BPW_RANGE, ConvertManager, ConvertProgress
from app.hub.download import JobState
from app.jobs_panel import JobsPanel
from app.telemetry import fmt_bytes


class ConvertForm(QDialog):
    """Source (a Hub repository or a local folder) and bits per weight; `values()` after `exec()`."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Convert to EXL2")
        self.hub_radio = QRadioButton("Hugging Face repository")
        self.local_radio = QRadioButton("Local folder")
        self.hub_radio.setChecked(True)
        group = QButtonGroup(self)
        group.addButton(self.hub_radio)
        group.addButton(self.local_radio)
        self.repo_edit = QLineEdit()
        self.repo_edit.setPlaceholderText("owner/model, e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
        self.folder_edit = QLineEdit()
        self.folder_edit.setPlaceholderText("a folder with config.json and .safetensors weights")
        self.browse_button = QPushButton("Browse…")
        self.browse_button.clicked.connect(self._browse)
        self.bpw_spin = QDoubleSpinBox()
        self.bpw_spin.setRange(*BPW_RANGE)
        self.bpw_spin.setSingleStep(0.5)
        self.bpw_spin.setDecimals(1)
        self.bpw_spin.setValue(4.0)
        note = QLabel("The original (fp16/bf16) safetensors checkpoint of a Llama, Qwen3 or Qwen3-MoE model, or a "
                      "GPTQ / AutoRound / AWQ build of one (imported: its 4-bit experts kept, the rest at these bits). "
                      "The conversion runs on the CPU, layer by layer; it continues where it stopped if the app "
                      "closes. The model appears in the list once complete.")
        note.setWordWrap(True)
        grid = QGridLayout()
        grid.addWidget(self.hub_radio, 0, 0)
        grid.addWidget(self.repo_edit, 0, 1, 1, 2)
        grid.addWidget(self.local_radio, 1, 0)
        grid.addWidget(self.folder_edit, 1, 1)
        grid.addWidget(self.browse_button, 1, 2)
        grid.addWidget(QLabel("Bits per weight"), 2, 0)
        grid.addWidget(self.bpw_spin, 2, 1)
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.button(QDialogButtonBox.Ok).setText("Convert")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        v = QVBoxLayout(self)
        v.addLayout(grid)
        v.addWidget(note)
        v.addWidget(buttons)
        self.repo_edit.textEdited.connect(lambda _: self.hub_radio.setChecked(True))
        self.folder_edit.textEdited.connect(lambda _: self.local_radio.setChecked(True))

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "A Hugging Face model folder")
        if folder:
            self.folder_edit.setText(folder)
            self.local_radio.setChecked(True)

    def values(self) -> tuple[bool, str, float]:
        """(from the Hub, repository id or folder, bits per weight)."""
        hub = self.hub_radio.isChecked()
        return hub, (self.repo_edit if hub else self.folder_edit).text().strip(), self.bpw_spin.value()


class ConversionsPanel(JobsPanel):
    """One row per conversion or import: what, state, a progress bar (bytes while downloading, layers while
    converting), the time left (from the layers done so far in this run)."""
    event = Signal(object)                    # ConvertProgress, from a background thread
    finished_model = Signal(str)              # a conversion completed: the model list should refresh

    def __init__(self, manager_factory, parent=None):
        super().__init__("Conversions", ["Conversion", "State", "Progress", "Time left", "Details"], select_new=True,
                         parent=parent)
        self.event.connect(self._on_event)
        self.manager: ConvertManager = manager_factory(self.event.emit)
        for progress in self.manager.restore():
            self._on_event(progress)

    def row_text(self, job_id: str) -> tuple[str, str, str]:
        """(state, progress bar text, details) of a job's row: what the user reads."""
        r = self._rows[job_id]
        return self.table.item(r, 1).text(), self.table.cellWidget(r, 2).format(), self.table.item(r, 4).text()

    def time_left(self, job_id: str) -> str:
        return self.table.item(self._rows[job_id], 3).text()

    def _on_event(self, p: ConvertProgress) -> None:
        if p.phase == "download":
            text = f"original: {fmt_bytes(p.done)} of {fmt_bytes(p.total)}"
        else:
            text = f"layer {p.done} of {p.total}" if p.total else "—"
        row = self.show_progress(p.job_id, p.done, p.total, text)
        state = "downloading" if p.phase == "download" and p.state is JobState.RUNNING else p.state.value
        left = "" if p.eta_s is None or p.state is not JobState.RUNNING else _duration(p.eta_s)
        self.show_texts(row, {1: state, 3: left, 4: p.message}, p.message)
        self.set_state(p.job_id, p.state)
        if p.state is JobState.DONE:
            self.finished_model.emit(p.job_id)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"
