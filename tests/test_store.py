"""The conversation store: migrations, streaming saves, concurrent instances, search, export, presets."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app import store as store_mod
from app.store import SCHEMA_VERSION, Store, StoreError
from runtime.options import SamplingOptions
from runtime.protocol import DraftStats, GenerationStats

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "conv.sqlite3"


def test_new_database_is_wal_and_current_version(db_path):
    s = Store(db_path)
    assert s.version() == SCHEMA_VERSION
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert s.db.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000


def test_default_path_is_in_the_data_dir(tmp_path):
    from runtime import paths
    assert store_mod.default_path().parent == paths.data_dir()
    s = Store()
    assert s.path.exists()


def test_migrates_a_v1_database_with_data_intact(db_path):
    v1 = Store(db_path, target_version=1)
    assert v1.version() == 1
    # Only v1 columns exist: write with plain SQL as a v1 app would have.
    cols = [r[1] for r in v1.db.execute("PRAGMA table_info(conversations)")]
    assert "system_prompt" not in cols
    v1.db.execute("INSERT INTO conversations (id, title, created, updated, model) VALUES (1, 'Old chat', 1.0, 2.0, 'demo')")
    v1.db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'user', 'hello there', 1.5)")
    v1.db.execute("INSERT INTO messages (conversation_id, role, content, created, state, error)"
                  " VALUES (1, 'assistant', 'General Kenobi', 1.6, 'error', 'worker died')")
    v1.close()

    s = Store(db_path)
    assert s.version() == SCHEMA_VERSION
    conv = s.conversation(1)
    assert (conv.title, conv.model, conv.system_prompt, conv.sampling) == ("Old chat", "demo", "", None)
    msgs = s.messages(1)
    assert [(m.role, m.content, m.state, m.error) for m in msgs] == [
        ("user", "hello there", "done", ""), ("assistant", "General Kenobi", "error", "worker died")]
    # The v2 features work on the migrated file, and the old text is searchable.
    s.set_conversation_settings(1, "Be brief.", SamplingOptions(temperature=0.2), "terse")
    assert s.conversation(1).sampling.temperature == 0.2
    s.save_preset("terse", "Be brief.", SamplingOptions(top_k=5))
    assert [p.name for p in s.presets()] == ["terse"]
    assert [h.conversation_id for h in s.search("kenobi")] == [1]


def test_newer_schema_is_refused_with_a_clear_error(db_path):
    s = Store(db_path)
    s.db.execute("UPDATE schema_version SET version = 99")
    s.close()
    with pytest.raises(StoreError, match="schema version 99 is newer"):
        Store(db_path)


def test_not_a_database_names_the_file(db_path):
    db_path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError, match=str(db_path.name)):
        Store(db_path)


def test_conversation_and_message_round_trip(db_path):
    s = Store(db_path)
    c = s.create_conversation("Trip", model="demo")
    u = s.add_message(c.id, "user", "Plan a trip")
    a = s.add_message(c.id, "assistant", "", model="demo", state="streaming")
    s.update_message(a.id, content="Day 1: ")
    stats = GenerationStats(prompt_tokens=10, generated_tokens=3, ttft_s=0.1, prefill_tps=100.0,
                            decode_tps=50.0, total_s=0.2, draft=DraftStats(mode="ngram", drafted_tokens=4))
    s.update_message(a.id, content="Day 1: Paris", state="done", stats=stats)
    msgs = s.messages(c.id)
    assert [m.id for m in msgs] == [u.id, a.id]
    assert msgs[1].content == "Day 1: Paris" and msgs[1].state == "done"
    assert msgs[1].stats == stats
    s.rename_conversation(c.id, "  Paris trip ")
    assert s.conversation(c.id).title == "Paris trip"
    with pytest.raises(ValueError, match="empty"):
        s.rename_conversation(c.id, "  ")
    with pytest.raises(ValueError, match="role 'robot'"):
        s.add_message(c.id, "robot", "x")
    s.supersede(c.id, a.id)
    assert [m.id for m in s.messages(c.id)] == [u.id]
    s.delete_conversation(c.id)
    assert s.conversations() == []


def test_streaming_text_is_on_disk_before_the_answer_finishes(db_path):
    """A second connection (another process after a crash) sees every flushed part."""
    s = Store(db_path)
    c = s.create_conversation()
    a = s.add_message(c.id, "assistant", "", state="streaming")
    s.update_message(a.id, content="partial answer")
    other = sqlite3.connect(db_path)
    assert other.execute("SELECT content, state FROM messages WHERE id = ?", (a.id,)).fetchone() == (
        "partial answer", "streaming")
    # A later start turns what a crash left streaming into an error that keeps the text (once its writer is
    # gone: a live instance's answer is left alone, tests/test_store_damage.py).
    s.close()
    s2 = Store(db_path)
    assert s2.mark_interrupted("The app closed while this answer was being written.") == 1
    m = s2.message(a.id)
    assert (m.content, m.state) == ("partial answer", "error")


WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from app.store import Store
    s = Store(Path(sys.argv[1]))
    c = s.create_conversation("writer " + sys.argv[2])
    for i in range(150):
        m = s.add_message(c.id, "user", f"message {i} from {sys.argv[2]}")
        s.update_message(m.id, content=f"message {i} from {sys.argv[2]} edited")
        s.search("message")
""")


