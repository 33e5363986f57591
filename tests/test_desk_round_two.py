"""Round two of what got in a new user's way (real widgets offscreen, the real window and engine client
against the scripted worker, tests/fake_worker.py): each test failed before its fix."""
from __future__ import annotations

import os
import signal

import pytest
from PySide6.QtWidgets import QApplication

from app.main import build
from app.settings import Settings
from runtime.protocol import Telemetry
from tests.test_chat_session import make_desk, send  # noqa: F401 (make_desk is a fixture)
from tests.test_window_size import desk  # noqa: F401 (the window with no engine started: a fixture)


def _settle(qtbot, ms: int = 60) -> None:
    QApplication.processEvents()
    qtbot.wait(ms)


# -- the gauges dock -------------------------------------------------------------------------------

def _toggle_details(qtbot, gauges, expanded: bool) -> None:
    if gauges.details_button.isChecked() != expanded:
        gauges.details_button.click()
    qtbot.waitUntil(lambda: gauges.details.isVisible() == expanded, timeout=3000)
    _settle(qtbot)


def test_closing_details_gives_the_chat_its_room_back(qtbot, make_desk):
    d = make_desk()
    win, gauges = d.window, d.gauges
    win.resize(1280, 780)
    _settle(qtbot)
    line, view = win.gauges_dock.height(), win.chat.view.height()
    _toggle_details(qtbot, gauges, True)
    assert win.gauges_dock.height() > line + 100
    # The dock's height as a user leaves it (its separator dragged, or the window state saved and restored
    # at the next start): the main window keeps that height for it from then on.
    win.restoreState(win.saveState())
    _settle(qtbot)
    _toggle_details(qtbot, gauges, False)
    assert win.gauges_dock.height() <= line + 2 and win.chat.view.height() >= view - 2
    _toggle_details(qtbot, gauges, True)           # open across an engine restart, closed after it
    win.restoreState(win.saveState())
    with qtbot.waitSignal(d.client.loaded, timeout=30000):
        win.restart_requested.emit()
    _toggle_details(qtbot, gauges, False)
    assert win.gauges_dock.height() <= line + 2 and win.chat.view.height() >= view - 2


def test_the_cpu_busy_note_keeps_the_dock_one_line_and_is_cut_with_an_ellipsis(qtbot, desk):
    win, gauges = desk.window, desk.gauges
    win.resize(640, 440)
    _settle(qtbot)
    line = win.gauges_dock.height()
    gauges.show_telemetry(Telemetry(cpu_busy_others=3.2, cpu_threads=1))
    _settle(qtbot)
    note = gauges.cpu_note
    assert note.isVisible() and win.gauges_dock.height() == line
    assert note.geometry().right() <= gauges.details_button.geometry().left()     # in the line, not under it
    shown = note.shown_text()
    assert shown.endswith("…") and "3.2" in note.toolTip() and note.toolTip() == note.text()
    gauges.show_telemetry(Telemetry(cpu_busy_others=0.1, cpu_threads=2))
    _settle(qtbot)
    assert not note.isVisible() and win.gauges_dock.height() == line


def test_after_the_engine_dies_the_line_greys_its_last_figures(qtbot, make_desk):
    d = make_desk(max_tokens=4)
    send(qtbot, d, "Hello")
    strip = d.gauges.strip_labels
    assert "—" not in strip["decode_tps"].text() and strip["decode_tps"].isEnabled()
    with qtbot.waitSignal(d.client.worker_died, timeout=10000):
        os.kill(d.client.pid(), signal.SIGKILL)
    for key in ("decode_tps", "ttft"):
        assert not strip[key].isEnabled(), key        # as its tile: greyed, not live
    assert strip["ram"].isEnabled()


# -- the main window -------------------------------------------------------------------------------

def test_the_first_window_fits_the_screen_with_its_title_bar(qtbot, desk):
    free = desk.window.screen().availableGeometry()
    win = desk.window
    assert win.width() <= free.width() and win.height() + 24 <= free.height()    # a title bar still fits
    from app.window import first_size
    from PySide6.QtCore import QSize
    assert first_size(QSize(1920, 1080)) == (1280, 800)              # where there is room: as before
    w, h = first_size(QSize(1280, 800))
    assert h <= 800 - 40 and w <= 1280


