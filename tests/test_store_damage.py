"""A damaged or foreign conversations file never stops the app: it is kept beside a fresh store, the user is
told where, and what can be read is recovered. A second app instance leaves the first one's answer alone."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.options import SamplingOptions
from app.store import SCHEMA_VERSION, Store
from app.store_recovery import open_store

ROOT = Path(__file__).resolve().parents[1]


def filled(path: Path, chats: int = 40) -> list[tuple[str, list[str]]]:
    """A store with `chats` conversations of 3 messages each (bulky text so the file spans many pages)."""
    s = Store(path)
    made = []
    for i in range(chats):
        c = s.create_conversation(f"chat {i}")
        texts = [f"question {i} " + "q" * 300, f"answer {i} " + "a" * 900, f"more {i}"]
        for j, t in enumerate(texts):
            s.add_message(c.id, "user" if j % 2 == 0 else "assistant", t)
        made.append((f"chat {i}", texts))
    s.save_preset("terse", "Be brief.", SamplingOptions(top_k=5))
    s.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    s.close()
    return made


def kept_files(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.iterdir() if p.name != path.name and "damaged" in p.name)


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "100 B":
        path.write_bytes(data[:100])
    elif how == "4 KB":
        path.write_bytes(data[:4096])
    elif how == "half":
        path.write_bytes(data[:len(data) // 2])
    elif how == "header":
        path.write_bytes(b"\xff" * 100 + data[100:])
    elif how == "0 B":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))


@pytest.mark.parametrize("how", ["100 B", "4 KB", "half", "header", "0 B", "garbage"])
def test_a_damaged_file_is_kept_aside_and_a_fresh_store_opens(tmp_path, how):
    path = tmp_path / "conversations.sqlite3"
    made = filled(path)
    damage(path, how)
    damaged_bytes = path.read_bytes()
    store, notice = open_store(path)
    assert store.version() == SCHEMA_VERSION and store.path == path
    (kept,) = [p for p in kept_files(path) if p.suffix == ".sqlite3"]
    assert kept.read_bytes() == damaged_bytes                    # untouched, for the user or a tool
    assert str(kept) in notice and "conversations" in notice.lower()
    store.create_conversation("works")                           # the fresh store is usable
    recovered = {c.title: [m.content for m in store.messages(c.id)] for c in store.conversations()}
    if how in ("half", "header"):                               # pages are there: rows come back
        assert len([t for t in recovered if t.startswith("chat ")]) >= (10 if how == "half" else len(made))
        for title, texts in made:
            if title in recovered:
                assert recovered[title] == texts[:len(recovered[title])]
        assert "recovered" in notice
    if how == "header":
        assert [p.name for p in store.presets()] == ["terse"]
    store.close()


def test_the_wal_travels_with_the_damaged_file(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    filled(path, chats=3)
    Path(str(path) + "-wal").write_bytes(b"not a wal" * 10)
    path.write_bytes(b"\xff" * 100 + path.read_bytes()[100:])
    store, notice = open_store(path)
    names = {p.name for p in kept_files(path)}
    stem = next(n for n in names if n.endswith(".sqlite3"))
    assert stem + "-wal" in names
    assert not Path(str(path) + "-wal").exists() or Path(str(path) + "-wal").read_bytes() != b"not a wal" * 10
    store.close()


def test_a_healthy_file_opens_without_a_notice(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    filled(path, chats=2)
    store, notice = open_store(path)
    assert notice == "" and len(store.conversations()) == 2 and kept_files(path) == []


@pytest.mark.parametrize("version", ["99", "'two'", "-1"])
def test_a_schema_version_from_the_future_or_as_text(tmp_path, version):
    path = tmp_path / "conversations.sqlite3"
    filled(path, chats=2)
    db = sqlite3.connect(path)
    db.execute(f"UPDATE schema_version SET version = {version}")
    db.commit()
    db.close()
    before = path.read_bytes()
    store, notice = open_store(path)
    assert store.version() == SCHEMA_VERSION
    if version == "99":
        # Written by a newer app: left exactly where and as it is (that app will find it), never downgraded.
        assert path.read_bytes() == before and store.path != path
        assert "newer" in notice and str(path) in notice and str(store.path) in notice
        store.create_conversation("in the older app")
        store.close()
        again, notice2 = open_store(path)                        # the next start uses the same side store
        assert again.path == store.path and "in the older app" in [c.title for c in again.conversations()]
        again.close()
    else:
        assert store.path == path and "recovered 2 conversations" in notice
        assert sorted(c.title for c in store.conversations()) == ["chat 0", "chat 1"]
        store.close()


def test_the_app_starts_on_a_damaged_file_and_says_so(qtbot, tmp_path, monkeypatch):
    from app.main import build
    from app.settings import Settings
    from app.store import default_path
    default_path().parent.mkdir(parents=True, exist_ok=True)
    default_path().write_bytes(b"SQLite format 3\0" + b"\x01" * 84)
    desk = build(Settings(), worker_command=[sys.executable, "-c", "pass"], model=None)
    qtbot.addWidget(desk.window)
    assert desk.window.notice.isVisibleTo(desk.window)
    assert "damaged" in desk.window.notice.text.text() and str(default_path().parent) in desk.window.notice.text.text()
    desk.store.close()


# -- two app instances: only answers whose writer is gone are interrupted

def test_a_second_instance_leaves_the_first_ones_streaming_answer_alone(tmp_path):
    path = tmp_path / "c.sqlite3"
    first = Store(path)
    c = first.create_conversation()
    a = first.add_message(c.id, "assistant", "", state="streaming")
    second = Store(path)
    assert second.mark_interrupted("interrupted") == 0
    assert second.message(a.id).state == "streaming"
    first.update_message(a.id, content="still going", state="done")
    assert second.message(a.id).state == "done"
    second.close()
    first.close()


STREAMER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from app.store import Store
    s = Store(Path(sys.argv[1]))
    c = s.create_conversation("streaming")
    m = s.add_message(c.id, "assistant", "", state="streaming")
    s.update_message(m.id, content="half an answer")
    print(m.id, flush=True)
    time.sleep(60)
""")


def test_an_answer_whose_process_died_is_interrupted_and_keeps_its_text(tmp_path):
    path = tmp_path / "c.sqlite3"
    proc = subprocess.Popen([sys.executable, "-c", STREAMER, str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    mid = int(proc.stdout.readline())
    other = Store(path)
    assert other.mark_interrupted("interrupted") == 0              # its writer is alive
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert other.mark_interrupted("interrupted") == 1              # now it is gone
    m = other.message(mid)
    assert (m.state, m.content, m.error) == ("error", "half an answer", "interrupted")
    other.close()
