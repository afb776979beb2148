"""The content-addressed cache store: one directory of shards plus a SQLite index.

    root/index.sqlite             entries (key -> shard, tensor names, meta), memoized file hashes
    root/shards/<uuid>.safetensors many entries per file, tensor names prefixed per entry
    root/writer.lock              held shared by writers, exclusively by cleanup and prune

Keys come from `tuner.cache.keys.entry_key`; caching commands ask `missing(keys)`, encode those, and
`put` them through `writer()` (see `tuner.cache.writer` for why a kill never corrupts the store).
Reading is `get(key)`, or in two halves that may run in different processes: `locate(key)` (an
`EntryLocation`: shard file, byte offsets, dtypes, shapes) and `view(location)` (tensors sliced out
of this process's map of the shard). DataLoader workers locate and `prefetch`, the main process views:
no tensor bytes cross processes (`tuner.cache.reads` explains why and wraps it in a Dataset).

Each process keeps its shards memory-mapped (`ShardReader` returns tensors backed by the map
without copying) and loads the key -> row map with one query the first time it reads, so a read is
a few dict lookups and a slice, no syscall. SQLite connections never cross `fork()`: everything
process-local is opened lazily and reopened when `os.getpid()` changes.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from tuner.cache.index import FORMAT_VERSION, INDEX_NAME, SHARDS_DIR, connect, transaction
from tuner.cache.keys import hash_file
from tuner.cache.shards import ShardReader, TensorLocation, shard_data_bytes
from tuner.cache.writer import LOCK_NAME, ShardWriter, WriterLock, remove_orphans
from tuner.errors import CacheError, DataError

DEFAULT_MAX_SHARD_BYTES = 256 << 20
DEFAULT_MAX_ENTRIES = 1024
# A file modified this recently may be modified again within the same mtime tick, unseen by a
# (size, mtime) check; its hash is not memoized (git's "racy" rule).
_RACY_NS = 2_000_000_000
_QUERY_CHUNK = 500  # keys per `IN (...)` query, below SQLite's variable limit

# Connections inherited through fork(). The child must not use them, and must not close them either
# (closing runs SQLite cleanup on files the parent still uses), so they stay referenced forever.
_INHERITED_CONNECTIONS: list[sqlite3.Connection] = []


class _IndexRow(NamedTuple):
    shard: str
    prefix: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class EntryLocation:
    """Where an entry's tensors lie (`CacheStore.locate`): a few hundred bytes once pickled, valid in
    any process that opens the same store."""

    key: str  # to locate the entry again if its shard was compacted away meanwhile
    shard: str  # file name under shards/
    tensors: tuple[TensorLocation, ...]


class CacheStore:
    """One cache directory. Cheap to construct, safe to pass to DataLoader workers (fork or spawn)."""

    def __init__(self, root: str | os.PathLike, readonly: bool = False):
        self.root = Path(root)
        self.readonly = readonly
        self._reset_process_state()
        self._connection()  # open now so a wrong or newer-format directory fails here, not mid-run

    # -- process-local state ---------------------------------------------------------------------

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._conn: sqlite3.Connection | None = None
        # No bound on open shards: a ShardReader holds a mapping, not a file descriptor.
        self._handles: dict[str, ShardReader] = {}
        self._rows: dict[str, _IndexRow] | None = None

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            if self._conn is not None:
                _INHERITED_CONNECTIONS.append(self._conn)
            self._reset_process_state()

    def _connection(self) -> sqlite3.Connection:
        self._check_process()
        if self._conn is None:
            self._conn = connect(self.root, self.readonly)
        return self._conn

    def close(self) -> None:
        """Close this process's index connection and forget its shard maps (tensors already
        returned stay valid). The store reopens them if used again."""
        self._check_process()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._forget_maps()

    def __getstate__(self) -> dict:
        # Pickled for spawn-started workers: only the address travels, the state is reopened there.
        return {"root": self.root, "readonly": self.readonly}

    def __setstate__(self, state: dict) -> None:
        self.root = state["root"]
        self.readonly = state["readonly"]
        self._reset_process_state()

    @property
    def shards_dir(self) -> Path:
        return self.root / SHARDS_DIR

    # -- reading ---------------------------------------------------------------------------------

    def has(self, key: str) -> bool:
        """Whether an entry is committed under `key` (asks the index, so it sees other writers)."""
        return (
            self._connection().execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone() is not None
        )

    def missing(self, keys: Iterable[str]) -> list[str]:
        """The keys with no committed entry, in the order given (duplicates kept)."""
        keys = list(keys)
        conn = self._connection()
        present: set[str] = set()
        unique = list(dict.fromkeys(keys))
        for i in range(0, len(unique), _QUERY_CHUNK):
            chunk = unique[i : i + _QUERY_CHUNK]
            marks = ",".join("?" * len(chunk))
            present.update(
                k for (k,) in conn.execute(f"SELECT key FROM entries WHERE key IN ({marks})", chunk)
            )
        return [k for k in keys if k not in present]

    def keys(self, kind: str | None = None) -> list[str]:
        """All committed keys (of one kind if given), sorted."""
        conn = self._connection()
        if kind is None:
            rows = conn.execute("SELECT key FROM entries ORDER BY key")
        else:
            rows = conn.execute("SELECT key FROM entries WHERE kind = ? ORDER BY key", (kind,))
        return [k for (k,) in rows]

    def meta(self, key: str) -> dict:
        """The metadata dict stored with an entry."""
        row = self._connection().execute("SELECT meta FROM entries WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise self._missing_error(key)
        return json.loads(row[0])

    def get(self, key: str) -> dict[str, torch.Tensor]:
        """The entry's tensors by name, backed by this process's map of the shard (copy-on-write:
        see `tuner.cache.shards` for what in-place edits do)."""
        return self.view(self.locate(key))

    def locate(self, key: str) -> EntryLocation:
        """Where the entry's tensors lie, for `view` in this or another process."""
        self._check_process()
        row = self._row(key)
        handle = self._open(row.shard)
        if handle is None:
            # A prune compacted the shard since this process looked the key up: look again.
            self._rows.pop(key, None)
            row = self._row(key)
            handle = self._open(row.shard)
            if handle is None:
                raise self._shard_missing_error(key, row.shard)
        return EntryLocation(key, row.shard, tuple(handle.locate(name, row.prefix) for name in row.names))

    def view(self, location: EntryLocation) -> dict[str, torch.Tensor]:
        """The tensors at `location` by name, sliced out of this process's map of the shard: no copy,
        no syscall once the shard is mapped. If the shard was compacted away since `location` was
        made (a prune in another process), the key is located again."""
        self._check_process()
        handle = self._open(location.shard)
        if handle is None:
            location = self.locate(location.key)  # raises if the entry itself was pruned
            handle = self._handles[location.shard]
        return {t.name: handle.view(t) for t in location.tensors}

    def prefetch(self, location: EntryLocation) -> None:
        """Bring the entry's bytes into the OS page cache, reading them from disk if needed, and
        return when they are there: a later `view`, in any process, then waits for no disk. This is
        the I/O a DataLoader worker does in parallel with training."""
        self._check_process()
        handle = self._open(location.shard)
        if handle is None:
            return  # compacted away: `view` will locate the entry again
        for tensor in location.tensors:
            handle.prefetch(tensor)

    def _row(self, key: str) -> _IndexRow:
        if self._rows is None:
            # One query per process instead of one per read.
            rows = self._connection().execute("SELECT key, shard, prefix, names FROM entries")
            self._rows = {k: _IndexRow(s, p, tuple(json.loads(n))) for k, s, p, n in rows}
        found = self._rows.get(key)
        if found is None:
            # Committed after the map was loaded (a writer appending while we read), or absent.
            row = (
                self._connection()
                .execute("SELECT shard, prefix, names FROM entries WHERE key = ?", (key,))
                .fetchone()
            )
            if row is None:
                raise self._missing_error(key)
            found = _IndexRow(row[0], row[1], tuple(json.loads(row[2])))
            self._rows[key] = found
        return found

    def _open(self, shard: str) -> ShardReader | None:
        """This process's map of `shard`, or None if the file is gone (deleted by a compaction)."""
        handle = self._handles.get(shard)
        if handle is None:
            try:
                handle = ShardReader(self.shards_dir / shard)
            except FileNotFoundError:
                return None
            self._handles[shard] = handle
        return handle

    def _shard_missing_error(self, key: str, shard: str) -> CacheError:
        return CacheError(
            f"cache store {self.root}: shard {shard} of entry {key} is missing; "
            f"run caching again to re-encode it"
        )

    def _missing_error(self, key: str) -> CacheError:
        return CacheError(f"cache store {self.root} has no entry {key}; run caching to encode it")

    def _forget_maps(self) -> None:
        self._handles.clear()
        self._rows = None

    # -- source hashes ---------------------------------------------------------------------------

    def hash_source(self, path: str | os.PathLike) -> str:
        """`hash_file(path)`, memoized in the index by (path, size, mtime, inode).

        Re-runs skip re-reading unchanged videos. Not detected: a same-size in-place rewrite that
        also restores the previous mtime to the nanosecond.
        """
        resolved = os.path.realpath(path)
        try:
            before = os.stat(resolved)
        except FileNotFoundError:
            raise DataError(f"source file not found: {path}") from None
        stamp = (before.st_size, before.st_mtime_ns, before.st_ino)
        conn = self._connection()
        row = conn.execute(
            "SELECT size, mtime_ns, inode, hash FROM file_hashes WHERE path = ?", (resolved,)
        ).fetchone()
        if row is not None and tuple(row[:3]) == stamp:
            return row[3]
        digest = hash_file(resolved)
        after = os.stat(resolved)
        unchanged = (after.st_size, after.st_mtime_ns, after.st_ino) == stamp
        settled = time.time_ns() - before.st_mtime_ns > _RACY_NS
        if not self.readonly and unchanged and settled:
            # One statement commits on its own; no BEGIN, so threads hashing in parallel may share
            # this connection.
            conn.execute(
                "INSERT OR REPLACE INTO file_hashes VALUES (?, ?, ?, ?, ?)", (resolved, *stamp, digest)
            )
        return digest

    # -- writing ---------------------------------------------------------------------------------

    def writer(
        self, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> ShardWriter:
        """A batching writer; use as `with store.writer() as w: w.put(key, kind, tensors, meta)`.

        Opening the first writer removes what killed writers left behind (orphan shards, temp files).
        """
        self._require_writable()
        lock = WriterLock(self.root)
        try:
            if lock.try_exclusive():
                remove_orphans(self._connection(), self.shards_dir)
            lock.shared()
            return ShardWriter(self.root, max_shard_bytes, max_entries, lock=lock)
        except BaseException:
            lock.release()
            raise

    def prune(
        self, keep: set[str], compact_below: float = 0.5, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    ) -> int:
        """Delete entries not in `keep` and return how many.

        Shards left with no entries are deleted; shards whose live data fell below `compact_below`
        of their size are rewritten (their live entries moved into new shards, then the old file
        deleted), each step crash-safe like a write. Refuses while a writer is open.
        """
        self._require_writable()
        conn = self._connection()
        lock = WriterLock(self.root)
        try:
            if not lock.try_exclusive():
                raise CacheError(
                    f"a writer is open on {self.root} (in this or another process); prune after it closes"
                )
            remove_orphans(conn, self.shards_dir)
            with transaction(conn):
                conn.execute("CREATE TEMP TABLE keep(key TEXT PRIMARY KEY)")
                conn.executemany("INSERT OR IGNORE INTO temp.keep VALUES (?)", ((k,) for k in keep))
                deleted = conn.execute(
                    "DELETE FROM entries WHERE key NOT IN (SELECT key FROM temp.keep)"
                ).rowcount
                conn.execute("DROP TABLE temp.keep")
            self._compact(conn, compact_below, max_shard_bytes)
            remove_orphans(conn, self.shards_dir)  # shards emptied by the delete or the compaction
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            lock.release()
            self._forget_maps()
        return deleted

    def _compact(self, conn: sqlite3.Connection, compact_below: float, max_shard_bytes: int) -> None:
        live = conn.execute("SELECT shard, SUM(nbytes) FROM entries GROUP BY shard").fetchall()
        sparse = [
            shard
            for shard, live_bytes in live
            if live_bytes < compact_below * shard_data_bytes(self.shards_dir / shard)
        ]
        if not sparse:
            return
        # Moving an entry = writing it into a new shard and replacing its row; the old shard loses
        # its last row and is deleted as an orphan. A kill in between leaves the old shard valid.
        with ShardWriter(self.root, max_shard_bytes, DEFAULT_MAX_ENTRIES, lock=None) as writer:
            for shard in sparse:
                rows = conn.execute(
                    "SELECT key, kind, prefix, names, meta, created FROM entries WHERE shard = ?", (shard,)
                ).fetchall()
                reader = ShardReader(self.shards_dir / shard)
                for key, kind, prefix, names, meta_json, created in rows:
                    tensors = {n: reader.get_tensor(prefix + n) for n in json.loads(names)}
                    writer._put_owned(key, kind, tensors, meta_json, created)

    def _require_writable(self) -> None:
        if self.readonly:
            raise CacheError(f"cache store {self.root} was opened read-only")

    # -- reporting -------------------------------------------------------------------------------

    def info(self) -> dict:
        """Counts per kind, bucket (meta "bucket") and encoder (meta "encoder"), and sizes on disk."""
        conn = self._connection()

        def counts(sql: str) -> dict[str, int]:
            return {str(name): n for name, n in conn.execute(sql)}

        shard_files = list(self.shards_dir.glob("*.safetensors"))
        index_files = [
            self.root / n for n in (INDEX_NAME, f"{INDEX_NAME}-wal", f"{INDEX_NAME}-shm", LOCK_NAME)
        ]
        shard_bytes = sum(p.stat().st_size for p in shard_files)
        index_bytes = sum(p.stat().st_size for p in index_files if p.exists())
        by_field = (
            "SELECT json_extract(meta, '$.{0}') AS v, COUNT(*) FROM entries WHERE v IS NOT NULL GROUP BY v"
        )
        return {
            "root": str(self.root),
            "format_version": FORMAT_VERSION,
            "entries": conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0],
            "kinds": counts("SELECT kind, COUNT(*) FROM entries GROUP BY kind ORDER BY kind"),
            "buckets": counts(by_field.format("bucket") + " ORDER BY v"),
            "encoders": counts(by_field.format("encoder") + " ORDER BY v"),
            "shards": len(shard_files),
            "live_bytes": conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0],
            "bytes": shard_bytes + index_bytes,
        }


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def format_info(info: dict) -> str:
    """Render `CacheStore.info()` for `tuner cache info DIR`."""
    lines = [
        f"cache store {info['root']} (format {info['format_version']})",
        f"  {info['entries']:,} entries in {info['shards']:,} shards, {_size(info['bytes'])} on disk "
        f"({_size(info['live_bytes'])} of live tensor data)",
    ]
    for title, field in (("kind", "kinds"), ("bucket", "buckets"), ("encoder", "encoders")):
        if not info[field]:
            continue
        lines.append(f"  by {title}:")
        width = max(len(name) for name in info[field])
        lines += [f"    {name:<{width}}  {n:>8,}" for name, n in info[field].items()]
    return "\n".join(lines)
