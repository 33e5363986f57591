"""The local server inside the app (Settings → Local server), against the app's own engine client and the
scripted worker: API requests and chat answers share one worker (each waits for the other), the key is
checked and kept in a 0600 file, other devices need a key, and the settings page shows key and address."""
from __future__ import annotations

import dataclasses
import os
import socket
import stat
import sys
import threading

import httpx
import pytest

from app.main import apply_settings, build
from app.secrets import get_secret, secrets_path, set_secret
from app.settings import Settings, settings_path
from app.settings_panel import SERVER_KEY, SettingsPanel
from runtime.options import SamplingOptions, ServeOptions
from runtime.protocol import ChatMessage

FAKE = [sys.executable, "-m", "tests.fake_worker"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def desk(qtbot, monkeypatch):
    monkeypatch.setenv("FAKE_WORKER_DELAY", "0.02")
    set_secret(SERVER_KEY, "k1")
    settings = Settings(sampling=SamplingOptions(max_tokens=30), server=ServeOptions(enabled=True, port=free_port()))
    d = build(settings, worker_command=FAKE, model="m")
    qtbot.addWidget(d.window)
    with qtbot.waitSignal(d.client.loaded, timeout=30000):
        d.client.start()
    yield d
    d.server.stop()
    d.client.shutdown(wait=True)
    d.gauges.timer.stop()
    d.store.close()


def in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    return out


def test_api_and_chat_share_the_worker(qtbot, desk):
    url = desk.server.url
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    ask = {"model": "m", "messages": [{"role": "user", "content": "from the api"}], "max_tokens": 5}
    desk.session.send("from the chat")                                 # the chat's answer streams first...
    got = in_thread(lambda: httpx.post(f"{url}/chat/completions", json=ask, timeout=30,
                                       headers={"Authorization": "Bearer k1"}))
    qtbot.waitUntil(lambda: "r" in got and not desk.session.busy, timeout=30000)
    assert desk.session.model.items[-1].state == "done"                # ...and neither is refused as busy
    r = got["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("You said: from the api.")

    denied = in_thread(lambda: httpx.get(f"{url}/models", timeout=30))
    qtbot.waitUntil(lambda: "r" in denied, timeout=30000)
    assert denied["r"].status_code == 401


def test_key_file_other_devices_and_the_settings_page(qtbot, desk):
    set_secret(SERVER_KEY, "k1")
    assert stat.S_IMODE(os.stat(secrets_path()).st_mode) == 0o600
    set_secret(SERVER_KEY, None)
    other = dataclasses.replace(desk.settings, server=dataclasses.replace(desk.settings.server,
                                                                          allow_other_devices=True))
    apply_settings(desk, other, reload=False)
    assert desk.server.url is None and "needs an API key" in desk.window.banner.detail.text()
    assert "k1" not in settings_path().read_text()                    # keys never go to settings.json

    panel = SettingsPanel(desk.settings)
    qtbot.addWidget(panel)
    assert not panel.apply_button.isEnabled() and panel.key_status.text() == "needed for other devices"
    panel.key_edit.setText("k2")
    assert panel.apply_button.isEnabled()
    panel.set_server_address("http://127.0.0.1:1/v1")
    with qtbot.waitSignal(panel.apply_requested) as applied:
        panel.apply_button.click()
    assert get_secret(SERVER_KEY) == "k2" and applied.args[0].server.allow_other_devices


def test_switching_engines_mid_answer_and_back(qtbot, desk):
    """The chat moves to a remote engine (here the app's own server) and back; an answer cut by the switch
    keeps its text, the window and gauges follow the engine in use."""
    from app.main import SWITCHED, use_engine, use_remote
    from app.serve.remote import RemoteConfig

    desk.session.default_sampling = SamplingOptions(max_tokens=400)
    desk.session.send("long one")
    qtbot.waitUntil(lambda: len(desk.session.model.items[-1].content) > 12, timeout=10000)
    use_remote(desk, RemoteConfig(desk.server.url, "m", "k1"))
    cut = desk.session.model.items[-1]
    assert cut.state == "error" and cut.error == SWITCHED and cut.content.startswith("You said: long one.")
    qtbot.waitUntil(lambda: desk.window.loaded is not None, timeout=10000)
    assert "Remote server http://127.0.0.1" in desk.window.banner.headline.text()
    assert desk.gauges.note_text("ram") == "not available for a remote engine"
    desk.session.default_sampling = SamplingOptions(max_tokens=5)
    desk.session.send("over http")
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=30000)
    assert desk.session.model.items[-1].content.startswith("You said: over http.")

    use_engine(desk, desk.client)
    assert desk.window.loaded is desk.client.loaded_event and desk.gauges.note_text("ram") != \
        "not available for a remote engine"
    desk.session.send("local again")
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=30000)
    assert desk.session.model.items[-1].content.startswith("You said: local again.")


