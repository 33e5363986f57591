"""`moedesk`: the desktop app. QApplication on a qasync loop, the parts built, and the ONE block that
wires the engine process to the views (`wire`). Nothing else connects the engine client to a view.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from app import theme
from app.chat.session import ChatSession
from app.engine_client import EngineClient
from app.gauges import GaugesPanel
from app.models_dialog import ModelManagerDialog
from app.settings import Settings, load_settings, save_settings
from app.settings_panel import SettingsPanel
from app.store import Store
from app.store_recovery import open_store
from app.window import MainWindow
from runtime import paths

INTERRUPTED = "The app closed while this answer was being written; the text so far was kept."


@dataclass
class Desk:
    """Everything the running app is made of (tests and screenshots build one too)."""
    settings: Settings
    store: Store
    session: ChatSession
    client: EngineClient
    gauges: GaugesPanel
    window: MainWindow
    model: Optional[str]       # loaded when the engine is first ready
    models: Optional[ModelManagerDialog] = None   # made on first use; downloads outlive its window


def startup_model(settings: Settings) -> Optional[str]:
    """The last model, or the demo model when it is imported, or none (the user picks one)."""
    if settings.app.last_model:
        return settings.app.last_model
    if (paths.resolve_model(paths.DEMO_ALIAS) / "config.json").exists():
        return paths.DEMO_ALIAS
    return None


def build(settings: Optional[Settings] = None, worker_command: Optional[Sequence[str]] = None,
          model: Optional[str] = "auto") -> Desk:
    warning = None
    if settings is None:
        result = load_settings()
        settings, warning = result.settings, result.warning
    store, store_notice = open_store()
    store.mark_interrupted(INTERRUPTED)
    session = ChatSession(store, settings.sampling)
    client = EngineClient(worker_command)
    gauges = GaugesPanel(columns=5)
    window = MainWindow(store, session, gauges)
    desk = Desk(settings, store, session, client, gauges, window,
                startup_model(settings) if model == "auto" else model)
    wire(desk)
    window.gauges_dock.setVisible(settings.app.show_gauges)
    if store_notice:
        window.notice.add("Conversations", store_notice)
    if warning:
        window.notice.add("Settings were reset", warning)
    return desk


def wire(desk: Desk) -> None:
    """The one place where the engine process meets the views. QProcess delivers its output on the
    GUI thread, so every connection here runs there; the views never see the process."""
    client, session, window, gauges = desk.client, desk.session, desk.window, desk.gauges

    # Engine -> chat: the streamed answer and how it ended.
    client.token.connect(session.on_token)
    client.finished.connect(session.on_finished)
    client.error.connect(session.on_error)
    client.worker_died.connect(session.on_worker_died)

    # Engine -> window: state in words, load progress, errors with the worker's stderr.
    client.state_changed.connect(window.on_engine_state)
    client.ready.connect(window.on_ready)
    client.progress.connect(window.on_progress)
    client.loaded.connect(window.on_loaded)
    client.error.connect(window.on_engine_error)
    client.worker_died.connect(window.on_worker_died)
    client.unloaded.connect(window.on_unloaded)

    # The chat header: token counts for the context meter, loads and unloads from the model picker.
    chat = window.chat
    chat.meter.count_requested.connect(client.count)
    client.token_count.connect(chat.meter.on_count)
    chat.picker.load_requested.connect(lambda model: client.load(model, desk.settings.load))
    chat.picker.eject_requested.connect(lambda: client.unload())

    # Engine -> gauges.
    client.telemetry.connect(gauges.show_telemetry)
    client.finished.connect(gauges.show_finished)
    client.loaded.connect(lambda _ev: gauges.reset_speed())
    client.ready.connect(lambda ev: gauges.set_engine(ev.engine))
    client.loaded.connect(lambda ev: gauges.set_engine(ev.backend))
    client.state_changed.connect(lambda _s: gauges.set_worker_pid(client.pid()))

    # Chat and window -> engine.
    session.generate_requested.connect(
        lambda rid, msgs, sampling, prefix: client.generate(rid, msgs, sampling, answer_prefix=prefix))
    session.cancel_requested.connect(client.cancel)
    window.restart_requested.connect(client.restart)

    def load_first_model(_ready) -> None:
        # Only the first start loads here; restart() reloads what was loaded itself.
        if desk.model and client.last_load is None:
            client.load(desk.model, desk.settings.load)

    client.ready.connect(load_first_model)

    # Settings panel: saved at once; a reload re-sends the load command with the new options.
    def open_settings() -> None:
        panel = SettingsPanel(desk.settings, active=client.last_load[1] if client.last_load else None,
                              has_model=client.loaded_event is not None, parent=window)
        if client.loaded_event is not None:
            panel.show_applied(client.loaded_event.applied)
        client.telemetry.connect(panel.show_telemetry)       # which expert path runs, and why (live)
        panel.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        panel.apply_requested.connect(lambda settings, reload: apply_settings(desk, settings, reload))
        panel.open()

    def remember_model(ev) -> None:
        if desk.settings.app.last_model != ev.model and ev.model != paths.DEMO_ALIAS:
            desk.settings = dataclasses.replace(desk.settings,
                                                app=dataclasses.replace(desk.settings.app, last_model=ev.model))
            save_settings(desk.settings)

    # The model manager: loading a model from it goes through the same client.
    def open_models() -> None:
        if desk.models is None:
            desk.models = ModelManagerDialog(window, engine_client=client)
            desk.models.load_requested.connect(lambda path: client.load(path, desk.settings.load))
            app = QApplication.instance()
            if app is not None:
                app.aboutToQuit.connect(desk.models.shutdown)
        desk.models.show()
        desk.models.raise_()

    window.settings_requested.connect(open_settings)
    window.models_requested.connect(open_models)
    client.loaded.connect(remember_model)


def apply_settings(desk: Desk, settings: Settings, reload: bool) -> None:
    """The settings panel's Apply: saved at once; a reload re-sends the load command with the new options."""
    desk.settings = settings
    desk.session.default_sampling = settings.sampling
    desk.window.gauges_dock.setVisible(settings.app.show_gauges)
    app = QApplication.instance()
    if app is not None:
        theme.apply(app, settings.app.theme)
    save_settings(settings)
    if reload and desk.client.last_load is not None:
        desk.client.load(desk.client.last_load[0], settings.load)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="moedesk", description="MoE Desk: chat with local MoE models.")
    parser.add_argument("--model", help="model to load at start (name, folder, or 'demo'); default: the last one")
    parser.add_argument("--install-desktop-entry", action="store_true",
                        help="add MoE Desk to the desktop's application menu (Linux) and exit")
    parser.add_argument("--smoke-test", metavar="QUESTION", help=argparse.SUPPRESS)  # see app/smoke.py
    args = parser.parse_args(argv)
    if args.install_desktop_entry:
        from app.desktop_entry import install
        print(install())
        return 0
    question = args.smoke_test or os.environ.get("MOEDESK_SMOKE_TEST")
    smoke_model = args.model or paths.DEMO_ALIAS          # --smoke-test --model DIR: another model (GPU bundles)
    if question and smoke_model == paths.DEMO_ALIAS:
        from app.demo_install import DemoMissing, ensure_demo_model
        try:
            ensure_demo_model()
        except DemoMissing as e:
            print(f"smoke: {e}", file=sys.stderr)
            return 1
    if question:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("MoE Desk")
    app.setOrganizationName("moedesk")
    import qasync
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    result = load_settings()
    theme.apply(app, result.settings.app.theme)
    desk = build(result.settings, model=smoke_model if question else args.model or "auto")
    if result.warning:
        desk.window.notice.add("Settings were reset", result.warning)
    desk.window.restore_geometry()
    desk.window.show()
    from app import firstrun, smoke
    smoke_test = smoke.start(desk, question) if question else None
    if smoke_test is None:
        firstrun.offer_welcome(desk)
    desk.client.start()
    closed = asyncio.Event()
    app.aboutToQuit.connect(closed.set)
    app.lastWindowClosed.connect(app.quit)
    with loop:
        loop.run_until_complete(closed.wait())
    desk.store.close()
    return smoke_test.exit_code if smoke_test is not None else 0


if __name__ == "__main__":
    sys.exit(main())
