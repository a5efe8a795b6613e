"""The checkpoint store's SQLite index: its schema, opening it, transactions, and the rows it trusts.

The index only says where to look: every row is checked for the type and form this store writes before it is
used (`checked_row`), and every file it names is verified before its content is (engine/cache/verify.py).
Schema (``PRAGMA user_version = 4``; K/V block tables in engine/cache/kv_blocks.py)::

    entries(entry_id TEXT PRIMARY KEY,      -- checkpoint_key(StoreKey, tokens): SHA-256 hex
            model_digest, layout_digest,    -- copies of the StoreKey fields (lookup filters on them)
            n_tokens INTEGER,               -- length of the token prefix
            file_name TEXT,                 -- blob file holding this entry
            nbytes INTEGER,                 -- size of that file on disk: what the budget counts
            content_sha256 TEXT,            -- the file's content digest (engine/cache/content_digest.py)
            hits INTEGER, created REAL, last_used REAL,   -- wall-clock seconds (time.time())
            use_order INTEGER,              -- LRU order: larger = used more recently
            meta_json TEXT,                 -- the caller's meta dict
            token_preview TEXT)             -- JSON list of the first PREVIEW_TOKENS token ids

    signatures(kind TEXT, record_id TEXT, signature TEXT, PRIMARY KEY (kind, record_id))
                                            -- an entry's or a K/V block's row signed (engine/cache/auth.py);
                                            -- dropped with the row it signs (triggers)

An index of an earlier version is emptied on open (a clear miss: version 1's digests are flat SHA-256, version 2's
entries are whole states without K/V blocks, version 3's rows are not signed; their files become unindexed and are
swept).
"""
from __future__ import annotations

import functools
import json
import re
import sqlite3
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from prefixrun.engine.cache import kv_blocks
from prefixrun.engine.cache.content_digest import DIGEST_FORM
from prefixrun.engine.cache.keys import HEX_DIGEST, SHA256_HEX

INDEX_SCHEMA_VERSION = 4  # 4: signed rows (3: K/V block tables; 2: whole-state entries; 1: flat SHA-256 digests)
INDEX_FILE_NAME = "index.sqlite3"
INDEX_FILE_SUFFIXES = ("", "-wal", "-shm", "-journal")  # the index and the files SQLite keeps beside it
BUSY_TIMEOUT_S = 60.0
PREVIEW_TOKENS = 64
BLOB_NAME = re.compile(r"([0-9a-f]{64})\.[0-9a-f]{16}\.safetensors")  # <entry_id>.<16 digits of the digest>...
# LRU counters stay far below SQLite's integer range: a row edited to a huge use_order is malformed (dropped), so
# `MAX(use_order) + 1` can never overflow into a REAL that would make every touched row malformed
MAX_USE_ORDER = 2**53

ROW_COLUMNS = (
    "entry_id, model_digest, layout_digest, n_tokens, file_name, nbytes, content_sha256, "
    "hits, created, last_used, use_order, meta_json, token_preview"
)
SUM_NBYTES = "COALESCE(SUM(CASE WHEN typeof(nbytes) = 'integer' THEN nbytes ELSE 0 END), 0)"

SCHEMA = """
CREATE TABLE entries (
    entry_id TEXT PRIMARY KEY,
    model_digest TEXT NOT NULL,
    layout_digest TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    file_name TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    content_sha256 TEXT NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    use_order INTEGER NOT NULL,
    meta_json TEXT NOT NULL,
    token_preview TEXT NOT NULL
);
CREATE INDEX entries_by_model_length ON entries (model_digest, layout_digest, n_tokens);
CREATE INDEX entries_by_use_order ON entries (use_order);
"""
SIGNATURES_SCHEMA = """
CREATE TABLE IF NOT EXISTS signatures (
    kind TEXT NOT NULL,
    record_id TEXT NOT NULL,
    signature TEXT NOT NULL,
    PRIMARY KEY (kind, record_id)
);
CREATE TRIGGER IF NOT EXISTS entry_signature_dropped AFTER DELETE ON entries BEGIN
    DELETE FROM signatures WHERE kind = 'entry' AND record_id = OLD.entry_id;
END;
CREATE TRIGGER IF NOT EXISTS block_signature_dropped AFTER DELETE ON blocks BEGIN
    DELETE FROM signatures WHERE kind = 'block' AND record_id = OLD.block_id;
END;
"""


class StoreError(RuntimeError):
    """The store itself cannot be used (unreadable index, foreign schema); the message says what to do."""


