"""Start the ranks of a multi-process test directly, without torchrun: a torchrun launcher is one more
Python process importing torch (and its elastic agent) for every launch, and only tests/test_stop.py is
about what torchrun itself does.

Each rank gets the environment torchrun gives its workers for a one-node static rendezvous that
`torch.distributed`'s env:// initialization, accelerate and DeepSpeed read: RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and
OMP_NUM_THREADS=1 unless set (torch.distributed.elastic.agent.server.local_elastic_agent); rank 0 hosts
the TCP store, as under env:// without torchrun's agent store. Python runs unbuffered (`-u`), as
torchrun starts it. As torchrun does, a rank that fails ends the others (SIGKILL here, after a moment
for them to print their own error), so a test never waits on a collective that cannot complete.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from tuner.ranks import free_port, rank_environment

GRACE = 5.0  # seconds the other ranks get to finish or fail on their own once one has failed


def launch(argv: list[str], processes: int = 2, env: dict | None = None, timeout: float = 600,
           grace: float = GRACE) -> subprocess.CompletedProcess:  # fmt: skip
    """Run `python -u *argv` as `processes` ranks; wait for all of them (`timeout` seconds in all; once
    one has failed, `grace` seconds for the others).
    Return one CompletedProcess: the lowest failing rank's exit status (0 when all succeed) and every
    rank's stdout and stderr, joined in rank order."""
    base = {**(os.environ if env is None else env)}
    base.setdefault("OMP_NUM_THREADS", "1")
    port = free_port()
    command = [sys.executable, "-u", *argv]
    ranks, outputs = [], []
    try:
        for rank in range(processes):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            outputs.append((out, err))
            rank_env = {**base, **rank_environment(rank, processes, port)}
            ranks.append(subprocess.Popen(command, env=rank_env, stdout=out, stderr=err))
        status = _wait(ranks, time.monotonic() + timeout, grace)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    stdout, stderr = [], []
    for out, err in outputs:
        for file, joined in ((out, stdout), (err, stderr)):
            file.seek(0)
            joined.append(file.read())
            file.close()
    return subprocess.CompletedProcess(command, status, "".join(stdout), "".join(stderr))


def _wait(ranks: list[subprocess.Popen], deadline: float, grace: float) -> int:
    """The first non-zero exit status, or 0 once every rank has exited with 0. Raises TimeoutError at
    `deadline` (the caller kills what still runs)."""
    failed_at = None
    while True:
        codes = [p.poll() for p in ranks]
        failures = [c for c in codes if c not in (None, 0)]
        if failures and failed_at is None:
            failed_at = time.monotonic()
        if None not in codes or (failures and time.monotonic() > failed_at + grace):
            return failures[0] if failures else 0
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks still running after the launch's timeout: {ranks[0].args}")
        time.sleep(0.05)
