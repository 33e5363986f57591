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
from typing import Any, Optional, Sequence

from PySide6.QtCore import QObject, Qt
from PySide6.QtWidgets import QApplication

from app import theme
from app.chat.session import ChatSession
from app.engine_client import EngineClient
from app.gauges import GaugesPanel
from app.hub.local import mark_used
from app.idle_unload import IdleUnloader
from app.model_options import ModelOptions
from app.models_dialog import ModelManagerDialog
from app.settings import Settings, load_settings, save_settings
from app.settings_panel import SettingsPanel
from app.store import Store
from app.store_recovery import open_store
from app.window import MainWindow
from runtime import tuning
from runtime import paths
from runtime.options import LoadOptions

INTERRUPTED = "The app closed while this answer was being written; the text so far was kept."
SWITCHED = "The engine was switched while this answer was being written; the text so far was kept."


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
    engine: Any = None         # the engine the chat uses: `client`, or a remote one (use_engine)
    engine_links: list = dataclasses.field(default_factory=list)
    server: Any = None         # the local OpenAI-compatible server (app.serve.inapp.LocalServer)
    server_indicator: Any = None   # its words in the status bar (app.server_indicator.ServerIndicator)
    model_options: ModelOptions = dataclasses.field(default_factory=ModelOptions)   # load options per model
    unloader: Any = None       # unloads the local model when idle (app.idle_unload.IdleUnloader)
    memory: Optional[tuple] = None    # (VRAM bytes, RAM bytes, GPU name) for fit estimates, read once
    load_dialog: Any = None    # the open load-options dialog (app.load_dialog.LoadDialog)


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
                startup_model(settings) if model == "auto" else model, model_options=ModelOptions.load())
    wire(desk)
    apply_server(desk)
    show_secrets_notice(desk)
    window.gauges_dock.setVisible(settings.app.show_gauges)
    if store_notice:
        window.notice.add("Conversations", store_notice)
    if desk.model_options.warning:
        window.notice.add("Load options were reset", desk.model_options.warning)
    if warning:
        window.notice.add("Settings were reset", warning)
    return desk


def wire(desk: Desk) -> None:
    """The one place where the engine process meets the views. QProcess delivers its output on the
    GUI thread, so every connection here runs there; the views never see the process."""
    client, session, window, gauges = desk.client, desk.session, desk.window, desk.gauges
    desk.engine = client
    desk.unloader = IdleUnloader(client, window)
    desk.unloader.set_minutes(desk.settings.app.unload_idle_minutes)
    desk.engine_links = connect_engine(desk, client)

    # Chat and window -> the engine in use (the local worker, or a remote server, which never sleeps).
    def generate(rid, msgs, sampling, prefix) -> None:
        if desk.engine is client:
            desk.unloader.wake()            # a model unloaded for idleness loads again first
        desk.engine.generate(rid, msgs, sampling, answer_prefix=prefix)

    session.generate_requested.connect(generate)
    session.cancel_requested.connect(lambda rid: desk.engine.cancel(rid))
    window.restart_requested.connect(lambda: desk.engine.restart())
    client.state_changed.connect(lambda _s: gauges.set_worker_pid(client.pid()) if desk.engine is client else None)

    # The chat header: token counts for the context meter; the model picker loads local models and ejects.
    chat = window.chat
    chat.meter.count_requested.connect(lambda rid, msgs: desk.engine.count(rid, msgs))
    chat.picker.load_requested.connect(lambda model: load_local(desk, model))
    chat.picker.eject_requested.connect(lambda: (desk.unloader.forget(), desk.engine.unload()))
    chat.picker.options_requested.connect(lambda model: open_load_dialog(desk, model))

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
        desk.engine.telemetry.connect(panel.show_telemetry)  # which expert path runs, and why (live)
        panel.set_server_address(desk.server.words if desk.server is not None else "The local server is off.")
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
    # "Last used" of the model manager: when it was loaded, and each answer it wrote since.
    client.loaded.connect(lambda ev: mark_used(Path(ev.path)))
    client.finished.connect(lambda _ev: client.loaded_event is not None and mark_used(Path(client.loaded_event.path)))


def load_local(desk: Desk, model: str, options: Optional[LoadOptions] = None) -> None:
    """Chat with the local engine again (if a remote one was in use) and load `model` there."""
    use_engine(desk, desk.client)
    load_model(desk, model, options)


def options_for(desk: Desk, model: str) -> LoadOptions:
    """The load options of `model`: its own (remembered from its load dialog), else the settings' defaults."""
    return desk.model_options.get(model) or desk.settings.load


def load_model(desk: Desk, model: str, options: Optional[LoadOptions] = None) -> None:
    """Load `model` with `options` (by default its own or the settings'), unless it is loaded (or loading)
    with them already."""
    desk.unloader.forget()
    if desk.client.load(model, options or options_for(desk, model)) is None:
        how = "is being loaded now" if desk.client.loading else "is loaded already with these options"
        desk.window.statusBar().showMessage(f"{paths.display_name(model)} {how}.", 4000)