# what the environment may raise from a store operation (SQLite locked past its busy timeout, disk full, the folder
# removed, a damaged index): the cache gives up for the run, the run goes on
STORE_FAILURES = (sqlite3.Error, OSError, StoreError)


@dataclass(frozen=True)
class Row:
    entry_id: str
    model_digest: str
    layout_digest: str
    n_tokens: int
    file_name: str
    nbytes: int
    content_sha256: str
    hits: int
    created: float
    last_used: float
    use_order: int
    meta_json: str
    token_preview: str


def checked_row(values: Sequence) -> Row | None:
    """An index row with every column of the type and form this store writes, else None (malformed)."""
    try:
        row = Row(*values)
    except TypeError:
        return None
    text = (row.model_digest, row.layout_digest, row.meta_json, row.token_preview)
    integers = (row.n_tokens, row.nbytes, row.hits, row.use_order)
    if not isinstance(row.entry_id, str) or not SHA256_HEX.fullmatch(row.entry_id) \
            or not isinstance(row.content_sha256, str) or not DIGEST_FORM.fullmatch(row.content_sha256) \
            or not all(isinstance(v, str) for v in text) \
            or not all(isinstance(v, int) and 0 <= v <= MAX_USE_ORDER for v in integers) or row.n_tokens < 1 \
            or not all(isinstance(v, (int, float)) for v in (row.created, row.last_used)) \
            or not HEX_DIGEST.fullmatch(row.model_digest) or not HEX_DIGEST.fullmatch(row.layout_digest):
        return None
    match = BLOB_NAME.fullmatch(row.file_name) if isinstance(row.file_name, str) else None
    if match is None or match.group(1) != row.entry_id:
        return None
    try:
        meta, preview = json.loads(row.meta_json), json.loads(row.token_preview)
    except (ValueError, RecursionError):
        return None
    if not isinstance(meta, dict) or not isinstance(preview, list) \
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in preview):
        return None
    return row


def open_index(path: Path) -> sqlite3.Connection:
    """Open (creating or upgrading) the index at `path`; StoreError when it cannot be used."""
    db = None
    try:
        # isolation_level=None: no implicit transactions; every write is an explicit short BEGIN IMMEDIATE ...
        # COMMIT, so a writer takes the lock up front instead of upgrading (deadlock-free).
        db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA trusted_schema = OFF")  # the schema is the folder's writer's: no function runs from it
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a power cut may lose the last rows, never corrupt
        with write_transaction(db):
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version in (1, 2, 3):
                # the flat-SHA-256 era (1), whole-state entries without K/V blocks (2) or unsigned rows (3): every
                # object dropped (their files become unindexed and are swept), a clear miss rather than quarantined
                for kind, name in db.execute("SELECT type, name FROM sqlite_master WHERE type IN "
                                             "('table', 'view', 'trigger') AND name NOT LIKE 'sqlite_%'").fetchall():
                    db.execute(f'DROP {kind.upper()} IF EXISTS "{name}"')
                version = 0
            if version == 0:
                for statement in filter(str.strip, SCHEMA.split(";")):
                    db.execute(statement)
            elif version != INDEX_SCHEMA_VERSION:
                raise StoreError(f"checkpoint index {path} has schema version {version}, this prefixrun uses "
                                 f"{INDEX_SCHEMA_VERSION}")
            for statement in _statements(kv_blocks.SCHEMA + SIGNATURES_SCHEMA):
                db.execute(statement)
            foreign = _foreign_objects(db)
            if foreign:
                raise StoreError(f"checkpoint index {path} holds {', '.join(foreign[:3])}, which prefixrun does not "
                                 "make (it would run on the store's statements); it is not used")
            db.execute(f"PRAGMA user_version = {INDEX_SCHEMA_VERSION}")
        return db
    except BaseException as error:
        if db is not None:
            db.close()
        if isinstance(error, sqlite3.DatabaseError):
            raise StoreError(f"cannot open the checkpoint index {path}: {error}") from error
        raise


def _foreign_objects(db: sqlite3.Connection) -> list[str]:
    """The triggers, views and indexes of the index that the schema above does not make as it makes them: they run
    code on the store's statements (whoever can write the folder can add a trigger that never ends, or an index on
    an expression that builds a gigabyte per row). A redefined or extra table runs nothing: its rows are checked as
    any row is (`checked_row`)."""
    found = db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master WHERE type IN ('trigger', 'view', "
                       "'index') AND name NOT LIKE 'sqlite_%'")
    expected = _expected_objects()
    return [f"{kind} {json.dumps(name)}" for kind, name, table, sql in found.fetchall()
            if (kind, name, table, _plain_sql(sql)) not in expected]