def test_a_remote_engine_counts_nothing_refuses_continue_and_ejects(qtbot, desk):
    """What the chat header and Continue do with a remote engine: the meter says it cannot count (no crash,
    no count), Continue is refused in words with the text kept, ⏏ stops using the server's model."""
    from app.chat.header import REMOTE_COUNT
    from app.main import use_remote
    from app.serve.remote import NO_CONTINUE, RemoteConfig

    use_remote(desk, RemoteConfig(desk.server.url, "m", "k1"))
    qtbot.waitUntil(lambda: desk.window.loaded is not None, timeout=10000)
    meter = desk.window.chat.meter
    assert meter.context is None and meter.text() == "— tokens" and meter.toolTip() == REMOTE_COUNT
    assert not desk.gauges.shown("expert_hit_rate")
    with qtbot.waitSignal(desk.engine.error, timeout=5000) as counted:
        desk.engine.count("c1", [ChatMessage("user", "hi")])
    assert counted.args[0] == "c1" and counted.args[1].code == "remote_no_count"

    desk.session.default_sampling = SamplingOptions(max_tokens=400)
    desk.session.send("long one")
    qtbot.waitUntil(lambda: len(desk.session.model.items[-1].content) > 12, timeout=10000)
    desk.session.stop()
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    kept = desk.session.model.items[-1].content
    assert desk.session.continue_answer()
    qtbot.waitUntil(lambda: not desk.session.busy, timeout=10000)
    last = desk.session.model.items[-1]
    assert last.state == "error" and last.error == NO_CONTINUE and last.content == kept

    with qtbot.waitSignal(desk.engine.unloaded, timeout=5000):
        desk.window.chat.picker.eject_requested.emit()
    assert desk.window.loaded is None and desk.engine.loaded_event is None
    assert not desk.window.chat.send_button.isEnabled()


def test_moedesk_serve_imports_neither_qt_nor_torch():
    import subprocess
    code = ("import sys; from app.launch import main; import app.serve.cli, app.serve.api, app.serve.worker_backend; "
            "print([m for m in sys.modules if m.split('.')[0] in ('PySide6', 'torch')])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_a_full_queue_answers_503_with_retry_after(qtbot, desk):
    full = dataclasses.replace(desk.settings, server=dataclasses.replace(desk.settings.server, max_queue=0))
    apply_settings(desk, full, reload=False)
    url, auth = desk.server.url, {"Authorization": "Bearer k1"}
    ask = {"model": "m", "messages": [{"role": "user", "content": "long"}], "max_tokens": 300, "stream": True}
    started, release = threading.Event(), threading.Event()

    def long_stream():
        with httpx.stream("POST", f"{url}/chat/completions", json=ask, headers=auth, timeout=30) as r:
            for _ in r.iter_lines():
                started.set()
                if release.is_set():
                    return "left"
    first = in_thread(long_stream)
    qtbot.waitUntil(started.is_set, timeout=30000)
    second = in_thread(lambda: httpx.post(f"{url}/chat/completions", json={**ask, "stream": False},
                                          headers=auth, timeout=30))
    qtbot.waitUntil(lambda: "r" in second, timeout=30000)
    release.set()
    r = second["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
    qtbot.waitUntil(lambda: "r" in first, timeout=30000)


def test_the_apps_server_answers_only_its_host_names_and_allowed_origins(qtbot, desk):
    def get(url, **headers):
        got = in_thread(lambda: httpx.get(f"{url}/models", headers={"Authorization": "Bearer k1", **headers},
                                          timeout=30))
        qtbot.waitUntil(lambda: "r" in got, timeout=30000)
        return got["r"]
    url = desk.server.url
    assert get(url, origin="http://localhost:3000").json()["error"]["code"] == "origin_not_allowed"
    assert get(url, host="evil.example").json()["error"]["code"] == "host_not_allowed"
    allowed = dataclasses.replace(desk.settings, server=dataclasses.replace(
        desk.settings.server, allowed_origins=("http://localhost:3000",), allowed_hosts=("gpu-box.lan",)))
    apply_settings(desk, allowed, reload=False)
    url = desk.server.url
    r = get(url, origin="http://localhost:3000")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert get(url, host="gpu-box.lan").status_code == 200
    bad = dataclasses.replace(allowed, server=dataclasses.replace(allowed.server, allowed_origins=("example.com",)))
    apply_settings(desk, bad, reload=False)
    assert desk.server.url is None and "allowed origin 'example.com'" in desk.window.banner.detail.text()
