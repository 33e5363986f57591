"""Settings file: defaults, round trip, atomic writes, and recovery from a broken file."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from app import settings as st
from runtime import paths
from runtime.options import OffloadOptions, OptionError


def test_missing_file_gives_defaults_without_warning():
    r = st.load_settings()
    assert r.settings == st.Settings() and r.warning is None and r.backup is None
    assert st.settings_path() == paths.config_dir() / "settings.json"


def test_round_trip():
    s = st.Settings()
    s = dataclasses.replace(
        s, app=dataclasses.replace(s.app, last_model="demo", theme="dark"),
        load=dataclasses.replace(s.load, offload=OffloadOptions(vram_budget_gb=12.5, kv_cache="q4")))
    path = st.save_settings(s)
    assert path == st.settings_path()
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["load"]["offload"]["kv_cache"] == "q4"
    r = st.load_settings()
    assert r.settings == s and r.warning is None


def test_partial_file_fills_defaults():
    st.settings_path().parent.mkdir(parents=True)
    st.settings_path().write_text('{"app": {"theme": "light"}}')
    r = st.load_settings()
    assert r.warning is None
    assert r.settings.app.theme == "light" and r.settings.load == st.Settings().load


@pytest.mark.parametrize("body, words", [
    ('{"app": {"theme": "light"', "not valid JSON"),
    ('[1, 2]', "expected an object"),
    ('{"load": {"offload": {"kv_cache": "q5"}}}', "load.offload.kv_cache"),
    ('{"load": {"offload": {"context_length": "long"}}}', "expected a whole number"),
    ('{"sampling": {"tempreature": 1}}', "unknown option(s) tempreature"),
    ('{"version": 7}', "settings version 7"),
    (b'\xff\xfe garbage', "could not be read"),
])
def test_broken_file_is_backed_up_and_defaults_used(body, words):
    path = st.settings_path()
    path.parent.mkdir(parents=True)
    if isinstance(body, bytes):
        path.write_bytes(body)
    else:
        path.write_text(body)
    r = st.load_settings()
    assert r.settings == st.Settings()
    assert r.warning is not None and words in r.warning
    assert "Default settings are in use" in r.warning and r.backup.name in r.warning
    assert not path.exists()
    assert r.backup.parent == path.parent and r.backup.name.startswith("settings.json.bak-")
    assert r.backup.read_bytes() == (body if isinstance(body, bytes) else body.encode())
    # Saving afterwards writes a good file; the next start is clean.
    st.save_settings(r.settings)
    assert st.load_settings().warning is None


def test_two_backups_in_the_same_second_do_not_collide():
    path = st.settings_path()
    path.parent.mkdir(parents=True)
    backups = set()
    for _ in range(2):
        path.write_text("nope")
        backups.add(st.load_settings().backup)
    assert len(backups) == 2 and all(b.exists() for b in backups)


def test_atomic_write_keeps_old_file_when_writing_fails(monkeypatch):
    st.save_settings(st.Settings())
    before = st.settings_path().read_text()

    def boom(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    changed = dataclasses.replace(st.Settings(), app=st.AppSettings(theme="dark"))
    with pytest.raises(OSError, match="disk full"):
        st.save_settings(changed)
    assert st.settings_path().read_text() == before
    assert [p.name for p in st.settings_path().parent.iterdir()] == ["settings.json"]   # no temp left


def test_parse_settings_names_the_field():
    with pytest.raises(OptionError) as e:
        st.parse_settings({"app": {"theme": "neon"}})
    assert e.value.path == "app.theme" and "neon" in e.value.problem


@pytest.mark.parametrize("body", [
    "[" * 100_000 + "]" * 100_000,                                  # RecursionError in the JSON parser
    '{"app": ' + '{"a": ' * 50_000 + "1" + "}" * 50_001,
    '{"app": [1, 2]}', '{"app": "dark"}', '{"load": 3}', '{"sampling": null}',
    '{"app": {"theme": ["dark"]}}', '{"app": {"last_model": {"x": 1}}}', '{"app": {"show_gauges": "yes"}}',
    '{"sampling": {"temperature": 1e999}}', '{"sampling": {"seed": "' + "9" * 100_000 + '"}}',
    '{"sampling": {"stop": [1, {"a": []}]}}', '{"load": {"offload": {"vram_budget_gb": -1e308}}}',
    '{"version": [1]}', '{"version": {"a": 1}}',
])
def test_any_hostile_settings_file_is_backed_up_and_defaults_used(body):
    path = st.settings_path()
    path.parent.mkdir(parents=True)
    path.write_text(body)
    r = st.load_settings()
    assert r.settings == st.Settings() or r.warning is None        # accepted only where it is valid
    if r.warning is not None:
        assert "Default settings are in use" in r.warning and r.backup.read_text() == body


def test_any_exception_while_parsing_is_a_warning(monkeypatch):
    path = st.settings_path()
    path.parent.mkdir(parents=True)
    path.write_text('{"app": {}}')
    monkeypatch.setattr(st, "parse_settings", lambda data: (_ for _ in ()).throw(MemoryError()))
    r = st.load_settings()
    assert r.settings == st.Settings() and "MemoryError" in r.warning
