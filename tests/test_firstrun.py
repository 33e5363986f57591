"""First run: the demo model copied out of the bundle, the welcome screen shown once, its screenshot,
and `moedesk --install-desktop-entry`."""
from __future__ import annotations

import json

import pytest

from app import demo_install, firstrun
from app.machine import Finding, MachineReport
from runtime import paths

REPORT = MachineReport(None, None, None, 16 * 1024 ** 3, 8 * 1024 ** 3, 100 * 1024 ** 3, None,
                       (Finding("fail", "No NVIDIA GPU found (no NVIDIA driver is installed).", "Runs the demo on the CPU."),))


def fake_bundle_demo(tmp_path):
    src = tmp_path / "bundle" / "demo-model"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (src / "tokenizer.json").write_text("{}")
    return src


def test_demo_is_copied_once_from_the_bundle(tmp_path):
    src = fake_bundle_demo(tmp_path)
    assert not demo_install.is_installed()
    target = demo_install.ensure_demo_model(src)
    assert target == paths.resolve_model(paths.DEMO_ALIAS)
    assert (target / "tokenizer.json").read_text() == "{}"
    (src / "tokenizer.json").write_text("changed")
    assert demo_install.ensure_demo_model(src) == target          # already there: left alone
    assert (target / "tokenizer.json").read_text() == "{}"
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".demo-copy")]


def test_a_broken_demo_folder_is_kept_aside_not_deleted(tmp_path):
    src = fake_bundle_demo(tmp_path)
    broken = paths.resolve_model(paths.DEMO_ALIAS)
    broken.mkdir(parents=True)
    (broken / "notes.txt").write_text("mine")
    demo_install.ensure_demo_model(src)
    assert (broken / "config.json").is_file()
    aside = [p for p in broken.parent.iterdir() if p.name.startswith(f".{broken.name}-broken-")]
    assert len(aside) == 1 and (aside[0] / "notes.txt").read_text() == "mine"


def test_without_a_bundle_the_missing_demo_says_how_to_import_it():
    assert demo_install.bundled_demo() is None                   # not frozen
    with pytest.raises(demo_install.DemoMissing, match="moedesk-cli import-demo"):
        demo_install.ensure_demo_model()


def test_bundle_without_config_is_reported(tmp_path):
    src = tmp_path / "empty"
    src.mkdir()
    with pytest.raises(demo_install.DemoMissing, match="installation is incomplete"):
        demo_install.ensure_demo_model(src)


def test_welcome_is_shown_once_and_its_buttons_choose(qtbot):
    assert firstrun.should_show_welcome()
    d = firstrun.WelcomeDialog(REPORT)
    qtbot.addWidget(d)
    from PySide6.QtWidgets import QLabel
    assert "CPU demo only" in d.findChild(QLabel, "verdict").text()
    with qtbot.waitSignal(d.demo_requested, timeout=1000):
        d.demo_btn.click()
    assert d.choice == "demo"
    assert not firstrun.should_show_welcome()


def test_browse_button_asks_for_the_model_manager(qtbot):
    d = firstrun.WelcomeDialog(REPORT)
    qtbot.addWidget(d)
    with qtbot.waitSignal(d.browse_requested, timeout=1000):
        d.browse_btn.click()
    assert d.choice == "browse" and not firstrun.should_show_welcome()


def test_grab_welcome_writes_a_png(qtbot, tmp_path):
    out = firstrun.grab_welcome(tmp_path / "shots" / "welcome.png", REPORT)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_install_desktop_entry_flag_prints_the_entry(tmp_path, monkeypatch, capsys):
    from app import main as app_main
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert app_main.main(["--install-desktop-entry"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(tmp_path / "xdg" / "applications" / "moedesk.desktop")
    assert "Exec=" in (tmp_path / "xdg" / "applications" / "moedesk.desktop").read_text()