def test_two_app_instances_write_concurrently_without_corruption(db_path):
    Store(db_path).close()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(db_path), name], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    # This process reads and writes at the same time too.
    s = Store(db_path)
    mine = s.create_conversation("reader")
    for i in range(50):
        s.add_message(mine.id, "assistant", f"reply {i}")
        s.conversations()
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert s.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    by_title = {c.title: c for c in s.conversations()}
    for name in ("a", "b"):
        msgs = s.messages(by_title[f"writer {name}"].id)
        assert len(msgs) == 150 and all(m.content.endswith("edited") for m in msgs)
    assert len(s.messages(mine.id)) == 50
    if s.fts:
        assert s.db.execute("INSERT INTO messages_fts(messages_fts) VALUES ('integrity-check')") is not None


@pytest.mark.parametrize("use_fts", [True, False])
def test_search_by_title_and_content(db_path, use_fts):
    if use_fts and not store_mod.fts5_available():
        pytest.skip("this SQLite has no FTS5")
    s = Store(db_path, use_fts=use_fts)
    assert s.fts is use_fts
    a = s.create_conversation("Rust lifetimes")
    s.add_message(a.id, "user", "What does 'static mean?")
    b = s.create_conversation("Dinner")
    s.add_message(b.id, "user", "A recipe with mushrooms and thyme, please")
    m = s.add_message(b.id, "assistant", "", state="streaming")
    s.update_message(m.id, content="Try a risotto with 100% arborio_rice")
    assert [h.conversation_id for h in s.search("rust")] == [a.id]
    hits = s.search("mushroom thyme")
    assert [h.conversation_id for h in hits] == [b.id] and "mushroom" in hits[0].snippet.lower()
    assert [h.conversation_id for h in s.search("risotto")] == [b.id]     # text saved while streaming
    assert s.search("mushrooms rust") == []
    assert s.search("   ") == []
    # Characters that mean something to FTS or LIKE are plain text.
    assert s.search('"unbalanced') == [] and s.search("100%") != [] and s.search("a%z") == []
    s.delete_conversation(b.id)
    assert s.search("risotto") == []


def test_export_markdown_and_json(db_path):
    s = Store(db_path)
    c = s.create_conversation("Capitals", model="demo", system_prompt="Answer in one line.",
                              sampling=SamplingOptions(temperature=0.0, max_tokens=32))
    s.add_message(c.id, "user", "What is the capital of France?")
    a = s.add_message(c.id, "assistant", "The capital of France is Paris.", model="demo")
    s.update_message(a.id, stats=GenerationStats(9, 8, 0.05, 180.0, 60.0, 0.2))
    md = s.export_markdown(c.id)
    assert md.startswith("# Capitals\n")
    assert "Answer in one line." in md and "## You\n\nWhat is the capital of France?" in md
    assert "## Assistant (SmolLM2-135M-Instruct-exl2-8.0bpw)\n\nThe capital of France is Paris." in md
    data = json.loads(s.export_json(c.id))
    assert data["title"] == "Capitals" and data["sampling"]["max_tokens"] == 32
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][1]["stats"]["decode_tps"] == 60.0


def test_export_markdown_names_the_model_not_its_folder(db_path):
    """The stored model is the folder it was loaded from: the export shows its display name, on one line."""
    s = Store(db_path)
    c = s.create_conversation("Paths")
    for model in ("/home/ann/models/Qwen3-30B-A3B-exl2-4.0bpw", "C:\\Users\\ann\\models\\Mixtral-exl2\\",
                  "/srv/m/evil\n## You\n[x]<b>"):
        s.add_message(c.id, "assistant", "ok", model=model)
    md = s.export_markdown(c.id)
    assert "## Assistant (Qwen3-30B-A3B-exl2-4.0bpw)" in md
    assert "## Assistant (Mixtral-exl2)" in md
    assert "## Assistant (evil ## You \\[x\\]\\<b\\>)" in md
    assert "/home/ann" not in md and "Users" not in md and "/srv/m" not in md
    assert "\n## You" not in md                         # no heading of its own


