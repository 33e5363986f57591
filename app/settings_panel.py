"""The settings dialog, generated from the option dataclasses' metadata (`runtime.options.describe`).

    panel = SettingsPanel(settings, active=client_loaded_options, has_model=True)
    panel.apply_requested.connect(on_apply)     # (Settings, reload: bool)
    client.loaded.connect(lambda ev: panel.show_applied(ev.applied))
    panel.set_draft_compatibility(check)        # check(target_dir, draft_dir) -> None | reason
    panel.set_target_model(path_of_loaded_model)
    panel.exec()

Groups: General (`app.settings.AppSettings`), Offload (`OffloadOptions`), Draft (`DraftOptions`), and
the default sampling for new conversations (`SamplingOptions`, stop strings excepted).
Each option shows its label, an editor, its one-line description with its default (as a visible
hint and as a tooltip), and a status: "needs reload" for a changed option whose metadata says
`reload` (compared with `active`, the options the loaded model runs with), or what the worker
reported for it in the `loaded` event's `applied` dict ("applied" / "ignored: why").
"Apply and reload" is offered when a reload is needed and a model is loaded.

The draft-model picker lists folders under `runtime.paths.models_dir()` that validate
(`runtime.modelfolder.validate` when present, else folders with a config.json). Once a target is
set (`set_target_model`), each is checked with the vocabulary rule: by default the model hub's
`app.hub.local.draft_compatibility`; `set_draft_compatibility` replaces it. Unusable models stay
listed, disabled, with the reason.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (QApplication, QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox,
                               QFrame, QGridLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QMessageBox, QPushButton,
                               QScrollArea, QSpinBox, QVBoxLayout, QWidget)

from app.settings import AppSettings, Settings
from app.chat.header import OVERFLOW_CHOICES
from app.wheel import scroll_past_inputs
from runtime import paths
from runtime.options import DraftOptions, LoadOptions, OffloadOptions, SamplingOptions, ServeOptions, describe

SPIN_MAX = 2**31 - 1        # QSpinBox's range is a 32-bit int; a larger option bound (the seed's) is cut to it

# (target dir, draft dir) -> None or the reason it cannot draft; `(ok, reason)` tuples are accepted too
DraftCompatibility = Callable[[Path, Path], Any]

LABELS = {
    "app.theme": "Theme", "app.show_gauges": "Show gauges", "app.unload_idle_minutes": "Unload when idle (minutes)",
    "offload.vram_budget_gb": "VRAM budget (GiB)", "offload.ram_budget_gb": "RAM budget (GiB)",
    "offload.cpu_threads": "CPU threads", "offload.kv_cache": "KV cache",
    "offload.context_length": "Context length", "offload.placement": "Expert placement",
    "offload.backend": "Engine",
    "draft.mode": "Speculative decoding", "draft.model": "Draft model",
    "draft.draft_tokens": "Draft tokens", "draft.adaptive": "Adaptive draft length",
    "sampling.top_p": "Top-p", "sampling.top_k": "Top-k", "sampling.min_p": "Min-p",
    "sampling.max_tokens": "Max tokens", "sampling.context_overflow": "When the chat is full",
    "server.enabled": "Local server", "server.port": "Port", "server.allow_other_devices": "Allow other devices",
    "server.max_queue": "Queue length", "server.allowed_origins": "Allowed origins",
    "server.allowed_hosts": "Allowed host names",
}
CHOICE_LABELS = {
    "app.theme": {"system": "Follow the system", "light": "Light", "dark": "Dark"},
    "offload.kv_cache": {"fp16": "FP16", "q8": "Q8", "q6": "Q6", "q4": "Q4"},
    "offload.placement": {"auto": "Auto", "vram": "All in VRAM", "cpu": "CPU experts", "stream": "Stream to GPU"},
    "offload.backend": {"auto": "Auto", "cuda": "GPU (CUDA)", "cpu": "CPU"},
    "draft.mode": {"off": "Off", "model": "Draft model", "mtp": "MTP head", "ngram": "N-gram"},
    "sampling.context_overflow": dict(OVERFLOW_CHOICES),
}
# Shown at the spin box's lowest value, which stands for None (or 0 where 0 means "automatic").
SPECIAL_TEXT = {"offload.vram_budget_gb": "All free VRAM", "offload.ram_budget_gb": "What is free",
                "offload.cpu_threads": "Automatic", "sampling.seed": "Random", "app.unload_idle_minutes": "Never",
                "sampling.top_k": "No limit"}
SERVER_KEY = "server_api_key"      # the local server's key, in app.secrets
HIDDEN = {"app.last_model", "app.remote_url", "app.remote_model", "sampling.stop"}
GROUPS = (("General", "app", AppSettings), ("Offload", "offload", OffloadOptions), ("Draft", "draft", DraftOptions),
          ("New conversations: sampling", "sampling", SamplingOptions),
          ("Local server (OpenAI-compatible API)", "server", ServeOptions))


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    problem: Optional[str] = None     # why it cannot be used as a draft; None when it can


def list_local_models(models_dir: Optional[Path] = None, target: Optional[Path] = None,
                      compatible: Optional[DraftCompatibility] = None) -> list[LocalModel]:
    """Model folders under `models_dir`, each with the reason it cannot serve as a draft (or None)."""
    root = Path(models_dir) if models_dir is not None else paths.models_dir()
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    validate = _validate_function()
    out = []
    for folder in folders:
        problem = None
        if validate is not None:
            try:
                validate(folder)
            except Exception as e:   # ModelFolderError names the file and the problem
                problem = str(e).replace(f"{folder}{os.sep}", "")    # the file, relative to its folder
        elif not (folder / "config.json").is_file():
            problem = "no config.json"
        if problem is None and target is not None:
            if folder.resolve() == Path(target).resolve():
                problem = "this is the loaded model"
            elif compatible is not None:
                problem = _problem(compatible(Path(target), folder))
        out.append(LocalModel(folder.name, folder, problem))
    return out


def _problem(verdict: Any) -> Optional[str]:
    """A compatibility verdict as "why not" text: None / "reason" / (ok, reason)."""
    if isinstance(verdict, tuple):
        ok, reason = verdict
        return None if ok else str(reason)
    return None if verdict is None else str(verdict)


def default_draft_compatibility() -> Optional[DraftCompatibility]:
    """The model hub's rule (same vocabulary size and tokenizer) when that module is present."""
    try:
        from app.hub.local import draft_compatibility
    except ImportError:
        return None
    return draft_compatibility


