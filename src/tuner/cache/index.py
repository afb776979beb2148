"""The cache store's SQLite index: schema, format version, and opening a connection safely.

The index maps an entry key to where its tensors live (shard file, tensor-name prefix, names) and
its metadata. SQLite gives us what a folder of files cannot: a transaction that adds a whole shard's
entries at once, many concurrent readers alongside one writer (WAL mode), and queries for `info`.

Why WAL: in the default rollback-journal mode a writer blocks every reader for the duration of its
transaction; in WAL mode readers see the last committed state while a writer appends, which is what
DataLoader workers reading during a caching run need. `synchronous=NORMAL` is durable against a
killed process; after a power loss the last commits may roll back, which only leaves shards with no
rows (orphans) that the next writer removes.

A connection must never cross `fork()` (SQLite's documentation lists it as a way to corrupt a
database), so `CacheStore` opens connections lazily and reopens when `os.getpid()` changes.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from tuner.errors import CacheError

FORMAT_VERSION = 1
"""Layout version of a store (index schema + shard naming). A store of any other version is refused."""

INDEX_NAME = "index.sqlite"
SHARDS_DIR = "shards"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS store (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    shard TEXT NOT NULL,        -- file name under shards/
    prefix TEXT NOT NULL,       -- tensor-name prefix of this entry inside the shard
    names TEXT NOT NULL,        -- JSON list of tensor names without the prefix
    nbytes INTEGER NOT NULL,    -- tensor data bytes, for compaction decisions
    meta TEXT NOT NULL,         -- JSON object
    created REAL NOT NULL       -- unix time
);
CREATE INDEX IF NOT EXISTS entries_shard ON entries(shard);
CREATE INDEX IF NOT EXISTS entries_kind ON entries(kind);
CREATE TABLE IF NOT EXISTS file_hashes (
    path TEXT PRIMARY KEY,      -- resolved absolute path
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    inode INTEGER NOT NULL,     -- a file replaced by rename gets a new inode even if mtime is reused
    hash TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS probes (
    path TEXT PRIMARY KEY,      -- resolved absolute path, as in file_hashes
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    inode INTEGER NOT NULL,
    value TEXT NOT NULL         -- JSON of the probe (tuner.data.media)
);
CREATE TABLE IF NOT EXISTS verified_shards (
    shard TEXT PRIMARY KEY,     -- file name under shards/
    size INTEGER NOT NULL,      -- the file's stamp when its checksums were known to match its bytes
    mtime_ns INTEGER NOT NULL,
    inode INTEGER NOT NULL
);
"""
# Tables added after format 1 was released: older tuners ignore them, so they do not change the
# format version; a writable connection creates them in an older index (`_add_tables`).
_ADDED_TABLES = ("probes", "verified_shards")

_BUSY_TIMEOUT_S = 60.0  # writers hold the lock for one small transaction; waiting is always right


def _fix(root: Path) -> str:
    return f"delete {root} (or point to another cache directory) and run caching again"


def unwritable_error(root: Path, e: OSError) -> CacheError:
    """A store that cannot be created or written here (a read-only mount, another user's folder)."""
    where = e.filename or root
    return CacheError(
        f"cannot write the cache store {root}: {where}: {e.strerror}. Make {root} writable by this user, or "
        "set cache_directory in the dataset config to a folder that is."
    )


def _access_problem(root: Path, readonly: bool) -> str | None:
    """What this user may not do with the store's folder or index, if anything: a permission problem is
    said as one (the store may be fine), never as damage to delete."""
    need = os.R_OK if readonly else os.R_OK | os.W_OK
    for path, mode in ((root, need | os.X_OK), (root / INDEX_NAME, need)):
        if path.exists() and not os.access(path, mode):
            what = "read" if readonly else "read and write"
            return (
                f"this user may not {what} {path} (a permission problem or a read-only mount, not damage): "
                "fix its permissions or owner, or run tuner as the user that wrote the cache"
            )
    return None


def connect(root: Path, readonly: bool) -> sqlite3.Connection:
    """Open the index of the store at `root`, creating it unless `readonly`, and check its version.

    Two processes opening one store at the same instant (caching latents and text side by side, or the
    processes of a multi-process caching run) can meet SQLite's "database is locked" without its busy
    wait (a read lock that must become a write lock is refused at once, to avoid a deadlock): the
    opening is then tried again, for up to the busy timeout."""
    deadline = time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            return _connect(root, readonly)
        except _Locked:
            if time.monotonic() > deadline:
                raise CacheError(
                    f"cannot open the cache index {root / INDEX_NAME}: it stays locked"
                ) from None
            time.sleep(0.05)