def test_export_json_names_the_model_not_its_folder(db_path):
    """The JSON export gives the conversation's and each answer's model by its display name too."""
    s = Store(db_path)
    c = s.create_conversation("Paths", model="/home/ann/models/Qwen3-30B-A3B-exl2-4.0bpw")
    s.add_message(c.id, "assistant", "ok", model="C:\\Users\\ann\\models\\Mixtral-exl2\\")
    s.add_message(c.id, "assistant", "ok", model="demo")
    text = s.export_json(c.id)
    data = json.loads(text)
    assert data["model"] == "Qwen3-30B-A3B-exl2-4.0bpw"
    assert [m["model"] for m in data["messages"]] == ["Mixtral-exl2", "SmolLM2-135M-Instruct-exl2-8.0bpw"]
    assert "/home/ann" not in text and "Users" not in text


def test_presets_replace_by_name_and_delete(db_path):
    s = Store(db_path)
    s.save_preset("Coder", "You write code.", SamplingOptions(temperature=0.2))
    s.save_preset("coder2", "x", SamplingOptions())
    s.save_preset("Coder", "You write Python.", SamplingOptions(temperature=0.3, seed=7))
    ps = s.presets()
    assert [p.name for p in ps] == ["Coder", "coder2"]
    assert ps[0].system_prompt == "You write Python." and ps[0].sampling.seed == 7
    with pytest.raises(ValueError, match="name"):
        s.save_preset(" ", "", SamplingOptions())
    s.delete_preset("coder2")
    assert [p.name for p in s.presets()] == ["Coder"]


def test_hand_broken_sampling_json_falls_back_to_defaults(db_path):
    s = Store(db_path)
    c = s.create_conversation()
    s.db.execute("UPDATE conversations SET sampling = '{\"temperature\": \"hot\"}' WHERE id = ?", (c.id,))
    assert s.conversation(c.id).sampling is None


def test_migrates_a_v2_database_and_its_messages_get_versions(db_path):
    v2 = Store(db_path, target_version=2)
    v2.db.execute("INSERT INTO conversations (id, title, created, updated) VALUES (1, 'Old chat', 1.0, 2.0)")
    v2.db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'user', 'hi', 1.5)")
    v2.db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'assistant', 'old', 1.6)")
    v2.close()
    s = Store(db_path)
    assert s.version() == SCHEMA_VERSION
    u, a = s.messages(1)
    assert (a.content, a.slot, a.version, a.versions) == ("old", a.id, 1, 1)
    b = s.add_message(1, "assistant", "new", slot=s.supersede(1, a.id))
    assert [(m.content, m.version, m.versions) for m in s.messages(1)] == [("hi", 1, 1), ("new", 2, 2)]
    assert s.versions(1, a.id) == [a.id, b.id]


def test_versions_keep_what_followed_them(db_path):
    """Edit the first question: the old question and its whole answer come back with the old version."""
    s = Store(db_path)
    c = s.create_conversation("Versions")
    q1 = s.add_message(c.id, "user", "first question")
    s.add_message(c.id, "assistant", "first answer")
    s.add_message(c.id, "user", "follow-up")
    a2 = s.add_message(c.id, "assistant", "follow-up answer")
    r2 = s.add_message(c.id, "assistant", "follow-up answer, again", slot=s.supersede(c.id, a2.id))   # Regenerate
    q1b = s.add_message(c.id, "user", "edited question", slot=s.supersede(c.id, q1.id))              # Edit
    s.add_message(c.id, "assistant", "answer to the edit")
    texts = lambda: [m.content for m in s.messages(c.id)]
    assert texts() == ["edited question", "answer to the edit"]
    assert [(m.version, m.versions) for m in s.messages(c.id)][0] == (2, 2)
    s.show_version(c.id, q1b.id, q1.id)
    assert texts() == ["first question", "first answer", "follow-up", "follow-up answer, again"]
    s.show_version(c.id, r2.id, a2.id)
    assert texts() == ["first question", "first answer", "follow-up", "follow-up answer"]
    s.show_version(c.id, q1.id, q1b.id)
    assert texts() == ["edited question", "answer to the edit"]
    with pytest.raises(ValueError, match="not a version"):
        s.show_version(c.id, q1b.id, a2.id)
    assert "follow-up answer" not in s.export_markdown(c.id)       # exports show what is visible


def test_fork_copies_the_visible_messages_up_to_one(db_path):
    s = Store(db_path)
    c = s.create_conversation("Trip", model="demo", system_prompt="Be brief.", sampling=SamplingOptions(top_k=3))
    s.add_message(c.id, "user", "q1")
    a1 = s.add_message(c.id, "assistant", "a1")
    s.add_message(c.id, "user", "q2")
    f = s.fork_conversation(c.id, a1.id)
    assert (f.title, f.model, f.system_prompt, f.sampling.top_k) == ("Trip (fork)", "demo", "Be brief.", 3)
    assert [m.content for m in s.messages(f.id)] == ["q1", "a1"]
    assert len(s.messages(c.id)) == 3