def remember_options(desk: Desk, model: str, options: LoadOptions) -> None:
    """Keep `model`'s own load options; options equal to the settings' defaults are not kept (later changes
    to the defaults then reach it)."""
    try:
        if options == desk.settings.load:
            desk.model_options.forget(model)
        else:
            desk.model_options.put(model, options)
    except OSError as e:
        desk.window.statusBar().showMessage(f"The load options could not be saved: {e.strerror or e}", 8000)


def machine_memory(desk: Desk) -> tuple:
    """(VRAM bytes, RAM bytes, GPU name), read once."""
    if desk.memory is None:
        from app.hub.fit import detect_memory
        desk.memory = detect_memory()
    return desk.memory


def open_load_dialog(desk: Desk, model: str):
    """The load options of `model` (from the chat's model picker): Load uses them, Save remembers them."""
    from app.load_dialog import LoadDialog
    client = desk.client
    own = desk.model_options.get(model)
    loaded = (client.loaded_event is not None and client.last_load is not None
              and paths.same_model(client.last_load[0], model))
    dialog = LoadDialog(model, client.last_load[1] if loaded else own or desk.settings.load, desk.settings.load,
                        remembered=own is not None, loaded=loaded,
                        applied=client.loaded_event.applied if loaded else None, memory=machine_memory(desk),
                        engine=client.ready_event.engine if client.ready_event else "cpu", parent=desk.window)
    def load(m: str, options: LoadOptions, remember: bool) -> None:
        if remember:
            remember_options(desk, m, options)
        load_local(desk, m, options)

    dialog.load_requested.connect(load)
    dialog.save_requested.connect(lambda m, options: remember_options(desk, m, options))
    dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    dialog.destroyed.connect(lambda *_: setattr(desk, "load_dialog", None))
    desk.load_dialog = dialog
    dialog.open()
    return dialog


def load_demo(desk: Desk) -> None:
    """The welcome screen's "Chat with the demo model": make sure it is in the models folder (copied from
    the bundle when frozen), then load it now, or as soon as the engine is ready."""
    from app.demo_install import DemoMissing, ensure_demo_model
    try:
        ensure_demo_model()
    except DemoMissing as e:
        desk.window.banner.show_state("The demo model is not available", str(e), choose_model=True)
        return
    desk.model = paths.DEMO_ALIAS
    if desk.window.ready is not None and desk.client.is_running():
        load_model(desk, paths.DEMO_ALIAS)
    # otherwise the ready handler (wire) loads desk.model when the engine has started


def open_models(desk: Desk) -> ModelManagerDialog:
    """The model manager (one per app: downloads outlive its window): its Load goes to the local engine
    (`load_local`), its remote server replaces it (`use_remote`)."""
    if desk.models is None:
        desk.models = ModelManagerDialog(desk.window, engine_client=desk.client, remote=remote_settings(desk.settings))
        desk.models.load_requested.connect(lambda path: load_local(desk, path))
        desk.models.remote_requested.connect(lambda config: use_remote(desk, config))
        app = QApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(desk.models.shutdown)
    show_secrets_notice(desk)
    desk.models.show()
    desk.models.raise_()
    return desk.models


def show_secrets_notice(desk: Desk) -> None:
    """A damaged secrets file set aside (app.secrets): the user is told once, and what was kept."""
    from app.secrets import check_file
    words = check_file()
    if words:
        desk.window.notice.add("Secrets file damaged", words)


def connect_engine(desk: Desk, engine) -> list:
    """The engine's events to the chat, the window and the gauges; returns the links (to undo them)."""
    session, window, gauges = desk.session, desk.window, desk.gauges
    return [
        # Engine -> chat: the streamed answer and how it ended.
        engine.token.connect(session.on_token),
        engine.finished.connect(session.on_finished),
        engine.error.connect(session.on_error),
        engine.worker_died.connect(session.on_worker_died),
        # Engine -> window: state in words, load progress, errors with the worker's stderr.
        engine.state_changed.connect(window.on_engine_state),
        engine.ready.connect(window.on_ready),
        engine.progress.connect(window.on_progress),
        engine.loaded.connect(window.on_loaded),
        engine.error.connect(window.on_engine_error),
        engine.worker_died.connect(window.on_worker_died),
        engine.worker_died.connect(lambda *_: gauges.engine_gone()),
        engine.unloaded.connect(lambda ev: on_unloaded(desk, engine, ev)),
        # Engine -> the chat header's context meter.
        engine.token_count.connect(window.chat.meter.on_count),
        # Engine -> gauges.
        engine.telemetry.connect(gauges.show_telemetry),
        engine.finished.connect(gauges.show_finished),
        engine.loaded.connect(lambda _ev: gauges.reset_speed()),
        engine.ready.connect(lambda ev: gauges.set_engine(ev.engine)),
        engine.loaded.connect(lambda ev: gauges.set_engine(ev.backend)),
    ]


