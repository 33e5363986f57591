"""The model manager's tables, and its jobs tables (downloads, conversions): a row of Pause, Resume and Cancel
over a row per job, the job's id in the first column and a progress bar in the third."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QProgressBar, QPushButton,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from app.hub.download import JobState
from app.hub.jobs import ACTIVE, ENDED, RESUMABLE


def cell(text: str, tip: str = "") -> QTableWidgetItem:
    """A read-only table cell."""
    it = QTableWidgetItem(text)
    it.setFlags(it.flags() & ~Qt.ItemIsEditable)
    if tip:
        it.setToolTip(tip)
    return it


def new_table(headers: list[str]) -> QTableWidget:
    """A table of rows picked one at a time, its columns as wide as their contents, the last one the rest."""
    t = QTableWidget(0, len(headers))
    t.setHorizontalHeaderLabels(headers)
    t.setSelectionBehavior(QAbstractItemView.SelectRows)
    t.setSelectionMode(QAbstractItemView.SingleSelection)
    t.verticalHeader().setVisible(False)
    t.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
    t.horizontalHeader().setStretchLastSection(True)
    return t


class JobsPanel(QWidget):
    """`title`, Pause, Resume and Cancel (each calls the manager's method of that name with the selected job,
    and is enabled only where it applies to that job's state, `set_state`), over a table of `headers` with a
    row per job; `select_new` selects each new row, else only the first."""

    def __init__(self, title: str, headers: list[str], manager=None, select_new: bool = False, parent=None):
        super().__init__(parent)
        self.manager = manager
        self._select_new = select_new
        self._rows: dict[str, int] = {}              # job id -> row
        self._states: dict[str, JobState] = {}       # job id -> its last state
        self.table = new_table(headers)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.horizontalHeader().setSectionResizeMode(2, QHeaderView.Fixed)
        self.table.setColumnWidth(2, 230)
        controls = QHBoxLayout()
        controls.addWidget(QLabel(title))
        self.pause_button, self.resume_button, self.cancel_button = (
            self._button(controls, label) for label in ("Pause", "Resume", "Cancel"))
        controls.addStretch(1)
        v = QVBoxLayout(self)
        v.setContentsMargins(0, 0, 0, 0)
        v.addLayout(controls)
        v.addWidget(self.table)
        self._update_buttons()

    def _button(self, row: QHBoxLayout, label: str) -> QPushButton:
        b = QPushButton(label)
        b.clicked.connect(lambda _=False, action=label.lower(): self._act(action))
        row.addWidget(b)
        return b

    def _act(self, action: str) -> None:
        job_id = self.selected_job()
        if job_id:
            getattr(self.manager, action)(job_id)

    def set_state(self, job_id: str, state: JobState) -> None:
        self._states[job_id] = state
        self._update_buttons()

    def _update_buttons(self) -> None:
        state = self._states.get(self.selected_job())
        self.pause_button.setEnabled(state in ACTIVE)
        self.resume_button.setEnabled(state in RESUMABLE)
        self.cancel_button.setEnabled(state is not None and state not in ENDED)

    def selected_job(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        return self.table.item(rows[0].row(), 0).data(Qt.UserRole) if rows else None

    def select(self, job_id: str) -> None:
        if job_id in self._rows:
            self.table.selectRow(self._rows[job_id])

    def show_progress(self, job_id: str, done: int, total: int, text: str) -> int:
        """Set the job's progress bar (a new row for a new job) to `done` of `total`, reading `text`; its row."""
        t = self.table
        row = self._rows.get(job_id)
        if row is None:
            row = self._rows[job_id] = t.rowCount()
            t.insertRow(row)
            name = cell(job_id)
            name.setData(Qt.UserRole, job_id)
            t.setItem(row, 0, name)
            bar = QProgressBar()
            bar.setRange(0, 1000)
            t.setCellWidget(row, 2, bar)
            if self._select_new or t.rowCount() == 1:
                t.selectRow(row)
        bar = t.cellWidget(row, 2)
        bar.setValue(int(1000 * done / total) if total else 0)
        bar.setFormat(text)
        return row

    def show_texts(self, row: int, texts: dict[int, str], tip: str) -> None:
        """Put `texts` (column -> text) in `row`, each with the tooltip `tip`."""
        for column, text in texts.items():
            self.table.setItem(row, column, cell(text, tip))
