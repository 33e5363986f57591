"""What got in a new user's way, through the real window and engine client against the scripted worker
(tests/fake_worker.py, offscreen): each test failed before its fix."""
from __future__ import annotations

import os
import signal

import pytest
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QGuiApplication, QKeySequence, QWheelEvent
from PySide6.QtWidgets import QComboBox, QSpinBox

from app.hub.local import last_used_map
from runtime import paths
from runtime.protocol import Telemetry, WorkerError
from tests.test_chat_session import make_desk, send  # noqa: F401 (make_desk is a fixture)


def _wheel(widget, steps: int = -3) -> None:
    """Turn the wheel over `widget` (negative: towards the user, i.e. scroll down / next value)."""
    centre = QPointF(widget.rect().center())
    ev = QWheelEvent(centre, QPointF(widget.mapToGlobal(centre.toPoint())), QPoint(0, 0), QPoint(0, 120 * steps),
                     Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QGuiApplication.sendEvent(widget, ev)


def test_the_wheel_scrolls_the_settings_past_unfocused_inputs(qtbot):
    from app.settings import Settings
    from app.settings_panel import SettingsPanel
    panel = SettingsPanel(Settings())
    qtbot.addWidget(panel)
    panel.resize(600, 300)                       # short: the page scrolls
    panel.show()
    mode: QComboBox = panel.fields["draft.mode"].editor
    spin: QSpinBox = panel.fields["offload.context_length"].editor
    before = mode.currentData(), spin.value()
    _wheel(mode)
    _wheel(spin)
    assert (mode.currentData(), spin.value()) == before == ("off", 4096)
    from PySide6.QtWidgets import QScrollArea
    bar = panel.findChild(QScrollArea).verticalScrollBar()
    assert bar.value() > 0                       # the page scrolled instead
    spin.setFocus()                              # once the user clicked into it, the wheel is its own
    qtbot.waitUntil(spin.hasFocus, timeout=2000)
    _wheel(spin, 1)
    assert spin.value() != 4096


def test_the_wheel_leaves_chat_settings_values_alone(qtbot, tmp_path):
    from app.chat.settings_dialog import ConversationSettingsDialog
    from app.store import Store
    from runtime.options import SamplingOptions
    store = Store(tmp_path / "c.sqlite3")
    dlg = ConversationSettingsDialog(store, "", SamplingOptions())
    qtbot.addWidget(dlg)
    dlg.show()
    spins = dlg.form.editors
    before = {k: w.value() for k, w in spins.items()}
    for w in spins.values():
        _wheel(w)
    assert {k: w.value() for k, w in spins.items()} == before
    store.close()


def _demo_in_models_folder(demo_model) -> None:
    link = paths.models_dir() / paths.DEMO_MODEL_NAME
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(demo_model, target_is_directory=True)


def test_what_is_loaded_is_not_loaded_again(qtbot, make_desk, demo_model):
    from app.main import load_demo
    _demo_in_models_folder(demo_model)
    desk = make_desk()
    loads = []
    desk.client.loaded.connect(loads.append)
    load_demo(desk)                              # the welcome screen's "Chat with the demo model"
    assert desk.client.state == "idle" and desk.client._loading is None
    desk.window.models_requested.emit()          # Models → Load on the same folder, by its path
    desk.models.load_requested.emit(str(paths.models_dir() / paths.DEMO_MODEL_NAME))
    desk.models.shutdown()
    assert desk.client.state == "idle" and desk.client._loading is None
    assert "is loaded already" in desk.window.statusBar().currentMessage()
    from runtime.options import LoadOptions, OffloadOptions
    other = LoadOptions(offload=OffloadOptions(context_length=2048))
    with qtbot.waitSignal(desk.client.loaded, timeout=10000):
        desk.client.load(paths.DEMO_ALIAS, other)                        # other options: loaded again
    assert len(loads) == 1


def test_the_loaded_model_is_marked_and_its_last_use_recorded(qtbot, make_desk, demo_model):
    _demo_in_models_folder(demo_model)
    desk = make_desk()                                # loads "demo"
    assert paths.DEMO_MODEL_NAME in last_used_map()
    from app.main import open_models
    dlg = open_models(desk)
    qtbot.addWidget(dlg)
    t = dlg.local_table
    row = next(r for r in range(t.rowCount()) if paths.DEMO_MODEL_NAME in t.item(r, 0).text())
    assert t.item(row, 6).text() == "loaded — in use" and t.item(row, 0).text().startswith("● ")
    assert t.item(row, 5).text() != "never"
    t.selectRow(row)
    assert not dlg.load_button.isEnabled() and dlg.load_button.text() == "Loaded"
    dlg.shutdown()


def test_a_dead_engine_leaves_no_live_figures_and_no_guesses(qtbot, make_desk):
    desk = make_desk(delay=0.02, max_tokens=30)
    send(qtbot, desk, "Hello")
    gauges = desk.gauges
    gauges.show_telemetry(Telemetry(request_id="r", decode_tps=30.0, ttft_s=0.2, prefill_tps=100.0, generating=True))
    assert gauges.note_text("decode_tps") == "live"
    with qtbot.waitSignal(desk.client.worker_died, timeout=10000):
        os.kill(desk.client.pid(), signal.SIGKILL)
    for key in ("decode_tps", "ttft", "prefill_tps"):
        assert gauges.note_text(key) == "engine stopped: not live"
        assert not gauges.gauges[key].value.isEnabled()
    words = desk.window.banner.headline.text()
    assert "SIGKILL" in words and "possibly" not in words
    assert not desk.client.holds(paths.DEMO_ALIAS, desk.settings.load)     # nothing is loaded now
    with qtbot.waitSignal(desk.client.loaded, timeout=30000):
        desk.window.banner.restart.click()
    assert gauges.gauges["decode_tps"].value.isEnabled()


def test_a_model_that_cannot_load_offers_another(qtbot, make_desk):
    desk = make_desk()
    banner = desk.window.banner
    assert not banner.choose_model.isVisible()
    desk.client.error.emit("load-1", WorkerError("model_not_found", "/no/such/folder: no such model folder", ""))
    assert banner.kind == "error" and banner.choose_model.isVisible() and banner.restart.isVisible()
    assert not desk.window.chat.send_button.isEnabled()          # nothing is loaded now
    banner.choose_model.click()
    assert desk.models is not None and desk.models.isVisible()
    desk.models.shutdown()


def test_status_messages_do_not_move_the_content(qtbot, make_desk):
    desk = make_desk()
    top = desk.window.centralWidget().mapTo(desk.window, QPoint(0, 0))
    height = desk.window.centralWidget().height()
    desk.window.chat.view.copied.emit("Code copied")
    qtbot.wait(50)
    assert desk.window.statusBar().currentMessage() == "Code copied"
    assert (desk.window.centralWidget().mapTo(desk.window, QPoint(0, 0)), desk.window.centralWidget().height()) \
        == (top, height)


def test_each_chat_keeps_its_own_draft(qtbot, make_desk):
    desk = make_desk(max_tokens=3)
    w, box = desk.window, desk.window.chat.input
    send(qtbot, desk, "First chat")
    first = desk.session.conversation.id
    box.setPlainText("half a thought for the first chat")
    w.new_chat()                                              # Ctrl+N
    assert box.toPlainText() == ""
    box.setPlainText("Second chat")
    desk.session.open(first)
    assert box.toPlainText() == "half a thought for the first chat"
    w.new_chat()
    assert box.toPlainText() == "Second chat"
    qtbot.keyClick(box, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=20000)
    assert desk.session.conversation.title == "Second chat" and box.toPlainText() == ""
    w.new_chat()
    assert box.toPlainText() == ""                            # the sent text is no draft
    desk.session.open(first)
    w.close()                                                 # saved with the app
    from app.chat.drafts import Drafts
    assert Drafts().get(first) == "half a thought for the first chat"


def test_message_text_is_selectable_and_copied_with_ctrl_c(qtbot, make_desk):
    desk = make_desk(max_tokens=3)
    send(qtbot, desk, "Select me please")
    view = desk.window.chat.view
    view.resize(700, 400)
    qtbot.wait(50)
    rect = view.visualRect(desk.session.model.index(0, 0))
    y = rect.top() + rect.height() * 2 // 3                    # the message's text, below its header
    qtbot.mousePress(view.viewport(), Qt.MouseButton.LeftButton, pos=QPoint(rect.left() + 20, y))
    qtbot.mouseMove(view.viewport(), QPoint(rect.right() - 20, y))
    qtbot.mouseRelease(view.viewport(), Qt.MouseButton.LeftButton, pos=QPoint(rect.right() - 20, y))
    assert "me please" in view.selected_text()
    QGuiApplication.clipboard().clear()
    qtbot.keyClick(view, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier)
    assert "me please" in QGuiApplication.clipboard().text()


def test_search_hits_show_no_brackets_and_new_chats_stay_listed(qtbot, make_desk):
    HIT_START, HIT_END = "\x02", "\x03"         # app.store's markers of a hit in a snippet
    desk = make_desk(max_tokens=2)
    send(qtbot, desk, "The capital is Paris")
    lst = desk.window.conversations
    lst.search.setText("paris")
    qtbot.waitUntil(lambda: not lst._search_timer.isActive(), timeout=3000)
    assert lst.list.count() == 1
    item = lst.list.item(0)
    assert "[" not in item.text() and HIT_START not in item.text() and item.text().count("Paris") == 2
    lst.list.setCurrentRow(0)
    lst.list.setFocus()
    QGuiApplication.clipboard().clear()
    qtbot.keyClick(lst.list, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier)
    copied = QGuiApplication.clipboard().text()
    assert "[" not in copied and HIT_START not in copied and HIT_END not in copied
    desk.window.new_chat()                                   # a chat made while the search is on
    send(qtbot, desk, "Something else")
    ids = [lst.list.item(i).data(Qt.ItemDataRole.UserRole + 1) for i in range(lst.list.count())]
    assert desk.session.conversation.id in ids
    lst.search.clear()
    qtbot.waitUntil(lambda: lst.list.count() == 2 and not lst._search_timer.isActive(), timeout=3000)


def test_ctrl_comma_opens_settings(qtbot, make_desk):
    desk = make_desk()
    action = next(a for a in desk.window.actions() if a.text() == "&Settings…")
    assert action.shortcut() == QKeySequence("Ctrl+,")
    with qtbot.waitSignal(desk.window.settings_requested, timeout=1000):
        action.trigger()


def test_the_gauges_say_when_other_programs_slow_the_engine(qtbot):
    from app.gauges import GaugesPanel
    panel = GaugesPanel(interval_ms=10_000)
    qtbot.addWidget(panel)
    panel.show()
    panel.show_telemetry(Telemetry(cpu_busy_others=0.1, cpu_threads=2))
    assert not panel.cpu_note.isVisible()
    panel.show_telemetry(Telemetry(cpu_busy_others=1.2, cpu_threads=1))
    assert panel.cpu_note.isVisible() and "1.2" in panel.cpu_note.text() and "1 thread" in panel.cpu_note.text()
    panel.timer.stop()


@pytest.mark.parametrize("problem, words", [
    (Exception("NVML Shared Library Not Found"), "no NVIDIA driver is installed"),
    (Exception("Driver Not Loaded"), "the NVIDIA driver is installed but not running"),
])
def test_no_gpu_in_words_a_user_knows(problem, words):
    from app.telemetry import NvmlMonitor

    class Refusing:
        def nvmlInit(self):
            raise problem
    m = NvmlMonitor(Refusing())
    assert m.poll() is None and m.reason == words


def test_settings_show_only_options_that_apply(qtbot):
    from app.settings import Settings
    from app.settings_panel import SettingsPanel
    panel = SettingsPanel(Settings(), has_model=True)
    qtbot.addWidget(panel)
    panel.show()
    panel.show_applied({"offload.vram_budget_gb": "ignored: the CPU engine uses no GPU memory",
                        "offload.cpu_threads": "applied", "offload.placement": "ignored: no experts"})
    assert panel.fields["offload.vram_budget_gb"].editor.isHidden()
    assert panel.fields["offload.placement"].label.isHidden()
    assert not panel.fields["offload.cpu_threads"].editor.isHidden()
    assert "VRAM budget (GiB)" in panel.applied_note.text() and "Expert placement" in panel.applied_note.text()