def _validate_function() -> Optional[Callable[[Path], Any]]:
    """`runtime.modelfolder.validate` when that module is present, else None (config.json rule)."""
    try:
        from runtime.modelfolder import validate
    except ImportError:
        return None
    return validate


def _fmt(path: str, value: Any) -> str:
    if value is None:
        return SPECIAL_TEXT.get(path, "none")
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ", ".join(value) or "none"
    if path in SPECIAL_TEXT and value == 0:
        return SPECIAL_TEXT[path]
    return CHOICE_LABELS.get(path, {}).get(value, str(value))


def _status_style(text: str) -> str:
    """Colours readable on light and dark themes: changes stand out, engine reports stay quiet."""
    if text in ("needs reload", "used at next load"):
        return "color: #d9822b; font-weight: bold;"
    if text == "applied":
        return "color: #3c9a5f;"
    return "color: gray; font-style: italic;" if text else ""


class OptionField:
    """One option's row: editor, status and hint, and how to read and write its value."""

    def __init__(self, path: str, tp: Any, default: Any, meta: dict, on_change: Callable[[], None]):
        self.path, self.default, self.meta = path, default, meta
        self.reload = bool(meta.get("reload"))
        self.optional = type(None) in typing.get_args(tp)
        base = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if self.optional else tp
        self.label = QLabel(LABELS.get(path, path.split(".")[-1].replace("_", " ").capitalize()))
        self.status = QLabel("")
        self.status.setObjectName("optionStatus")
        self.status.setWordWrap(True)          # the engine's word on an option can be a sentence
        hint = f"{meta.get('help', '')} Default: {_fmt(path, default)}."
        self.hint = QLabel(hint)
        self.hint.setWordWrap(True)
        self.hint.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.editor = self._make_editor(base, meta, on_change)
        for w in (self.label, self.editor, self.hint):
            w.setToolTip(hint)

    def _make_editor(self, base: Any, meta: dict, on_change: Callable[[], None]) -> QWidget:
        if path_is_model(self.path):
            ed = QComboBox()
            ed.currentIndexChanged.connect(on_change)
        elif meta.get("choices"):
            ed = QComboBox()
            for c in meta["choices"]:
                ed.addItem(CHOICE_LABELS.get(self.path, {}).get(c, c), c)
            ed.currentIndexChanged.connect(on_change)
        elif base is bool:
            ed = QCheckBox()
            ed.toggled.connect(on_change)
        elif base is int:
            ed = QSpinBox()
            lo = int(meta["min"]) if meta.get("min") is not None else 0
            hi = int(meta["max"]) if meta.get("max") is not None else 1 << 24
            ed.setRange(lo - 1 if self.optional else lo, min(hi, SPIN_MAX))     # a spin box holds 32 bits
            ed.valueChanged.connect(on_change)
        elif base is float:
            ed = QDoubleSpinBox()
            fine = meta.get("max") is not None and meta["max"] <= 5      # probabilities, temperature
            ed.setDecimals(2 if fine else 1)
            ed.setSingleStep(0.05 if fine else 0.5)
            lo = float(meta["min"]) if meta.get("min") is not None else 0.0
            ed.setRange(lo - 0.5 if self.optional else lo, float(meta["max"]) if meta.get("max") is not None else 4096.0)
            ed.valueChanged.connect(on_change)
        elif typing.get_origin(base) is tuple:          # a list of texts: written separated by commas
            ed = QLineEdit(placeholderText="none")
            ed.textChanged.connect(on_change)
        else:
            raise TypeError(f"{self.path}: no editor for options of type {base!r}")
        if isinstance(ed, (QSpinBox, QDoubleSpinBox)) and self.path in SPECIAL_TEXT:
            ed.setSpecialValueText(SPECIAL_TEXT[self.path])
        return ed

    def set_shown(self, shown: bool) -> None:
        for w in (self.label, self.editor, self.status, self.hint):
            w.setVisible(shown)

    def value(self) -> Any:
        ed = self.editor
        if isinstance(ed, QComboBox):
            return ed.currentData()
        if isinstance(ed, QCheckBox):
            return ed.isChecked()
        if isinstance(ed, QLineEdit):
            return tuple(part.strip() for part in ed.text().replace("\n", ",").split(",") if part.strip())
        v = ed.value()
        if self.optional and v <= ed.minimum():
            return None
        lo = self.meta.get("min")
        return max(v, type(v)(lo)) if lo is not None else v   # typed values below the minimum

    def set_value(self, value: Any) -> None:
        ed = self.editor
        if isinstance(ed, QComboBox):
            i = ed.findData(value)
            if i < 0:     # a saved draft model that is gone: keep it visible, marked
                ed.addItem(f"{value} (not found)", value)
                i = ed.count() - 1
            ed.setCurrentIndex(i)
        elif isinstance(ed, QCheckBox):
            ed.setChecked(bool(value))
        elif isinstance(ed, QLineEdit):
            ed.setText(", ".join(value))
        else:
            ed.setValue(ed.minimum() if value is None else value)


