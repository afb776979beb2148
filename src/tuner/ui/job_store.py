"""What the job queue (`tuner.ui.jobs`, in the UI) and the runners (`tuner.ui.runner`, one per running job)
share: the SQLite table of jobs, the files of a run folder, and the helpers both use on them.

Every access is a short transaction of its own on a new connection, in WAL mode: the web server's
threads, the background poller and the runners never wait on each other for long.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

STATES = ("queued", "running", "stopping", "stopped", "done", "failed")
STAGES = (("cache latents", ("cache", "latents")), ("cache text", ("cache", "text")), ("train", ("train",)))
CONFIG, DATASET, LOG = "config.toml", "dataset.toml", "job.log"
METRICS = Path("logs") / "metrics.jsonl"  # under save.output_dir, written by `tuner.trainers.metrics`
ERROR_LINES = 20  # log lines kept in a failed job's `error`

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    stage TEXT,
    pid INTEGER,            -- the job's runner (its process group); stop() signals it
    created REAL NOT NULL,
    started REAL,
    finished REAL,
    run_dir TEXT NOT NULL,
    output_dir TEXT NOT NULL,
    error TEXT,
    resume INTEGER NOT NULL DEFAULT 0,  -- train with --resume latest (set by resume())
    slot TEXT,              -- the GPUs ("0,1"; or "cpu") the job runs on
    stage_pid INTEGER,      -- the current stage's process group (every process of the stage is in it)
    processes INTEGER NOT NULL DEFAULT 1,  -- processes per stage: one per GPU, or CPU (gloo) processes
    ranks TEXT              -- JSON: the current (or last) stage's processes, see `rank_states`
)
"""
ADDED_COLUMNS = {"processes": "INTEGER NOT NULL DEFAULT 1", "ranks": "TEXT"}
"""Columns a database written by an earlier tuner lacks; `open_store` adds them."""


def connect(db_path: str | os.PathLike) -> sqlite3.Connection:
    """A connection in autocommit mode that waits up to 30 s for a lock (runners share the database)."""
    conn = sqlite3.connect(db_path, timeout=30.0, isolation_level=None)
    conn.row_factory = sqlite3.Row
    return conn


@contextlib.contextmanager
def transaction(db_path: str | os.PathLike) -> Iterator[sqlite3.Connection]:
    """One short write transaction (taken at once: BEGIN IMMEDIATE), committed on success."""
    conn = connect(db_path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    finally:
        conn.close()


def finish(db_path: str | os.PathLike, job_id: int, state: str, error: str | None = None,
           only_from: tuple[str, ...] = ("running", "stopping")) -> bool:  # fmt: skip
    """Record a job's end (done, stopped or failed) unless it already left `only_from`; return whether it did."""
    marks = ", ".join("?" * len(only_from))
    with transaction(db_path) as conn:
        cur = conn.execute(
            f"UPDATE jobs SET state = ?, error = ?, finished = ?, stage_pid = NULL WHERE id = ? AND state IN ({marks})",
            (state, error, time.time(), job_id, *only_from),
        )
        return cur.rowcount == 1


def open_store(db_path: Path) -> None:
    """Create the database and its table where missing; switch it to WAL (readers never wait for a
    writer; the mode is kept in the file)."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    conn = connect(db_path)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(SCHEMA)
        have = {row["name"] for row in conn.execute("PRAGMA table_info(jobs)")}
        for name, declaration in ADDED_COLUMNS.items():
            if name not in have:
                conn.execute(f"ALTER TABLE jobs ADD COLUMN {name} {declaration}")
    finally:
        conn.close()


def rank_states(processes: list[subprocess.Popen], codes: list[int | None]) -> str:
    """The `ranks` column: one entry per process of a stage, in rank order:
    {"rank", "pid", "state": "running" | "exited", "code": its exit status (negative: the signal that ended
    it) or null while it runs}."""
    return json.dumps(
        [{"rank": rank, "pid": p.pid, "state": "running" if code is None else "exited", "code": code}
         for rank, (p, code) in enumerate(zip(processes, codes, strict=True))]
    )  # fmt: skip


def query(db_path: str | os.PathLike, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
    """The rows of one read."""
    conn = connect(db_path)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of a text file, each as a terminal would show it (a progress bar's `\\r`
    redraws keep only their last state); [] for a missing file."""
    if lines <= 0 or not path.is_file():
        return []
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        end = pos = f.tell()
        data = b""
        while pos > 0 and data.count(b"\n") <= lines:
            pos = max(0, pos - 65536)
            f.seek(pos)
            data = f.read(end - pos)
    text = data.decode("utf-8", errors="replace")
    shown = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n")]
    if pos > 0:
        shown = shown[1:]  # the first line read may have started before the block
    if shown and shown[-1] == "":
        shown.pop()
    return shown[-lines:]


def latest_state(output_dir: Path) -> Path | None:
    """The newest complete training state under `output_dir` (see `tuner.trainers.checkpoints`), if any."""
    from tuner.trainers.checkpoints import Checkpoints

    states = Checkpoints(output_dir, None, None).complete_states()
    return states[-1] if states else None
