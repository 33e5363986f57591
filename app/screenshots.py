"""`make screenshots`: PNGs of the app with the real worker and the demo model, for the docs.

    QT_QPA_PLATFORM=offscreen python -m app.screenshots screenshots

Writes main-window.png (1280x800, mid-conversation: an answer regenerated once, so "‹ 2/2 ›", then one
still streaming; the chat header's model picker and context meter; the compact gauges),
main-window-dark.png, main-window-min.png (the window at its minimum size), message-versions.png (the
chat with a regenerated answer and a stopped one offering Continue), settings.png, gauges.png (every
gauge: the details opened), model-manager.png (a download in progress), model-manager-convert.png
(conversions: one running, one paused) and welcome.png (the first-run
screen for this machine), and the first-run screen on a staged GPU machine in the GPU kernels' states:
welcome-gpu-toolkit-not-needed.png, welcome-gpu-building.png, welcome-gpu-failed.png,
welcome-gpu-ready.png; then local-server.png (Settings → Local server, running) and remote-server.png
(the model manager's "Remote server…" tab). `--only server` writes just the last two (no worker
needed). Uses a temporary data dir, so the user's
conversations are neither shown nor touched.
"""
from __future__ import annotations

import argparse
from dataclasses import replace as dataclasses_replace
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QEventLoop, QTimer
from PySide6.QtWidgets import QApplication

from runtime import paths

QUESTIONS = ["What is the capital of France?",
             "Write a Python function that returns the square of a number."]


def settle(ms: int = 500) -> None:
    """Let queued events (palette changes, layouts, paints) run."""
    loop = QEventLoop()
    QTimer.singleShot(ms, loop.quit)
    loop.exec()


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        loop = QEventLoop()
        QTimer.singleShot(20, loop.quit)
        loop.exec()


def shoot(out: Path, model: str, timeout_s: float = 600.0) -> list[Path]:
    from app import theme
    from app.main import build
    from app.settings import Settings
    from app.settings_panel import SettingsPanel
    from runtime.options import SamplingOptions

    app = QApplication.instance() or QApplication(sys.argv[:1])
    theme.apply(app, "light")
    from app.window import MIN_SIZE

    greedy = SamplingOptions(temperature=0.0, max_tokens=120)
    desk = build(Settings(sampling=greedy), model=model)
    win = desk.window
    win.resize(1280, 800)
    win.show()
    written: list[Path] = []
    try:
        desk.client.start()
        wait_for(lambda: win.loaded is not None, timeout_s, "the demo model to load")
        desk.session.send(QUESTIONS[0])
        wait_for(lambda: not desk.session.busy, timeout_s, "the first answer")
        desk.session.default_sampling = SamplingOptions(temperature=0.8, seed=7, max_tokens=60)
        desk.session.regenerate()                 # a second version of the answer: "‹ 2/2 ›"
        wait_for(lambda: not desk.session.busy, timeout_s, "the regenerated answer")
        desk.session.default_sampling = greedy
        desk.session.send(QUESTIONS[1])
        # Mid-conversation: grab while the second answer is still streaming.
        wait_for(lambda: len(desk.session.model.items[-1].content) >= 110 or not desk.session.busy,
                 timeout_s, "the second answer to get going")
        written.append(_save(win.grab(), out / "main-window.png"))
        theme.apply(app, "dark")
        settle()
        written.append(_save(win.grab(), out / "main-window-dark.png"))
        theme.apply(app, "light")
        settle()
        if desk.session.busy:
            desk.session.stop()
            wait_for(lambda: not desk.session.busy, timeout_s, "the answer to stop")
        win.chat.input.setPlainText("And in JavaScript?")      # the meter counts what is typed
        settle(900)
        written.append(_save(win.chat.grab(), out / "message-versions.png"))
        win.resize(100, 100)                                     # held at the minimum size
        settle()
        assert (win.width(), win.height()) == MIN_SIZE, (win.width(), win.height())
        written.append(_save(win.grab(), out / "main-window-min.png"))
        win.resize(1280, 800)
        desk.gauges.set_expanded(True)
        settle()
        written.append(_save(desk.gauges.grab(), out / "gauges.png"))
        desk.gauges.set_expanded(False)
        panel = SettingsPanel(desk.settings, active=desk.settings.load, has_model=True, parent=win)
        if desk.client.loaded_event is not None:
            panel.show_applied(desk.client.loaded_event.applied)
        panel.resize(960, _full_height(panel, 960))
        panel.show()
        settle()
        written.append(_save(panel.grab(), out / "settings.png"))
        panel.close()
        from app.firstrun import grab_welcome
        from app.models_dialog import grab_model_manager
        written.append(grab_model_manager(out / "model-manager.png"))
        from app.convert_panel import grab_conversions
        written.append(grab_conversions(out / "model-manager-convert.png"))
        written.append(grab_welcome(out / "welcome.png"))
        written.extend(grab_kernel_states(out))
        written += shoot_server(out)
    finally:
        win.close()
        desk.client.shutdown(wait=True)
        desk.store.close()
    return written


