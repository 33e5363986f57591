"""Conversations in SQLite: never lost, shared safely between app instances.

One database file in `runtime.paths.data_dir()`. WAL journal and a busy timeout, so two instances of
the app (or the app and a backup tool) can read while one writes; every write is one short
`BEGIN IMMEDIATE` transaction. The schema is versioned (`schema_version` table); `MIGRATIONS` brings
any older file up to `SCHEMA_VERSION` in one transaction, so an upgrade never half-applies.

Assistant text is written while it streams (`update_message`, called by the chat session on a timer),
so a crash of the app or of the worker loses at most the last flush interval. Each open store holds an OS
file lock of its own (`<file>.writers/<id>.lock`, released by the OS when the process dies, however it dies)
and tags the answers it streams with that id: at start-up `mark_interrupted` marks only answers whose
writer's lock is free, so a second app instance leaves the first one's streaming answer alone.

A file that cannot be opened or read (damaged, not SQLite, a schema version from a newer app) is handled by
`open_store` (`app/store_recovery.py`): the app always starts.

Messages keep their versions: Regenerate and Edit do not delete the message they replace, they
*supersede* it: it and every later message of the chat become inactive (the later ones remember which
version they followed, `tail_of`), and the new message takes the same `slot`. Showing an older version
swaps the tails back. `messages()` returns the visible (active) ones, each with its place among the
versions of its slot.

Search uses an FTS5 index over message text when SQLite has FTS5 and falls back to LIKE otherwise.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from filelock import FileLock, Timeout

from runtime import paths
from runtime.options import OptionError, SamplingOptions, from_dict, to_dict
from runtime.protocol import GenerationStats, from_plain

DB_NAME = "conversations.sqlite3"
SCHEMA_VERSION = 5
BUSY_TIMEOUT_MS = 10_000
STATES = ("streaming", "done", "error", "cancelled")
ROLES = ("system", "user", "assistant")


class StoreError(RuntimeError):
    """The database cannot be used: names the file and what is wrong."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class FutureSchemaError(StoreError):
    """The file was written by a newer app (a schema version above `SCHEMA_VERSION`)."""

    def __init__(self, path: Path, version: int):
        super().__init__(path, f"schema version {version} is newer than this app understands "
                               f"({SCHEMA_VERSION}); update MoE Desk")
        self.version = version


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    model: str = ""
    system_prompt: str = ""
    sampling: Optional[SamplingOptions] = None   # None: the app's defaults
    preset: str = ""                             # name of the preset the settings came from
    pinned: bool = False                         # listed above the others, whatever its date


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    role: str                    # "system" | "user" | "assistant"
    content: str
    created: float
    model: str = ""
    state: str = "done"          # "streaming" | "done" | "error" | "cancelled"
    stats: Optional[GenerationStats] = None
    error: str = ""              # what went wrong, in words, when state is "error"
    slot: int = 0                # the first version's id: every version of this message shares it
    version: int = 1             # 1-based place among the versions of the slot (oldest first)
    versions: int = 1


@dataclass(frozen=True)
class Preset:
    name: str
    system_prompt: str
    sampling: SamplingOptions


@dataclass(frozen=True)
class SearchHit:
    conversation_id: int
    title: str
    snippet: str                 # where the text matched, words between HIT_START and HIT_END ("": the title)


# Around each matched word in a search hit's snippet: control characters no message contains as text.
HIT_START, HIT_END = "\x02", "\x03"


# ----------------------------------------------------------------------------------------------
# Schema and migrations. Each step takes the database from version N-1 to N; never edit a
# released step, add a new one.

