"""Writing cache entries: batched into shards, crash-safe at every instant.

One safetensors file per entry (what other tools write) costs a file open, a header parse and a
fresh memory map per read, and a folder of 100k files is slow to list and copy. We batch many
entries into one shard file, prefixing each entry's tensor names with a number unique in the shard.

The write protocol, and why a kill at any instant leaves a valid store:

1. The shard is written under a temporary name, fsynced, renamed to `shards/<uuid>.safetensors`
   and the folder fsynced (`tuner.io.atomic_path`). Killed before the rename: a `.tmp` file that
   nothing refers to. The rename is atomic, so a shard file is always complete.
2. Only then are the shard's index rows inserted, in one transaction. Killed before the commit: a
   complete shard with no rows (an orphan). SQLite rolls back a half-done transaction, so a row
   never points to a missing or partial shard.

Entries without rows are simply missing, so the next run encodes them again. Buffered entries are
committed when the shard is full, when `commit_every_seconds` have passed since the last commit, and
when the writer closes (also on an exception, such as the one the caching commands raise on SIGTERM
or SIGINT); so a SIGKILL loses at most the entries of the last interval. Orphans and temporary
files are removed when a writer opens (or by `prune`), but only under an exclusive lock on
`writer.lock`: another writer might have renamed its shard and not yet committed its rows. Writers
hold the lock shared while they work; the first writer to open takes it exclusively for the cleanup
and then downgrades. A killed process releases its lock (flock locks die with their file descriptor).
The caching commands also hold a lock of their own per kind of entry (`caching-latent.lock`), so that
a second caching run waits for the first instead of encoding the same entries twice.

A shard that cannot be written (a full disk, a folder made read-only) raises one `CacheError` naming it:
the entries buffered for it are lost, every shard committed before stays readable and is reused by the
next run.

Each shard records a checksum per entry in its header (`tuner.cache.shards` explains the checksum).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from tuner.cache.index import FORMAT_VERSION, SHARDS_DIR, connect, transaction, unwritable_error
from tuner.cache.keys import canonical_json
from tuner.cache.shards import CHECKSUM, SUPPORTED_DTYPES, tensors_checksum
from tuner.errors import CacheError
from tuner.io import save_safetensors

try:
    import fcntl
except ImportError:  # Windows: no flock; see WriterLock
    fcntl = None

# Test hook: called with the shard path after its rename and before its rows are committed.
_before_index_commit: Callable[[Path], None] | None = None

LOCK_NAME = "writer.lock"


class WriterLock:
    """Advisory lock on `root/writer.lock`: writers share it, cleanup and prune need it alone.

    Without `fcntl` (Windows) there is no lock: one writer at a time is assumed, and cleanup runs.
    """

    def __init__(self, root: Path, name: str = LOCK_NAME):
        self.path = root / name
        try:
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a read-only mount, another user's folder
            raise unwritable_error(root, e) from None

    def try_exclusive(self) -> bool:
        """Take the lock alone if no one else holds it; never waits."""
        if fcntl is None:
            return True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def exclusive(self) -> None:
        """Take the lock alone, waiting for as long as another process holds it."""
        if fcntl is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)

    def shared(self) -> None:
        """Hold the lock shared (converting an exclusive hold); waits while a cleanup or prune runs."""
        if fcntl is not None:
            fcntl.flock(self._fd, fcntl.LOCK_SH)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def remove_orphans(conn: sqlite3.Connection, shards_dir: Path) -> int:
    """Delete shard files no row refers to, temporary files, and rows whose shard file is gone.

    The caller must hold the `WriterLock` exclusively. Returns the number of files deleted.
    """
    removed = 0
    for tmp in shards_dir.glob(".*.tmp"):  # left by a writer killed mid-write (atomic_path's names)
        tmp.unlink(missing_ok=True)
        removed += 1
    referenced = {name for (name,) in conn.execute("SELECT DISTINCT shard FROM entries")}
    on_disk = {p.name for p in shards_dir.glob("*.safetensors")}
    for name in on_disk - referenced:
        # On Windows a file another process maps cannot be deleted; it is retried next time.
        with contextlib.suppress(PermissionError):
            (shards_dir / name).unlink(missing_ok=True)
            removed += 1
    gone = sorted(referenced - on_disk)
    with transaction(conn):
        # Shards deleted by hand: drop their rows so those entries read as missing and get re-encoded.
        conn.executemany("DELETE FROM entries WHERE shard = ?", [(name,) for name in gone])
        conn.execute("DELETE FROM verified_shards WHERE shard NOT IN (SELECT shard FROM entries)")
    return removed


@dataclasses.dataclass
class _Pending:
    kind: str
    tensors: dict[str, torch.Tensor]
    meta_json: str
    created: float
    nbytes: int


class ShardWriter:
    """Buffers entries and writes them as shards of at most `max_shard_bytes` / `max_entries`.

    Use as a context manager (`CacheStore.writer`): the buffer is flushed when full and on exit,
    also when the body raises, so work encoded before an error is kept.
    """

    def __init__(
        self,
        root: Path,
        max_shard_bytes: int,
        max_entries: int,
        lock: WriterLock | None,
        commit_every_seconds: float | None = None,
    ):
        if max_shard_bytes <= 0 or max_entries <= 0:
            raise ValueError("max_shard_bytes and max_entries must be positive")
        if commit_every_seconds is not None and commit_every_seconds < 0:
            raise ValueError("commit_every_seconds must be >= 0")
        self._commit_every = commit_every_seconds
        self._last_commit = time.monotonic()
        self._shards_dir = root / SHARDS_DIR
        self._max_bytes = max_shard_bytes
        self._max_entries = max_entries
        self._lock = lock
        # Its own connection: a writer is used by one process (and may be used from another thread
        # than the store's readers).
        self._conn = connect(root, readonly=False)
        self._pending: dict[str, _Pending] = {}
        self._pending_bytes = 0
        self.entries_written = 0
        self.shards_written = 0

    def put(self, key: str, kind: str, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> None:
        """Add an entry (replacing any entry with the same key). `meta` must be JSON-serializable."""
        if not key or not kind:
            raise ValueError("key and kind must be non-empty strings")
        if not tensors:
            raise ValueError(f"entry {key} has no tensors")
        meta_json = canonical_json(meta or {})
        # A private CPU copy: the caller may reuse its buffer, and a view into a large batch tensor
        # would otherwise keep the whole batch alive (and safetensors refuses shared storage).
        owned = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"entry {key}: {name!r} is a {type(t).__name__}, not a tensor")
            if t.dtype not in SUPPORTED_DTYPES:  # fail now, not when the whole shard is written
                raise TypeError(f"entry {key}: {name!r} has dtype {t.dtype}, which shards cannot store")
            owned[name] = t.detach().to("cpu", copy=True).contiguous()
        self._add(key, _Pending(kind, owned, meta_json, time.time(), _nbytes(owned)))

    def _put_owned(self, key: str, kind: str, tensors: dict, meta_json: str, created: float) -> None:
        """Add tensors the writer may keep as they are (used by compaction to move entries)."""
        self._add(key, _Pending(kind, tensors, meta_json, created, _nbytes(tensors)))

    def _add(self, key: str, entry: _Pending) -> None:
        if (old := self._pending.pop(key, None)) is not None:
            self._pending_bytes -= old.nbytes
        # Flush first if this entry would overflow a non-empty shard; a single entry larger than
        # max_shard_bytes gets a shard of its own.
        if self._pending and self._pending_bytes + entry.nbytes > self._max_bytes:
            self.flush()
        self._pending[key] = entry
        self._pending_bytes += entry.nbytes
        if len(self._pending) >= self._max_entries or self._pending_bytes >= self._max_bytes:
            self.flush()
        elif self._commit_every is not None and time.monotonic() - self._last_commit >= self._commit_every:
            self.flush()  # a smaller shard, so that a kill loses at most this interval's work

    def flush(self) -> None:
        """Write the buffered entries as one shard, then commit their index rows."""
        if not self._pending:
            return
        name = f"{uuid.uuid4().hex}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        rows = []
        checksums = {}
        for i, (key, entry) in enumerate(self._pending.items()):
            prefix = f"{i}/"
            for tensor_name, t in entry.tensors.items():
                tensors[prefix + tensor_name] = t
            checksums[prefix] = tensors_checksum(entry.tensors)
            names = json.dumps(list(entry.tensors))
            rows.append((key, entry.kind, name, prefix, names, entry.nbytes, entry.meta_json, entry.created))
        path = self._shards_dir / name
        metadata = {
            "format": "tuner-cache-shard",
            "version": FORMAT_VERSION,
            "checksum": CHECKSUM,
            "checksums": json.dumps(checksums, separators=(",", ":")),
        }
        try:
            save_safetensors(tensors, path, metadata=metadata)
            if _before_index_commit is not None:
                _before_index_commit(path)
            st = path.stat()
            with transaction(self._conn):
                self._conn.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
                # its checksums were computed from the very tensors written: the file is known good as is
                self._conn.execute(
                    "INSERT OR REPLACE INTO verified_shards VALUES (?, ?, ?, ?)",
                    (name, st.st_size, st.st_mtime_ns, st.st_ino),
                )
        except (OSError, sqlite3.OperationalError) as e:  # a full disk, a folder made read-only meanwhile
            raise self._write_failed(path, e) from None
        self.entries_written += len(rows)
        self.shards_written += 1
        self._pending.clear()
        self._pending_bytes = 0
        self._last_commit = time.monotonic()

    def _write_failed(self, path: Path, e: OSError | sqlite3.OperationalError) -> CacheError:
        """One line for a shard that could not be written: what is lost (the buffer), what is kept (every
        commit before it), and what to do. The buffer is dropped, so closing does not try again."""
        lost = len(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        full = getattr(e, "errno", None) == errno.ENOSPC or "full" in why
        fix = f"free some space on {self._shards_dir}" if full else f"make {self._shards_dir} writable"
        return CacheError(
            f"cannot write the cache shard {path} ({why}): the {lost} entries encoded since the last commit "
            f"are not saved; the {self.entries_written} committed before them are kept. {fix.capitalize()} and run the "
            "command again: it reuses what was kept."
        )

    def close(self) -> None:
        """Flush what is buffered and release the connection and the lock."""
        try:
            self.flush()
        finally:
            self._conn.close()
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