def grab_kernel_states(out: Path) -> list[Path]:
    """The welcome screen of a staged GPU machine (an RTX 4090 with NVIDIA's toolchain wheels installed),
    in each state of the GPU kernels' one-time build."""
    from app.firstrun import grab_welcome
    from app.machine import GB, Finding, MachineReport, kernel_finding
    from runtime.gpu_setup import KernelStatus, Toolchain

    wheels = Toolchain("wheels", Path("site-packages/nvidia/cu13"), "13.0.88")
    buildable = KernelStatus("buildable", "GPU kernels: built once on this machine with the "
                             f"{wheels.describe()}.", "No CUDA toolkit needed.", toolchain=wheels)
    log = ("[31/47] nvcc -c cuda/q_gemm.cu -o q_gemm.cuda.o ...\n"
           "/usr/include/c++/15/bits/c++config.h:2: error: unsupported GNU version! gcc versions later "
           "than 14 are not supported!\nninja: build stopped: subcommand failed.")
    states = {
        "toolkit-not-needed": (buildable, None),
        "building": (dataclasses_replace(buildable, state="building", title="GPU kernels: being built now, one time."),
                     lambda d: d.kernels.show_progress(23, 47)),
        "failed": (KernelStatus("failed", "Building the GPU kernels failed last time; MoE Desk works on the CPU.",
                                "Your C++ compiler is newer than this CUDA "
                                "compiler supports: install an older gcc and name it in CC.",
                                toolchain=wheels, log_tail=log), lambda d: d.kernels.retry.setEnabled(True)),
        "ready": (KernelStatus("cached", "GPU kernels: built for this GPU."), lambda d: d.kernels.show_ready(212)),
    }
    written = []
    for name, (status, setup) in states.items():
        report = MachineReport("NVIDIA GeForce RTX 4090", "570.133", 24 * GB, 64 * GB, 48 * GB, 500 * GB,
                               None, (Finding("ok", "NVIDIA GPU: NVIDIA GeForce RTX 4090, driver 570.133, 24 GB VRAM."),
                                      kernel_finding(status),
                                      Finding("ok", "64 GB of RAM (48 GB free)."),
                                      Finding("ok", "500 GB free on the disk that holds models.")), status)
        written.append(grab_welcome(out / f"welcome-gpu-{name}.png", report, setup))
    return written


def shoot_server(out: Path) -> list[Path]:
    """Settings → Local server with the server running (a real one, on a free port), and the remote-server form."""
    import dataclasses

    from PySide6.QtWidgets import QGroupBox

    from app import theme
    from app.engine_client import EngineClient
    from app.models_dialog import ModelManagerDialog
    from app.secrets import new_api_key, set_secret
    from app.serve.inapp import LocalServer
    from app.serve.remote import RemoteConfig
    from app.settings import Settings
    from app.settings_panel import SERVER_KEY, SettingsPanel
    from runtime.options import ServeOptions

    app = QApplication.instance() or QApplication(sys.argv[:1])
    theme.apply(app, "light")
    settings = Settings(server=dataclasses.replace(ServeOptions(), enabled=True))
    set_secret(SERVER_KEY, new_api_key())
    server = LocalServer(EngineClient())     # the address is what this picture shows: no engine is started
    problem = server.apply(settings.server, None)
    panel = SettingsPanel(settings)
    panel.set_server_address(problem or server.words)
    panel.resize(960, _full_height(panel, 960))
    panel.show()
    settle()
    box = next(b for b in panel.findChildren(QGroupBox) if b.title().startswith("Local server"))
    written = [_save(box.grab(), out / "local-server.png")]
    server.stop()
    panel.close()
    with tempfile.TemporaryDirectory() as models:
        dialog = ModelManagerDialog(models_dir=Path(models),
                                    remote=RemoteConfig("http://gpu-box:8000/v1", "Qwen/Qwen3-30B-A3B", "key"))
        dialog._show_remote_models(["Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-0.6B"])
        dialog.tabs.setCurrentIndex(2)
        dialog.resize(900, 360)
        dialog.show()
        settle()
        written.append(_save(dialog.tabs.grab(), out / "remote-server.png"))
        dialog.shutdown()
        dialog.deleteLater()
    return written


def _full_height(dialog, width: int) -> int:
    """The dialog's height with its scrolled content shown whole (for a picture, not for a screen)."""
    from PySide6.QtWidgets import QScrollArea
    area = dialog.findChild(QScrollArea)
    if area is None or area.widget() is None:
        return dialog.sizeHint().height()
    content = area.widget()
    lay = content.layout()
    inner = lay.totalHeightForWidth(width - 40) if lay is not None and lay.hasHeightForWidth() else content.sizeHint().height()
    return dialog.sizeHint().height() - area.sizeHint().height() + inner + 2 * area.frameWidth() + 4


def _save(pixmap, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not pixmap.save(str(path), "PNG"):
        raise OSError(f"could not write {path}")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.screenshots", description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="screenshots", help="folder for the PNGs")
    parser.add_argument("--model", default=paths.DEMO_ALIAS, help="model to chat with (default: the demo model)")
    parser.add_argument("--only", choices=("server",), help="just the local-server and remote-server pictures")
    args = parser.parse_args(argv)
    if args.only == "server":
        with tempfile.TemporaryDirectory(prefix="moedesk-shots-") as home:
            os.environ["MOEDESK_HOME"] = home
            for p in shoot_server(Path(args.out)):
                print(p)
        return 0
    model = str(paths.resolve_model(args.model))        # resolved before the data dir is redirected
    if not (Path(model) / "config.json").exists():
        print(f"error: model {args.model!r} not found at {model}; run `moedesk-cli import-demo` first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="moedesk-shots-") as home:
        os.environ["MOEDESK_HOME"] = home
        for p in shoot(Path(args.out), model):
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