def on_unloaded(desk: Desk, engine, ev) -> None:
    """No model any more; one unloaded for idleness sleeps: the chat may send (it loads again first)."""
    desk.window.on_unloaded(ev)
    if engine is desk.client and desk.unloader.asleep is not None:
        desk.window.chat.set_engine_ready(True)
        desk.window.banner.show_state(f"{paths.display_name(desk.unloader.asleep[0])} · unloaded while idle",
                                      desk.unloader.words)


def use_engine(desk: Desk, engine) -> None:
    """Chat with `engine` from now on: the local EngineClient, or a RemoteEngine (app.serve.remote)."""
    if engine is desk.engine:
        return
    for stream in list(desk.session.streams.values()):   # the old engine's answers end here, their text kept
        desk.engine.cancel(stream.request_id)
        desk.session.fail_request(stream.request_id, SWITCHED)
    for link in desk.engine_links:
        QObject.disconnect(link)
    old, desk.engine = desk.engine, engine
    if old is not desk.client:
        old.shutdown()
    desk.engine_links = connect_engine(desk, engine)
    desk.window.loaded = None
    remote = engine is not desk.client
    desk.gauges.set_remote(engine.config.base_url if remote else None)
    if not remote:
        desk.gauges.set_worker_pid(desk.client.pid())
    if engine.ready_event is not None:           # what the window shows: this engine's own state
        desk.window.on_ready(engine.ready_event)
        desk.gauges.set_engine(engine.ready_event.engine)
    if engine.loaded_event is not None:
        desk.window.on_loaded(engine.loaded_event)
        desk.gauges.set_engine(engine.loaded_event.backend)
    else:
        desk.window.on_unloaded()
    desk.window.on_engine_state(engine.state)


def use_remote(desk: Desk, config) -> None:
    """Chat with a remote OpenAI-compatible server; its address and model are remembered, its key kept secret."""
    from app.secrets import set_secret
    from app.serve.remote import RemoteEngine
    engine = RemoteEngine(config)
    try:
        set_secret(f"remote:{engine.config.base_url}", config.api_key)
    except OSError as e:                                 # the chat goes on; the key is asked for next time
        desk.window.notice.add("The server's key was not saved", str(e))
    desk.settings = dataclasses.replace(desk.settings, app=dataclasses.replace(
        desk.settings.app, remote_url=engine.config.base_url, remote_model=config.model))
    save_settings(desk.settings)
    use_engine(desk, engine)
    engine.start()


def remote_settings(settings: Settings):
    """The remote server last used (address, model, key), to fill in the model manager's form."""
    from app.secrets import get_secret
    from app.serve.remote import RemoteConfig
    url = settings.app.remote_url
    return RemoteConfig(url, settings.app.remote_model or "", get_secret(f"remote:{url}")) if url else None


def apply_settings(desk: Desk, settings: Settings, reload: bool) -> None:
    """The settings panel's Apply: saved at once; a reload re-sends the load command with the new options."""
    desk.settings = settings
    desk.session.default_sampling = settings.sampling
    desk.window.gauges_dock.setVisible(settings.app.show_gauges)
    app = QApplication.instance()
    if app is not None:
        theme.apply(app, settings.app.theme)
    save_settings(settings)
    desk.unloader.set_minutes(settings.app.unload_idle_minutes)
    apply_server(desk)
    if reload and desk.client.last_load is not None:
        model = desk.client.last_load[0]
        if desk.model_options.get(model) is not None:
            desk.window.statusBar().showMessage(f"{paths.display_name(model)} has load options of its own (⚙ beside "
                                                "the model list): it keeps them; Settings holds the defaults for "
                                                "the other models.", 10000)
        desk.client.load(model, options_for(desk, model))


def apply_server(desk: Desk) -> None:
    """Start, restart or stop the local OpenAI-compatible server to match the settings."""
    if desk.server is None:
        if not desk.settings.server.enabled:
            return
        from app.serve.inapp import LocalServer
        from app.server_indicator import ServerIndicator
        desk.server = LocalServer(desk.client, desk.window)
        desk.server.status.connect(lambda words: desk.window.statusBar().showMessage(words, 8000))
        desk.server.backend.waker = desk.unloader       # a request wakes a model unloaded for idleness
        desk.server_indicator = ServerIndicator(desk.server)
        desk.window.statusBar().addPermanentWidget(desk.server_indicator)
        app = QApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(desk.server.stop)
    from app.secrets import get_secret
    from app.settings_panel import SERVER_KEY
    problem = desk.server.apply(desk.settings.server, get_secret(SERVER_KEY))
    if problem:
        desk.window.banner.show_state("The local server is not running", problem, kind="info")


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
    question = args.smoke_test or tuning.smoke_test_question()
    if not question:
        from app import display_check
        words = display_check.advice(display_check.missing_for_display()) if display_check.uses_xcb() else None
        if words:
            print(words, file=sys.stderr)
            return 1
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
        firstrun.offer_welcome(desk, load_demo, open_models)
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
