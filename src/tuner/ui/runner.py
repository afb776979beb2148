"""The process that drives one job of `tuner.ui.jobs.JobQueue` through its stages.

    python -m tuner.ui.runner DB_PATH JOB_ID LAUNCHER_JSON

The queue starts it in a session of its own, in the job's run folder. It runs cache latents, cache text
and train in order (each `LAUNCHER + tuner arguments`, in a process group of its own, output appended to
`job.log`), records each stage in the database, and the job's end: done, failed (a stage exited non-zero;
`error` holds the last log lines) or stopped.

A job of several processes (`processes` > 1) runs each stage as that many ranks of the command, started
here with the environment torchrun gives its workers (`tuner.ranks`; CPU processes talk through gloo, GPU
ones through NCCL, one GPU each), all in the stage's process group. Each rank's exit is recorded in the
job's `ranks`; the first that fails is named in the job's error and log, and the others are killed if they
have not ended `GRACE` seconds later.

SIGTERM (the queue's stop()) or SIGINT is passed on to the running stage's process group, every rank
included: the trainer finishes its step and saves a resumable state, `accelerate launch` itself simply
exits. The runner waits until every process of that group is gone (the trainer may outlive its launcher),
then records stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from tuner.ranks import free_port, rank_environment
from tuner.ui.job_store import (
    CONFIG,
    ERROR_LINES,
    LOG,
    STAGES,
    finish,
    latest_state,
    query,
    rank_states,
    tail,
    transaction,
)

GRACE = 5.0
"""Seconds the other processes of a stage get to end by themselves once one has failed (then SIGKILL)."""


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
    (job,) = query(db_path, "SELECT run_dir, output_dir, resume, processes FROM jobs WHERE id = ?", (job_id,))
    run_dir, output_dir, count = Path(job["run_dir"]), Path(job["output_dir"]), job["processes"]
    log_path = run_dir / LOG
    for stage, args in STAGES:
        if stop.requested or _stop_recorded(db_path, job_id):
            break
        command = [*launcher, *args, "--config", str(run_dir / CONFIG)]
        if stage == "train" and job["resume"] and latest_state(output_dir) is not None:
            command += ["--resume", "latest"]
        with log_path.open("ab") as log:
            each = f" ({count} processes; rank 0 writes here, rank r in job.rank<r>.log)" if count > 1 else ""
            log.write(f"== {stage}: {' '.join(command)}{each}\n".encode())
        processes = _start(command, count, run_dir)
        stop.group = processes[0].pid
        with transaction(db_path) as conn:
            conn.execute(
                "UPDATE jobs SET stage = ?, stage_pid = ?, ranks = ? WHERE id = ?",
                (stage, stop.group, rank_states(processes, [None] * count), job_id),
            )
        if stop.requested or _stop_recorded(db_path, job_id):  # stop() came while the stage was starting
            stop.requested = True
            stop.forward()
        failed = _wait(processes, db_path, job_id, stop)
        _wait_for_group(stop.group)
        stop.group = None
        # a stop that came after the run's last step changes nothing: the job is done
        finished = failed is None and stage == STAGES[-1][0]
        if not finished and (stop.requested or _stop_recorded(db_path, job_id)):
            break
        if failed is not None:
            finish(db_path, job_id, "failed", _failure(stage, *failed, count, run_dir))
            return 1
    else:
        finish(db_path, job_id, "done")
        return 0
    finish(db_path, job_id, "stopped")
    return 0


def rank_log_name(rank: int) -> str:
    """The log of process `rank` of a multi-process stage, in the run folder (rank 0's is `job.log`)."""
    return LOG if rank == 0 else f"job.rank{rank}.log"


def _start(command: list[str], count: int, run_dir: Path) -> list[subprocess.Popen]:
    """A stage's processes, all in one new process group (the first one's: stop() signals them together).
    One process: `command` itself, which may be a launcher (`accelerate launch`). Several: `count` copies of
    `command` as ranks 0 .. count - 1, with the environment torchrun gives its workers (`tuner.ranks`);
    rank 0 writes `job.log`, rank r the run folder's `job.rank{r}.log`."""
    port = free_port() if count > 1 else 0
    processes: list[subprocess.Popen] = []
    for rank in range(count):
        env = None
        if count > 1:
            env = {**os.environ, **rank_environment(rank, count, port)}
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: each process one thread unless told
        # rank 0 leads a new process group in the runner's session, the others join it (setpgid works within
        # a session only)
        group = partial(os.setpgid, 0, processes[0].pid if processes else 0)
        with (run_dir / rank_log_name(rank)).open("ab") as log:
            try:
                processes.append(subprocess.Popen(command, cwd=run_dir, env=env, stdin=subprocess.DEVNULL,
                                                  stdout=log, stderr=subprocess.STDOUT, preexec_fn=group))  # fmt: skip
            except (OSError, subprocess.SubprocessError):
                if processes:  # the ranks already started would wait for this one forever
                    os.killpg(processes[0].pid, signal.SIGKILL)
                raise
    return processes


def _wait(
    processes: list[subprocess.Popen], db_path: str, job_id: int, stop: _Stop
) -> tuple[int, int] | None:
    """Until every process of the stage has exited; each exit is recorded in the job's `ranks`. Returns
    (rank, exit status) of the first that failed, or None. Once one has failed, the others get `GRACE`
    seconds to end by themselves (tuner's own watch ends them: `tuner.distributed.failures`), then the
    whole group gets SIGKILL: none is left waiting on a collective that cannot complete."""
    codes: list[int | None] = [None] * len(processes)
    failed: tuple[int, int] | None = None
    killed_at = None
    while None in codes:
        now = [p.poll() for p in processes]
        if now != codes:
            codes = now
            with transaction(db_path) as conn:
                conn.execute(
                    "UPDATE jobs SET ranks = ? WHERE id = ?", (rank_states(processes, codes), job_id)
                )
            if failed is None:
                failed = next(((rank, c) for rank, c in enumerate(codes) if c not in (None, 0)), None)
                if failed is not None and len(processes) > 1 and not stop.requested:
                    killed_at = time.monotonic() + GRACE
        if killed_at is not None and time.monotonic() > killed_at:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(processes[0].pid, signal.SIGKILL)
            killed_at = None
        time.sleep(0.1)
    return failed


def _failure(stage: str, rank: int, code: int, count: int, run_dir: Path) -> str:
    """The failed job's `error`: which process ended the stage, how, and the last lines of its log (also
    appended to `job.log` for a rank that writes a log of its own)."""
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    if count == 1:
        return f"{stage} {how}; last log lines:\n" + "\n".join(tail(run_dir / LOG, ERROR_LINES))
    lines = tail(run_dir / rank_log_name(rank), ERROR_LINES)
    error = f"{stage}: rank {rank} of {count} processes {how}; the others were stopped. Its last log lines:"
    if rank > 0:
        with (run_dir / LOG).open("a", encoding="utf-8") as log:
            log.write("\n".join([f"== {error}", *lines]) + "\n")
    return "\n".join([error, *lines])


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