class _Locked(Exception):
    pass


def _connect(root: Path, readonly: bool) -> sqlite3.Connection:
    path = root / INDEX_NAME
    if readonly and not path.exists():
        raise CacheError(f"no cache store at {root} ({INDEX_NAME} is missing); run caching first")
    try:
        if readonly:
            conn = _connect_readonly(path)
        else:
            root.mkdir(parents=True, exist_ok=True)
            (root / SHARDS_DIR).mkdir(exist_ok=True)
            # isolation_level=None: no implicit transactions; we BEGIN/COMMIT where we mean to.
            # check_same_thread=False: SQLite serializes calls on one connection itself, and a
            # store may be read from a prefetch thread.
            conn = sqlite3.connect(
                path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            # Create tables only in an empty database: a file of some other program keeps its
            # tables and is refused by the version check below.
            if conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0:
                conn.execute("PRAGMA journal_mode=WAL")  # persistent: stored in the file
                _create(conn)
            conn.execute("PRAGMA synchronous=NORMAL")
        version = _read_version(conn)
    except OSError as e:  # creating the folder on a read-only mount or in another user's folder
        raise unwritable_error(root, e) from None
    except sqlite3.OperationalError as e:
        if "locked" in str(e):
            raise _Locked from None
        full = "full" in str(e)  # "database or disk is full"
        fix = f"free some space on {root}" if full else _access_problem(root, readonly) or _fix(root)
        raise CacheError(f"cannot read the cache index {path}: {e}; {fix}") from None
    except sqlite3.DatabaseError as e:
        raise CacheError(f"cannot read the cache index {path}: {e}; {_fix(root)}") from None
    if version != FORMAT_VERSION:
        conn.close()
        raise CacheError(
            f"cache store {root} has format version {version}, this tuner reads version "
            f"{FORMAT_VERSION}; {_fix(root)}"
        )
    if not readonly:
        try:
            _add_tables(conn)
        except sqlite3.OperationalError as e:
            conn.close()
            if "locked" in str(e):
                raise _Locked from None
            raise
    return conn


def _connect_readonly(path: Path) -> sqlite3.Connection:
    """A read-only connection. SQLite reads a WAL-mode database through a `-shm` file it creates
    beside it; on a read-only folder or file system it cannot, and the database opens only as
    `immutable` (no locks, no WAL). That is exact when no `-wal` file holds commits, which is the
    case after the last writer closed; a store still being written cannot be on a read-only mount."""

    def open_(flags: str) -> sqlite3.Connection:
        conn = sqlite3.connect(
            f"{path.resolve().as_uri()}?{flags}",
            uri=True,
            timeout=_BUSY_TIMEOUT_S,
            isolation_level=None,
            check_same_thread=False,
        )
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()  # opens the file now
        return conn

    try:
        return open_("mode=ro")
    except sqlite3.OperationalError:
        wal = path.with_name(path.name + "-wal")
        if os.access(path.parent, os.W_OK) or (wal.exists() and wal.stat().st_size > 0):
            raise
        return open_("mode=ro&immutable=1")


def _add_tables(conn: sqlite3.Connection) -> None:
    have = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if all(t in have for t in _ADDED_TABLES):
        return
    with transaction(conn):
        for statement in _SCHEMA.split(";"):
            if any(f"EXISTS {t} " in statement for t in _ADDED_TABLES):
                conn.execute(statement)


def _create(conn: sqlite3.Connection) -> None:
    # One transaction, so two processes creating the same store do not race.
    with transaction(conn):
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(
            "INSERT OR IGNORE INTO store(name, value) VALUES ('format_version', ?), ('created', ?)",
            (str(FORMAT_VERSION), str(time.time())),
        )


def _read_version(conn: sqlite3.Connection) -> str | int:
    try:
        row = conn.execute("SELECT value FROM store WHERE name = 'format_version'").fetchone()
    except sqlite3.OperationalError:
        return "unknown (not a tuner cache index)"
    if row is None:
        return "unknown (no version recorded)"
    try:
        return int(row[0])
    except ValueError:
        return repr(row[0])


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """`BEGIN IMMEDIATE ... COMMIT`, rolled back if the body raises.

    IMMEDIATE takes the write lock up front: a deferred transaction that reads first and writes later
    can fail with "database is locked" instead of waiting for the busy timeout.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