def _v1(fts: bool) -> list[str]:
    steps = [
        """CREATE TABLE conversations (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            title TEXT NOT NULL,
            created REAL NOT NULL,
            updated REAL NOT NULL,
            model TEXT NOT NULL DEFAULT '')""",
        # AUTOINCREMENT: ids are never reused, so a regenerated answer is a new message everywhere.
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL,
            created REAL NOT NULL,
            model TEXT NOT NULL DEFAULT '',
            state TEXT NOT NULL DEFAULT 'done' CHECK (state IN ('streaming', 'done', 'error', 'cancelled')),
            stats TEXT,
            error TEXT NOT NULL DEFAULT '')""",
        "CREATE INDEX messages_by_conversation ON messages(conversation_id, id)",
    ]
    if fts:
        steps += [
            "CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', content_rowid='id')",
            """CREATE TRIGGER messages_ai AFTER INSERT ON messages BEGIN
                INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
            END""",
            """CREATE TRIGGER messages_ad AFTER DELETE ON messages BEGIN
                INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
            END""",
            """CREATE TRIGGER messages_au AFTER UPDATE OF content ON messages BEGIN
                INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
                INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
            END""",
        ]
    return steps


def _v2(fts: bool) -> list[str]:
    """Per-conversation system prompt and sampling, and named presets of both."""
    return [
        "ALTER TABLE conversations ADD COLUMN system_prompt TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE conversations ADD COLUMN sampling TEXT",
        "ALTER TABLE conversations ADD COLUMN preset TEXT NOT NULL DEFAULT ''",
        """CREATE TABLE presets (
            name TEXT PRIMARY KEY,
            system_prompt TEXT NOT NULL DEFAULT '',
            sampling TEXT NOT NULL,
            updated REAL NOT NULL)""",
    ]


def _v3(fts: bool) -> list[str]:
    """Which app instance streams an answer (its writer lock's id), so another instance can tell whether
    that writer is still alive."""
    return ["ALTER TABLE messages ADD COLUMN writer TEXT NOT NULL DEFAULT ''"]


def _v4(fts: bool) -> list[str]:
    """Message versions (Regenerate, Edit): superseded messages stay, inactive, in their slot."""
    return [
        "ALTER TABLE messages ADD COLUMN slot INTEGER",             # NULL: the message's own id
        "ALTER TABLE messages ADD COLUMN active INTEGER NOT NULL DEFAULT 1",
        "ALTER TABLE messages ADD COLUMN tail_of INTEGER",          # inactive: the version it followed
        "CREATE INDEX messages_visible ON messages(conversation_id, active, id)",
    ]


def _v5(fts: bool) -> list[str]:
    """Pinned chats: listed on top of the chat list."""
    return ["ALTER TABLE conversations ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0"]


# Each step: the SQL statements (run in one transaction with the version bump) for one version.
MIGRATIONS: dict[int, Callable[[bool], list[str]]] = {1: _v1, 2: _v2, 3: _v3, 4: _v4, 5: _v5}
_WRITER_ID = re.compile(r"[0-9a-f]{32}")


def fts5_available() -> bool:
    try:
        sqlite3.connect(":memory:").execute("CREATE VIRTUAL TABLE t USING fts5(x)")
        return True
    except sqlite3.OperationalError:
        return False


def default_path() -> Path:
    return paths.data_dir() / DB_NAME


# ----------------------------------------------------------------------------------------------

class Store:
    """All reads and writes of conversations. Only the GUI thread uses one instance."""

    def __init__(self, path: Optional[Path] = None, *, target_version: int = SCHEMA_VERSION,
                 use_fts: Optional[bool] = None):
        self.path = Path(path) if path else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        try:
            self.db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            mode = self.db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            self.db.execute("PRAGMA foreign_keys = ON")
            self.db.execute("PRAGMA synchronous = NORMAL")
            if mode.lower() != "wal":
                raise StoreError(self.path, f"could not switch to WAL journal (got {mode!r})")
            self._migrate(target_version, fts5_available() if use_fts is None else use_fts)
            self.fts = self._has_table("messages_fts")
        except BaseException as e:
            self.db.close()                 # nothing of ours keeps the file open: it may be set aside
            if isinstance(e, sqlite3.DatabaseError):
                raise StoreError(self.path, f"not a usable SQLite database ({e})") from None
            raise
        # This instance's writer lock: held while the store is open, released by the OS if the process dies.
        self.writer = uuid.uuid4().hex
        self._lock = FileLock(self._writer_lock_path(self.writer))
        self._lock.acquire()

    def close(self) -> None:
        self.db.close()
        self._lock.release()
        Path(self._lock.lock_file).unlink(missing_ok=True)

    # -- migrations -----------------------------------------------------------------------------
    def version(self) -> int:
        if not self._has_table("schema_version"):
            return 0
        row = self.db.execute("SELECT version FROM schema_version").fetchone()
        version = row[0] if row else 0
        if not isinstance(version, int) or version < 0:
            raise StoreError(self.path, f"its schema version {version!r} is not a version number")
        return version

    def _migrate(self, target: int, fts: bool) -> None:
        with self._write():
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            current = self.version()
            if current > SCHEMA_VERSION:
                raise FutureSchemaError(self.path, current)
            for v in range(current + 1, target + 1):
                for statement in MIGRATIONS[v](fts):
                    self.db.execute(statement)
            if target > current:
                self.db.execute("DELETE FROM schema_version")
                self.db.execute("INSERT INTO schema_version VALUES (?)", (target,))

    def _has_table(self, name: str) -> bool:
        return self.db.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone() is not None

    def _write(self):
        return _Immediate(self.db)

    # -- conversations --------------------------------------------------------------------------
    def create_conversation(self, title: str = "New chat", model: str = "", system_prompt: str = "",
                            sampling: Optional[SamplingOptions] = None, preset: str = "") -> Conversation:
        now = time.time()
        with self._write():
            cur = self.db.execute(
                "INSERT INTO conversations (title, created, updated, model, system_prompt, sampling, preset)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (title, now, now, model, system_prompt, _sampling_json(sampling), preset))
        return self.conversation(cur.lastrowid)

    def conversation(self, conversation_id: int) -> Conversation:
        row = self.db.execute(f"SELECT {_CONV_COLS} FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return _conversation(row)

    def conversations(self) -> list[Conversation]:
        """Pinned ones first, then by last update, most recent first."""
        rows = self.db.execute(f"SELECT {_CONV_COLS} FROM conversations ORDER BY pinned DESC, updated DESC, id DESC")
        return [_conversation(r) for r in rows]

    def set_pinned(self, conversation_id: int, pinned: bool) -> None:
        with self._write():
            self.db.execute("UPDATE conversations SET pinned = ? WHERE id = ?", (int(bool(pinned)), conversation_id))

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        title = title.strip()
        if not title:
            raise ValueError("a conversation title cannot be empty")
        with self._write():
            self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def set_conversation_settings(self, conversation_id: int, system_prompt: str,
                                  sampling: Optional[SamplingOptions], preset: str = "") -> None:
        with self._write():
            self.db.execute("UPDATE conversations SET system_prompt = ?, sampling = ?, preset = ? WHERE id = ?",
                            (system_prompt, _sampling_json(sampling), preset, conversation_id))

    def set_conversation_model(self, conversation_id: int, model: str) -> None:
        with self._write():
            self.db.execute("UPDATE conversations SET model = ? WHERE id = ?", (model, conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        with self._write():
            self.db.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # -- messages -------------------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: str, content: str, *, model: str = "",
                    state: str = "done", slot: Optional[int] = None) -> Message:
        """A new visible message at the end; `slot`: it is a new version of that slot's message."""
        if role not in ROLES:
            raise ValueError(f"message role {role!r} is not one of {', '.join(ROLES)}")
        if state not in STATES:
            raise ValueError(f"message state {state!r} is not one of {', '.join(STATES)}")
        now = time.time()
        with self._write():
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, role, content, created, model, state, writer, slot)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, now, model, state, self.writer, slot))
            self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return self.message(cur.lastrowid)

    def update_message(self, message_id: int, *, content: Optional[str] = None, state: Optional[str] = None,
                       stats: Optional[GenerationStats] = None, error: Optional[str] = None) -> None:
        """Change what is given; used for the streaming flushes and for the final state."""
        sets, args = [], []
        if content is not None:
            sets.append("content = ?"); args.append(content)
        if state is not None:
            if state not in STATES:
                raise ValueError(f"message state {state!r} is not one of {', '.join(STATES)}")
            sets.append("state = ?"); args.append(state)
        if stats is not None:
            sets.append("stats = ?"); args.append(json.dumps(dataclasses.asdict(stats)))
        if error is not None:
            sets.append("error = ?"); args.append(error)
        if not sets:
            return
        with self._write():
            self.db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*args, message_id))

    def message(self, message_id: int) -> Message:
        row = self.db.execute(f"SELECT {_MSG_COLS} FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return _message(row)

    def messages(self, conversation_id: int) -> list[Message]:
        """The visible messages, oldest first, each with its place among its slot's versions."""
        rows = self.db.execute(f"SELECT {_MSG_COLS} FROM messages WHERE conversation_id = ? AND active = 1"
                               f" ORDER BY id", (conversation_id,)).fetchall()
        slots = self._slots(conversation_id)
        out = []
        for r in rows:
            m = _message(r)
            ids = slots.get(m.slot, [m.id])
            out.append(dataclasses.replace(m, version=ids.index(m.id) + 1, versions=len(ids)))
        return out

    def versions(self, conversation_id: int, slot: int) -> list[int]:
        """The ids of every version of a message, oldest first."""
        return self._slots(conversation_id).get(slot, [])

    def _slots(self, conversation_id: int) -> dict[int, list[int]]:
        slots: dict[int, list[int]] = {}
        for slot, mid in self.db.execute("SELECT COALESCE(slot, id), id FROM messages WHERE conversation_id = ?"
                                         " ORDER BY id", (conversation_id,)):
            slots.setdefault(slot, []).append(mid)
        return slots

    def supersede(self, conversation_id: int, message_id: int) -> int:
        """Hide a message and everything after it, kept as the version they were; returns its slot, for
        the new version (`add_message(..., slot=)`)."""
        m = self.message(message_id)
        with self._write():
            self._hide_from(conversation_id, message_id)
        return m.slot

    def show_version(self, conversation_id: int, message_id: int, version_id: int) -> None:
        """Show `version_id` (another version of the visible `message_id`) with what followed it."""
        shown, wanted = self.message(message_id), self.message(version_id)
        if shown.slot != wanted.slot or shown.conversation_id != conversation_id:
            raise ValueError(f"message {version_id} is not a version of message {message_id}")
        with self._write():
            self._hide_from(conversation_id, message_id)
            self.db.execute("UPDATE messages SET active = 1, tail_of = NULL WHERE conversation_id = ?"
                            " AND (id = ? OR tail_of = ?)", (conversation_id, version_id, version_id))

    def _hide_from(self, conversation_id: int, message_id: int) -> None:
        self.db.execute("UPDATE messages SET active = 0, tail_of = ? WHERE conversation_id = ? AND active = 1"
                        " AND id > ?", (message_id, conversation_id, message_id))
        self.db.execute("UPDATE messages SET active = 0 WHERE id = ?", (message_id,))

    def fork_conversation(self, conversation_id: int, up_to_message_id: int) -> Conversation:
        """A new chat with the same settings and the visible messages up to and including the given one."""
        conv = self.conversation(conversation_id)
        kept = [m for m in self.messages(conversation_id) if m.id <= up_to_message_id]
        now = time.time()
        with self._write():
            cur = self.db.execute(
                "INSERT INTO conversations (title, created, updated, model, system_prompt, sampling, preset)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (f"{conv.title} (fork)", now, now, conv.model, conv.system_prompt, _sampling_json(conv.sampling),
                 conv.preset))
            for m in kept:
                self.db.execute(
                    "INSERT INTO messages (conversation_id, role, content, created, model, state, stats, error)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (cur.lastrowid, m.role, m.content, m.created, m.model,
                     "cancelled" if m.state == "streaming" else m.state,
                     json.dumps(dataclasses.asdict(m.stats)) if m.stats else None, m.error))
        return self.conversation(cur.lastrowid)

    def mark_interrupted(self, reason: str) -> int:
        """Messages left 'streaming' by an instance that is gone (closed, crashed, killed) become errors that
        keep their text; those of a live instance (its writer lock held) are left alone."""
        with self._write():
            writers = [w for (w,) in self.db.execute("SELECT DISTINCT writer FROM messages WHERE state = 'streaming'")]
            gone = [w for w in writers if w != self.writer and not self._writer_alive(w)]
            marks = ",".join("?" * len(gone))
            cur = self.db.execute(f"UPDATE messages SET state = 'error', error = ? WHERE state = 'streaming'"
                                  f" AND writer IN ({marks})", (reason, *gone))
        return cur.rowcount

    def _writer_lock_path(self, writer: str) -> Path:
        folder = self.path.with_name(self.path.name + ".writers")
        folder.mkdir(exist_ok=True)
        return folder / f"{writer}.lock"

    def _writer_alive(self, writer: str) -> bool:
        """Whether the instance `writer` still holds its lock (ids that are not ours to parse: gone)."""
        if not _WRITER_ID.fullmatch(writer or ""):
            return False
        lock = FileLock(self._writer_lock_path(writer), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            return True
        lock.release()
        Path(lock.lock_file).unlink(missing_ok=True)      # the writer is gone: its lock file is litter
        return False

    # -- search ---------------------------------------------------------------------------------
    def search(self, text: str, limit: int = 100) -> list[SearchHit]:
        """Conversations whose title or message text contains every word of `text`."""
        words = text.split()
        if not words:
            return []
        hits: dict[int, SearchHit] = {}
        like = [f"%{_like_escape(w)}%" for w in words]
        title_sql = " AND ".join("title LIKE ? ESCAPE '\\'" for _ in words)
        for cid, title in self.db.execute(f"SELECT id, title FROM conversations WHERE {title_sql} ORDER BY updated DESC", like):
            hits[cid] = SearchHit(cid, title, "")
        if self.fts:
            query = " ".join('"' + w.replace('"', '""') + '"*' for w in words)
            rows = self.db.execute(
                "SELECT c.id, c.title, snippet(messages_fts, 0, ?, ?, '…', 12) FROM messages_fts"
                " JOIN messages m ON m.id = messages_fts.rowid JOIN conversations c ON c.id = m.conversation_id"
                " WHERE messages_fts MATCH ? ORDER BY c.updated DESC LIMIT ?", (HIT_START, HIT_END, query, limit * 5))
        else:
            content_sql = " AND ".join("m.content LIKE ? ESCAPE '\\'" for _ in words)
            rows = self.db.execute(
                f"SELECT c.id, c.title, m.content FROM messages m JOIN conversations c ON c.id = m.conversation_id"
                f" WHERE {content_sql} ORDER BY c.updated DESC LIMIT ?", (*like, limit * 5))
            rows = [(cid, title, _snippet(content, words[0])) for cid, title, content in rows]
        for cid, title, snip in rows:
            if cid not in hits or not hits[cid].snippet:
                hits[cid] = SearchHit(cid, title, snip)
        return list(hits.values())[:limit]

    # -- presets --------------------------------------------------------------------------------
    def save_preset(self, name: str, system_prompt: str, sampling: SamplingOptions) -> Preset:
        name = name.strip()
        if not name:
            raise ValueError("a preset needs a name")
        with self._write():
            self.db.execute("INSERT OR REPLACE INTO presets (name, system_prompt, sampling, updated) VALUES (?, ?, ?, ?)",
                            (name, system_prompt, _sampling_json(sampling), time.time()))
        return Preset(name, system_prompt, sampling)

    def presets(self) -> list[Preset]:
        rows = self.db.execute("SELECT name, system_prompt, sampling FROM presets ORDER BY name COLLATE NOCASE")
        return [Preset(n, sp, _sampling_from(s) or SamplingOptions()) for n, sp, s in rows]

    def delete_preset(self, name: str) -> None:
        with self._write():
            self.db.execute("DELETE FROM presets WHERE name = ?", (name,))

    # -- export ---------------------------------------------------------------------------------
    def export_markdown(self, conversation_id: int) -> str:
        conv = self.conversation(conversation_id)
        out = [f"# {conv.title}", ""]
        if conv.system_prompt:
            out += ["**System prompt**", "", conv.system_prompt, ""]
        names = {"user": "You", "assistant": "Assistant", "system": "System"}
        for m in self.messages(conversation_id):
            who = names[m.role] + (f" ({_model_label(m.model)})" if m.model and m.role == "assistant" else "")
            out += [f"## {who}", "", close_fences(m.content), ""]
            if m.state == "error":
                out += [f"> Interrupted: {m.error}", ""]
        return "\n".join(out).rstrip() + "\n"

    def export_json(self, conversation_id: int) -> str:
        conv = self.conversation(conversation_id)
        data = {
            "title": conv.title, "created": conv.created, "updated": conv.updated, "model": _model_name(conv.model),
            "system_prompt": conv.system_prompt,
            "sampling": to_dict(conv.sampling) if conv.sampling else None,
            "messages": [{"role": m.role, "content": m.content, "created": m.created, "model": _model_name(m.model),
                          "state": m.state, "error": m.error,
                          "stats": dataclasses.asdict(m.stats) if m.stats else None}
                         for m in self.messages(conversation_id)],
        }
        return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def _model_name(model: str) -> str:
    """The model's display name for an export: never the folder it was loaded from (a path of this
    machine), on one line."""
    if not model:
        return ""
    name = paths.display_name(model.replace("\\", "/").rstrip("/")) or model
    return " ".join(re.sub(r"[\x00-\x1f\x7f]", " ", name).split())


def _model_label(model: str) -> str:
    """_model_name for a Markdown heading: without the characters Markdown would read as markup there."""
    name = _model_name(model)
    return re.sub(r"([\\`*_\[\]<>])", r"\\\1", name)


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def close_fences(text: str) -> str:
    """`text` with a code fence it leaves open (an answer stopped inside a code block) closed, so that
    what follows it in an exported file is not code. The closing fence is longer than any run of its
    character at a line start inside the block, so no line of the code can be read as closing it."""
    open_char, open_len, longest = "", 0, 0
    for line in text.splitlines():
        m = _FENCE.match(line)
        if not open_char:
            if m and not (m.group(1)[0] == "`" and "`" in m.group(2)):     # CommonMark: no ` in a ``` info
                open_char, open_len, longest = m.group(1)[0], len(m.group(1)), 0
            continue
        if m and m.group(1)[0] == open_char:
            if len(m.group(1)) >= open_len and not m.group(2).strip():
                open_char = ""
                continue
            longest = max(longest, len(m.group(1)))
    if not open_char:
        return text
    return text.rstrip("\n") + "\n" + open_char * max(open_len, longest + 1)


class _Immediate:
    """`with` block running one BEGIN IMMEDIATE ... COMMIT transaction (ROLLBACK on error)."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb):
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        return False


_CONV_COLS = "id, title, created, updated, model, system_prompt, sampling, preset, pinned"
_MSG_COLS = "id, conversation_id, role, content, created, model, state, stats, error, COALESCE(slot, id)"


def _conversation(row: tuple) -> Conversation:
    cid, title, created, updated, model, sp, sampling, preset, pinned = row
    return Conversation(cid, title, created, updated, model, sp, _sampling_from(sampling), preset, bool(pinned))


def _message(row: tuple) -> Message:
    mid, cid, role, content, created, model, state, stats, error, slot = row
    return Message(mid, cid, role, content, created, model, state, _stats_from(stats), error, slot)


def _sampling_json(s: Optional[SamplingOptions]) -> Optional[str]:
    return json.dumps(to_dict(s)) if s is not None else None


def _sampling_from(text: Optional[str]) -> Optional[SamplingOptions]:
    if not text:
        return None
    try:
        return from_dict(SamplingOptions, json.loads(text), "sampling")
    except (ValueError, OptionError):
        return None     # a hand-edited or older value: the app's defaults apply


def _stats_from(text: Optional[str]) -> Optional[GenerationStats]:
    if not text:
        return None
    try:
        return from_plain(GenerationStats, json.loads(text))
    except ValueError:          # OptionError is a ValueError: a hand-edited or older value
        return None


def _like_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _snippet(content: str, word: str, width: int = 60) -> str:
    i = content.lower().find(word.lower())
    if i < 0:
        return content[:width]
    start = max(0, i - width // 2)
    return (("…" if start else "") + content[start:i] + HIT_START + content[i:i + len(word)] + HIT_END
            + content[i + len(word):i + width // 2] + "…")

