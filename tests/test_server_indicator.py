"""The local server in sight (against the scripted worker, offscreen): the main window's status bar says the
server runs, at which address, serving which model, with how many requests in flight; a click shows the
request log, refused requests included."""
from __future__ import annotations

import dataclasses
import sys
import threading

import httpx

from app.main import apply_settings, build
from app.settings import Settings
from tests.test_serve_inapp import desk  # noqa: F401 (a fixture: the app with its server on, scripted worker)

FAKE = [sys.executable, "-m", "tests.fake_worker"]


def _post(url: str, body: dict, key: str = "k1") -> dict:
    out: dict = {}

    def run() -> None:
        r = httpx.post(f"{url}/chat/completions", json=body, timeout=30, headers={"Authorization": f"Bearer {key}"})
        out["status"] = r.status_code
    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


def test_the_window_shows_the_running_server_and_its_requests(qtbot, desk):
    desk.window.show()
    indicator = desk.server_indicator
    assert indicator is not None and indicator.isVisible()
    host_port = desk.server.url.split("//")[1].split("/")[0]
    assert indicator.text() == f"○ Server {host_port} · m · idle"          # address, model id, requests
    assert desk.server.url in indicator.toolTip()

    ask = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 20}
    got = _post(desk.server.url, ask)
    qtbot.waitUntil(lambda: desk.server.history.in_flight == 1, timeout=10000)
    assert "1 request in flight" in indicator.text()
    qtbot.waitUntil(lambda: "status" in got, timeout=20000)
    qtbot.waitUntil(lambda: desk.server.history.in_flight == 0, timeout=10000)
    assert "idle" in indicator.text()

    refused = _post(desk.server.url, ask, key="wrong")                  # a client with a wrong key
    qtbot.waitUntil(lambda: "status" in refused and desk.server.history.served == 2, timeout=10000)

    dialog = indicator.show_log()                                       # a click away
    qtbot.waitUntil(dialog.isVisible, timeout=3000)
    assert desk.server.url in dialog.heading.text() and "2 served" in dialog.heading.text()
    table = dialog.table
    rows = [[table.item(r, c).text() for c in range(table.columnCount())] for r in range(table.rowCount())]
    assert len(rows) == 2
    newest, first = rows
    assert newest[2] == "POST /v1/chat/completions" and newest[3] == "401"
    assert first[3] == "200" and first[5].startswith("20") and first[6] == "token limit"
    assert first[1] == "127.0.0.1"


def test_the_indicator_follows_the_server_and_the_model(qtbot, desk):
    desk.window.show()
    indicator = desk.server_indicator
    with qtbot.waitSignal(desk.client.unloaded, timeout=10000):
        desk.window.chat.picker.eject_requested.emit()
    assert "no model loaded" in indicator.text()
    off = dataclasses.replace(desk.settings, server=dataclasses.replace(desk.settings.server, enabled=False))
    apply_settings(desk, off, reload=False)
    assert not indicator.isVisible() and desk.server.url is None
    on = dataclasses.replace(off, server=dataclasses.replace(off.server, enabled=True))
    apply_settings(desk, on, reload=False)
    assert indicator.isVisible() and desk.server.history.served == 0


def test_no_indicator_while_the_server_is_off(qtbot, monkeypatch):
    monkeypatch.setenv("FAKE_WORKER_DELAY", "0.02")
    d = build(Settings(), worker_command=FAKE, model=None)
    qtbot.addWidget(d.window)
    assert d.server is None and d.server_indicator is None
    d.gauges.timer.stop()
    d.store.close()
