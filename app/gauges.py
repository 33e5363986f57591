"""The gauges panel: VRAM, RAM, the worker's memory, and the worker's speed figures, each with a sparkline.

Use (the window's wiring block connects it to the engine client):

    panel = GaugesPanel()
    client.ready.connect(lambda ev: panel.set_worker_pid(ev.pid))
    client.telemetry.connect(panel.show_telemetry)     # runtime.protocol.Telemetry
    client.finished.connect(panel.show_finished)       # runtime.protocol.Finished
    client.worker_died.connect(lambda *a: panel.set_worker_pid(None))

By default the panel is one compact line (decode speed, first token, RAM, and VRAM where there is an
NVIDIA GPU); "Details" opens the tiles with their sparklines. Tiles that can never have a value are
hidden: VRAM without an NVIDIA GPU, and expert cache hits and host↔GPU traffic on the CPU engine
(`set_engine`).

The panel polls only NVML and psutil, on its own QTimer (`interval_ms`, 500 by default: about two
updates a second). Every other figure comes from the worker's telemetry events and shows "—" until
the engine reports it. No NVIDIA GPU (or no driver) shows "No NVIDIA GPU — CPU engine" in the VRAM
gauge; NVML failures are retried by `app.telemetry.NvmlMonitor`, never raised.
"""
from __future__ import annotations

from typing import Callable, Optional

from PySide6.QtCore import QPointF, QSize, Qt, QTimer
from PySide6.QtGui import QPainter, QPainterPath, QPalette, QPen
from PySide6.QtWidgets import (QFrame, QGridLayout, QHBoxLayout, QLabel, QScrollArea, QSizePolicy, QToolButton,
                               QVBoxLayout, QWidget)

from app.elided import ElidedLabel

from runtime.cpu_load import CONTENDED_CPUS, physical_cores

from app.telemetry import (DASH, History, NvmlMonitor, NvmlState, RamSampler, fmt_bytes,
                           fmt_bytes_per_token, fmt_fraction, fmt_rate, fmt_seconds, fmt_used_total)
from runtime.protocol import Finished, Telemetry