def test_window_geometry_is_kept_under_the_apps_home(qtbot, desk):
    from runtime import paths
    desk.window.resize(700, 500)
    _settle(qtbot)
    desk.window.close()
    kept = paths.config_dir() / "window.ini"
    assert kept.is_file() and str(kept).startswith(os.environ["MOEDESK_HOME"])
    again = build(Settings(), model=None)
    qtbot.addWidget(again.window)
    again.window.restore_geometry()
    assert (again.window.width(), again.window.height()) == (700, 500)
    again.gauges.timer.stop()
    again.store.close()


def test_an_engine_error_says_what_to_do_in_words_not_its_code(qtbot, desk):
    from runtime.protocol import WorkerError
    desk.client.error.emit("load-1", WorkerError("model_not_found", "/no/such/folder: no such model folder", ""))
    detail = desk.window.banner.detail.text()
    assert "model_not_found" not in detail and "Error code" not in detail
    assert "choose one of your models" in detail
    desk.client.error.emit("x", WorkerError("internal", "the worker failed to handle a command", "Traceback…"))
    assert "internal" not in desk.window.banner.detail.text().split()


def test_the_engine_death_log_is_as_tall_as_its_lines(qtbot, desk):
    banner = desk.window.banner
    line = banner.log.fontMetrics().lineSpacing()
    desk.window.on_worker_died(9, "The engine was killed (signal 9, SIGKILL).", ["one line"])
    _settle(qtbot)
    assert banner.log.isVisible() and banner.log.height() <= 2 * line + 16
    desk.window.on_worker_died(9, "The engine was killed.", [f"line {i}" for i in range(30)])
    _settle(qtbot)
    assert 11 * line < banner.log.height() <= 12 * line + 16


def test_an_export_keeps_the_title_as_it_reads():
    from app.window import export_file_name
    assert export_file_name("Why is the sky blue? A long question about…", "md") == \
        "Why is the sky blue_ A long question about….md"
    assert export_file_name("Crème brûlée: 日本語", "json") == "Crème brûlée_ 日本語.json"
    assert export_file_name("a/b\\c\n..", "md") == "a_b_c_.md" and export_file_name(" . ", "md") == "chat.md"


# -- the chat panel --------------------------------------------------------------------------------

def test_enter_without_a_model_says_why_and_keeps_the_text(qtbot, desk):
    from PySide6.QtCore import Qt
    box = desk.window.chat.input
    box.setPlainText("Hello there")
    qtbot.keyClick(box, Qt.Key.Key_Return)
    assert "No model is loaded" in desk.window.statusBar().currentMessage()
    assert box.toPlainText() == "Hello there" and desk.session.conversation is None


def test_enter_while_the_model_loads_says_it_is_loading(qtbot, desk):
    from PySide6.QtCore import Qt
    desk.window.on_engine_state("loading")
    box = desk.window.chat.input
    box.setPlainText("Hello there")
    qtbot.keyClick(box, Qt.Key.Key_Return)
    assert "still loading" in desk.window.statusBar().currentMessage() and box.toPlainText() == "Hello there"


def test_a_long_chat_title_is_cut_with_an_ellipsis(qtbot, desk):
    win, title = desk.window, desk.window.chat.title
    win.resize(640, 440)
    conv = desk.store.create_conversation("Supercalifragilisticexpialidocious questions about quantum chromodynamics")
    desk.session.open(conv.id)
    _settle(qtbot)
    shown = title.shown_text()
    assert shown.endswith("…") and len(shown) > 4
    assert title.fontMetrics().horizontalAdvance(shown) <= title.contentsRect().width()
    assert title.toolTip() == conv.title


def test_a_long_model_name_in_the_picker_is_cut_with_an_ellipsis(qtbot, desk):
    win, combo = desk.window, desk.window.chat.picker.combo
    win.resize(640, 440)
    combo.addItem("● SmolLM2-135M-Instruct-exl2-8.0bpw-with-a-much-longer-name")
    combo.setCurrentIndex(combo.count() - 1)
    _settle(qtbot)
    shown = combo.shown_text()
    assert shown.endswith("…") and shown[:-1] in combo.currentText()
    combo.grab()                                              # paints without error


