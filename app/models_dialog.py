"""The model manager: local models, the Hub's EXL2 quants with a fit verdict each, and the download queue.
GPTQ-family builds (GPTQ, AutoRound, AWQ) are listed beside them ("INT4 (GPTQ) — imports in minutes"): Download
fetches one and imports it into EXL2, shown under Conversions with its progress and time left.

Self-contained: `ModelManagerDialog(parent, engine_client=None)`; it emits `load_requested(path)` when the
user asks to load a local model. Hub calls and imports run on worker threads; their results, and download
events from the download thread, come back to the GUI thread as queued signals. Closing the dialog hides
it: downloads go on. Call `shutdown()` when the app quits (running downloads pause; they resume next time).
"""
from __future__ import annotations

import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QComboBox, QDialog, QFileDialog, QGridLayout, QHBoxLayout, QInputDialog, QLabel,
                               QLineEdit, QListWidget, QListWidgetItem, QMessageBox, QPushButton, QSpinBox, QSplitter,
                               QTabWidget, QVBoxLayout, QWidget)

from app.convert_panel import ConversionsPanel, ConvertForm
from app.hub.browse import HubClient, Quant, sign_in
from app.hub.convert import ConvertManager, ConvertProgress, hub_source, source_files
from app.hub.download import DownloadProgress, JobState
from app.hub.errors import HubError
from app.hub.fit import FitError, ModelShape, detect_memory, estimate_fit, exl2_size_bytes
from app.hub.local import LocalModel, delete_model, import_folder, list_local_models
from app.hub.queue import DownloadManager
from app.hub.recommend import recommend
from app.jobs_panel import JobsPanel, cell, new_table
from app.telemetry import fmt_bytes
from app.wheel import scroll_past_inputs
from runtime import paths
from runtime.options import IMPORT_BPW

KV_TYPES = ("fp16", "q8", "q6", "q4")


def _params(n: int) -> str:
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


