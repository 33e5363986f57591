"""A damaged secrets.json (not UTF-8, nested, not an object of texts, unreadable) never stops the app or the model
manager: it is set aside with a notice, every key that can be read is kept, and no save loses keys."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import sys

import pytest

from app import secrets
from app.secrets import SecretsError, check_file, get_secret, secrets_path, set_secret
from app.settings_panel import SERVER_KEY

NESTED = "[" * 100_000 + "]" * 100_000


def write(raw: bytes) -> None:
    secrets_path().parent.mkdir(parents=True, exist_ok=True)
    secrets_path().write_bytes(raw)
    os.chmod(secrets_path(), 0o600)


def set_aside() -> list:
    return sorted(secrets_path().parent.glob("secrets.json.damaged-*"))


@pytest.mark.parametrize("raw, problem", [
    (b'{"server_api_key": "k1", "remote:https://a/v1": "\xff\xfe", "remote:https://b/v1": "k2"}',
     "not valid UTF-8 (at byte"),
    (b'{"server_api_key": "k1", "x": ' + NESTED.encode() + b', "remote:https://b/v1": "k2"}', "nested too deeply"),
    (b'{"server_api_key": "k1", "x": {"remote:https://a/v1": "hoisted?"}, "remote:https://b/v1": "k2"}',
     "not an object of names and texts"),
    (b'{"server_api_key": "k1", "remote:https://b/v1": "k2", "cut": "', "not valid JSON"),
])
def test_a_damaged_file_is_set_aside_and_its_readable_keys_kept(raw, problem):
    write(raw)
    assert get_secret(SERVER_KEY) == "k1"
    (kept,) = set_aside()
    assert kept.read_bytes() == raw and stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert json.loads(secrets_path().read_text()) == {"server_api_key": "k1", "remote:https://b/v1": "k2"}
    assert stat.S_IMODE(secrets_path().stat().st_mode) == 0o600
    notice = check_file()
    assert problem in notice and kept.name in notice and "2 key(s)" in notice
    assert check_file() is None                                    # told once
    set_secret("remote:https://c/v1", "k3")                        # a save loses nothing that was kept
    assert json.loads(secrets_path().read_text()) == {"server_api_key": "k1", "remote:https://b/v1": "k2",
                                                      "remote:https://c/v1": "k3"}
    assert len(set_aside()) == 1


@pytest.mark.parametrize("raw", [NESTED.encode(), b'["k1"]', b"\xff" * 10, b'"text"', b"x" * (secrets.MAX_BYTES + 5)])
def test_a_file_with_nothing_to_keep_is_set_aside_and_the_app_goes_on(raw):
    write(raw)
    assert get_secret(SERVER_KEY) is None
    assert set_aside()[0].read_bytes() == raw and json.loads(secrets_path().read_text()) == {}
    assert "0 key(s)" in check_file()


def test_a_file_that_cannot_be_read_is_never_overwritten():
    secrets_path().mkdir(parents=True)                             # not a file: unreadable as one
    assert get_secret(SERVER_KEY) is None
    with pytest.raises(SecretsError, match="secrets.json cannot be read .* not rewritten"):
        set_secret(SERVER_KEY, "k1")
    assert secrets_path().is_dir() and set_aside() == []


def test_a_healthy_file_is_left_as_it_is():
    set_secret(SERVER_KEY, "k1")
    set_secret("remote:https://b/v1", "k2")
    set_secret("remote:https://b/v1", None)
    assert json.loads(secrets_path().read_text()) == {"server_api_key": "k1"}
    assert check_file() is None and set_aside() == []


def test_the_app_starts_with_the_local_server_on_and_the_model_manager_opens(qtbot, monkeypatch):
    """A nested secrets.json once stopped the app from starting (server on) and the model manager from opening."""
    from app.main import build, open_models
    from app.settings import AppSettings, Settings
    from runtime.options import ServeOptions
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    write(b'{"server_api_key": "k1", "deep": ' + NESTED.encode() + b"}")
    settings = Settings(server=ServeOptions(enabled=True, port=port),
                        app=dataclasses.replace(AppSettings(), remote_url="https://b/v1"))
    desk = build(settings, worker_command=[sys.executable, "-m", "tests.fake_worker"], model=None)
    qtbot.addWidget(desk.window)
    try:
        assert desk.server is not None
        assert "Secrets file damaged" in desk.window.notice.text.text()
        assert "nested too deeply" in desk.window.notice.text.text()
        assert get_secret(SERVER_KEY) == "k1"
        write(b'{"remote:https://b/v1": "k2", "x": ' + NESTED.encode() + b"}")
        dialog = open_models(desk)                                 # reads the remote server's key
        assert dialog.isVisible()
        assert desk.window.notice.text.text().count("Secrets file damaged") == 2
        assert get_secret("remote:https://b/v1") == "k2"
        dialog.shutdown()
    finally:
        desk.server.stop()
        desk.client.shutdown(wait=True)
        desk.gauges.timer.stop()
        desk.store.close()