def path_is_model(path: str) -> bool:
    return path == "draft.model"


def fill_draft_models(f: OptionField, models: list[LocalModel]) -> None:
    """The draft-model picker's entries: "(none)", then `models`, unusable ones disabled with the reason;
    the chosen one stays chosen."""
    combo: QComboBox = f.editor  # type: ignore[assignment]
    current = f.value() if combo.count() else None
    combo.clear()
    combo.addItem("(none)", None)
    for m in models:
        combo.addItem(m.name if m.problem is None else f"{m.name} — {m.problem}", m.name)
        item = combo.model().item(combo.count() - 1)
        if m.problem is not None:
            item.setEnabled(False)
            item.setToolTip(m.problem)
    f.set_value(current)


class SettingsPanel(QDialog):
    apply_requested = Signal(object, bool)   # (Settings, reload)

    def __init__(self, settings: Settings, active: Optional[LoadOptions] = None, has_model: bool = False,
                 parent: Optional[QWidget] = None, models_dir: Optional[Path] = None):
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self._base = settings
        self._active = active if active is not None else settings.load
        self._has_model = has_model
        self._models_dir = models_dir
        self._target: Optional[Path] = None
        self._compatible: Optional[DraftCompatibility] = default_draft_compatibility()
        self._applied: dict[str, str] = {}
        self._placement_note = ""                  # the engine's live word on the expert path (telemetry)
        self._loading = True
        self.fields: dict[str, OptionField] = {}
        lay = QVBoxLayout(self)
        body = QWidget()
        body_lay = QVBoxLayout(body)
        for title, key, cls in GROUPS:
            body_lay.addWidget(self._group(title, key, cls))
        body_lay.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidget(body)
        lay.addWidget(scroll)
        self.resize(760, 640)
        self.applied_note = QLabel("")
        self.applied_note.setWordWrap(True)
        lay.addWidget(self.applied_note)
        buttons = QDialogButtonBox()
        self.reload_button = QPushButton("Apply and reload")
        self.apply_button = QPushButton("Apply")
        self.defaults_button = QPushButton("Restore defaults")
        buttons.addButton(self.reload_button, QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.addButton(self.apply_button, QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.addButton(self.defaults_button, QDialogButtonBox.ButtonRole.ResetRole)
        buttons.addButton(QDialogButtonBox.StandardButton.Cancel)
        self.reload_button.clicked.connect(lambda: self._apply(reload=True))
        self.apply_button.clicked.connect(lambda: self._apply(reload=False))
        self.defaults_button.clicked.connect(lambda: self.set_settings(Settings()))
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)
        self.refresh_models()
        self.set_settings(settings)
        scroll_past_inputs(self)

    def _group(self, title: str, key: str, cls: type) -> QGroupBox:
        box = QGroupBox(title)
        grid = QGridLayout(box)
        hints = typing.get_type_hints(cls)
        row = 0
        for name, default, meta in describe(cls):
            path = f"{key}.{name}"
            if path in HIDDEN:
                continue
            f = self.fields[path] = OptionField(path, hints[name], default, meta, self._on_changed)
            grid.addWidget(f.label, row, 0)
            grid.addWidget(f.editor, row, 1)
            grid.addWidget(f.status, row, 2)
            grid.addWidget(f.hint, row + 1, 1, 1, 2)
            row += 2
        grid.setColumnStretch(2, 1)              # the status column takes what is left, and wraps in it
        if key == "server":
            self._server_rows(grid, row)
        return box

    def _server_rows(self, grid: QGridLayout, row: int) -> None:
        """The server's API key (kept in app.secrets, not in settings.json) and its address, with Copy."""
        from app.secrets import get_secret, new_api_key
        self.key_edit = QLineEdit(get_secret(SERVER_KEY) or "", echoMode=QLineEdit.EchoMode.Password,
                                  placeholderText="no key: only this computer can connect")
        self.key_edit.textChanged.connect(self._on_changed)
        new_key = QPushButton("New key")
        new_key.clicked.connect(lambda: (self.key_edit.setText(new_api_key()),
                                         self.key_edit.setEchoMode(QLineEdit.EchoMode.Normal)))
        copy_key = QPushButton("Copy key")
        copy_key.clicked.connect(lambda: QApplication.clipboard().setText(self.key_edit.text()))
        self.key_status = QLabel("")
        line = QHBoxLayout()
        for w in (self.key_edit, new_key, copy_key):
            line.addWidget(w)
        grid.addWidget(QLabel("API key"), row, 0)
        grid.addLayout(line, row, 1)
        grid.addWidget(self.key_status, row, 2)
        hint = QLabel("Clients send it as 'Authorization: Bearer KEY'. Required when other devices are allowed. "
                      "Kept in the app's secrets file, readable only by you.")
        hint.setWordWrap(True)
        hint.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        grid.addWidget(hint, row + 1, 1, 1, 2)
        self.address = QLabel("The local server is off.")
        self.address.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        copy_address = QPushButton("Copy address")
        copy_address.clicked.connect(lambda: QApplication.clipboard().setText(self.address.text()))
        line = QHBoxLayout()
        line.addWidget(self.address, 1)
        line.addWidget(copy_address)
        grid.addWidget(QLabel("Address"), row + 2, 0)
        grid.addLayout(line, row + 2, 1)

    def set_server_address(self, text: str) -> None:
        """What the running server says: its address (base URL for clients), or why it is not running."""
        self.address.setText(text)

    # -- public -------------------------------------------------------------------------------
    def set_settings(self, settings: Settings) -> None:
        self._loading = True
        for path, f in self.fields.items():
            group, name = path.split(".")
            f.set_value(getattr(self._section(settings, group), name))
        self._loading = False
        self._on_changed()

    def settings(self) -> Settings:
        """The edited settings (validated by the dataclasses' types and the editors' ranges)."""
        groups: dict[str, dict[str, Any]] = {"app": {}, "offload": {}, "draft": {}, "sampling": {}, "server": {}}
        for path, f in self.fields.items():
            group, name = path.split(".")
            groups[group][name] = f.value()
        base = self._base
        load = LoadOptions(offload=dataclasses.replace(base.load.offload, **groups["offload"]),
                           draft=dataclasses.replace(base.load.draft, **groups["draft"]))
        return dataclasses.replace(base, app=dataclasses.replace(base.app, **groups["app"]), load=load,
                                   sampling=dataclasses.replace(base.sampling, **groups["sampling"]),
                                   server=dataclasses.replace(base.server, **groups["server"]))

    def needs_reload(self) -> list[str]:
        """Paths of changed options that take effect only after the model is reloaded."""
        out = []
        for path, f in self.fields.items():
            group, name = path.split(".")
            if f.reload and group in ("offload", "draft") and f.value() != getattr(self._section_load(self._active, group), name):
                out.append(path)
        return out

    def set_active(self, active: LoadOptions, has_model: bool = True) -> None:
        self._active, self._has_model = active, has_model
        self._on_changed()

    def show_applied(self, applied: dict[str, str]) -> None:
        """What the worker did with each option (the `loaded` event's `applied` dict)."""
        self._applied = dict(applied)
        known = {p for p in self.fields} | {p.split(".", 1)[1] for p in self.fields}
        others = [f"{k}: {v}" for k, v in sorted(applied.items()) if k not in known]
        # Options that do not apply to the loaded model on this engine are not shown (changing one
        # would do nothing); the note names them.
        unused = []
        for path, f in self.fields.items():
            reported = applied.get(path, applied.get(path.split(".", 1)[1], ""))
            f.set_shown(not reported.startswith("ignored"))
            if reported.startswith("ignored"):
                unused.append(f.label.text())
        notes = (["Not shown, as they do not apply to this model on this engine: " + ", ".join(unused) + "."]
                 if unused else []) + (["Engine also reported — " + "; ".join(others)] if others else [])
        self.applied_note.setText("\n".join(notes))
        self._on_changed()

    def show_telemetry(self, event: Any) -> None:
        """Live engine figures (a `telemetry` event): which expert path runs and why, beside the
        placement option (the CUDA engine's `placement_decision`, in the event's `extra`)."""
        decision = (getattr(event, "extra", None) or {}).get("placement_decision")
        summary = decision.get("summary") if isinstance(decision, dict) else None
        if summary and summary != self._placement_note:
            self._placement_note = summary
            self._on_changed()

    def set_draft_compatibility(self, check: Optional[DraftCompatibility]) -> None:
        self._compatible = check
        self.refresh_models()

    def set_target_model(self, path: Optional[Path]) -> None:
        self._target = Path(path) if path is not None else None
        self.refresh_models()

    def refresh_models(self) -> None:
        """Re-list the local models for the draft picker; unusable ones are shown disabled with the reason."""
        was_loading, self._loading = self._loading, True
        fill_draft_models(self.fields["draft.model"], list_local_models(self._models_dir, self._target, self._compatible))
        self._loading = was_loading
        if not was_loading:
            self._on_changed()

    # -- internals ------------------------------------------------------------------------------
    @staticmethod
    def _section(settings: Settings, group: str) -> Any:
        if group in ("app", "sampling", "server"):
            return getattr(settings, group)
        return SettingsPanel._section_load(settings.load, group)

    @staticmethod
    def _section_load(load: LoadOptions, group: str) -> Any:
        return load.offload if group == "offload" else load.draft

    def _on_changed(self, *_: Any) -> None:
        if self._loading:
            return
        reload = set(self.needs_reload())
        for path, f in self.fields.items():
            text = self._status_text(path, f, path in reload)
            f.status.setText(text)
            f.status.setStyleSheet(_status_style(text))
        mode = self.fields["draft.mode"].value()
        self.fields["draft.model"].editor.setEnabled(mode == "model")
        for p in ("draft.draft_tokens", "draft.adaptive"):
            self.fields[p].editor.setEnabled(mode != "off")
        missing = mode == "model" and self.fields["draft.model"].value() is None
        if missing:
            self.fields["draft.model"].status.setText("choose a draft model")
            self.fields["draft.model"].status.setStyleSheet(_status_style("needs reload"))
        no_key = self.fields["server.allow_other_devices"].value() and not self.key_edit.text().strip()
        self.key_status.setText("needed for other devices" if no_key else "")
        self.key_status.setStyleSheet(_status_style("needs reload") if no_key else "")
        missing = missing or no_key or self._bad_server_lists()
        self.apply_button.setEnabled(not missing)
        self.reload_button.setEnabled(bool(reload) and self._has_model and not missing)
        self.reload_button.setVisible(self._has_model)

    def _bad_server_lists(self) -> bool:
        """Mark an allowed origin or host that the server would refuse; True when there is one."""
        from app.serve.guard import parse_hosts, parse_origins
        bad = False
        for path, parse in (("server.allowed_origins", parse_origins), ("server.allowed_hosts", parse_hosts)):
            f = self.fields[path]
            try:
                parse(f.value())
            except ValueError as e:
                f.status.setText(str(e))
                f.status.setStyleSheet(_status_style("needs reload"))
                bad = True
        return bad

    def _status_text(self, path: str, f: OptionField, needs_reload: bool) -> str:
        if needs_reload:
            return "needs reload" if self._has_model else "used at next load"
        reported = self._applied.get(path, self._applied.get(path.split(".", 1)[1]))
        if path == "offload.placement" and self._placement_note:
            return f"applied: {self._placement_note}"       # live: it may change while the model runs
        return reported or ""

    def _apply(self, reload: bool) -> None:
        from app.secrets import get_secret, set_secret
        key = self.key_edit.text().strip() or None
        if key != get_secret(SERVER_KEY):
            try:
                set_secret(SERVER_KEY, key)
            except OSError as e:                         # unreadable secrets file: never overwritten
                QMessageBox.warning(self, "The API key was not saved", str(e))
                return
        self.apply_requested.emit(self.settings(), reload and bool(self.needs_reload()))
        self.accept()
