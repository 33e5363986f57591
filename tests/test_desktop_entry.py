"""The desktop entry validates and installs; the first-run machine check never crashes without a GPU."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from app import desktop_entry, machine
from app.resources import resource

needs_validator = pytest.mark.skipif(shutil.which("desktop-file-validate") is None,
                                     reason="desktop-file-validate not installed (Debian: desktop-file-utils)")


@needs_validator
def test_shipped_entry_validates():
    r = subprocess.run(["desktop-file-validate", str(resource("moedesk.desktop"))], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


@needs_validator
def test_install_writes_a_valid_entry_pointing_at_this_installation(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    entry = desktop_entry.install()
    assert entry == tmp_path / "applications" / "moedesk.desktop"
    assert (tmp_path / "icons/hicolor/scalable/apps/moedesk.svg").read_bytes() == resource("icons", "moedesk.svg").read_bytes()
    text = entry.read_text()
    exec_line = next(line for line in text.splitlines() if line.startswith("Exec="))
    assert exec_line.endswith(" %U") and (sys.executable in exec_line or "moedesk" in exec_line)
    r = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout


def test_no_gpu_is_a_state_not_a_crash(tmp_path, monkeypatch):
    import pynvml

    def boom():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setattr(pynvml, "nvmlInit", boom)
    report = machine.check_machine(tmp_path / "models" / "not-yet")
    assert not report.gpu_engine
    assert report.summary.startswith("CPU demo only")
    assert report.findings[0].level == "fail" and "No NVIDIA GPU" in report.findings[0].title
    assert report.ram_total_bytes > 0 and report.disk_free_bytes > 0


def test_gpu_without_a_toolchain_says_how_to_get_one(tmp_path, monkeypatch):
    from runtime.gpu_setup import KernelStatus
    monkeypatch.setattr(machine, "probe_gpu", lambda: ("NVIDIA GeForce RTX 4090", "560.35", 24 * machine.GB, ""))
    monkeypatch.setattr(machine, "kernel_status", lambda: KernelStatus(
        "no_toolchain", "No CUDA compiler (nvcc) found.", "pip install 'moedesk[gpu]'"))
    report = machine.check_machine(tmp_path)
    assert report.gpu_engine and "RTX 4090" in report.summary and report.kernels.state == "no_toolchain"
    assert any(f.level == "warn" and "nvcc" in f.title and "moedesk[gpu]" in f.advice for f in report.findings)


def test_welcome_dialog_offers_demo_and_marks_done(qtbot, tmp_path, monkeypatch):
    from app import firstrun
    monkeypatch.setattr(machine, "probe_gpu", lambda: (None, None, None, "no NVIDIA driver answered"))
    dlg = firstrun.WelcomeDialog(machine.check_machine(tmp_path), demo=("ready", ""))   # demo imported already
    qtbot.addWidget(dlg)
    assert firstrun.should_show_welcome()
    with qtbot.waitSignal(dlg.demo_requested, timeout=1000):
        dlg.demo_btn.click()
    assert dlg.choice == "demo" and not firstrun.should_show_welcome()
