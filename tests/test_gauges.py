"""Gauges: formatting, history, the NVML state machine (with a stand-in pynvml), psutil readings, the panel."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import psutil
import pytest

from app import telemetry as tm
from app.telemetry import DASH, History, NvmlMonitor, NvmlState, RamSampler
from runtime.protocol import DraftStats, Finished, GenerationStats, Telemetry


# ---- formatting and history ------------------------------------------------------------------

def test_formatting():
    assert tm.fmt_bytes(None) == DASH
    assert tm.fmt_bytes(512) == "512 B"
    assert tm.fmt_bytes(1536) == "1.5 KiB"
    assert tm.fmt_bytes(3 * 2 ** 30) == "3.0 GiB"
    assert tm.fmt_used_total(3.2 * 2 ** 30, 16 * 2 ** 30) == "3.2 / 16.0 GiB"
    assert tm.fmt_used_total(100 * 2 ** 20, 512 * 2 ** 20) == "100 / 512 MiB"
    assert tm.fmt_used_total(1, None) == DASH
    assert tm.fmt_rate(42.34) == "42.3 T/s"
    assert tm.fmt_rate(1234.4) == "1,234 T/s"
    assert tm.fmt_seconds(0.85) == "850 ms"
    assert tm.fmt_seconds(2.345) == "2.35 s"
    assert tm.fmt_fraction(0.734) == "73%"
    assert tm.fmt_bytes_per_token(2 ** 20) == "1.0 MiB/tok"
    for f in (tm.fmt_rate, tm.fmt_seconds, tm.fmt_fraction, tm.fmt_bytes_per_token):
        assert f(None) == DASH


def test_history_ring_and_gaps():
    h = History(3)
    assert h.span() is None and h.last() is None
    for v in (1, None, 5, 2):
        h.append(v)
    assert h.values() == [None, 5.0, 2.0]     # oldest dropped
    assert h.known() == [5.0, 2.0]
    assert h.span() == (2.0, 5.0)
    assert h.last() == 2.0 and len(h) == 3
    with pytest.raises(ValueError, match="at least 2"):
        History(1)


# ---- NVML state machine with a stand-in pynvml ------------------------------------------------

class FakeNVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fake_nvml(init_fails=False, count=1):
    """A pynvml-shaped module; set .fail_query to make memory queries raise NVMLError."""
    m = types.SimpleNamespace(NVMLError=FakeNVMLError, calls=[], fail_query=False, init_fails=init_fails)

    def nvmlInit():
        m.calls.append("init")
        if m.init_fails:
            raise FakeNVMLError(12)   # NVML_ERROR_LIBRARY_NOT_FOUND
    m.nvmlInit = nvmlInit
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    m.nvmlDeviceGetName = lambda h: b"NVIDIA Test GPU"

    def mem(h):
        if m.fail_query:
            raise FakeNVMLError(15)   # NVML_ERROR_GPU_IS_LOST
        return types.SimpleNamespace(used=2 * 2 ** 30, total=24 * 2 ** 30, free=22 * 2 ** 30)
    m.nvmlDeviceGetMemoryInfo = mem
    return m


def test_nvml_ok_reads_vram():
    nvml = fake_nvml()
    mon = NvmlMonitor(nvml)
    s = mon.poll()
    assert s == tm.VramSample(used=2 * 2 ** 30, total=24 * 2 ** 30, name="NVIDIA Test GPU", device_count=1)
    assert mon.state == NvmlState.OK and mon.status_text() == "NVIDIA Test GPU"
    mon.poll()
    assert nvml.calls == ["init"]          # initialised once, not per poll


def test_nvml_missing_library_is_no_gpu_state_and_retried_later():
    clock = Clock()
    nvml = fake_nvml(init_fails=True)
    mon = NvmlMonitor(nvml, retry_s=5.0, clock=clock)
    assert mon.poll() is None
    assert mon.state == NvmlState.NO_GPU
    assert mon.status_text() == "No NVIDIA GPU — CPU engine"
    clock.t = 1.0
    assert mon.poll() is None and nvml.calls == ["init"]   # no retry before retry_s
    nvml.init_fails = False                                # e.g. the driver got loaded
    clock.t = 6.0
    assert mon.poll() is not None and mon.state == NvmlState.OK


def test_nvml_zero_devices_is_no_gpu():
    nvml = fake_nvml(count=0)
    mon = NvmlMonitor(nvml)
    assert mon.poll() is None and mon.state == NvmlState.NO_GPU
    assert nvml.calls == ["init", "shutdown"]


def test_nvml_error_during_query_shuts_down_and_reinitialises():
    clock = Clock()
    nvml = fake_nvml()
    mon = NvmlMonitor(nvml, retry_s=2.0, clock=clock)
    assert mon.poll() is not None and mon.inits == 1
    nvml.fail_query = True
    assert mon.poll() is None
    assert mon.state == NvmlState.ERROR and "retrying" in mon.status_text()
    assert nvml.calls == ["init", "shutdown"]
    nvml.fail_query = False
    clock.t = 2.5
    assert mon.poll() is not None
    assert mon.state == NvmlState.OK and mon.inits == 2
    assert nvml.calls == ["init", "shutdown", "init"]


def test_nvml_with_the_real_pynvml_never_raises():
    mon = NvmlMonitor()     # the real module: on this machine a GPU or the no-GPU state
    sample = mon.poll()
    assert (sample is not None) == (mon.state == NvmlState.OK)
    assert mon.state in (NvmlState.OK, NvmlState.NO_GPU, NvmlState.ERROR)
    mon.close()


# ---- psutil -----------------------------------------------------------------------------------

def test_ram_sampler_reads_system_and_process_memory():
    s = RamSampler(os.getpid()).sample()
    vm = psutil.virtual_memory()
    assert s.total == vm.total and 0 < s.used <= s.total
    own = psutil.Process().memory_info().rss
    assert s.process_rss is not None and s.process_rss >= own * 0.5


def test_ram_sampler_process_gone_is_none():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    sampler = RamSampler(child.pid)
    child.wait()
    assert sampler.sample().process_rss is None and sampler.pid is None
    assert RamSampler(None).sample().process_rss is None


# ---- the panel --------------------------------------------------------------------------------

@pytest.fixture
def panel(qtbot):
    from app.gauges import GaugesPanel
    p = GaugesPanel(nvml=NvmlMonitor(fake_nvml(init_fails=True)), interval_ms=50)
    qtbot.addWidget(p)
    return p


def test_panel_shows_no_gpu_state_and_psutil_values(panel, qtbot):
    assert panel.no_gpu
    assert panel.value_text("vram") == DASH
    assert panel.note_text("vram") == "No NVIDIA GPU — CPU engine"
    assert panel.value_text("ram").endswith("GiB")
    total_gib = f"{psutil.virtual_memory().total / 2 ** 30:.1f} GiB"
    assert panel.value_text("ram").endswith(total_gib)
    assert panel.note_text("worker_rss") == "engine not running"
    panel.set_worker_pid(os.getpid())
    assert panel.value_text("worker_rss") != DASH and f"pid {os.getpid()}" == panel.note_text("worker_rss")
    n = len(panel.gauges["ram"].history)
    panel.set_worker_pid(os.getpid())                  # the same pid again: no extra sample
    assert len(panel.gauges["ram"].history) == n
    qtbot.waitUntil(lambda: len(panel.gauges["ram"].history) >= n + 2, timeout=3000)   # the timer polls


def test_panel_shows_vram_from_nvml(qtbot):
    from app.gauges import GaugesPanel
    p = GaugesPanel(nvml=NvmlMonitor(fake_nvml()))
    qtbot.addWidget(p)
    assert not p.no_gpu
    assert p.value_text("vram") == "2.0 / 24.0 GiB"
    assert p.note_text("vram") == "NVIDIA Test GPU"


def test_panel_telemetry_dash_until_reported(panel):
    for key in ("decode_tps", "ttft", "prefill_tps", "draft_acceptance", "expert_hit_rate", "pcie"):
        assert panel.value_text(key) == DASH
    panel.show_telemetry(Telemetry(request_id="r", decode_tps=31.25, ttft_s=0.4, generating=True))
    assert panel.value_text("decode_tps") == "31.2 T/s" and panel.note_text("decode_tps") == "live"
    assert panel.value_text("ttft") == "400 ms"
    assert panel.value_text("expert_hit_rate") == DASH and panel.value_text("pcie") == DASH
    panel.show_telemetry(Telemetry(expert_hit_rate=0.9, pcie_bytes_per_token=3 * 2 ** 20))
    assert panel.value_text("expert_hit_rate") == "90%"
    assert panel.value_text("pcie") == "3.0 MiB/tok"
    assert panel.value_text("decode_tps") == "31.2 T/s"     # absent figures stay
    stats = GenerationStats(prompt_tokens=10, generated_tokens=20, ttft_s=1.5, prefill_tps=200.0,
                            decode_tps=25.0, total_s=2.0, draft=DraftStats(mode="ngram", acceptance_rate=0.5))
    panel.show_finished(Finished(request_id="r", reason="eos", stats=stats))
    assert panel.value_text("decode_tps") == "25.0 T/s"
    assert panel.value_text("draft_acceptance") == "50%"
    assert panel.note_text("ttft") == "last answer: 20 tokens"
    assert panel.gauges["decode_tps"].history.known() == [31.25, 25.0]
    panel.reset_speed()
    assert panel.value_text("decode_tps") == DASH


def test_sparkline_points_follow_history(panel):
    g = panel.gauges["decode_tps"]
    g.spark.resize(102, 24)
    for v in (0.0, None, 10.0):
        g.history.append(v)
    pts = g.spark.points()
    assert pts[1] is None
    assert pts[2].x() == pytest.approx(100.0)           # newest on the right edge
    assert pts[0].y() > pts[2].y()                      # higher value drawn higher
    g.spark.grab()                                      # paints without error


def test_gui_modules_do_not_import_torch():
    code = ("import sys, app.engine_client, app.gauges, app.telemetry, app.settings, app.settings_panel\n"
            "app.settings_panel.list_local_models(), app.settings_panel.default_draft_compatibility()\n"
            "app.engine_client.worker_command(), app.engine_client.worker_environment()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'exllamav2')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_memory_sparklines_are_scaled_to_the_total(panel):
    spark = panel.gauges["ram"].spark
    spark.resize(102, 24)
    total_gib = psutil.virtual_memory().total / 2 ** 30
    assert spark.ceiling == pytest.approx(total_gib)
    used = panel.gauges["ram"].history.last()
    pt = spark.points()[-1]
    assert pt.y() == pytest.approx(22 - used / total_gib * 20, abs=0.01)   # height 24, padding 2


def test_repainting_does_not_leak_references_to_none(panel):
    """PySide6 6.12.0 on Python < 3.12 dropped a reference to None per void call: the gauges, which
    repaint twice a second for as long as the app runs, would crash it within the hour."""
    for g in panel.gauges.values():
        g.spark.resize(120, 24)
        for v in range(50):
            g.history.append(float(v % 7))
    before = sys.getrefcount(None)
    for _ in range(200):
        panel.poll()
        for g in panel.gauges.values():
            g.spark.grab()
    assert sys.getrefcount(None) >= before - 100


def test_compact_line_and_tiles_that_can_never_have_a_value_are_hidden(panel, qtbot):
    """No GPU: no VRAM tile or strip entry; the CPU engine: no expert hits or host↔GPU traffic."""
    panel.show()
    assert not panel.details.isVisible()
    assert not panel.strip_labels["vram"].isVisible() and panel.strip_labels["ram"].isVisible()
    panel.show_telemetry(Telemetry(request_id="r", decode_tps=31.25, ttft_s=0.4, generating=True))
    assert "31.2 T/s" in panel.strip_labels["decode_tps"].text() and "400 ms" in panel.strip_labels["ttft"].text()
    panel.set_expanded(True)
    assert panel.details.isVisible()
    assert not panel.gauges["vram"].isVisible() and not panel.gauges["pcie"].isVisible()
    assert panel.gauges["decode_tps"].isVisible() and panel.gauges["draft_acceptance"].isVisible()


def test_with_a_gpu_the_cpu_engine_still_hides_expert_tiles(qtbot):
    from app.gauges import GaugesPanel
    p = GaugesPanel(nvml=NvmlMonitor(fake_nvml()))
    qtbot.addWidget(p)
    p.show()
    p.set_expanded(True)
    assert p.strip_labels["vram"].isVisible() and "2.0 / 24.0 GiB" in p.strip_labels["vram"].text()
    assert p.gauges["expert_hit_rate"].isVisible() and p.gauges["pcie"].isVisible()
    p.set_engine("cpu")
    assert not p.gauges["expert_hit_rate"].isVisible() and not p.gauges["pcie"].isVisible()
    assert p.gauges["vram"].isVisible()
    p.set_engine("cuda")
    assert p.gauges["expert_hit_rate"].isVisible()
