"""The process that drives one job of `tuner.ui.jobs.JobQueue` through its stages.

    python -m tuner.ui.runner DB_PATH JOB_ID LAUNCHER_JSON

The queue starts it in a session of its own, in the job's run folder. It runs cache latents, cache text
and train in order (each `LAUNCHER + tuner arguments`, in a process group of its own, output appended to
`job.log`), records each stage in the database, and the job's end: done, failed (a stage exited non-zero;
`error` holds the last log lines) or stopped.

SIGTERM (the queue's stop()) or SIGINT is passed on to the running stage's process group: the trainer
finishes its step and saves a resumable state, `accelerate launch` itself simply exits. The runner waits
until every process of that group is gone (the trainer may outlive its launcher), then records stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tuner.ui.jobs import CONFIG, ERROR_LINES, LOG, STAGES, connect, finish, latest_state, tail, transaction


class _Stop:
    """The stop request and the process group it is passed on to."""

    def __init__(self) -> None:
        self.requested = False
        self.group: int | None = None

    def __call__(self, signum, frame) -> None:
        self.requested = True
        self.forward()

    def forward(self) -> None:
        if self.group is not None:
            try:
                os.killpg(self.group, signal.SIGTERM)
            except ProcessLookupError:
                pass


def run(db_path: str, job_id: int, launcher: list[str]) -> int:
    _adopt_orphans()
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    conn = connect(db_path)
    try:
        job = conn.execute("SELECT run_dir, output_dir, resume FROM jobs WHERE id = ?", (job_id,)).fetchone()
    finally:
        conn.close()
    run_dir, output_dir = Path(job["run_dir"]), Path(job["output_dir"])
    log_path = run_dir / LOG
    for stage, args in STAGES:
        if stop.requested or _stop_recorded(db_path, job_id):
            break
        command = [*launcher, *args, "--config", str(run_dir / CONFIG)]
        if stage == "train" and job["resume"] and latest_state(output_dir) is not None:
            command += ["--resume", "latest"]
        with log_path.open("ab") as log:
            log.write(f"== {stage}: {' '.join(command)}\n".encode())
            log.flush()
            process = subprocess.Popen(command, cwd=run_dir, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        stop.group = process.pid
        with transaction(db_path) as conn:
            conn.execute(
                "UPDATE jobs SET stage = ?, stage_pid = ? WHERE id = ?", (stage, process.pid, job_id)
            )
        if stop.requested:  # the signal came while the stage was starting
            stop.forward()
        code = process.wait()
        _wait_for_group(process.pid)
        stop.group = None
        if stop.requested or _stop_recorded(db_path, job_id):
            break
        if code != 0:
            lines = tail(log_path, ERROR_LINES)
            finish(
                db_path,
                job_id,
                "failed",
                f"{stage} exited with code {code}; last log lines:\n" + "\n".join(lines),
            )
            return 1
    else:
        finish(db_path, job_id, "done")
        return 0
    finish(db_path, job_id, "stopped")
    return 0


def _stop_recorded(db_path: str, job_id: int) -> bool:
    """Whether stop() marked the job stopping (its signal may not have reached us yet)."""
    conn = connect(db_path)
    try:
        return conn.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()[0] == "stopping"
    finally:
        conn.close()


def _adopt_orphans() -> None:
    """Linux: become the parent of this job's orphaned processes (a trainer whose launcher exited first),
    so that they are reaped here when they end rather than left as zombies where nothing reaps them (a
    container's first process often does not); elsewhere the system's init reaps them."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_child_subreaper = 36
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def _wait_for_group(group: int) -> None:
    """Wait until no process of `group` is left: under `accelerate launch`, the trainer still saving its
    state after a stop outlives the launcher that was the stage's first process."""
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap adopted orphans that ended
                pass
        except ChildProcessError:
            pass
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        except PermissionError:  # a process of the group we may not signal: still there
            pass
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    db_path, job_id, launcher = argv if argv is not None else sys.argv[1:]
    return run(db_path, int(job_id), json.loads(launcher))


if __name__ == "__main__":
    sys.exit(main())
