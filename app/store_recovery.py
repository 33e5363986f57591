"""Open the conversation store whatever state its file is in: the app always starts, and nothing is lost.

`open_store(path)` returns the store and a notice for the user ("" when all went well):

- A file that SQLite cannot open or read (truncated, header overwritten, not a database, pages that fail
  SQLite's quick_check, an unreadable schema version) is renamed beside the fresh store as
  `<name>.damaged-<YYYYmmdd-HHMMSS>.sqlite3`, with its `-wal` and `-shm` files under the same new name, and
  left untouched there. What can be read is copied into the fresh store: from a scratch copy of the damaged
  files, with a rebuilt 100-byte header when the original one is not SQLite's (the pages behind it are
  usually whole), each table read row by row from the front and from the back until a damaged page stops
  the reading. The notice says where the file went and what was recovered.
- A file from a newer app (schema version above ours) is neither changed nor moved: that app will find it
  where it left it. This app keeps its chats in a side store, `<stem>-v<our version>.sqlite3`, and says so.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import struct
import tempfile
import time
from pathlib import Path
from typing import Optional

from app.store import SCHEMA_VERSION, FutureSchemaError, Store, StoreError, default_path

MAGIC = b"SQLite format 3\0"
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26         # SQLite's result codes for a damaged file / not a database
SIDE_FILES = ("-wal", "-shm")
# Tables copied back, with the columns the fresh store takes (any the damaged file lacks keep their default).
TABLES = {
    "conversations": ("id", "title", "created", "updated", "model", "system_prompt", "sampling", "preset"),
    "messages": ("id", "conversation_id", "role", "content", "created", "model", "state", "stats", "error",
                 "slot", "active", "tail_of"),
    "presets": ("name", "system_prompt", "sampling", "updated"),
}
RECOVERED_NOTE = "Recovered from a damaged conversations file; it may be incomplete."


def open_store(path: Optional[Path] = None) -> tuple[Store, str]:
    path = Path(path) if path is not None else default_path()
    try:
        return _open_checked(path), ""
    except FutureSchemaError as e:
        side = path.with_name(f"{path.stem}-v{SCHEMA_VERSION}{path.suffix}")
        store, more = open_store(side) if side != path else (Store(side), "")
        return store, (f"Your conversations file {path} was written by a newer version of MoE Desk (schema "
                       f"version {e.version}; this version reads up to {SCHEMA_VERSION}). It was left unchanged "
                       f"for that version; this one keeps its chats in {side}. " + more).strip()
    except StoreError as e:
        problem = e.problem
    kept = set_aside(path)
    store = Store(path)
    counts = recover(kept, store)
    found = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
    return store, (f"Your conversations file was damaged ({problem}). It was kept as {kept} (with its -wal/-shm "
                   f"files, if any) and a fresh one is in use; "
                   + (f"recovered {found} from it." if found else "nothing in it could be read."))


def _open_checked(path: Path) -> Store:
    if path.exists():
        if path.stat().st_size == 0 and not Path(str(path) + "-wal").exists():
            raise StoreError(path, "the file is empty (0 bytes)")
        _probe(path)
    return Store(path)


def _probe(path: Path) -> None:
    """Read every page of `path` through a read-only connection (so a damaged file and its -wal stay as they
    are); raises `StoreError` when SQLite finds it damaged or not a database. Other failures (a -wal without
    its -shm, say) are left to the read-write open to report."""
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error:
        return
    try:
        problems = [r[0] for r in db.execute("PRAGMA quick_check(5)")]
    except sqlite3.DatabaseError as e:
        if getattr(e, "sqlite_errorcode", None) in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            raise StoreError(path, f"not a usable SQLite database ({e})") from None
        return
    finally:
        db.close()
    if problems != ["ok"]:
        raise StoreError(path, "damaged (" + "; ".join(problems) + ")")


def set_aside(path: Path) -> Path:
    """Rename the database and its -wal/-shm files to one new unused name beside it; returns the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    n, kept = 1, path.with_name(f"{path.stem}.damaged-{stamp}{path.suffix}")
    while any(Path(str(kept) + s).exists() for s in ("",) + SIDE_FILES):
        n += 1
        kept = path.with_name(f"{path.stem}.damaged-{stamp}-{n}{path.suffix}")
    for suffix in ("",) + SIDE_FILES:
        if Path(str(path) + suffix).exists():
            os.replace(str(path) + suffix, str(kept) + suffix)
    return kept


# -- recovery ---------------------------------------------------------------------------------------------

def recover(damaged: Path, store: Store) -> dict[str, int]:
    """Copy what can be read of `damaged` (left untouched) into `store`; counts per kind of row."""
    counts = {"conversations": 0, "messages": 0, "presets": 0}
    with tempfile.TemporaryDirectory(prefix="moedesk-recover-") as scratch:
        copy = Path(scratch) / "copy.sqlite3"
        for suffix in ("",) + SIDE_FILES:
            if Path(str(damaged) + suffix).exists():
                shutil.copyfile(str(damaged) + suffix, str(copy) + suffix)
        if not copy.exists():
            return counts
        db = _readable(copy)
        if db is None:
            return counts
        try:
            rows = {table: _rows(db, table, cols) for table, cols in TABLES.items()}
        finally:
            db.close()
    return _insert(store, rows)


