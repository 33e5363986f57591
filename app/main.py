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
from pathlib import Path
from typing import Optional, Sequence

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from app import theme
from app.chat.session import ChatSession
from app.engine_client import EngineClient
from app.gauges import GaugesPanel
from app.hub.local import mark_used
from app.models_dialog import ModelManagerDialog
from app.settings import Settings, load_settings, save_settings
from app.settings_panel import SettingsPanel
from app.store import Store
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
    store = Store()
    store.mark_interrupted(INTERRUPTED)
    session = ChatSession(store, settings.sampling)
    client = EngineClient(worker_command)
    gauges = GaugesPanel(columns=5)
    window = MainWindow(store, session, gauges)
    desk = Desk(settings, store, session, client, gauges, window,
                startup_model(settings) if model == "auto" else model)
    wire(desk)
    window.gauges_dock.setVisible(settings.app.show_gauges)
    if warning:
        window.banner.show_state("Settings were reset", warning, kind="info")
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

    # Engine -> gauges.
    client.telemetry.connect(gauges.show_telemetry)
    client.finished.connect(gauges.show_finished)
    client.loaded.connect(lambda _ev: gauges.reset_speed())
    client.worker_died.connect(lambda *_: gauges.engine_gone())
    client.state_changed.connect(lambda _s: gauges.set_worker_pid(client.pid()))

    # Chat and window -> engine.
    session.generate_requested.connect(lambda rid, msgs, sampling: client.generate(rid, msgs, sampling))
    session.cancel_requested.connect(client.cancel)
    window.restart_requested.connect(client.restart)

    def load_first_model(_ready) -> None:
        # Only the first start loads here; restart() reloads what was loaded itself.
        if desk.model and client.last_load is None:
            load_model(desk, desk.model)

    client.ready.connect(load_first_model)

    # Settings panel: saved at once; a reload re-sends the load command with the new options.
    def open_settings() -> None:
        panel = SettingsPanel(desk.settings, active=client.last_load[1] if client.last_load else None,
                              has_model=client.loaded_event is not None, parent=window)
        if client.loaded_event is not None:
            panel.show_applied(client.loaded_event.applied)
        panel.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        panel.apply_requested.connect(lambda settings, reload: apply_settings(desk, settings, reload))
        panel.open()

    def remember_model(ev) -> None:
        if desk.settings.app.last_model != ev.model and ev.model != paths.DEMO_ALIAS:
            desk.settings = dataclasses.replace(desk.settings,
                                                app=dataclasses.replace(desk.settings.app, last_model=ev.model))
            save_settings(desk.settings)

    window.settings_requested.connect(open_settings)
    window.models_requested.connect(lambda: open_models(desk))
    client.loaded.connect(remember_model)
    client.loaded.connect(lambda ev: mark_used(Path(ev.path)))     # "Last used" of the model manager


def load_model(desk: Desk, model: str) -> None:
    """Load `model` with the settings' options, unless it is loaded (or loading) with them already."""
    if desk.client.load(model, desk.settings.load) is None:
        desk.window.statusBar().showMessage(f"{paths.display_name(model)} is loaded already.", 4000)


def open_models(desk: Desk) -> ModelManagerDialog:
    """The model manager (one per app: downloads outlive its window); its Load goes through `load_model`."""
    if desk.models is None:
        desk.models = ModelManagerDialog(desk.window, engine_client=desk.client)
        desk.models.load_requested.connect(lambda path: load_model(desk, path))
        app = QApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(desk.models.shutdown)
    desk.models.show()
    desk.models.raise_()
    return desk.models


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
    if not question:
        from app import display_check
        words = display_check.advice(display_check.missing_for_display()) if display_check.uses_xcb() else None
        if words:
            print(words, file=sys.stderr)
            return 1
    if question:
        from app.demo_install import DemoMissing, ensure_demo_model
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
        try:
            ensure_demo_model()
        except DemoMissing as e:
            print(f"smoke: {e}", file=sys.stderr)
            return 1
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("MoE Desk")
    app.setOrganizationName("moedesk")
    import qasync
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    result = load_settings()
    theme.apply(app, result.settings.app.theme)
    desk = build(result.settings, model=paths.DEMO_ALIAS if question else args.model or "auto")
    if result.warning:
        desk.window.banner.show_state("Settings were reset", result.warning, kind="info")
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