class ModelManagerDialog(QDialog):
    load_requested = Signal(str)
    remote_requested = Signal(object)           # app.serve.remote.RemoteConfig: chat with that server
    _download_event = Signal(object)            # DownloadProgress, from the download thread
    _task_done = Signal(object, object)         # (callbacks, Future), from a worker thread

    def __init__(self, parent=None, engine_client=None, models_dir: Path | None = None,
                 manager: DownloadManager | None = None, hub: HubClient | None = None, remote=None):
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.resize(1000, 640)
        self.engine_client = engine_client
        self.models_dir = Path(models_dir or paths.models_dir())
        self._hub = hub
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="model-manager")
        self._download_event.connect(self._on_download_event)
        self._task_done.connect(self._finish_task)
        self.manager = manager or DownloadManager(on_event=self._download_event.emit, models_dir=self.models_dir)
        self.vram, self.ram, self.gpu = detect_memory()
        self._quants: list[Quant] = []
        self._local: list[LocalModel] = []

        self.tabs = QTabWidget()
        self.tabs.addTab(self._build_local(), "Local models")
        self.tabs.addTab(self._build_hub(), "Download from the Hub")
        self.tabs.addTab(self._build_remote(remote), "Remote server…")
        split = QSplitter(Qt.Vertical)           # downloads stay in sight while browsing
        split.addWidget(self.tabs)
        split.addWidget(self._build_downloads())
        self.conversions = ConversionsPanel(lambda emit: ConvertManager(self.models_dir, on_event=emit))
        self.conversions.finished_model.connect(lambda _: self.refresh_local())
        split.addWidget(self.conversions)
        split.setSizes([360, 130, 150])
        layout = QVBoxLayout(self)
        layout.addWidget(split)
        self.refresh_local()
        for progress in self.manager.restore():
            self._on_download_event(progress)
        if engine_client is not None:        # the loaded model is marked, its "Last used" now
            for sig in (engine_client.loaded, engine_client.unloaded, engine_client.worker_died):
                sig.connect(lambda *_: self.refresh_local())
        scroll_past_inputs(self)

    # ------------------------------------------------------------------------------------------
    # Local models

    def _build_local(self) -> QWidget:
        w = QWidget()
        self.local_table = new_table(["Name", "Architecture", "Parameters", "Bits/weight", "Size", "Last used",
                                      "Status"])
        self.load_button = QPushButton("Load")
        self.reveal_button = QPushButton("Reveal in file manager")
        self.delete_button = QPushButton("Delete…")
        self.import_button = QPushButton("Import folder…")
        self.convert_button = QPushButton("Convert to EXL2…")
        self.convert_button.setToolTip("Quantize an original Hugging Face checkpoint (from the Hub or a folder)")
        self.convert_button.clicked.connect(self._convert_clicked)
        self.load_button.clicked.connect(self._load_selected)
        self.reveal_button.clicked.connect(self._reveal_selected)
        self.delete_button.clicked.connect(self._delete_selected)
        self.import_button.clicked.connect(self._import_clicked)
        self.local_table.itemSelectionChanged.connect(self._local_selection_changed)
        self.local_table.doubleClicked.connect(lambda _: self._load_selected())
        buttons = QHBoxLayout()
        for b in (self.load_button, self.reveal_button, self.delete_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(self.convert_button)
        buttons.addWidget(self.import_button)
        self.local_status = QLabel("")
        self.local_status.setWordWrap(True)
        v = QVBoxLayout(w)
        v.addWidget(self.local_table)
        v.addLayout(buttons)
        v.addWidget(self.local_status)
        return w

    def refresh_local(self) -> None:
        self._local = list_local_models(self.models_dir)
        t = self.local_table
        t.setRowCount(len(self._local))
        for r, m in enumerate(self._local):
            loaded = self.is_loaded(m)
            used = ("in use now" if loaded else time.strftime("%Y-%m-%d %H:%M", time.localtime(m.last_used))
                    if m.last_used else "never")
            status = "loaded — in use" if loaded else "ready" if m.loadable else "cannot load"
            cells = [("● " if loaded else "") + m.name, m.architecture or "—",
                     _params(m.num_params) if m.num_params else "—",
                     f"{m.bits_per_weight:.2f}" if m.bits_per_weight else "—", fmt_bytes(m.size_bytes), used, status]
            for c, text in enumerate(cells):
                item = cell(text, m.error or m.source or str(m.path))
                if loaded:
                    font = item.font()
                    font.setBold(True)
                    item.setFont(font)
                t.setItem(r, c, item)
        self._local_selection_changed()

    def is_loaded(self, m: LocalModel) -> bool:
        """Whether the engine holds this model now."""
        ev = self.engine_client.loaded_event if self.engine_client is not None else None
        return ev is not None and Path(ev.path).resolve() == m.path.resolve()

    def selected_local(self) -> LocalModel | None:
        rows = self.local_table.selectionModel().selectedRows()
        return self._local[rows[0].row()] if rows else None

    def _local_selection_changed(self) -> None:
        m = self.selected_local()
        loaded = m is not None and self.is_loaded(m)
        self.load_button.setEnabled(bool(m and m.loadable) and not loaded)
        self.load_button.setText("Loaded" if loaded else "Load")
        self.reveal_button.setEnabled(m is not None)
        self.delete_button.setEnabled(m is not None)
        if m is not None:
            self.local_status.setText(f"Cannot load: {m.error}" if m.error else (m.source or str(m.path)))

    def _load_selected(self) -> None:
        m = self.selected_local()
        if m and m.loadable and not self.is_loaded(m):
            self.load_requested.emit(str(m.path))

    def _reveal_selected(self) -> None:
        m = self.selected_local()
        if m:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(m.path)))

    def _delete_selected(self) -> None:
        m = self.selected_local()
        if not m:
            return
        answer = QMessageBox.question(self, "Delete model",
                                      f"Delete {m.name} ({fmt_bytes(m.size_bytes)}) from disk?\n{m.path}")
        if answer != QMessageBox.Yes:
            return
        try:
            delete_model(m.path, self.models_dir)
        except (HubError, OSError) as exc:
            self.local_status.setText(str(exc))
        self.refresh_local()

    def _import_clicked(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Import a model folder")
        if folder:
            box = QMessageBox(QMessageBox.Question, "Import", f"Copy or move {folder} into the models folder?")
            copy = box.addButton("Copy", QMessageBox.AcceptRole)
            move = box.addButton("Move", QMessageBox.AcceptRole)
            box.addButton(QMessageBox.Cancel)
            box.exec()
            if box.clickedButton() in (copy, move):
                self.import_path(Path(folder), move=box.clickedButton() is move)

    def import_path(self, folder: Path, move: bool = False) -> None:
        self.local_status.setText(f"Importing {folder}…")
        self._run(lambda: import_folder(folder, move, self.models_dir),
                  lambda m: (self.refresh_local(), self.local_status.setText(f"Imported {m.name}.")),
                  lambda exc: self.local_status.setText(str(exc)))

    def _convert_clicked(self) -> None:
        form = ConvertForm(self)
        if form.exec() == QDialog.Accepted:
            self.start_conversion(*form.values())

    def start_conversion(self, from_hub: bool, source: str, bpw: float) -> None:
        """Check the source (on a worker thread: a Hub listing), then queue its download and conversion."""
        if not source:
            self._convert_refused(HubError("Enter a repository (owner/model) or pick a folder to convert."))
            return
        self.local_status.setText(f"Checking {source}…")
        manager = self.conversions.manager
        start = ((lambda: manager.start_hub(hub_source(self.hub(), source), bpw)) if from_hub
                 else (lambda: manager.start_local(Path(source), bpw)))

        def started(job) -> None:
            self.conversions.select(job.id)
            self.local_status.setText(f"Converting {source} to {job.id}: see Conversions below. It appears in "
                                      "this list once complete.")
        self._run(start, started, self._convert_refused)

    def _convert_refused(self, exc: BaseException) -> None:
        text = str(exc) if isinstance(exc, (HubError, OSError)) else f"Unexpected error: {exc}"
        self.local_status.setText(text)
        QMessageBox.warning(self, "Cannot convert", text)

    # ------------------------------------------------------------------------------------------
    # The Hub: search, branches with fit verdicts, download

    def _build_hub(self) -> QWidget:
        w = QWidget()
        self._searched = False                   # until then the list shows the recommended models
        self._suggested: dict[str, str] = {}     # repo id -> the branch recommended for this machine
        self.search_edit = QLineEdit()
        self.search_edit.setPlaceholderText("Search EXL2 models, e.g. Qwen3-30B-A3B")
        self.search_button = QPushButton("Search")
        self.signin_button = QPushButton("Sign in…")
        self.search_edit.returnPressed.connect(self.search)
        self.search_button.clicked.connect(self.search)
        self.signin_button.clicked.connect(self._sign_in)
        top = QHBoxLayout()
        top.addWidget(self.search_edit, 1)
        top.addWidget(self.search_button)
        top.addWidget(self.signin_button)
        self.hub_status = QLabel("Search the Hugging Face Hub for EXL2 quants.")
        self.hub_status.setWordWrap(True)
        self.repo_list = QListWidget(wordWrap=True)          # a recommendation's verdict is read whole
        self.repo_list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.repo_list.setResizeMode(QListWidget.ResizeMode.Adjust)
        self.repo_list.currentItemChanged.connect(lambda item, _: item and self.show_repo(item.data(Qt.UserRole)))
        self.quant_table = new_table(["Branch", "Bits/weight", "Download size", "Fit on this machine"])
        self.context_spin = QSpinBox()
        self.context_spin.setRange(512, 1 << 20)
        self.context_spin.setSingleStep(4096)
        self.context_spin.setValue(32768)
        self.kv_combo = QComboBox()
        self.kv_combo.addItems(KV_TYPES)
        self.context_spin.valueChanged.connect(lambda _: self._fill_quants())
        self.kv_combo.currentTextChanged.connect(lambda _: self._fill_quants())
        self.memory_label = QLabel()
        self.download_button = QPushButton("Download")
        self.download_button.clicked.connect(self._download_selected)
        self.quant_table.itemSelectionChanged.connect(self._quant_selection_changed)
        self._quant_selection_changed()
        opts = QHBoxLayout()
        opts.addWidget(QLabel("Context"))
        opts.addWidget(self.context_spin)
        opts.addWidget(QLabel("KV cache"))
        opts.addWidget(self.kv_combo)
        opts.addWidget(self.memory_label, 1)
        opts.addWidget(self.download_button)
        body = QHBoxLayout()
        body.addWidget(self.repo_list, 1)
        body.addWidget(self.quant_table, 2)
        v = QVBoxLayout(w)
        v.addLayout(top)
        v.addWidget(self.hub_status)
        v.addLayout(body, 1)
        v.addLayout(opts)
        self.set_memory(self.vram, self.ram, self.gpu)
        return w

    def hub(self) -> HubClient:
        if self._hub is None:
            self._hub = HubClient()
        return self._hub

    def set_memory(self, vram: float, ram: float, gpu: str) -> None:
        self.vram, self.ram, self.gpu = vram, ram, gpu
        self.memory_label.setText(f"{gpu}: {fmt_bytes(vram)} VRAM · {fmt_bytes(ram)} RAM" if vram > 0 else
                                  f"{gpu} · {fmt_bytes(ram)} RAM for the CPU engine")
        self._fill_quants()
        if not self._searched:
            self.show_recommended()

    def show_recommended(self) -> None:
        """Before any search: the models of the shipped list that fit this machine, best first."""
        try:
            recs = recommend(self.vram, self.ram, self.context_spin.value(), self.kv_combo.currentText())
        except (OSError, ValueError) as exc:       # a damaged installation: say so, search still works
            self.hub_status.setText(f"No recommendations: {exc}")
            return
        self.repo_list.clear()
        self._suggested = {r.candidate.repo: r.candidate.branch for r in recs}
        for r in recs:
            item = QListWidgetItem(f"★ {r.text}")
            item.setData(Qt.UserRole, r.candidate.repo)
            item.setToolTip(f"{r.candidate.repo} (branch {r.candidate.branch}); size estimated from the model's "
                            f"shape. {r.estimate.assumptions if r.estimate else ''}")
            self.repo_list.addItem(item)
        where = (f"{fmt_bytes(self.vram)} VRAM and {fmt_bytes(self.ram)} RAM" if self.vram > 0
                 else f"the CPU engine and {fmt_bytes(self.ram)} RAM")
        self.hub_status.setText(f"Recommended for this machine ({where}): pick one to see its quants, or search."
                                if recs else "None of the recommended models fits this machine: search the Hub.")

    def search(self) -> None:
        self._searched = True
        query = self.search_edit.text().strip()
        self.hub_status.setText(f"Searching for {query or 'EXL2 models'}…")
        self.search_button.setEnabled(False)
        self._run(lambda: self.hub().search(query), self._show_results, self._hub_failed)

    def _show_results(self, repos) -> None:
        self.search_button.setEnabled(True)
        self.repo_list.clear()
        for r in repos:
            item = QListWidgetItem(f"{r.repo_id}   ↓{r.downloads}" + ("   (gated)" if r.gated else ""))
            item.setData(Qt.UserRole, r.repo_id)
            self.repo_list.addItem(item)
        self.hub_status.setText(f"{len(repos)} repositories. Pick one to see its quants (one per branch)."
                                if repos else "No EXL2 repositories match.")

    def _hub_failed(self, exc: BaseException) -> None:
        self.search_button.setEnabled(True)
        self.hub_status.setText(str(exc) if isinstance(exc, HubError) else f"Unexpected error: {exc}")

    def show_repo(self, repo_id: str) -> None:
        self.hub_status.setText(f"Listing the branches of {repo_id}…")
        self._run(lambda: self.hub().quants(repo_id), lambda qs: self.show_quants(repo_id, qs), self._hub_failed)

    def show_quants(self, repo_id: str, quants: list[Quant]) -> None:
        self._quants = quants
        self.hub_status.setText(f"{repo_id}: {len(quants)} quants." if quants else
                                f"{repo_id} has no branch with safetensors weights.")
        self._fill_quants()
        suggested = self._suggested.get(repo_id)
        rows = [i for i, q in enumerate(quants) if q.branch == suggested]
        if rows:
            self.quant_table.selectRow(rows[0])

    def fit_text(self, q: Quant) -> tuple[str, str]:
        if q.access:
            return "gated: sign in to download it and to see its fit", q.access
        if q.refusal:
            return f"cannot import: {q.refusal}", q.refusal
        if not q.config or q.bpw is None:
            return "unknown: no config.json or bits per weight", ""
        try:      # an import: its experts at their own bits, the linears it kept in 16 bits at IMPORT_BPW
            rest = IMPORT_BPW if q.kind == "import" else q.bpw
            est = estimate_fit(ModelShape.from_config(q.config), rest, self.context_spin.value(),
                               self.kv_combo.currentText(), self.vram, self.ram, q.head_bits or 6.0, q.bpw)
        except FitError as exc:
            return f"unknown: {exc}", ""
        return est.text, est.assumptions

    def _fill_quants(self) -> None:
        if not hasattr(self, "quant_table"):
            return
        t = self.quant_table
        t.setRowCount(len(self._quants))
        for r, q in enumerate(self._quants):
            fit, why = self.fit_text(q)
            bits = f"{q.bpw:g}" if q.bpw else "?"
            if q.head_bits:
                bits += f" (head {q.head_bits:g})"
            if q.kind == "import":
                bits = f"{q.label} — imports in minutes"
            for c, text in enumerate([q.branch, bits, fmt_bytes(q.size_bytes), fit]):
                t.setItem(r, c, cell(text, why if c == 3 else q.access))
        if self._quants and not t.selectionModel().selectedRows():
            t.selectRow(0)

    def _quant_selection_changed(self) -> None:
        picked = bool(self.quant_table.selectionModel().selectedRows())
        self.download_button.setEnabled(picked)
        self.download_button.setToolTip("Download the selected branch into the models folder" if picked else
                                        "Pick a model on the left, then one of its branches, to download it")

    def _download_selected(self) -> None:
        rows = self.quant_table.selectionModel().selectedRows()
        if rows:
            self.start_download(self._quants[rows[0].row()])

    def start_download(self, quant: Quant) -> None:
        if quant.kind == "import":
            self.start_import(quant)
            return
        try:
            job = self.manager.enqueue(quant)
        except HubError as exc:                    # e.g. not enough disk space: refused before any byte
            self.hub_status.setText(str(exc))
            QMessageBox.warning(self, "Cannot download", str(exc))
            return
        self.hub_status.setText(f"Queued {job.repo_id} ({job.branch}): see Downloads.")

    def start_import(self, quant: Quant) -> None:
        """Download a GPTQ-family build and import it into EXL2 (refused in words, before any byte, where it
        cannot be: the field named)."""
        if quant.refusal:
            self._convert_refused(HubError(f"{quant.repo_id} cannot be imported: {quant.refusal}"))
            return
        try:
            job = self.conversions.manager.start_hub(source_files(quant, "import"), IMPORT_BPW, "import")
        except HubError as exc:
            self._convert_refused(exc)
            return
        self.conversions.select(job.id)
        self.hub_status.setText(f"Downloading {quant.repo_id} and importing it as {job.id}: see Conversions. It "
                                "appears in the model list once imported.")

    def _sign_in(self) -> None:
        token, ok = QInputDialog.getText(self, "Sign in to Hugging Face",
                                         "Access token (stored by huggingface_hub, never shown again):",
                                         QLineEdit.Password)
        if ok and token.strip():
            self.hub_status.setText("Checking the token…")
            self._run(lambda: sign_in(token),
                      lambda user: self.hub_status.setText(f"Signed in as {user}: gated and private repositories "
                                                           "you have access to can be downloaded now."),
                      self._hub_failed)

    # ------------------------------------------------------------------------------------------
    # A remote OpenAI-compatible server (vLLM, SGLang, TabbyAPI, llama.cpp, moedesk serve)

    def _build_remote(self, remote) -> QWidget:
        w = QWidget()
        self.remote_url = QLineEdit(remote.base_url if remote else "")
        self.remote_url.setPlaceholderText("http://gpu-box:8000/v1")
        self.remote_key = QLineEdit(remote.api_key or "" if remote else "", echoMode=QLineEdit.Password)
        self.remote_key.setPlaceholderText("API key, if the server needs one")
        self.remote_list_button = QPushButton("List models")
        self.remote_model = QComboBox(editable=True)
        if remote and remote.model:
            self.remote_model.addItem(remote.model)
        self.remote_use_button = QPushButton("Chat with this server")
        self.remote_status = QLabel("Chats stream from an OpenAI-compatible server instead of this computer's "
                                    "engine. Enter its address and list its models.")
        self.remote_status.setWordWrap(True)
        self.remote_list_button.clicked.connect(self.list_remote_models)
        self.remote_url.returnPressed.connect(self.list_remote_models)
        self.remote_use_button.clicked.connect(self._use_remote)
        grid = QGridLayout()
        for r, (label, widget) in enumerate((("Address", self.remote_url), ("API key", self.remote_key),
                                             ("Model", self.remote_model))):
            grid.addWidget(QLabel(label), r, 0)
            grid.addWidget(widget, r, 1)
        grid.addWidget(self.remote_list_button, 0, 2)
        grid.addWidget(self.remote_use_button, 2, 2)
        v = QVBoxLayout(w)
        v.addLayout(grid)
        v.addWidget(self.remote_status)
        v.addStretch(1)
        return w

    def _remote_address(self) -> Optional[str]:
        """The server address as typed, normalised; None (the reason shown) when it is not a usable URL."""
        from app.serve.remote import normalise_url
        try:
            return normalise_url(self.remote_url.text())
        except ValueError as exc:
            self.remote_status.setText(str(exc))
            return None

    def list_remote_models(self) -> None:
        from app.serve.remote import list_models
        url = self._remote_address()
        if url is None:
            return
        self.remote_url.setText(url)
        self.remote_status.setText(f"Asking {url} for its models…")
        self.remote_list_button.setEnabled(False)
        self._run(lambda: list_models(url, self.remote_key.text().strip() or None), self._show_remote_models,
                  self._remote_failed)

    def _show_remote_models(self, models: list) -> None:
        self.remote_list_button.setEnabled(True)
        current = self.remote_model.currentText()
        self.remote_model.clear()
        self.remote_model.addItems(models)
        if current in models:
            self.remote_model.setCurrentText(current)
        self.remote_status.setText(f"{len(models)} model(s) on this server. Pick one and press "
                                   "'Chat with this server'." if models else "The server lists no models.")

    def _remote_failed(self, exc: BaseException) -> None:
        self.remote_list_button.setEnabled(True)
        self.remote_status.setText(getattr(exc, "message", None) or str(exc))

    def _use_remote(self) -> None:
        from app.serve.remote import RemoteConfig
        url = self._remote_address()
        if url is None:
            return
        model = self.remote_model.currentText().strip()
        if not model:
            self.remote_status.setText("Pick a model first: 'List models' shows what the server has.")
            return
        self.remote_status.setText(f"Chats now stream from {model} at {url}.")
        self.remote_requested.emit(RemoteConfig(url, model, self.remote_key.text().strip() or None))

    # ------------------------------------------------------------------------------------------
    # Downloads

    def _build_downloads(self) -> QWidget:
        d = self.downloads = JobsPanel("Downloads", ["Model", "State", "Progress", "Speed", "Time left", "Details"],
                                       self.manager)
        self.download_table = d.table
        self.pause_button, self.resume_button, self.cancel_button = d.pause_button, d.resume_button, d.cancel_button
        return d

    def _on_download_event(self, p: DownloadProgress) -> None:
        row = self.downloads.show_progress(p.job_id, p.done_bytes, p.total_bytes,
                                           f"{fmt_bytes(p.done_bytes)} of {fmt_bytes(p.total_bytes)}")
        running = p.state is JobState.RUNNING
        eta = (f"{int(p.eta_s // 60)} min {int(p.eta_s % 60)} s" if p.eta_s is not None else "—") if running else ""
        self.downloads.show_texts(row, {1: p.state.value, 3: f"{fmt_bytes(p.speed_bps)}/s" if running else "",
                                        4: eta, 5: p.message}, p.message)
        self.downloads.set_state(p.job_id, p.state)
        if p.state is JobState.DONE:
            self.refresh_local()

    # ------------------------------------------------------------------------------------------
    # Worker threads: results come back through a queued signal

    def _run(self, fn: Callable, on_done: Callable, on_error: Callable) -> Future:
        future = self._pool.submit(fn)
        future.add_done_callback(lambda f: self._task_done.emit((on_done, on_error), f))
        return future

    def _finish_task(self, callbacks, future: Future) -> None:
        on_done, on_error = callbacks
        if future.cancelled():          # still queued when the dialog shut down: nothing to report
            return
        exc = future.exception()
        on_error(exc) if exc is not None else on_done(future.result())

    def closeEvent(self, event) -> None:
        self.hide()                     # downloads continue; the window owns this dialog
        event.ignore()

    def shutdown(self) -> None:
        self.manager.shutdown()
        self.conversions.manager.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)