def test_the_model_picker_stays_put_as_the_meter_counts(qtbot, desk):
    win, chat = desk.window, desk.window.chat
    win.resize(1280, 760)
    _settle(qtbot)
    where = chat.picker.mapTo(win, chat.picker.rect().topLeft()), chat.picker.width()
    meter = chat.meter
    meter.set_model_context(131072)
    meter.history_tokens, meter.total_tokens, meter._typed = 123456, 124000, "typed"
    meter._show()
    _settle(qtbot)
    assert (chat.picker.mapTo(win, chat.picker.rect().topLeft()), chat.picker.width()) == where
    assert meter.isVisible() and meter.width() >= meter.sizeHint().width()


def test_the_meter_counts_the_question_while_its_answer_streams(qtbot, make_desk):
    d = make_desk(delay=0.05, max_tokens=200)
    meter = d.window.chat.meter
    send(qtbot, d, "one two three four five", wait=False)
    assert d.session.busy
    qtbot.waitUntil(lambda: (meter.used or 0) > 0, timeout=5000)
    assert meter.used == 4 + 5 and d.session.busy              # the scripted count: 4 a message + its words
    d.window.chat.escape()
    qtbot.waitUntil(lambda: not d.session.busy, timeout=5000)


def test_the_meter_counts_a_message_being_edited_once(qtbot, make_desk):
    d = make_desk(max_tokens=3)
    send(qtbot, d, "one two three")
    meter, chat = d.window.chat.meter, d.window.chat
    first = d.session.model.items[0]
    chat.begin_edit(first.id)
    assert chat.input.toPlainText() == "one two three"
    qtbot.waitUntil(lambda: meter.total_tokens is not None and not meter._asked, timeout=5000)
    assert meter.used == 4 + 3                 # the edited message's new text, not it and its old text
    chat.escape()                              # the edit cancelled: the whole chat again
    qtbot.waitUntil(lambda: meter.used is not None and meter.used > 7 and not meter._asked, timeout=5000)


# -- the messages ----------------------------------------------------------------------------------

def _anchors(doc):
    """{href: (block, first char, end char)} of a rendered message's links."""
    out = {}
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.isValid() and frag.charFormat().isAnchor():
                href = frag.charFormat().anchorHref()
                start, end = frag.position() - block.position(), frag.position() + frag.length() - block.position()
                b, s0, _ = out.get(href, (block, start, end))
                out[href] = (b, s0, end)
            it += 1
        block = block.next()
    return out


def _answer_doc(desk, qtbot, size):
    from app.chat.model import ChatItem
    from runtime.records import GenerationStats
    desk.window.resize(*size)
    model = desk.session.model
    model.append(ChatItem(1, "user", "Tell me a story about a lighthouse"))
    model.append(ChatItem(2, "assistant", "Once upon a time…", model="SmolLM2-135M-Instruct-exl2-8.0bpw",
                          stats=GenerationStats(38, 160, 0.19, 200.0, 21.5, 7.6), version=2, versions=3))
    _settle(qtbot)
    view = desk.window.chat.view
    opt = view._option()
    return view.delegate.document(model.index(1), view.delegate._text_width(opt), opt.font).doc


def test_message_links_never_break_inside_a_word(qtbot, desk):
    """At 640x440 the answer's text is some 380 px wide; a chat list dragged wider or a larger font makes
    it narrower: at every width each link stays whole on its line (it used to break, "Regen|erate")."""
    from app.chat import markdown
    doc = _answer_doc(desk, qtbot, (640, 440))
    view = desk.window.chat.view
    opt = view._option()
    index = desk.session.model.index(1)
    for width in range(260, 720, 20):
        doc = view.delegate.document(index, width, opt.font).doc
        doc.size()                                      # laid out at this width
        links = _anchors(doc)
        assert {markdown.app_link(k) for k in ("older", "newer", "copy", "regenerate", "fork")} <= set(links)
        for href, (block, start, end) in links.items():
            layout = block.layout()
            first, last = layout.lineForTextPosition(start), layout.lineForTextPosition(end - 1)
            assert first.lineNumber() == last.lineNumber(), (width, href)


