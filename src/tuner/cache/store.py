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

Every entry carries a checksum (`tuner.cache.shards`). `locate` checks that the entry's bytes are
all in its shard, and its checksum the first time a process reads it from a shard whose file changed
since its checksums were last known to match (`tuner.cache.shards` explains why not always); this
happens in a DataLoader worker when there are workers. A damaged entry's location says so, and `view`
raises `DamagedEntryError` naming the entry's source and the command that re-encodes it. `verify`
checks many entries at once: the caching commands treat damaged entries as missing, `tuner cache
verify` reads everything. Entries of shards written before checksums existed are read unverified
(`unverified_entries` counts them).

Each process keeps its shards memory-mapped (`ShardReader` returns tensors backed by the map
without copying) and loads the key -> row map with one query the first time it reads, so a read is
a few dict lookups and a slice, no syscall. SQLite connections never cross `fork()`: everything
process-local is opened lazily and reopened when `os.getpid()` changes.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from tuner.cache.index import FORMAT_VERSION, INDEX_NAME, SHARDS_DIR, connect, transaction
from tuner.cache.keys import hash_file
from tuner.cache.memo import FileMemo
from tuner.cache.shards import ShardDamaged, ShardReader, TensorLocation, read_header, shard_data_bytes
from tuner.cache.writer import LOCK_NAME, ShardWriter, WriterLock, remove_orphans
from tuner.errors import CacheError

DEFAULT_MAX_SHARD_BYTES = 256 << 20
DEFAULT_MAX_ENTRIES = 1024
_QUERY_CHUNK = 500  # keys per `IN (...)` query, below SQLite's variable limit
# Which caching command encodes each kind of entry (named in damage messages).
_ENCODED_BY = {"latent": "tuner cache latents", "failed": "tuner cache latents", "text": "tuner cache text"}


class DamagedEntryError(CacheError):
    """An entry whose bytes do not match its checksum, or whose shard is truncated or unreadable."""