def _readable(copy: Path) -> Optional[sqlite3.Connection]:
    """A connection to `copy` whose schema can be read, rebuilding its header if need be; None if hopeless."""
    data = copy.read_bytes()
    if data[:16] == MAGIC or not data:             # empty: a -wal may still hold everything
        # A truncated file: its header still counts the pages it had. Say how many it has now.
        page_size = struct.unpack_from(">H", data, 16)[0] if data else 0
        page_size = 65536 if page_size == 1 else page_size
        if page_size >= 512 and data[24:28] == data[92:96]:
            copy.write_bytes(data[:28] + struct.pack(">I", len(data) // page_size) + data[32:])
        db = _try_open(copy)
        if db is not None:
            return db
    if len(data) < 512:
        return None
    wal = Path(str(copy) + "-wal").exists()
    for page_size in (4096, 1024, 2048, 8192, 16384, 32768, 65536, 512):
        if len(data) % page_size:
            continue
        copy.write_bytes(_header(page_size, len(data) // page_size, wal) + data[100:])
        db = _try_open(copy)
        if db is not None:
            return db
    return None


def _try_open(copy: Path) -> Optional[sqlite3.Connection]:
    try:
        db = sqlite3.connect(copy, isolation_level=None)
    except sqlite3.Error:
        return None
    try:
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if names & set(TABLES):
            return db
    except sqlite3.Error:
        pass
    db.close()
    return None


def _header(page_size: int, pages: int, wal: bool) -> bytes:
    """A database header as SQLite writes it (the file format's first 100 bytes) for a file of `pages` pages:
    no free list, UTF-8, schema format 4. Everything else SQLite needs lives in the pages themselves."""
    h = bytearray(100)
    h[0:16] = MAGIC
    struct.pack_into(">H", h, 16, page_size if page_size < 65536 else 1)
    h[18] = h[19] = 2 if wal else 1                 # file format write / read version: WAL or rollback journal
    h[21], h[22], h[23] = 64, 32, 32                # payload fractions (fixed by the format)
    struct.pack_into(">I", h, 24, 1)                # change counter
    struct.pack_into(">I", h, 28, pages)            # size in pages, valid because 92 matches 24
    struct.pack_into(">I", h, 40, 1)                # schema cookie
    struct.pack_into(">I", h, 44, 4)                # schema format
    struct.pack_into(">I", h, 56, 1)                # text encoding: UTF-8
    struct.pack_into(">I", h, 92, 1)                # version-valid-for
    struct.pack_into(">I", h, 96, sqlite3.sqlite_version_info[0] * 1_000_000
                     + sqlite3.sqlite_version_info[1] * 1000 + sqlite3.sqlite_version_info[2])
    return bytes(h)


def _rows(db: sqlite3.Connection, table: str, wanted: tuple[str, ...]) -> tuple[tuple[str, ...], list[tuple]]:
    """The readable rows of `table`: read from the first row on and from the last row back, each direction
    until a damaged page stops it (one bad page in the middle loses only the rows it held)."""
    try:
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
    except sqlite3.Error:
        return (), []
    cols = tuple(c for c in wanted if c in have)
    if not cols:
        return (), []
    found: dict[int, tuple] = {}
    for order in ("ASC", "DESC"):
        try:
            for row in db.execute(f"SELECT rowid, {', '.join(cols)} FROM {table} ORDER BY rowid {order}"):
                found.setdefault(row[0], row[1:])
        except sqlite3.Error:
            pass
    return cols, [found[k] for k in sorted(found)]


def _insert(store: Store, rows: dict[str, tuple[tuple[str, ...], list[tuple]]]) -> dict[str, int]:
    counts = {"conversations": 0, "messages": 0, "presets": 0}
    db = store.db
    db.execute("BEGIN IMMEDIATE")
    try:
        for table in ("conversations", "presets", "messages"):
            cols, found = rows[table]
            for row in found:
                values = dict(zip(cols, row))
                if table == "messages":
                    if not _conversation_for(db, values.get("conversation_id")):
                        continue
                    if values.get("state") == "streaming":
                        values.update(state="error", error=RECOVERED_NOTE)
                try:
                    db.execute(f"INSERT INTO {table} ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                               tuple(values.values()))
                    counts[table] += 1
                except sqlite3.Error:
                    continue                      # a row the schema refuses (NULL text, unknown role): skipped
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return counts


def _conversation_for(db: sqlite3.Connection, cid) -> bool:
    """Whether conversation `cid` exists, making one for messages whose conversation row was lost."""
    if not isinstance(cid, int):
        return False
    if db.execute("SELECT 1 FROM conversations WHERE id = ?", (cid,)).fetchone() is None:
        now = time.time()
        db.execute("INSERT INTO conversations (id, title, created, updated) VALUES (?, ?, ?, ?)",
                   (cid, f"Recovered chat {cid}", now, now))
    return True