def test_the_version_arrows_are_clickable_targets(qtbot, desk):
    from app.chat import markdown
    doc = _answer_doc(desk, qtbot, (1280, 760))
    links = _anchors(doc)
    for kind in ("older", "newer"):
        block, start, end = links[markdown.app_link(kind)]
        line = block.layout().lineForTextPosition(start)
        width = line.cursorToX(end)[0] - line.cursorToX(start)[0]
        assert width >= 20 and line.height() >= 18, (kind, width, line.height())


# -- the chat list ---------------------------------------------------------------------------------

def _rows_fit(lst) -> list:
    """Rows whose room in the list differs from their painted entry's height (with its group's heading, where
    it is the first of a group): taller, it spills over the next row (the selection's highlight and text over
    the next title); shorter, it leaves a gap."""
    from PySide6.QtWidgets import QStyleOptionViewItem
    bad, bottom = [], None
    for i in range(lst.count()):
        rect = lst.visualItemRect(lst.item(i))
        opt = QStyleOptionViewItem()
        opt.rect, opt.font, opt.fontMetrics = rect, lst.font(), lst.fontMetrics()
        index = lst.model().index(i, 0)
        delegate = lst.itemDelegate()
        need = delegate._doc(opt, index).size().height() + delegate._heading_height(opt, index)
        if abs(need - rect.height()) > 1 or (bottom is not None and rect.top() < bottom):
            bad.append((i, rect, need))
        bottom = rect.bottom() + 1
    return bad


def test_each_chat_entry_keeps_to_its_row_at_any_width(qtbot, desk):
    win, lst = desk.window, desk.window.conversations.list
    win.resize(1280, 760)
    _settle(qtbot)
    for title in ("Hello there, how are you today", "What is the capital of France and why is it there?",
                  "Short"):                  # as a new user makes them: a chat, Ctrl+N, another
        c = desk.store.create_conversation(title)
        desk.store.add_message(c.id, "user", title)
        desk.window.conversations.refresh(select=c.id)
        _settle(qtbot)
        assert _rows_fit(lst) == []
    win.resize(640, 440)                     # the list narrows: titles wrap onto more lines
    _settle(qtbot, 150)
    assert _rows_fit(lst) == []
    win.resize(1280, 760)
    _settle(qtbot, 150)
    assert _rows_fit(lst) == []


# -- settings --------------------------------------------------------------------------------------

APPLIED_ON_CPU = {      # what the worker reports for the demo model on the CPU engine (its `loaded` event)
    "offload.backend": "applied: cpu (No NVIDIA GPU found: models run on the CPU.)",
    "offload.context_length": "applied",
    "offload.cpu_threads": "applied: automatic, up to 2 (the physical cores less those other programs keep busy)",
    "offload.vram_budget_gb": "ignored: CPU reference engine uses no GPU memory",
    "offload.ram_budget_gb": "ignored: CPU reference engine keeps every weight in RAM",
    "offload.kv_cache": "ignored: CPU reference engine keeps the cache in bfloat16",
    "offload.placement": "ignored: CPU reference engine computes every expert on the CPU"}


def _cut_labels(root, viewport) -> list:
    """Visible labels of `root` that reach past `viewport` or whose wrapped text is taller than the label."""
    from PySide6.QtCore import QPoint
    from PySide6.QtWidgets import QLabel
    out = []
    for label in root.findChildren(QLabel):
        if not label.isVisibleTo(root) or not label.text():
            continue
        right = label.mapTo(viewport, QPoint(label.width(), 0)).x()
        if right > viewport.width() + 1:
            out.append(("past the edge", label.text()[:40], right, viewport.width()))
        elif label.wordWrap() and label.heightForWidth(label.width()) > label.height() + 1:
            out.append(("cut", label.text()[:40], label.heightForWidth(label.width()), label.height()))
        elif not label.wordWrap() and label.sizeHint().width() > label.width() + 1 and label.minimumWidth() == 0 \
                and not hasattr(label, "shown_text"):
            out.append(("clipped", label.text()[:40], label.sizeHint().width(), label.width()))
    return out


@pytest.mark.parametrize("loaded", [False, True])
def test_settings_at_their_default_size_need_no_sideways_scroll_and_cut_no_text(qtbot, loaded):
    from PySide6.QtWidgets import QScrollArea
    from app.settings_panel import SettingsPanel
    panel = SettingsPanel(Settings(), has_model=loaded)
    qtbot.addWidget(panel)
    if loaded:
        panel.show_applied(APPLIED_ON_CPU)
    panel.show()
    _settle(qtbot, 100)
    scroll = panel.findChild(QScrollArea)
    assert scroll.horizontalScrollBar().maximum() == 0
    assert _cut_labels(scroll.widget(), scroll.viewport()) == []


