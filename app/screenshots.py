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
needed). Also chat-list.png (the chat list grouped by date with a pinned chat, one chat writing and one
queued behind it), load-dialog.png (a model's load options with the fit estimate: a staged Qwen3-30B-A3B
on a staged 24 GiB GPU), server-indicator.png (the window while the local server answers a request: the
status bar says so) and request-log.png (the log a click away). Uses a temporary data dir, so the user's
conversations are neither shown nor touched; the older chats in the list are staged.
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
        stage_chats(desk.store)
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
        written.append(grab_staged_load_dialog(out / "load-dialog.png"))
        written.append(shoot_chat_list(desk, out / "chat-list.png", timeout_s))
        written += shoot_server_indicator(desk, out, timeout_s)
        from app.firstrun import grab_welcome
        from app.models_dialog import grab_model_manager
        written.append(grab_model_manager(out / "model-manager.png"))
        from app.models_dialog import grab_conversions
        written.append(grab_conversions(out / "model-manager-convert.png"))
        written.append(grab_welcome(out / "welcome.png"))
        written.extend(grab_kernel_states(out))
        written += shoot_server(out)
    finally:
        win.close()
        desk.client.shutdown(wait=True)
        desk.store.close()
    return written


STAGED_CHATS = (("Fix the flaky upload test", 10, True), ("Sourdough starter schedule", 3, False),
                ("Packing list for Lisbon", 1, False), ("Compare MoE offload strategies", 24, False))


def stage_chats(store) -> None:
    """Older chats for the list (title, days ago, pinned): what a list looks like after a few weeks."""
    now = time.time()
    for title, days, pinned in STAGED_CHATS:
        c = store.create_conversation(title)
        store.add_message(c.id, "user", title)
        store.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now - days * 86400, c.id))
        if pinned:
            store.set_pinned(c.id, True)


def shoot_chat_list(desk, path: Path, timeout_s: float) -> Path:
    """The chat list while a new chat's answer streams and a message sent in another new chat waits for it;
    then both are deleted (their answers stopped) and the chat open before comes back."""
    from runtime.options import SamplingOptions
    session, win = desk.session, desk.window
    back, sampling = session.conversation.id if session.conversation else None, session.default_sampling
    session.default_sampling = SamplingOptions(temperature=0.0, max_tokens=400)
    win.new_chat()
    session.send("Write a short story about a lighthouse keeper.")
    wait_for(lambda: len(session.model.items[-1].content) >= 20 or not session.busy, timeout_s,
             "the story to get going")
    win.new_chat()
    session.send("And what is the capital of Italy?")
    settle()
    shot = _save(win.conversations.grab(), path)
    for cid in list(session.streams):
        session.delete(cid)
    session.default_sampling = sampling
    session.open(back)
    settle()
    return shot


def grab_staged_load_dialog(path: Path) -> Path:
    """The load options of a staged Qwen3-30B-A3B 4.0 bpw (its real config) with a 12 GiB VRAM budget,
    a 32k context, a Q8 cache and n-gram drafting."""
    from app.load_dialog import grab_load_dialog
    from runtime.modelfolder import FolderInfo
    from runtime.options import DraftOptions, LoadOptions, OffloadOptions
    config = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
              "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
              "max_position_embeddings": 40960}
    name = "Qwen3-30B-A3B-exl2-4.0bpw"
    info = FolderInfo(Path(name), name, "Qwen3MoeForCausalLM", "qwen3_moe", 30_532_122_624, 3_338_000_000, 4.0,
                      16_400_000_000, 151936, 48, 128, 8, True, True, config)
    options = LoadOptions(OffloadOptions(vram_budget_gb=12.0, context_length=32768, kv_cache="q8"),
                          DraftOptions(mode="ngram"))
    return grab_load_dialog(path, name, options=options, info=info)


def shoot_server_indicator(desk, out: Path, timeout_s: float) -> list[Path]:
    """The local server switched on in the running app, one API request streaming through it (the window's
    status bar says so), then the request log."""
    import dataclasses
    import socket
    import threading

    import httpx

    from app.main import apply_settings
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = desk.settings
    apply_settings(desk, dataclasses.replace(settings, server=dataclasses.replace(settings.server, enabled=True,
                                                                                 port=port)), reload=False)
    url, model = desk.server.url, desk.server.backend.served_model().id
    body = {"model": model, "messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": 120,
            "stream": True, "temperature": 0}
    done = threading.Event()

    def ask() -> None:
        try:
            httpx.get(f"{url}/models", timeout=timeout_s)          # what a client asks first
            with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=timeout_s) as r:
                for _ in r.iter_lines():
                    pass
        finally:
            done.set()
    threading.Thread(target=ask, daemon=True).start()
    history = desk.server.history
    wait_for(lambda: history.served == 1 and history.in_flight == 1 or done.is_set(), timeout_s,
             "the API request to arrive")
    settle(300)
    written = [_save(desk.window.grab(), out / "server-indicator.png")]
    wait_for(done.is_set, timeout_s, "the API request to end")
    wait_for(lambda: history.in_flight == 0, timeout_s, "the request log to note the end")
    dialog = desk.server_indicator.show_log()
    settle()
    written.append(_save(dialog.grab(), out / "request-log.png"))
    dialog.close()
    apply_settings(desk, settings, reload=False)
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