@contextmanager
def screenshot_dialog(path: str | Path) -> Iterator[ModelManagerDialog]:
    """A model manager over an empty models folder on a 24 GB GPU, for `make screenshots`: what the block
    puts in it is saved as a PNG at `path` when the block ends."""
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as models:
        dialog = ModelManagerDialog(models_dir=Path(models))
        dialog.set_memory(24 * 1024 ** 3, 64 * 1024 ** 3, "NVIDIA GeForce RTX 4090")
        yield dialog
        dialog.show()
        app.processEvents()
        dialog.grab().save(str(out))
        dialog.shutdown()
        dialog.deleteLater()


def grab_model_manager(path: str | Path) -> Path:
    """A PNG of the model manager with a download in progress, for `make screenshots`.

    Needs no network: the dialog shows a listing of a repository with the real Qwen3-30B-A3B config and a
    download part-way, fed through the same slots a live session uses.
    """
    from app.hub.browse import RemoteFile

    config = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
              "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936}
    repo = "turboderp/Qwen3-30B-A3B-exl2"
    shape = ModelShape.from_config(config)

    def size(bpw: float) -> int:
        return exl2_size_bytes(shape, bpw, 6.0)
    quants = [Quant(repo, f"{bpw:.1f}bpw", "0" * 40, bpw, 6.0,
                    (RemoteFile("model.safetensors", size(bpw), "0" * 64, ""),), config)
              for bpw in (3.0, 4.0, 6.0, 8.0)]
    total = size(4.0)
    with screenshot_dialog(path) as dialog:
        dialog.tabs.setCurrentIndex(1)
        dialog.search_edit.setText("Qwen3-30B-A3B")
        dialog._searched = True                 # a search's results replace the recommendations
        dialog.repo_list.clear()
        item = QListWidgetItem(f"{repo}   ↓12840")
        item.setData(Qt.UserRole, repo)
        dialog.repo_list.addItem(item)
        dialog.repo_list.blockSignals(True)
        dialog.repo_list.setCurrentItem(item)
        dialog.repo_list.blockSignals(False)
        dialog.show_quants(repo, quants)
        dialog.quant_table.selectRow(1)
        dialog._on_download_event(DownloadProgress(f"{repo.replace('/', '--')}--4.0bpw", JobState.RUNNING,
                                                   int(total * 0.41), total, 48.2e6, total * 0.59 / 48.2e6,
                                                   "model-00002-of-00004.safetensors",
                                                   "Downloading model-00002-of-00004.safetensors"))
    return Path(path)


def grab_conversions(path) -> Path:
    """A PNG of the model manager converting a model, for `make screenshots`: no network, no converter;
    the events a live conversion sends are fed to the same slot."""
    with screenshot_dialog(path) as dialog:
        panel = dialog.conversions
        panel._on_event(ConvertProgress("Qwen3-8B-exl2-3.0bpw", JobState.PAUSED, "convert", 9, 36,
                                        "Paused after layer 9: press Resume to continue."))
        panel._on_event(ConvertProgress("SmolLM2-1.7B-Instruct-exl2-4.0bpw", JobState.RUNNING, "convert", 17, 24,
                                        "Converting: layer 17 of 24 done"))
        dialog.local_status.setText("Converting HuggingFaceTB/SmolLM2-1.7B-Instruct to "
                                    "SmolLM2-1.7B-Instruct-exl2-4.0bpw: see Conversions below. It appears in this "
                                    "list once complete.")
    return Path(path)