# -- the model manager -----------------------------------------------------------------------------

@pytest.fixture
def manager(qtbot, tmp_path):
    from app.models_dialog import ModelManagerDialog
    d = ModelManagerDialog(models_dir=tmp_path / "models")
    qtbot.addWidget(d)
    yield d
    d.shutdown()


def test_download_and_the_job_buttons_are_enabled_only_where_they_apply(qtbot, manager):
    from app.hub.download import DownloadProgress, JobState
    d = manager
    d.set_memory(24 * 1024 ** 3, 64 * 1024 ** 3, "Test GPU")
    d.show()
    d.tabs.setCurrentIndex(1)
    assert d.quant_table.rowCount() == 0 and not d.download_button.isEnabled()      # nothing to download
    assert "Pick a model" in d.download_button.toolTip()
    buttons = (d.pause_button, d.resume_button, d.cancel_button)
    assert d.download_table.rowCount() == 0 and not any(b.isEnabled() for b in buttons)   # an empty list
    d._on_download_event(DownloadProgress("x--4.0bpw", JobState.RUNNING, 10, 100, 1e6, 90.0, "f", "Downloading"))
    assert [b.isEnabled() for b in buttons] == [True, False, True]
    d._on_download_event(DownloadProgress("x--4.0bpw", JobState.PAUSED, 10, 100, 0.0, None, "f", "Paused"))
    assert [b.isEnabled() for b in buttons] == [False, True, True]
    d._on_download_event(DownloadProgress("x--4.0bpw", JobState.DONE, 100, 100, 0.0, None, "", "Done"))
    assert not any(b.isEnabled() for b in buttons)


def test_recommended_models_read_whole_without_a_sideways_scroll(qtbot, manager):
    from PySide6.QtCore import QRect, Qt
    d = manager
    d.resize(1000, 640)
    d.set_memory(0, 64 * 1024 ** 3, "No NVIDIA GPU (no NVIDIA driver is installed)")   # the CPU engine's list
    d.show()
    d.tabs.setCurrentIndex(1)
    _settle(qtbot, 100)
    lst = d.repo_list
    assert lst.count() >= 1 and "runs on the CPU engine" in lst.item(0).text()
    assert lst.horizontalScrollBar().maximum() == 0
    fm = lst.fontMetrics()
    for i in range(lst.count()):
        rect = lst.visualItemRect(lst.item(i))
        assert rect.right() <= lst.viewport().width()
        need = fm.boundingRect(QRect(0, 0, rect.width(), 10_000), Qt.TextFlag.TextWordWrap, lst.item(i).text())
        assert need.height() <= rect.height(), lst.item(i).text()


def test_no_gpu_is_said_in_words_in_the_model_manager(qtbot, manager, monkeypatch):
    import pynvml
    from app.hub.fit import detect_memory

    def refuse():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setattr(pynvml, "nvmlInit", refuse)
    vram, ram, words = detect_memory()
    assert vram == 0 and "NVMLError" not in words and "no NVIDIA driver is installed" in words
    manager.set_memory(vram, ram, words)
    assert "NVMLError" not in manager.memory_label.text() and "0 B VRAM" not in manager.memory_label.text()


def test_last_used_is_the_last_answer_not_the_load(qtbot, make_desk):
    from pathlib import Path
    from app.hub.local import last_used_map, mark_used
    d = make_desk(max_tokens=2)
    folder = Path(d.client.loaded_event.path)
    mark_used(folder, when=1000.0)                 # loaded long ago
    send(qtbot, d, "Hello")
    assert last_used_map()[folder.name] > 1000.0


def test_load_while_loading_says_it_is_loading(qtbot, make_desk):
    from app.main import load_model
    d = make_desk()
    d.client.load("some-other-model", d.settings.load)       # a load in flight (the scripted worker is slow to
    assert d.client._loading is not None                      # answer only after its progress event)
    load_model(d, "some-other-model")
    words = d.window.statusBar().currentMessage()
    assert "being loaded" in words and "loaded already" not in words
