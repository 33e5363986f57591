"""Per-conversation settings: system prompt and sampling, with named presets.

The fields come from `runtime.options.SamplingOptions` (defaults, ranges and one-line descriptions
live there); this dialog only lays them out. Presets are stored by name in the conversation store.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFormLayout, QHBoxLayout,
                               QInputDialog, QLabel, QMessageBox, QPlainTextEdit, QPushButton, QSpinBox,
                               QVBoxLayout, QWidget)

from app.store import Store
from app.wheel import scroll_past_inputs
from runtime.options import OptionError, SamplingOptions, describe, from_dict

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed")
LABELS = {"temperature": "Temperature", "top_p": "Top-p", "top_k": "Top-k", "min_p": "Min-p",
          "repetition_penalty": "Repetition penalty", "max_tokens": "Max tokens", "seed": "Seed"}
NO_PRESET = "(no preset)"


class SamplingForm(QWidget):
    """One spin box per sampling option, with its description as tooltip."""

    def __init__(self, parent=None):
        super().__init__(parent)
        form = QFormLayout(self)
        self.editors: dict[str, QWidget] = {}
        meta = {name: (default, m) for name, default, m in describe(SamplingOptions)}
        for name in FIELDS:
            default, m = meta[name]
            if name == "seed":
                w = QSpinBox(minimum=-1, maximum=2**31 - 1, specialValueText="random")
            elif isinstance(default, int):
                w = QSpinBox(minimum=int(m["min"] or 0), maximum=int(m["max"] or 1_000_000))
            else:
                w = QDoubleSpinBox(minimum=m["min"] or 0.0, maximum=m["max"] or 100.0, decimals=2, singleStep=0.05)
            w.setToolTip(m["help"])
            label = QLabel(LABELS[name])
            label.setToolTip(m["help"])
            form.addRow(label, w)
            self.editors[name] = w
        self.set_values(SamplingOptions())

    def set_values(self, s: SamplingOptions) -> None:
        for name, w in self.editors.items():
            v = getattr(s, name)
            w.setValue(-1 if v is None else v)

    def values(self, base: SamplingOptions = SamplingOptions()) -> SamplingOptions:
        data: dict[str, Any] = {}
        for name, w in self.editors.items():
            v = w.value()
            data[name] = None if name == "seed" and v < 0 else v
        merged = {**dataclasses.asdict(base), **data}
        merged["stop"] = list(merged["stop"])
        return from_dict(SamplingOptions, merged, "sampling")


class ConversationSettingsDialog(QDialog):
    def __init__(self, store: Store, system_prompt: str, sampling: SamplingOptions, preset: str = "",
                 defaults: SamplingOptions = SamplingOptions(), parent=None):
        super().__init__(parent)
        self.setWindowTitle("Chat settings")
        self.store = store
        self.defaults = defaults
        self.base = sampling
        self.presets = QComboBox()
        self.presets.activated.connect(self._apply_preset)
        save = QPushButton("Save as preset…", clicked=self._save_preset)
        delete = QPushButton("Delete preset", clicked=self._delete_preset)
        row = QHBoxLayout()
        row.addWidget(QLabel("Preset"))
        row.addWidget(self.presets, 1)
        row.addWidget(save)
        row.addWidget(delete)
        self.prompt = QPlainTextEdit(system_prompt)
        self.prompt.setPlaceholderText("System prompt: how the model should behave in this chat (optional)")
        self.prompt.setMaximumHeight(120)
        self.form = SamplingForm()
        self.form.set_values(sampling)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
                                   | QDialogButtonBox.StandardButton.RestoreDefaults)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).clicked.connect(self._defaults)
        lay = QVBoxLayout(self)
        lay.addLayout(row)
        lay.addWidget(QLabel("System prompt"))
        lay.addWidget(self.prompt)
        lay.addWidget(QLabel("Sampling"))
        lay.addWidget(self.form)
        lay.addWidget(buttons)
        self._fill_presets(preset)
        scroll_past_inputs(self)

    def result_values(self) -> tuple[str, SamplingOptions, str]:
        """(system prompt, sampling, preset name or "")."""
        preset = self.presets.currentText()
        return self.prompt.toPlainText().strip(), self.form.values(self.base), "" if preset == NO_PRESET else preset

    def _fill_presets(self, select: str = "") -> None:
        self.presets.clear()
        self.presets.addItem(NO_PRESET)
        for p in self.store.presets():
            self.presets.addItem(p.name)
        i = self.presets.findText(select) if select else 0
        self.presets.setCurrentIndex(max(0, i))

    def _apply_preset(self, _i: int) -> None:
        name = self.presets.currentText()
        for p in self.store.presets():
            if p.name == name:
                self.prompt.setPlainText(p.system_prompt)
                self.form.set_values(p.sampling)
                self.base = p.sampling

    def _save_preset(self, name: Optional[str] = None) -> None:
        if not name:
            current = self.presets.currentText()
            name, ok = QInputDialog.getText(self, "Save preset", "Preset name:",
                                            text="" if current == NO_PRESET else current)
            if not ok or not name.strip():
                return
        try:
            self.store.save_preset(name, self.prompt.toPlainText().strip(), self.form.values(self.base))
        except (ValueError, OptionError) as e:
            QMessageBox.warning(self, "Preset not saved", str(e))
            return
        self._fill_presets(name.strip())

    def _delete_preset(self) -> None:
        name = self.presets.currentText()
        if name != NO_PRESET:
            self.store.delete_preset(name)
            self._fill_presets()

    def _defaults(self) -> None:
        self.form.set_values(self.defaults)
        self.base = self.defaults
        self.presets.setCurrentIndex(0)
