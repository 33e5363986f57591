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


def test_without_a_bundle_the_missing_demo_is_said_in_words_with_no_command_to_type():
    assert demo_install.bundled_demo() is None                   # not frozen
    with pytest.raises(demo_install.DemoMissing, match="choose a model to download") as e:
        demo_install.ensure_demo_model()
    assert "moedesk-cli" not in str(e.value) and "pip" not in str(e.value)


def test_bundle_without_config_is_reported(tmp_path):
    src = tmp_path / "empty"
    src.mkdir()
    with pytest.raises(demo_install.DemoMissing, match="installation is incomplete"):
        demo_install.ensure_demo_model(src)


def test_welcome_is_shown_once_and_its_buttons_choose(qtbot):
    assert firstrun.should_show_welcome()
    d = firstrun.WelcomeDialog(REPORT, demo=("ready", ""))      # the demo model is there already
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


def test_welcome_shows_the_gpu_kernel_build_states(qtbot):
    """A GPU machine whose kernels can be built from NVIDIA's wheels: the panel follows the build's events."""
    from app.kernel_build import KernelBuild
    from runtime.gpu_setup import KernelStatus, Toolchain
    wheels = Toolchain("wheels", paths.cache_dir(), "13.0.88")
    status = KernelStatus("buildable", "GPU kernels: built once.", "No CUDA toolkit needed.", toolchain=wheels)
    report = MachineReport("NVIDIA GeForce RTX 4090", "570.133", 24 * 1024 ** 3, 64 * 1024 ** 3, 48 * 1024 ** 3,
                           500 * 1024 ** 3, None, (Finding("ok", "NVIDIA GPU"),), status)
    d = firstrun.WelcomeDialog(report, build_kernels=False)
    qtbot.addWidget(d)
    panel = d.kernels
    assert panel.state == "building" and "No CUDA toolkit needed" in panel.title.text()
    job = KernelBuild(d)
    job.progress.connect(panel.show_progress)
    job.done.connect(panel.show_ready)
    job.failed.connect(panel.show_failed)
    job.handle_line("Building exllamav2's CUDA extension ...")        # stray output is not an event
    job.handle_line('{"event": "progress", "done": 23, "total": 47}')
    assert (panel.bar.value(), panel.bar.maximum()) == (23, 47)
    job.handle_line('{"event": "failed", "message": "Install g++.", "detail": "c++: not found"}')
    assert panel.state == "failed" and "Install g++." in panel.title.text() and panel.log.text() == "c++: not found"
    assert not panel.retry.isHidden() and not panel.retry.isEnabled()     # build_kernels=False: no builds here
    job.handle_line('{"event": "done", "seconds": 171.0}')
    assert panel.state == "ready" and "171 s" in panel.title.text()


def test_welcome_without_a_gpu_has_no_kernel_panel(qtbot):
    d = firstrun.WelcomeDialog(REPORT)
    qtbot.addWidget(d)
    assert d.kernels is None and d.kernel_job is None


def test_the_background_build_process_is_followed_to_its_end(qtbot):
    """KernelBuild runs a real child process: JSON events become signals; an exit without a final event is a
    failure carrying the stray output."""
    import sys

    from app.kernel_build import KernelBuild
    script = ("import json; print(json.dumps({'event': 'progress', 'done': 1, 'total': 2}), flush=True); "
              "print('nvcc fatal: something', flush=True); raise SystemExit(1)")
    job = KernelBuild(command=[sys.executable, "-c", script])
    seen = []
    job.progress.connect(lambda d, t: seen.append((d, t)))
    with qtbot.waitSignal(job.failed, timeout=20000) as blocker:
        job.start()
    assert seen == [(1, 2)]
    assert "exit status 1" in blocker.args[0] and "nvcc fatal: something" in blocker.args[1]


def test_a_finished_build_moves_an_idle_cpu_engine_to_the_gpu(qtbot):
    import sys
    from types import SimpleNamespace

    from runtime.gpu_setup import KernelStatus
    status = KernelStatus("failed", "Building the GPU kernels failed last time; MoE Desk works on the CPU.")
    report = MachineReport("NVIDIA GeForce RTX 4090", "570.133", 24 * 1024 ** 3, 64 * 1024 ** 3, 48 * 1024 ** 3,
                           500 * 1024 ** 3, None, (Finding("ok", "NVIDIA GPU"),), status)
    d = firstrun.WelcomeDialog(report, build_kernels=False)
    qtbot.addWidget(d)
    done = "import json; print(json.dumps({'event': 'done', 'module': 'x.so', 'seconds': 3.0}))"
    with qtbot.waitSignal(d.kernels_ready, timeout=20000):
        d.start_kernel_build([sys.executable, "-c", done])            # what "Build again" starts
    assert d.kernels.state == "ready"

    restarts = []
    desk = SimpleNamespace(window=SimpleNamespace(ready=SimpleNamespace(engine="cpu")),
                           session=SimpleNamespace(generating=False),
                           client=SimpleNamespace(restart=lambda: restarts.append(1)))
    assert firstrun.switch_to_gpu(desk) and restarts == [1]
    desk.session.generating = True                                      # mid-answer, in any chat: left alone
    assert not firstrun.switch_to_gpu(desk)
    desk.session.generating, desk.window.ready.engine = False, "cuda"   # already on the GPU
    assert not firstrun.switch_to_gpu(desk) and restarts == [1]