def _plain_sql(sql) -> str | None:
    """A CREATE statement without its comments and with single spaces (a comment or layout edited in the schema
    above makes no other object)."""
    return None if sql is None else " ".join(re.sub(r"--[^\n]*", " ", sql).split())


@functools.cache
def _expected_objects() -> frozenset:
    """(type, name, table, sql) of every object a fresh index holds, as this SQLite stores them."""
    db = sqlite3.connect(":memory:")
    try:
        for statement in filter(str.strip, SCHEMA.split(";")):
            db.execute(statement)
        for statement in _statements(kv_blocks.SCHEMA + SIGNATURES_SCHEMA):
            db.execute(statement)
        return frozenset((kind, name, table, _plain_sql(sql)) for kind, name, table, sql in
                         db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall())
    finally:
        db.close()


def _statements(script: str) -> list[str]:
    """The statements of `script` (a trigger's body holds semicolons of its own: split after END)."""
    out, current = [], []
    for line in script.strip().splitlines():
        current.append(line)
        text = "\n".join(current).strip()
        if text.endswith(";") and (not text.upper().startswith("CREATE TRIGGER") or text.upper().endswith("END;")):
            out.append(text)
            current = []
    return out


def signature_of(db: sqlite3.Connection, kind: str, record_id: str):
    found = db.execute("SELECT signature FROM signatures WHERE kind = ? AND record_id = ?",
                       (kind, record_id)).fetchone()
    return found[0] if found else None


def set_signature(db: sqlite3.Connection, kind: str, record_id: str, signature: str) -> None:
    db.execute("INSERT OR REPLACE INTO signatures (kind, record_id, signature) VALUES (?, ?, ?)",
               (kind, record_id, signature))


@contextmanager
def write_transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def select_rows(db: sqlite3.Connection, where: str = "", params: Sequence = (), order: str = "") -> list[Row]:
    """The rows that pass `checked_row`; a malformed row (a damaged or hand-edited index) is invisible here and
    removed by maintenance, so it can neither break a run nor point the store at a file."""
    sql = f"SELECT {ROW_COLUMNS} FROM entries {where} {order}"
    rows = (checked_row(values) for values in db.execute(sql, params).fetchall())
    return [row for row in rows if row is not None]


def stored_lengths(db: sqlite3.Connection, model_digest: str, layout_digest: str, above: int, upper: int
                   ) -> list[int]:
    """The prefix lengths in (above, upper] indexed for this model and layout, longest first. A row edited to
    hold a non-integer length is no length."""
    return [n for (n,) in db.execute(
        "SELECT DISTINCT n_tokens FROM entries WHERE model_digest = ? AND layout_digest = ? "
        "AND n_tokens > ? AND n_tokens <= ? ORDER BY n_tokens DESC",
        (model_digest, layout_digest, int(above), int(upper))).fetchall() if type(n) is int]


def touch(db: sqlite3.Connection, entry_id: str, now: float, *, count_hit: bool) -> bool:
    """Mark an entry most recently used. One statement, so it is atomic even outside a transaction. False if the
    row is gone (another process evicted it)."""
    return db.execute(
        "UPDATE entries SET hits = hits + ?, last_used = ?, use_order = (SELECT COALESCE(MAX(use_order), 0) + 1 "
        "FROM entries WHERE typeof(use_order) = 'integer' AND use_order < ?) WHERE entry_id = ?",
        (1 if count_hit else 0, now, MAX_USE_ORDER, entry_id),
    ).rowcount > 0


def block_bytes_to_read(db: sqlite3.Connection, entry_id: str, resident_rows: int) -> int:
    """Bytes of an entry's K/V blocks that end past `resident_rows` (the rest the caller holds already)."""
    return db.execute(
        "SELECT COALESCE(SUM(CASE WHEN typeof(b.nbytes) = 'integer' THEN b.nbytes ELSE 0 END), 0) "
        "FROM entry_blocks r JOIN blocks b ON b.block_id = r.block_id WHERE r.entry_id = ? AND r.end_row > ?",
        (entry_id, int(resident_rows))).fetchone()[0]


def indexed_bytes(db: sqlite3.Connection) -> int:
    """What the budget counts: every entry's blob plus every block once."""
    return db.execute(f"SELECT {SUM_NBYTES} FROM entries").fetchone()[0] + db.execute(
        kv_blocks.SUM_BLOCK_BYTES).fetchone()[0]
