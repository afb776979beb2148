"""The queue of training jobs behind `tuner ui`, stored in SQLite so that it survives a restart of the UI.

A job is a run folder under `runs_dir` (its `config.toml`, and `dataset.toml` when the dataset was given
separately) and three stages, run in order as subprocesses: the commands a CLI user types.

    accelerate launch -m tuner cache latents --config config.toml
    accelerate launch -m tuner cache text    --config config.toml
    accelerate launch -m tuner train         --config config.toml   [--resume latest]

Each running job is driven by its own small runner process (`tuner.ui.runner`), started in a session of
its own: it runs the stages with their output appended to `job.log` in the run folder and records the
stage and the outcome here. The UI only starts runners and reads the database, so closing or restarting
the UI leaves running jobs running. A runner that is gone while its job still reads running (it was
killed, or the machine restarted) is noticed by `poll()`, which marks the job failed with the last lines
of its log.

    queued → running → done | failed
    running → stopping → stopped     stop(): SIGTERM; the trainer ends its step and saves a resumable state
    stopped | failed → queued        resume(): train continues from the newest state (--resume latest)

One job runs at a time per GPU (`gpus`; by default CUDA_VISIBLE_DEVICES or every GPU torch sees), or one
at a time on a machine without a GPU. A job of several processes (`submit(..., processes=N)`) takes N GPUs,
one per process, or runs N CPU processes (gloo) on a machine without a GPU. The database and the run
folder's files are `tuner.ui.job_store`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from tuner.config import tomllib
from tuner.errors import TunerError
from tuner.ui.job_store import (
    CONFIG,
    DATASET,
    ERROR_LINES,
    LOG,
    METRICS,
    finish,
    open_store,
    query,
    tail,
    transaction,
)
from tuner.ui.runner import runner_alive, runs

_LAUNCH_GRACE = 60.0  # seconds a claimed job may go without a runner pid before it counts as lost


class JobError(TunerError):
    """A job operation that does not apply to the job as it is (deleting a running job, ...)."""


class UnknownJob(JobError, LookupError):
    """No job has that id."""


@dataclass
class Job:
    """One row of the queue. Times are seconds since the epoch; `stage` is the stage running or last run."""

    id: int
    name: str
    state: str  # one of job_store.STATES
    stage: str | None
    pid: int | None
    created: float
    started: float | None
    finished: float | None
    run_dir: Path
    output_dir: Path
    error: str | None
    processes: int  # processes each stage runs as (one per GPU, or CPU processes)
    ranks: list[dict]  # the current (or last) stage's processes: rank, pid, state, code (`rank_states`)


_COLUMNS = ", ".join(f.name for f in fields(Job))


def visible_gpus() -> list[str]:
    """The GPUs jobs may use: CUDA_VISIBLE_DEVICES when set, else every GPU torch sees."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def default_launcher(slot: str, processes: int = 1) -> list[str]:
    """`accelerate launch -m tuner` as one process: on the given GPU (CUDA_VISIBLE_DEVICES is set to it), or
    on the CPU. Several processes: `python -m tuner`, each started by the runner as one rank (it sets what
    `accelerate launch` would). The stage's subcommand and arguments follow."""
    if processes > 1:
        return [sys.executable, "-u", "-m", "tuner"]
    return [sys.executable, "-m", "accelerate.commands.launch", *(["--cpu"] if slot == "cpu" else []),
            "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "-m", "tuner"]  # fmt: skip


class JobQueue:
    """Jobs in `db_path` (created when missing), their run folders under `runs_dir`.

    `launcher`: the command the stages' tuner arguments are appended to (default: `default_launcher`, i.e.
    `accelerate launch ... -m tuner`); tests pass `[sys.executable, "-m", "tuner"]`. `gpus`: the GPUs jobs
    may use, one job at a time on each (default `visible_gpus()`; none means one job at a time on the CPU).

    `check`: called with a job's config path when it is submitted and again when it starts; what it raises
    refuses the submission, or fails the job with its message. The UI sets it to `tuner.ui.job_check.JobCheck`
    (paths inside the roots, no code references); None checks nothing.
    """

    def __init__(self, db_path: str | os.PathLike, runs_dir: str | os.PathLike, launcher: list[str] | None = None,
                 gpus: list[str] | None = None):  # fmt: skip
        self.db_path = Path(db_path).resolve()
        self.runs_dir = Path(runs_dir).resolve()
        self.launcher = list(launcher) if launcher is not None else None
        self.check: Callable[[Path], None] | None = None
        self.slots = (visible_gpus() if gpus is None else [str(g) for g in gpus]) or ["cpu"]
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        open_store(self.db_path)
        self._lock = threading.Lock()  # one poll() at a time in this process
        self._children: dict[int, subprocess.Popen] = {}  # runners this object started, reaped by poll()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    # ---- reading ----
    def list(self) -> list[Job]:
        """Every job, oldest first."""
        return [_job(row) for row in query(self.db_path, f"SELECT {_COLUMNS} FROM jobs ORDER BY id")]

    def get(self, id: int) -> Job:
        if not 0 < id < 2**63:  # SQLite's integers: a larger id cannot name a job (and overflows the query)
            raise UnknownJob(f"no job {id} in {self.db_path}")
        rows = query(self.db_path, f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (id,))
        if not rows:
            raise UnknownJob(f"no job {id} in {self.db_path}")
        return _job(rows[0])

    def log_tail(self, id: int, lines: int = 200) -> list[str]:
        """The last lines of the job's log (every stage's output, each after a `== stage: command` line)."""
        return tail(self.get(id).run_dir / LOG, lines)

    def metrics(self, id: int) -> list[dict]:
        """The trainer's metrics lines, oldest first: one per logged step (step, epoch, loss, avg_loss, lr,
        step_seconds, eta_seconds, time) and one per validation (step, val_loss, time)."""
        return [r for r in self._metric_lines(id) if "path" not in r]

    def samples(self, id: int) -> list[dict]:
        """Samples drawn while training, oldest first: {"step", "prompt", "path"} (`path` absolute)."""
        out = self.get(id).output_dir
        return [{"step": r["step"], "prompt": r["prompt"], "path": out / r["path"]}
                for r in self._metric_lines(id) if "path" in r]  # fmt: skip

    def adapters(self, id: int) -> list[Path]:
        """The adapter files the run has saved so far, oldest first."""
        out = self.get(id).output_dir
        files = [f for f in out.glob("*.safetensors") if f.is_file()] if out.is_dir() else []
        return sorted(files, key=lambda f: (f.stat().st_mtime, f.name))

    def _metric_lines(self, id: int) -> list[dict]:
        path = self.get(id).output_dir / METRICS
        if not path.is_file():
            return []
        rows = []
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written right now
                rows.append(json.loads(line))
        return rows

    # ---- changing ----
    def submit(self, name: str, config_text: str, dataset_text: str | None = None, processes: int = 1) -> int:
        """Queue a new job: a run folder with `config.toml` (and `dataset.toml`, which the config names as
        `data.dataset_config = "dataset.toml"`). Relative paths in them are relative to the run folder.
        The TOML must parse; everything else is checked by the stages themselves (a bad key fails the
        job with tuner's message in its log). `processes`: each stage runs as that many processes
        (`check_processes`). Returns the job's id."""
        from tuner.io import write_text

        self.check_processes(processes)
        output_dir = self._output_dir(config_text, dataset_text)
        with transaction(self.db_path) as conn:
            cur = conn.execute(
                "INSERT INTO jobs (name, state, created, run_dir, output_dir, processes) "
                "VALUES (?, 'queued', ?, '', '', ?)",
                (name, time.time(), processes),
            )
            job_id = cur.lastrowid
            run_dir = self.runs_dir / f"{job_id:04d}-{_slug(name)}"
            for n in range(2, 1000):  # a folder left by an earlier database under the same id is kept
                if not run_dir.exists():
                    break
                run_dir = self.runs_dir / f"{job_id:04d}-{_slug(name)}-{n}"
            conn.execute(
                "UPDATE jobs SET run_dir = ?, output_dir = ? WHERE id = ?",
                (str(run_dir), str((run_dir / output_dir).resolve()), job_id),
            )
            run_dir.mkdir(parents=True, exist_ok=False)
            try:
                write_text(run_dir / CONFIG, config_text)
                if dataset_text is not None:
                    write_text(run_dir / DATASET, dataset_text)
            except BaseException:
                shutil.rmtree(run_dir, ignore_errors=True)
                raise
        if self.check is not None:  # outside the transaction: loading a config may take a while
            try:
                self.check(run_dir / CONFIG)
            except BaseException:
                with transaction(self.db_path) as conn:
                    conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
                shutil.rmtree(run_dir, ignore_errors=True)
                raise
        return job_id

    def check_processes(self, processes: object) -> None:
        """Refuse a process count this machine cannot run: a whole number ≥ 1, at most one per GPU jobs may use
        (`gpus`), or, without a GPU, at most one CPU process per core (they talk through gloo)."""
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise JobError(
                f"processes: {processes!r} is not a whole number ≥ 1 (processes each stage runs as)"
            )
        if self.slots == ["cpu"]:
            cores = os.cpu_count() or 1
            if processes > cores:
                raise JobError(
                    f"processes: {processes} CPU processes on a machine of {cores} cores; at most {cores}"
                )
        elif processes > len(self.slots):
            raise JobError(
                f"processes: {processes}, but jobs have {len(self.slots)} GPU(s) ({', '.join(self.slots)}); a job "
                "runs one process per GPU"
            )

    def start(self, id: int) -> None:
        """Start a queued job now, ahead of the others, on a free GPU (poll() starts queued jobs in order)."""
        with self._lock:
            job = self.get(id)
            if job.state != "queued":
                raise JobError(
                    f"job {id} is {job.state}; only a queued job can be started (resume a stopped one)"
                )
            free = self._free_slots()
            if len(free) < job.processes:
                busy = "the CPU is busy with another job" if self.slots == ["cpu"] else (
                    f"it needs {job.processes} GPU(s) and {len(free)} of {', '.join(self.slots)} are free, the "
                    "others busy")  # fmt: skip
                raise JobError(f"job {id}: {busy}; it starts when enough are free")
            self._launch(job, free[: job.processes])

    def stop(self, id: int) -> None:
        """Stop a job: a running one gets SIGTERM (its trainer finishes the step and saves a resumable state,
        then it reads stopped); a queued one is taken off the queue (stopped)."""
        with transaction(self.db_path) as conn:
            row = conn.execute("SELECT state, pid, stage_pid FROM jobs WHERE id = ?", (id,)).fetchone()
            if row is None:
                raise UnknownJob(f"no job {id} in {self.db_path}")
            if row["state"] == "queued":
                conn.execute(
                    "UPDATE jobs SET state = 'stopped', finished = ? WHERE id = ?", (time.time(), id)
                )
                return
            if row["state"] not in ("running", "stopping"):
                raise JobError(f"job {id} is {row['state']}, not running")
            conn.execute("UPDATE jobs SET state = 'stopping' WHERE id = ?", (id,))
        # the runner forwards the signal to its stage's processes; before its first stage (perhaps before
        # its handler is in place) it reads the state instead, and starts none
        if row["pid"] and row["stage_pid"] and runs(row["pid"], "tuner.ui.runner", str(id)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(row["pid"], signal.SIGTERM)

    def resume(self, id: int) -> None:
        """Queue a stopped or failed job again; its train stage continues from the newest saved state (the
        cache stages run again first and only encode what is missing)."""
        with transaction(self.db_path) as conn:
            cur = conn.execute(
                "UPDATE jobs SET state = 'queued', resume = 1, error = NULL, finished = NULL WHERE id = ? AND "
                "state IN ('stopped', 'failed')",
                (id,),
            )
            if cur.rowcount == 0:
                raise JobError(
                    f"job {id} is {self.get(id).state}; only a stopped or failed job can be resumed"
                )

    def delete(self, id: int) -> None:
        """Remove a job and its run folder (outputs included); refuses a running one (stop it first)."""
        job = self.get(id)
        with transaction(self.db_path) as conn:
            cur = conn.execute(
                "DELETE FROM jobs WHERE id = ? AND state NOT IN ('running', 'stopping')", (id,)
            )
            if cur.rowcount == 0:
                raise JobError(f"job {id} is {job.state}; stop it before deleting it")
        if job.run_dir.parent == self.runs_dir:  # never a folder anywhere else
            shutil.rmtree(job.run_dir, ignore_errors=True)

    # ---- advancing ----
    def poll(self) -> None:
        """Mark jobs whose runner is gone failed, then start queued jobs, oldest first, on free GPUs."""
        with self._lock:
            for pid, child in list(self._children.items()):
                if child.poll() is not None:  # reaped: its pid is free for the check below
                    del self._children[pid]
            for job in self.list():
                if job.state in ("running", "stopping") and self._lost(job):
                    self._fail_lost(job)
            free = self._free_slots()
            for job in (j for j in self.list() if j.state == "queued"):
                if len(free) < job.processes:
                    break  # in order: a later, smaller job does not overtake it
                if self._launch(job, free[: job.processes]):
                    # the CPU runs one job at a time, whatever its process count; GPUs are held per process
                    free = [] if self.slots == ["cpu"] else free[job.processes :]

    def run_in_background(self, interval: float = 1.0) -> None:
        """Call poll() every `interval` seconds in a daemon thread until close()."""
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._closing.wait(interval):
                try:
                    self.poll()
                except Exception as e:  # a locked or busy moment must not end the poller
                    print(f"tuner ui: polling the job queue failed: {e}", file=sys.stderr)

        self._closing.clear()
        self._thread = threading.Thread(target=loop, name="tuner-job-queue", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the background poller. Running jobs go on (their runners are not children of the UI's
        session); a new JobQueue on the same database picks them up."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ---- helpers ----
    def _free_slots(self) -> list[str]:
        """The GPUs no running job holds (each job's `slot`: its GPUs, comma-separated); on a machine
        without a GPU, ["cpu"] while no job runs, and as many as any job's processes (one job at a time)."""
        rows = query(self.db_path, "SELECT slot FROM jobs WHERE state IN ('running', 'stopping')")
        busy = {gpu for r in rows if r[0] for gpu in r[0].split(",")}
        if self.slots == ["cpu"]:
            return [] if busy else ["cpu"] * (os.cpu_count() or 1)
        return [s for s in self.slots if s not in busy]

    def _launch(self, job: Job, slots: list[str]) -> bool:
        """Claim a queued job for `slots` (its GPUs, or CPU) and start its runner; False if someone else
        claimed it first."""
        slot = ",".join(dict.fromkeys(slots))  # "0,1"; "cpu"
        with transaction(self.db_path) as conn:
            cur = conn.execute(
                "UPDATE jobs SET state = 'running', slot = ?, started = ?, finished = NULL, error = NULL, "
                "stage = NULL, pid = NULL, stage_pid = NULL WHERE id = ? AND state = 'queued'",
                (slot, time.time(), job.id),
            )
            if cur.rowcount == 0:
                return False
        if self.check is not None:
            try:
                self.check(job.run_dir / CONFIG)
            except TunerError as e:
                finish(self.db_path, job.id, "failed", f"refused before it started: {e}")
                return True
        launcher = self.launcher if self.launcher is not None else default_launcher(slot, job.processes)
        env = dict(os.environ)
        if env.get(
            "PYTHONPATH"
        ):  # the runner works in the run folder: a relative entry would point elsewhere
            env["PYTHONPATH"] = os.pathsep.join(
                str(Path(p).resolve()) for p in env["PYTHONPATH"].split(os.pathsep)
            )
        if slot != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = slot
        else:  # what `accelerate launch --cpu` sets: ranks the runner starts itself then form a gloo group
            env["ACCELERATE_USE_CPU"] = "true"
        try:
            with (job.run_dir / LOG).open("ab") as log:  # a runner's own failure lands in the job's log
                child = subprocess.Popen(
                    [sys.executable, "-m", "tuner.ui.runner", str(self.db_path), str(job.id), json.dumps(launcher)],
                    cwd=job.run_dir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    start_new_session=True,  # its own process group: stop() signals it alone; Ctrl-C of the UI does not
                )  # fmt: skip
        except OSError as e:
            finish(self.db_path, job.id, "failed", f"could not start the job's runner: {e}")
            return True
        self._children[child.pid] = child
        with transaction(self.db_path) as conn:
            conn.execute("UPDATE jobs SET pid = ? WHERE id = ?", (child.pid, job.id))
        return True

    def _lost(self, job: Job) -> bool:
        """Whether a running job's runner is gone (or never got a pid, within a grace period)."""
        if job.pid is None:
            return time.time() - (job.started or 0) > _LAUNCH_GRACE
        return not runner_alive(job.pid, job.id)

    def _fail_lost(self, job: Job) -> None:
        stage_pid = query(self.db_path, "SELECT stage_pid FROM jobs WHERE id = ?", (job.id,))[0][0]
        # an orphaned stage (checked to be one, not a process that took over its pid after a reboot):
        # stopped as stop() would stop it (the trainer saves a state)
        if stage_pid and runs(stage_pid, str(job.run_dir / CONFIG)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(stage_pid, signal.SIGTERM)
        lines = tail(job.run_dir / LOG, ERROR_LINES)
        why = f"the job's process (pid {job.pid}) is gone" if job.pid else "the job's process never started"
        error = f"{why} during {job.stage or 'start-up'}; last log lines:\n" + "\n".join(lines)
        finish(self.db_path, job.id, "failed", error)

    def _output_dir(self, config_text: str, dataset_text: str | None) -> str:
        try:
            config = tomllib.loads(config_text)
        except tomllib.TOMLDecodeError as e:
            raise JobError(f"{CONFIG}: not valid TOML ({e})") from None
        if dataset_text is not None:
            try:
                tomllib.loads(dataset_text)
            except tomllib.TOMLDecodeError as e:
                raise JobError(f"{DATASET}: not valid TOML ({e})") from None
        from tuner.config.schema import SaveConfig

        save = config.get("save", {})
        output_dir = save.get("output_dir", SaveConfig().output_dir) if isinstance(save, dict) else None
        if not isinstance(output_dir, str):
            raise JobError(f"{CONFIG}: save.output_dir must be a string (a folder)")
        return output_dir


def _job(row: sqlite3.Row) -> Job:
    values = dict(row)
    values["run_dir"], values["output_dir"] = Path(values["run_dir"]), Path(values["output_dir"])
    values["ranks"] = json.loads(values["ranks"]) if values["ranks"] else []
    return Job(**values)


def _slug(name: str) -> str:
    """A folder-name-safe version of a job's name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")[:40] or "job"
