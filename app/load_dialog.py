"""A model's load options, chosen before loading it (the chat header's model picker, ⚙): context length,
GPU budget and expert placement, RAM budget, KV-cache width, CPU threads, engine, and speculative
decoding (off, n-gram, a draft model, the model's MTP head; draft tokens). These are the load command's
own options (`runtime.options.OffloadOptions` and `DraftOptions`), edited with the settings panel's
editors; the engine says after loading which ones it applied (shown here for the loaded model).

    dialog = LoadDialog("demo", options, defaults=settings.load, memory=(vram, ram, gpu), engine="cuda")
    dialog.load_requested.connect(on_load)       # (model, LoadOptions, remember: bool)
    dialog.save_requested.connect(on_save)       # (model, LoadOptions): remember without loading
    dialog.open()

The fit estimate under the options (`fit_note`, from `app.hub.fit.estimate_fit` and the folder's
config.json and bits per weight) follows every change. "Remember for this model" keeps the options in
`app.model_options` (the next load of this model uses them); options equal to the Settings' defaults
are not kept, so later changes to the defaults reach the model.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from PySide6.QtCore import Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QGridLayout, QGroupBox, QLabel, QPushButton,
                               QSpinBox, QVBoxLayout, QWidget)

from app.hub.fit import GB, FitError, ModelShape, Verdict, estimate_fit
from app.settings_panel import OptionField, default_draft_compatibility, fill_draft_models, list_local_models
from app.wheel import scroll_past_inputs
from runtime import paths
from runtime.modelfolder import FolderInfo, flat_config, validate
from runtime.options import DraftOptions, LoadOptions, OffloadOptions, describe
from runtime.reference import DEFAULT_PRECISION

HEAD_BITS = 6.0            # the EXL2 converter's output head (CONVERT_HEAD_BITS); the estimate's default
CPU_BYTES_PER_WEIGHT = {"int8": 1.0, "bfloat16": 2.0, "float32": 4.0}     # the CPU reference engine's weights
GROUPS = (("Memory and placement", "offload", OffloadOptions,
           ("context_length", "vram_budget_gb", "placement", "ram_budget_gb", "kv_cache", "cpu_threads", "backend")),
          ("Speculative decoding", "draft", DraftOptions, ("mode", "model", "draft_tokens", "adaptive")))
MOE_ONLY = ("offload.placement", "offload.ram_budget_gb")     # what a model without experts has no use for
GPU_ONLY = ("offload.vram_budget_gb", "offload.kv_cache") + MOE_ONLY    # what the CPU engine does not take


@dataclass(frozen=True)
class FitNote:
    words: str
    ok: Optional[bool]          # None: unknown
    detail: str = ""            # the assumptions (tooltip)


def on_cpu(off: OffloadOptions, engine: str) -> bool:
    """Whether the CPU reference engine runs the model (`engine`: what "auto" picks here)."""
    return off.backend == "cpu" or (off.backend == "auto" and engine != "cuda")


def fit_note(info: FolderInfo, off: OffloadOptions, vram: float, ram: float, engine: str,
             draft_bytes: float = 0.0) -> FitNote:
    """Will `info`'s model load with `off` on this machine (`vram`, `ram` in bytes; `engine`: what "auto"
    picks here, "cuda" or "cpu")? An estimate in words."""
    try:
        shape = ModelShape.from_config(info.config)
    except FitError as e:
        return FitNote(f"Fit unknown: {e}", None)
    if on_cpu(off, engine):
        per_weight = CPU_BYTES_PER_WEIGHT.get(DEFAULT_PRECISION, 1.0)
        need = shape.total_params() * per_weight
        ok = need <= ram
        return FitNote(f"CPU engine: every weight in RAM as {DEFAULT_PRECISION}, about {need / GB:.1f} GiB of "
                       f"{ram / GB:.0f} GiB" + ("" if ok else " — does not fit") + ". The GPU and RAM budgets, KV "
                       "cache width and placement do not apply to it.", ok)
    bpw = info.bits_per_weight if 1.0 <= info.bits_per_weight <= 16.0 else 16.0
    budget = min(off.vram_budget_gb * GB, vram) if off.vram_budget_gb is not None else vram
    try:
        est = estimate_fit(shape, bpw, off.context_length, off.kv_cache, budget - draft_bytes, ram, HEAD_BITS)
    except FitError as e:
        return FitNote(f"Fit unknown: {e}", None)
    used = est.gpu_fixed_bytes + est.expert_bytes - est.experts_in_ram_bytes + draft_bytes
    of = f"VRAM {min(used, budget) / GB:.1f} of {budget / GB:.1f} GiB" + (" (budget)" if off.vram_budget_gb else "")
    kv = f"KV cache {est.kv_bytes / GB:.2f} GiB"
    draft = f", draft model {draft_bytes / GB:.1f} GiB" if draft_bytes else ""
    detail = est.assumptions + (f" The draft model's {draft_bytes / GB:.1f} GiB are on the GPU too." if draft_bytes else "")
    if off.placement == "vram" and est.verdict is Verdict.FITS_OFFLOAD:
        short = est.experts_in_ram_bytes
        return FitNote(f"Does not fit with every expert in VRAM: needs {short / GB:.1f} GiB more VRAM ({kv}{draft}). "
                       "Choose Auto placement to offload experts.", False, detail)
    if off.ram_budget_gb is not None and est.experts_in_ram_bytes > off.ram_budget_gb * GB:
        return FitNote(f"Does not fit the RAM budget: {est.experts_in_ram_bytes / GB:.1f} GiB of experts for "
                       f"{off.ram_budget_gb:g} GiB ({of}, {kv}{draft}).", False, detail)
    ok = est.verdict is not Verdict.DOES_NOT_FIT
    words = est.text[0].upper() + est.text[1:]
    return FitNote(f"{words} — {of}, {kv}{draft}.", ok, detail)


def folder_facts(info: FolderInfo) -> str:
    """One line about the model: architecture, size, bits per weight, experts, longest context."""
    bits = [info.architecture, f"{info.size_bytes / GB:.1f} GiB on disk"]
    if info.bits_per_weight:
        bits.append(f"{info.bits_per_weight:.2f} bits per weight")
    if info.num_experts:
        bits.append(f"{info.num_experts} experts, {info.experts_per_token} per token")
    longest = max_context(info)
    if longest:
        bits.append(f"trained for up to {longest:,} tokens of context")
    return " · ".join(bits)


def max_context(info: FolderInfo) -> Optional[int]:
    value = flat_config(info.config).get("max_position_embeddings")
    return value if type(value) is int and value > 0 else None


class LoadDialog(QDialog):
    load_requested = Signal(str, object, bool)     # model, LoadOptions, remember
    save_requested = Signal(str, object)           # model, LoadOptions: remember, do not load

    def __init__(self, model: str, options: LoadOptions, defaults: LoadOptions, *, remembered: bool = False,
                 loaded: bool = False, applied: Optional[dict[str, str]] = None,
                 memory: tuple[float, float, str] = (0.0, 0.0, ""), engine: str = "cpu",
                 models_dir: Optional[Path] = None, info: Optional[FolderInfo] = None,
                 parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.model, self.defaults, self.loaded = model, defaults, loaded
        self.vram, self.ram, gpu = memory
        self.engine = engine
        self._draft_sizes: dict[str, float] = {}
        self._models_dir = models_dir
        name = paths.display_name(model)
        self.setWindowTitle(f"Load options — {name}")
        self.heading = QLabel(f"<b>{name}</b>")
        self.facts = QLabel(wordWrap=True)
        self.facts.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.info: Optional[FolderInfo] = info       # the folder's facts (default: read from it now)
        if info is None:
            try:
                self.info = validate(paths.resolve_model(model))
            except Exception as e:          # the folder names the file and the problem
                self.facts.setText(f"This model cannot be checked: {e}")
        if self.info is not None:
            self.facts.setText(folder_facts(self.info))
        machine = (f"This computer: {gpu}, {self.vram / GB:.0f} GiB VRAM, " if engine == "cuda" and self.vram
                   else "This computer: no NVIDIA GPU in use (the CPU engine runs models), ")
        self.machine = QLabel(machine + f"{self.ram / GB:.0f} GiB RAM.")
        self.machine.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.fields: dict[str, OptionField] = {}
        self._applied = dict(applied or {})
        self._loading = True
        lay = QVBoxLayout(self)
        for w in (self.heading, self.facts, self.machine):
            lay.addWidget(w)
        for title, key, cls, order in GROUPS:
            lay.addWidget(self._group(title, key, cls, order))
        self.fit = QLabel(wordWrap=True)
        self.fit.setObjectName("fitEstimate")
        lay.addWidget(self.fit)
        self.remember = QCheckBox("Remember these options for this model", checked=True)
        self.remember.setToolTip("Next time this model loads (from the picker, at start-up, or by the server), "
                                 "these options are used instead of the defaults in Settings.")
        lay.addWidget(self.remember)
        self.origin = QLabel()
        self.origin.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        lay.addWidget(self.origin)
        buttons = QDialogButtonBox()
        self.load_button = QPushButton("Reload with these options" if loaded else "Load")
        self.load_button.setDefault(True)
        self.save_button = QPushButton("Save")
        self.save_button.setToolTip("Remember the options without loading the model now")
        self.defaults_button = QPushButton("Use defaults")
        self.defaults_button.setToolTip("The load options from Settings (Offload and Draft)")
        buttons.addButton(self.load_button, QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.addButton(self.save_button, QDialogButtonBox.ButtonRole.ApplyRole)
        buttons.addButton(self.defaults_button, QDialogButtonBox.ButtonRole.ResetRole)
        buttons.addButton(QDialogButtonBox.StandardButton.Cancel)
        self.load_button.clicked.connect(self._load)
        self.save_button.clicked.connect(self._save)
        self.defaults_button.clicked.connect(lambda: self.set_options(self.defaults))
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)
        self.origin.setText("Remembered for this model." if remembered else "Now: the defaults from Settings.")
        self._fill_drafts()
        self.set_options(options)
        scroll_past_inputs(self)

    def _group(self, title: str, key: str, cls: type, order: tuple[str, ...]) -> QGroupBox:
        box = QGroupBox(title)
        grid = QGridLayout(box)
        hints = typing.get_type_hints(cls)
        described = {name: (default, meta) for name, default, meta in describe(cls)}
        for row, name in enumerate(order):
            default, meta = described[name]
            path = f"{key}.{name}"
            f = self.fields[path] = OptionField(path, hints[name], default, meta, self._changed)
            for w in (f.label, f.editor):
                w.setToolTip(f.hint.text())
            grid.addWidget(f.label, row, 0)
            grid.addWidget(f.editor, row, 1)
            grid.addWidget(f.status, row, 2)
        grid.setColumnStretch(1, 1)
        if key == "draft":
            self.fields["draft.mode"].label.setText("Draft with")
            drafts: QComboBox = self.fields["draft.model"].editor        # type: ignore[assignment]
            drafts.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            drafts.setMinimumContentsLength(24)     # a long "name — why it cannot draft" must not widen the dialog
            return box
        longest = max_context(self.info) if self.info is not None else None
        if longest:
            spin: QSpinBox = self.fields["offload.context_length"].editor     # type: ignore[assignment]
            spin.setSuffix(f"  (model: up to {longest:,})")
        self.no_experts = QLabel("This model has no experts: expert placement and the RAM budget do not apply.")
        self.no_experts.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.has_experts = self.info is None or bool(self.info.num_experts)
        self.no_experts.setVisible(not self.has_experts)
        grid.addWidget(self.no_experts, len(order), 0, 1, 3)
        return box

    def _fill_drafts(self) -> None:
        target = paths.resolve_model(self.model)
        fill_draft_models(self.fields["draft.model"],
                          list_local_models(self._models_dir, target, default_draft_compatibility()))

    # -- values ---------------------------------------------------------------------------------
    def set_options(self, options: LoadOptions) -> None:
        self._loading = True
        for path, f in self.fields.items():
            group, name = path.split(".")
            f.set_value(getattr(options.offload if group == "offload" else options.draft, name))
        self._loading = False
        self._changed()

    def options(self) -> LoadOptions:
        values: dict[str, dict[str, Any]] = {"offload": {}, "draft": {}}
        for path, f in self.fields.items():
            group, name = path.split(".")
            values[group][name] = f.value()
        return LoadOptions(offload=dataclasses.replace(self.defaults.offload, **values["offload"]),
                           draft=dataclasses.replace(self.defaults.draft, **values["draft"]))

    def _draft_bytes(self, draft: DraftOptions) -> float:
        if draft.mode != "model" or not draft.model:
            return 0.0
        if draft.model not in self._draft_sizes:
            try:
                self._draft_sizes[draft.model] = float(validate(paths.resolve_model(draft.model)).size_bytes)
            except Exception:
                self._draft_sizes[draft.model] = 0.0
        return self._draft_sizes[draft.model]

    def _changed(self, *_: Any) -> None:
        if self._loading:
            return
        opts = self.options()
        mode = opts.draft.mode
        self.fields["draft.model"].editor.setEnabled(mode == "model")
        for p in ("draft.draft_tokens", "draft.adaptive"):
            self.fields[p].editor.setEnabled(mode != "off")
        cpu = on_cpu(opts.offload, self.engine)
        for p in GPU_ONLY:
            self.fields[p].editor.setEnabled(not cpu and (self.has_experts or p not in MOE_ONLY))
        for path, f in self.fields.items():
            reported = self._applied.get(path, "") if self.loaded else ""
            f.status.setText(reported if len(reported) <= 40 else reported[:39] + "…")
            f.status.setToolTip(reported)
        missing = mode == "model" and not opts.draft.model
        if missing:
            self.fields["draft.model"].status.setText("choose a draft model")
        if self.info is None:
            note = FitNote("Fit unknown: the model folder could not be read.", None)
        else:
            note = fit_note(self.info, opts.offload, self.vram, self.ram, self.engine, self._draft_bytes(opts.draft))
        self.fit.setText(("✓ " if note.ok else "⚠ " if note.ok is False else "") + note.words)
        self.fit.setToolTip(note.detail)
        self.fit.setStyleSheet("" if note.ok is not False else "color: #d1242f;")
        self.fit_ok = note.ok
        self.load_button.setEnabled(not missing and self.info is not None)
        self.save_button.setEnabled(not missing)

    def _load(self) -> None:
        self.load_requested.emit(self.model, self.options(), self.remember.isChecked())
        self.accept()

    def _save(self) -> None:
        self.save_requested.emit(self.model, self.options())
        self.accept()


def grab_load_dialog(path, model: str, memory=(24 * GB, 64 * GB, "NVIDIA GeForce RTX 4090"),
                     options: Optional[LoadOptions] = None, info: Optional[FolderInfo] = None) -> Path:
    """A PNG of the load dialog for `model` (or a staged one, `info`) on a staged machine (`make screenshots`)."""
    from PySide6.QtWidgets import QApplication
    app = QApplication.instance() or QApplication([])
    dialog = LoadDialog(model, options or LoadOptions(), LoadOptions(), memory=memory, engine="cuda", info=info)
    dialog.resize(720, dialog.sizeHint().height())
    dialog.show()
    app.processEvents()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    dialog.grab().save(str(out))
    dialog.close()
    dialog.deleteLater()
    return out