@dataclass(frozen=True)
class VerifyReport:
    """What `CacheStore.verify` found."""

    checked: int
    damaged: dict[str, str]  # key -> what is wrong
    unverified: int  # entries of shards without checksums (written by an older tuner): size-checked only
    bytes_read: int


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
    damage: str | None = None  # what `locate` found wrong; `view` raises with it


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
        # Entries whose checksum this process checked: each is checked once per process, before
        # any caller could edit its pages in place (a private map would then differ from the file).
        self._verified: set[tuple[str, str]] = set()
        self._known_good: dict[str, tuple[int, int, int] | None] | None = None  # shard -> stamp (index)
        self._hashes: FileMemo | None = None

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

    def missing(self, keys: Iterable[str], verify: bool = False) -> list[str]:
        """The keys with no committed entry, in the order given (duplicates kept). With `verify`,
        also the keys whose entry is damaged (`verify(..., trust_stamps=True)`)."""
        keys = list(keys)
        if verify:
            gone = set(self.missing(keys))
            present = [k for k in dict.fromkeys(keys) if k not in gone]
            damaged = self.verify(present, trust_stamps=True).damaged
            return [k for k in keys if k in gone or k in damaged]
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
        """Where the entry's tensors lie, for `view` in this or another process. The first time a
        process locates an entry it checks the entry's checksum (reading its bytes, which also
        brings them into the page cache); a damaged entry's location carries what is wrong."""
        self._check_process()
        row = self._row(key)
        try:
            handle = self._open(row.shard)
            if handle is None:
                # A prune compacted the shard since this process looked the key up: look again.
                self._rows.pop(key, None)
                row = self._row(key)
                handle = self._open(row.shard)
                if handle is None:
                    raise self._shard_missing_error(key, row.shard)
        except ShardDamaged as e:
            return EntryLocation(key, row.shard, (), f"shard {row.shard} is unreadable: {e}")
        if (row.shard, key) not in self._verified:
            damage = handle.damage(
                row.prefix, row.names, verify=not self._known_good_stamp(row.shard, handle)
            )
            if damage is not None:
                return EntryLocation(key, row.shard, (), f"shard {row.shard}: {damage}")
            self._verified.add((row.shard, key))
        return EntryLocation(key, row.shard, tuple(handle.locate(name, row.prefix) for name in row.names))

    def view(self, location: EntryLocation) -> dict[str, torch.Tensor]:
        """The tensors at `location` by name, sliced out of this process's map of the shard: no copy,
        no syscall once the shard is mapped. If the shard was compacted away since `location` was
        made (a prune in another process), the key is located again. Raises `DamagedEntryError`
        for a damaged entry."""
        self._check_process()
        if location.damage is not None:
            raise self._damaged_error(location.key, location.damage)
        handle = self._open(location.shard)
        if handle is None:
            location = self.locate(location.key)  # raises if the entry itself was pruned
            if location.damage is not None:
                raise self._damaged_error(location.key, location.damage)
            handle = self._handles[location.shard]
        return {t.name: handle.view(t) for t in location.tensors}

    # -- checking --------------------------------------------------------------------------------

    def verify(self, keys: Iterable[str] | None = None, trust_stamps: bool = False) -> VerifyReport:
        """Check the committed entries of `keys` (default: all): that their shard is readable and
        holds all their bytes, and their checksums (reading every byte), except, with
        `trust_stamps`, in shards unchanged since their checksums were known to match. Keys with
        no entry are skipped. Shards are mapped one at a time and unmapped after. A shard whose
        every entry passed is recorded as known good (unless the store is read-only)."""
        conn = self._connection()
        rows: list[tuple] = []
        if keys is None:
            rows = conn.execute("SELECT key, shard, prefix, names FROM entries").fetchall()
        else:
            unique = list(dict.fromkeys(keys))
            for i in range(0, len(unique), _QUERY_CHUNK):
                chunk = unique[i : i + _QUERY_CHUNK]
                marks = ",".join("?" * len(chunk))
                rows += conn.execute(
                    f"SELECT key, shard, prefix, names FROM entries WHERE key IN ({marks})", chunk
                ).fetchall()
        live = dict(conn.execute("SELECT shard, COUNT(*) FROM entries GROUP BY shard").fetchall())
        damaged: dict[str, str] = {}
        unverified = bytes_read = 0
        by_shard: dict[str, list[tuple]] = {}
        for key, shard, prefix, names in sorted(rows, key=lambda r: r[1]):
            by_shard.setdefault(shard, []).append((key, prefix, tuple(json.loads(names))))
        good: list[tuple] = []
        for shard, entries in by_shard.items():
            try:
                reader = ShardReader(self.shards_dir / shard)
            except FileNotFoundError:
                damaged.update((key, f"shard {shard} is missing") for key, _, _ in entries)
                continue
            except ShardDamaged as e:
                damaged.update((key, f"shard {shard} is unreadable: {e}") for key, _, _ in entries)
                continue
            if reader.checksums is None:
                unverified += len(entries)
            full = not (trust_stamps and self._known_good_stamp(shard, reader))
            problems = 0
            for key, prefix, names in entries:
                problem = reader.damage(prefix, names, verify=full)
                if problem is not None:
                    damaged[key] = f"shard {shard}: {problem}"
                    problems += 1
                elif full and reader.checksums is not None:
                    bytes_read += sum(reader.locate(n, prefix).nbytes for n in names)
            if full and not problems and reader.checksums is not None and len(entries) == live.get(shard):
                good.append((shard, *reader.stamp))
            del reader  # unmap before the next shard: verifying a large store must not map all of it
        if good and not self.readonly:
            with transaction(conn):
                conn.executemany("INSERT OR REPLACE INTO verified_shards VALUES (?, ?, ?, ?)", good)
            if self._known_good is not None:
                self._known_good.update((shard, tuple(stamp)) for shard, *stamp in good)
        return VerifyReport(len(rows), damaged, unverified, bytes_read)

    def _known_good_stamp(self, shard: str, reader: ShardReader) -> bool:
        """Whether `reader`'s file has the stamp recorded when its checksums last matched."""
        if self._known_good is None:
            try:
                rows = self._connection().execute("SELECT shard, size, mtime_ns, inode FROM verified_shards")
                self._known_good = {name: tuple(stamp) for name, *stamp in rows}
            except sqlite3.OperationalError:  # a read-only index from before checksums
                self._known_good = {}
        if shard not in self._known_good:  # written since the table was loaded?
            try:
                row = (
                    self._connection()
                    .execute("SELECT size, mtime_ns, inode FROM verified_shards WHERE shard = ?", (shard,))
                    .fetchone()
                )
            except sqlite3.OperationalError:
                row = None
            # remembered either way: one query per shard and process, not one per read
            self._known_good[shard] = tuple(row) if row is not None else None
        return self._known_good[shard] == reader.stamp

    def unverified_entries(self) -> int:
        """Entries in shards without checksums (written by a tuner older than checksums), which
        reads cannot check. Reads each shard's header, not its data."""
        count = 0
        for shard, n in self._connection().execute("SELECT shard, COUNT(*) FROM entries GROUP BY shard"):
            try:
                header, _ = read_header(self.shards_dir / shard)
            except (FileNotFoundError, ShardDamaged):
                continue  # damaged, not unverified: reads and `verify` report it
            if (header.get("__metadata__") or {}).get("checksum") is None:
                count += n
        return count

    def describe(self, key: str) -> str:
        """A short description of an entry for messages: its kind and source file or caption."""
        row = self._connection().execute("SELECT kind, meta FROM entries WHERE key = ?", (key,)).fetchone()
        if row is None:
            return f"entry {key}"
        kind, meta = row[0], json.loads(row[1])
        if "source" in meta:
            return f"{kind} entry of {meta['source']}"
        if "caption" in meta:
            caption = meta["caption"]
            return f"{kind} entry of caption {caption[:60]!r}" + ("..." if len(caption) > 60 else "")
        return f"{kind} entry {key}"

    def _damaged_error(self, key: str, damage: str) -> DamagedEntryError:
        kind = self._connection().execute("SELECT kind FROM entries WHERE key = ?", (key,)).fetchone()
        command = _ENCODED_BY.get(kind[0] if kind else "", "the caching command")
        return DamagedEntryError(
            f"the cache store {self.root} holds a damaged {self.describe(key)} (key {key[:16]}...; {damage}). "
            f"Training cannot re-encode it: run `{command} --config <this config>`, which re-encodes "
            f"damaged entries, then train again. `tuner cache verify {self.root}` lists all damaged entries."
        )

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
        """This process's map of `shard`, or None if the file is gone (deleted by a compaction).
        Raises `ShardDamaged` if its header cannot be read."""
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
        """`hash_file(path)`, memoized in the index by (path, size, mtime, inode) (`tuner.cache.memo`).

        Re-runs skip re-reading unchanged files. Call `preload_sources` first with every path about
        to be hashed (one query instead of one per file) and `save_memos` after (one transaction).
        """
        value = self._hash_memo().get(path, hash_file)
        self.save_memos()
        return value

    def hash_sources(self, paths: Iterable[str | os.PathLike]) -> dict[str, str]:
        """`hash_source` of many paths, as {path as given: hash}: one query per 500 paths, one commit."""
        paths = [str(p) for p in paths]
        memo = self._hash_memo()
        memo.preload(paths)
        hashes = {p: memo.get(p, hash_file) for p in dict.fromkeys(paths)}
        self.save_memos()
        return hashes

    def memo(self, table: str, tag: str = "") -> FileMemo:
        """The memo table `table` ("probes"...) of this store's index (see `tuner.cache.memo`);
        nothing is saved when the store is read-only."""
        return FileMemo(self._connection(), table, writable=not self.readonly, tag=tag)

    def _hash_memo(self) -> FileMemo:
        self._check_process()
        if self._hashes is None:
            self._hashes = FileMemo(self._connection(), "file_hashes", writable=not self.readonly)
        return self._hashes

    def save_memos(self) -> None:
        if self._hashes is not None:
            self._hashes.save()

    # -- writing ---------------------------------------------------------------------------------

    def writer(
        self,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        commit_every_seconds: float | None = None,
    ) -> ShardWriter:
        """A batching writer; use as `with store.writer() as w: w.put(key, kind, tensors, meta)`.
        With `commit_every_seconds`, what is buffered is also committed once that long has passed
        since the last commit (checked at each `put`).

        Opening the first writer removes what killed writers left behind (orphan shards, temp files).
        """
        self._require_writable()
        lock = WriterLock(self.root)
        try:
            if lock.try_exclusive():
                remove_orphans(self._connection(), self.shards_dir)
            lock.shared()
            return ShardWriter(
                self.root, max_shard_bytes, max_entries, lock=lock, commit_every_seconds=commit_every_seconds
            )
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
        damaged = []  # (key, shard) of entries not moved: their rows go, so caching re-encodes them
        with ShardWriter(self.root, max_shard_bytes, DEFAULT_MAX_ENTRIES, lock=None) as writer:
            for shard in sparse:
                rows = conn.execute(
                    "SELECT key, kind, prefix, names, meta, created FROM entries WHERE shard = ?", (shard,)
                ).fetchall()
                try:
                    reader = ShardReader(self.shards_dir / shard)
                except ShardDamaged:
                    reader = None
                for key, kind, prefix, names, meta_json, created in rows:
                    names = tuple(json.loads(names))
                    if reader is None or reader.damage(prefix, names) is not None:
                        damaged.append((key, shard))
                        continue
                    tensors = {n: reader.get_tensor(prefix + n) for n in names}
                    writer._put_owned(key, kind, tensors, meta_json, created)
        if damaged:
            with transaction(conn):
                conn.executemany("DELETE FROM entries WHERE key = ? AND shard = ?", damaged)

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
