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

from tuner.ui.job_store import (
    CONFIG,
    ERROR_LINES,
    LOG,
    STAGES,
    finish,
    latest_state,
    query,
    tail,
    transaction,
)


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
    (job,) = query(db_path, "SELECT run_dir, output_dir, resume FROM jobs WHERE id = ?", (job_id,))
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
        if stop.requested or _stop_recorded(db_path, job_id):  # stop() came while the stage was starting
            stop.requested = True
            stop.forward()
        code = process.wait()
        _wait_for_group(process.pid)
        stop.group = None
        # a stop that came after the run's last step changes nothing: the job is done
        finished = code == 0 and stage == STAGES[-1][0]
        if not finished and (stop.requested or _stop_recorded(db_path, job_id)):
            break
        if code != 0:
            lines = "\n".join(tail(log_path, ERROR_LINES))
            finish(db_path, job_id, "failed", f"{stage} exited with code {code}; last log lines:\n{lines}")
            return 1
    else:
        finish(db_path, job_id, "done")
        return 0
    finish(db_path, job_id, "stopped")
    return 0


def _stop_recorded(db_path: str, job_id: int) -> bool:
    """Whether stop() marked the job stopping (its signal may not have reached us yet)."""
    return query(db_path, "SELECT state FROM jobs WHERE id = ?", (job_id,))[0][0] == "stopping"


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


def runner_alive(pid: int, job_id: int) -> bool:
    """Whether job `job_id`'s runner, process `pid`, still runs (a child of this process that ended is
    reaped here). Where /proc exists, a process that took over the pid (after a reboot) does not count."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:  # not our child: ask the kernel
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: not our runner
        return False
    return runs(pid, "tuner.ui.runner", str(job_id))


def runs(pid: int, *args: str) -> bool:
    """Whether process `pid`'s command line holds each of `args` (True where /proc cannot tell)."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not Path("/proc/self/cmdline").is_file():
        return True
    try:
        held = cmdline.read_bytes().split(b"\0")
    except OSError:
        return False
    return all(a.encode() in held for a in args)


def main(argv: list[str] | None = None) -> int:
    db_path, job_id, launcher = argv if argv is not None else sys.argv[1:]
    return run(db_path, int(job_id), json.loads(launcher))


if __name__ == "__main__":
    sys.exit(main())
