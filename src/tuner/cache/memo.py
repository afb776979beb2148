"""Facts about source files (content hash, probed size and frame count) remembered in the index.

Planning a dataset asks two questions of every file: what are its contents (a blake2b hash, for the
cache key) and what is its size, frame count and frame rate (a probe, for its bucket and frame
windows). Both answers only change when the file does, so the index remembers them by the file's
(resolved path, size, mtime, inode) and a re-run only stats each file.

They are looked up the set-based way: `preload` fetches the remembered rows of many paths with one
query per 500 paths (instead of one query per file), `get` then answers from memory or computes, and
`save` writes everything newly computed in one transaction. Not detected: a same-size in-place rewrite
that also restores the previous mtime to the nanosecond.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterable

from tuner.cache.index import transaction
from tuner.errors import DataError

# A file modified this recently may be modified again within the same mtime tick, unseen by a
# (size, mtime) check; its facts are not remembered (git's "racy" rule).
_RACY_NS = 2_000_000_000
_QUERY_CHUNK = 500  # paths per `IN (...)` query, below SQLite's variable limit

Stamp = tuple[int, int, int]  # (size, mtime_ns, inode)


def _stamp(path: str) -> Stamp:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"source file not found: {path}") from None
    return st.st_size, st.st_mtime_ns, st.st_ino


class FileMemo:
    """One memo table (`file_hashes` or `probes`: path, size, mtime_ns, inode, value) of an index.

    With `writable` False nothing is saved (a read-only store): facts are computed when not found.
    Values are stored prefixed with `tag` and rows with another prefix count as absent: bump the
    tag when the computation changes (e.g. "probe-v1:").
    """

    def __init__(self, conn: sqlite3.Connection, table: str, writable: bool, tag: str = ""):
        self._conn = conn
        self._table = table
        self._writable = writable
        self._tag = tag
        self._rows: dict[str, tuple[Stamp, str]] = {}
        self._new: list[tuple] = []
        self._folders: dict[str, str] = {}  # folder -> its realpath

    def _resolve(self, path: str | os.PathLike) -> str:
        """`os.path.realpath(path)`, resolving each folder once: realpath lstats every component of
        every path, which was most of the time planning took at a few thousand files."""
        folder, name = os.path.split(os.path.abspath(path))
        real = self._folders.get(folder)
        if real is None:
            real = self._folders[folder] = os.path.realpath(folder)
        resolved = os.path.join(real, name)
        return os.path.realpath(resolved) if os.path.islink(resolved) else resolved

    def preload(self, paths: Iterable[str | os.PathLike]) -> None:
        """Fetch the remembered facts of `paths` (any number) in a few queries."""
        wanted = sorted({self._resolve(p) for p in paths} - self._rows.keys())
        for i in range(0, len(wanted), _QUERY_CHUNK):
            chunk = wanted[i : i + _QUERY_CHUNK]
            marks = ",".join("?" * len(chunk))
            try:
                rows = self._conn.execute(
                    f"SELECT path, size, mtime_ns, inode, {self._value} FROM {self._table} "
                    f"WHERE path IN ({marks})",
                    chunk,
                ).fetchall()
            except sqlite3.OperationalError:  # a read-only index from before this table existed
                return
            self._rows.update(
                (path, ((size, mtime, inode), value)) for path, size, mtime, inode, value in rows
            )

    @property
    def _value(self) -> str:
        return "hash" if self._table == "file_hashes" else "value"

    def get(self, path: str | os.PathLike, compute: Callable[[str], str]) -> str:
        """The remembered value of `path` if the file is unchanged, else `compute(resolved path)`
        (remembered for `save` when the file did not change while it was computed)."""
        resolved = self._resolve(path)
        before = _stamp(resolved)
        if resolved not in self._rows:
            self.preload([resolved])
        found = self._rows.get(resolved)
        if found is not None and found[0] == before and found[1].startswith(self._tag):
            return found[1][len(self._tag) :]
        value = compute(resolved)
        settled = time.time_ns() - before[1] > _RACY_NS
        if self._writable and settled and _stamp(resolved) == before:
            self._rows[resolved] = (before, self._tag + value)
            self._new.append((resolved, *before, self._tag + value))
        return value

    def save(self) -> None:
        """Remember what `get` computed since the last save, in one transaction."""
        if not self._new:
            return
        rows, self._new = self._new, []
        # executemany in autocommit mode would commit row by row; one transaction is one commit
        with transaction(self._conn):
            self._conn.executemany(f"INSERT OR REPLACE INTO {self._table} VALUES (?, ?, ?, ?, ?)", rows)