class Sparkline(QWidget):
    """A small line chart of a `History`, scaled to its own range (from 0 when `from_zero`)."""

    def __init__(self, history: History, from_zero: bool = True, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.history = history
        self.from_zero = from_zero
        self.ceiling: Optional[float] = None    # a fixed top (e.g. total memory) instead of the highest value
        self.setMinimumSize(80, 22)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(160, 26)

    def points(self) -> list[Optional[QPointF]]:
        """Widget coordinates of each sample (None for gaps); what paintEvent draws."""
        values = self.history.values()
        span = self.history.span()
        if span is None:
            return [None] * len(values)
        lo, hi = (min(0.0, span[0]), span[1]) if self.from_zero else span
        if self.ceiling is not None:
            hi = max(hi, self.ceiling)
        if hi <= lo:
            hi = lo + 1.0
        w, h, pad = self.width(), self.height(), 2.0
        step = (w - 2 * pad) / max(1, self.history.size - 1)
        x0 = w - pad - step * (len(values) - 1)     # newest sample on the right edge
        return [None if v is None else
                QPointF(x0 + i * step, h - pad - (v - lo) / (hi - lo) * (h - 2 * pad))
                for i, v in enumerate(values)]

    def paintEvent(self, event) -> None:  # noqa: N802 (Qt naming)
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        pal = self.palette()
        p.fillRect(self.rect(), pal.color(QPalette.ColorRole.Base))
        color = pal.color(QPalette.ColorRole.Highlight)
        path, pen_down = QPainterPath(), False
        for pt in self.points():
            if pt is None:
                pen_down = False
            elif pen_down:
                path.lineTo(pt)
            else:
                path.moveTo(pt)
                pen_down = True
        p.setPen(QPen(color, 1.5))
        p.drawPath(path)
        p.end()


class Gauge(QFrame):
    """Title, current value in words, a note line, and a sparkline of the history."""

    def __init__(self, title: str, tooltip: str, from_zero: bool = True, history_size: int = 120,
                 parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setToolTip(tooltip)
        self.history = History(history_size)
        self.title = QLabel(title)
        self.value = QLabel(DASH)
        self.value.setObjectName("gaugeValue")
        font = self.value.font()
        font.setPointSizeF(font.pointSizeF() * 1.3)
        font.setBold(True)
        self.value.setFont(font)
        self.note = QLabel("")
        self.note.setObjectName("gaugeNote")
        self.note.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.spark = Sparkline(self.history, from_zero)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 4, 6, 4)
        lay.setSpacing(1)
        for w in (self.title, self.value, self.note, self.spark):
            lay.addWidget(w)

    def update_value(self, text: str, sample: Optional[float], note: Optional[str] = None,
                     ceiling: Optional[float] = None) -> None:
        """Show `text`, append `sample` (None = gap) to the history; `note` replaces the note line;
        `ceiling` fixes the sparkline's top (e.g. the total, so that a full bar means full memory)."""
        self.value.setText(text)
        if ceiling is not None:
            self.spark.ceiling = ceiling
        if note is not None:
            self.note.setText(note)
        self.history.append(sample)
        self.spark.update()


QWIDGETSIZE_MAX = (1 << 24) - 1
STRIP = (("decode_tps", "Decode"), ("ttft", "First token"), ("ram", "RAM"), ("vram", "VRAM"))
GPU_ONLY = ("vram", "expert_hit_rate", "pcie")        # never a value without an NVIDIA GPU / on the CPU or a remote engine


class GaugesPanel(QWidget):
    """A compact line, and the gauges in a grid on demand. Public slots: set_worker_pid, show_telemetry,
    show_finished, reset_speed, set_engine, set_expanded."""

    def __init__(self, parent: Optional[QWidget] = None, interval_ms: int = 500,
                 nvml: Optional[NvmlMonitor] = None, ram: Optional[RamSampler] = None,
                 columns: int = 3):
        super().__init__(parent)
        self.nvml = nvml or NvmlMonitor()
        self.remote: Optional[str] = None       # the address of a remote engine in use, if any
        self.ram = ram or RamSampler()
        g = self.gauges = {
            "vram": Gauge("VRAM", "GPU memory used / total (NVML), all processes."),
            "ram": Gauge("RAM", "System memory in use / total (psutil)."),
            "worker_rss": Gauge("Engine memory", "Resident memory of the engine process (psutil)."),
            "decode_tps": Gauge("Decode", "Tokens per second while the answer streams."),
            "ttft": Gauge("First token", "Time from sending to the first token of the answer."),
            "prefill_tps": Gauge("Prefill", "Prompt tokens processed per second."),
            "draft_acceptance": Gauge("Draft acceptance", "Share of drafted tokens the model accepted."),
            "expert_hit_rate": Gauge("Expert cache hits", "Share of expert lookups found in VRAM."),
            "pcie": Gauge("Host↔GPU per token", "Bytes copied between host RAM and GPU per token."),
        }
        self.columns = columns
        self.engine: Optional[str] = None          # "cpu" | "cuda" once known
        self.strip_labels: dict[str, QLabel] = {}
        strip = QHBoxLayout()
        strip.setContentsMargins(6, 2, 6, 2)
        for key, title in STRIP:
            label = QLabel(toolTip=g[key].toolTip())
            label.setTextFormat(Qt.TextFormat.RichText)
            self.strip_labels[key] = label
            strip.addWidget(label)
        # Said only while other programs hold CPU cores the engine would use (runtime.cpu_load): in the line,
        # cut with "…" where it is narrow (the whole of it in its tooltip), so the dock keeps its height.
        self.cpu_note = ElidedLabel()
        self.cpu_note.setVisible(False)
        strip.addWidget(self.cpu_note)
        strip.addStretch(1)
        self.details_button = QToolButton(text="Details ▸", checkable=True, autoRaise=True,
                                          toolTip="Show every gauge with its history")
        self.details_button.toggled.connect(self.set_expanded)
        strip.addWidget(self.details_button)
        tiles = QWidget()
        self.grid = QGridLayout(tiles)
        self.grid.setContentsMargins(4, 0, 4, 4)
        self.details = QScrollArea(widgetResizable=True, frameShape=QFrame.Shape.NoFrame)
        self.details.setWidget(tiles)
        self.details.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.details.setVisible(False)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        lay.addLayout(strip)
        lay.addWidget(self.details, 1)
        self._layout_tiles()
        self.set_expanded(False)
        self.timer = QTimer(self)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self.poll)
        self.timer.start()
        self.poll()

    # -- compact line and details -----------------------------------------------------------
    def set_expanded(self, expanded: bool) -> None:
        self.details_button.blockSignals(True)
        self.details_button.setChecked(expanded)
        self.details_button.blockSignals(False)
        self.details_button.setText("Details ▾" if expanded else "Details ▸")
        self.details.setVisible(expanded)
        if expanded:
            tiles = self.details.widget()
            self.details.setMinimumHeight(min(tiles.sizeHint().height(), 260))
            self.setMaximumHeight(QWIDGETSIZE_MAX)
        else:        # the line alone: a dock around the panel shrinks back to it (no empty room left)
            self.setMaximumHeight(self.layout().sizeHint().height())
        self.updateGeometry()

    @property
    def expanded(self) -> bool:
        return self.details.isVisible() or self.details_button.isChecked()

    def set_engine(self, engine: Optional[str]) -> None:
        """"cpu" (and "remote": its GPU is not ours to see) hides the tiles only a local GPU engine fills."""
        self.engine = engine
        self._layout_tiles()

    def shown(self, key: str) -> bool:
        """Whether a gauge can ever have a value here (and so is shown)."""
        if key == "vram":
            return not self.no_gpu
        if key in GPU_ONLY:
            return self.engine not in ("cpu", "remote") and not self.no_gpu
        return True

    def _layout_tiles(self) -> None:
        visible = [(k, w) for k, w in self.gauges.items() if self.shown(k)]
        for k, w in self.gauges.items():
            self.grid.removeWidget(w)
            w.setVisible(self.shown(k))
        for i, (_, w) in enumerate(visible):
            self.grid.addWidget(w, i // self.columns, i % self.columns)
        self._refresh_strip()

    def _refresh_strip(self) -> None:
        for key, title in STRIP:
            label, value = self.strip_labels[key], self.gauges[key].value
            label.setVisible(self.shown(key))
            label.setText(f"{title} <b>{value.text()}</b>&nbsp;&nbsp;")
            label.setEnabled(value.isEnabled())          # greyed as its tile is: not live (the engine stopped)

    # -- polled: NVML and psutil only -------------------------------------------------------
    def set_worker_pid(self, pid: Optional[int]) -> None:
        """Watch this process's memory (None: none). Repeating the same pid changes nothing."""
        if (pid or None) == self.ram.pid:
            return
        self.ram.set_pid(pid)
        self.poll()

    def set_remote(self, url: Optional[str]) -> None:
        """A remote engine (its address) or None: this computer's memory says nothing about a remote engine."""
        self.remote = url
        self.poll()

    def poll(self) -> None:
        if self.remote:
            for key in ("vram", "ram", "worker_rss"):
                self.gauges[key].update_value(DASH, None, "not available for a remote engine")
            return
        vram = self.nvml.poll()
        gauge = self.gauges["vram"]
        if vram is None:
            gauge.update_value(DASH, None, self.nvml.status_text())
        else:
            gauge.update_value(fmt_used_total(vram.used, vram.total), vram.used / 2 ** 30,
                               self.nvml.status_text(), ceiling=vram.total / 2 ** 30)
        ram = self.ram.sample()
        self.gauges["ram"].update_value(fmt_used_total(ram.used, ram.total), ram.used / 2 ** 30,
                                        f"{fmt_bytes(ram.total - ram.used)} available",
                                        ceiling=ram.total / 2 ** 30)
        rss = ram.process_rss
        self.gauges["worker_rss"].update_value(
            fmt_bytes(rss), None if rss is None else rss / 2 ** 30,
            f"pid {self.ram.pid}" if self.ram.pid else "engine not running")
        if self.gauges["vram"].isHidden() != self.no_gpu:     # NVML's state is known after a poll
            self._layout_tiles()
        else:
            self._refresh_strip()

    @property
    def no_gpu(self) -> bool:
        return self.nvml.state == NvmlState.NO_GPU

    # -- from the worker --------------------------------------------------------------------
    _TELEMETRY: list[tuple[str, str, Callable[[Optional[float]], str]]] = [
        ("decode_tps", "decode_tps", fmt_rate),
        ("ttft", "ttft_s", fmt_seconds),
        ("prefill_tps", "prefill_tps", fmt_rate),
        ("draft_acceptance", "draft_acceptance", fmt_fraction),
        ("expert_hit_rate", "expert_hit_rate", fmt_fraction),
        ("pcie", "pcie_bytes_per_token", fmt_bytes_per_token),
    ]

    def show_telemetry(self, t: Telemetry) -> None:
        """One telemetry event: figures it carries replace the shown ones; absent ones stay."""
        for key, attr, fmt in self._TELEMETRY:
            value = getattr(t, attr)
            if value is not None:
                self.gauges[key].value.setEnabled(True)
                self.gauges[key].update_value(fmt(value), value, "live" if t.generating else "last answer")
        if t.cpu_busy_others is not None:
            self.show_cpu_load(t.cpu_busy_others, t.cpu_threads)
        self._refresh_strip()

    def show_cpu_load(self, others: float, threads: Optional[int]) -> None:
        """A line while other programs keep CPU cores busy: the engine's speed depends on them."""
        contended = others >= CONTENDED_CPUS
        if contended:
            team = f"; the engine uses {threads} thread{'s' if threads != 1 else ''}" if threads else ""
            self.cpu_note.setText(f"⚠ The machine is busy: other programs keep {others:.1f} of "
                                  f"{physical_cores()} CPU cores busy{team}. Answers come slower.")
        self.cpu_note.setVisible(contended)

    def engine_gone(self) -> None:
        """The engine process ended: its figures stay for reference, greyed and marked as not live."""
        for key, _, _ in self._TELEMETRY:
            g = self.gauges[key]
            if g.value.text() != DASH:
                g.value.setEnabled(False)
                g.note.setText("engine stopped: not live")
        self.cpu_note.setVisible(False)
        self._refresh_strip()

    def show_finished(self, f: Finished) -> None:
        """The final figures of an answer (the worker's own measurement of the whole request)."""
        s = f.stats
        acceptance = s.draft.acceptance_rate if s.draft is not None else None
        for key, value, fmt in (("decode_tps", s.decode_tps, fmt_rate), ("ttft", s.ttft_s, fmt_seconds),
                                ("prefill_tps", s.prefill_tps, fmt_rate),
                                ("draft_acceptance", acceptance, fmt_fraction)):
            if value is not None:
                self.gauges[key].value.setEnabled(True)
                self.gauges[key].update_value(fmt(value), value,
                                              f"last answer: {s.generated_tokens} tokens")
        self._refresh_strip()

    def reset_speed(self) -> None:
        """Back to "—" for the worker's figures (e.g. after a new model is loaded)."""
        for key, _, _ in self._TELEMETRY:
            g = self.gauges[key]
            g.history.clear()
            g.value.setEnabled(True)
            g.update_value(DASH, None, "")
        self._refresh_strip()

    def value_text(self, key: str) -> str:
        return self.gauges[key].value.text()

    def note_text(self, key: str) -> str:
        return self.gauges[key].note.text()

    def closeEvent(self, event) -> None:  # noqa: N802
        self.timer.stop()
        self.nvml.close()
        super().closeEvent(event)
