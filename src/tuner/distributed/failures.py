"""Multi-process runs that fail loudly: when one process fails or dies, every other one stops within
seconds, with one line naming that process and the cause.

Why it needs doing: a collective (an all-reduce, a barrier) waits for every process. A process that raised
or was killed (SIGKILL, the out-of-memory killer) leaves the others waiting in their next one: NCCL until
its watchdog's timeout (10 minutes), gloo until the dead peer's sockets close (then with "Connection closed
by peer", which blames no one). torchrun then prints `ChildFailedError` with the first exit code it saw.

Two tools, both no-ops with one process:

* `together(accelerator, what)` wraps a block that may fail on some processes only (the main process
  writing a save: a full disk, a refused export). At its end every process exchanges whether its block
  raised (one all-reduce, where a barrier stood); if any did, the others raise `PeerFailed` naming it,
  so none is left at a barrier the failed one never reaches. The process group stays usable.
* `PeerWatch` is a thread in each process, started when training starts, that talks through the rendezvous
  store (the TCP store at MASTER_ADDR:MASTER_PORT that torchrun's agent, or rank 0 under env://, hosts)
  over a connection of its own. Each process publishes its host and pid and bumps a heartbeat counter every
  second; a process whose training raises writes its error there (`note_failure`) before it ends. Every
  second each watch looks at its peers: a failure note, a peer on this host whose pid is gone (or a
  zombie), a peer elsewhere whose heartbeat has not moved for `SILENT` seconds, or the store gone (the
  process hosting it died). It then gives its own training `GRACE` seconds to end by itself (it may be
  raising already), and otherwise prints `error: process R ...; process r stops too` and ends its process
  with `PEER_EXIT` (os._exit: its main thread may be blocked in a collective nobody will join).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator

import torch

from tuner.errors import TrainingError, TrainingStopped, TunerError

BEAT = 1.0  # seconds between two looks at the peers (and two heartbeats)
SILENT = 60.0  # a peer on another host whose heartbeat has not moved this long is taken for dead
GRACE = 3.0  # seconds the main thread gets to end on its own once a peer is known to have failed
PEER_EXIT = 2  # what a process stopped because of another one exits with (as `PeerFailed` in `tuner train`)
_PREFIX = "tuner/watch"


class PeerFailed(TrainingError):
    """Another process failed (its own error says why); this one stops too. Not a cause of its own."""


@contextlib.contextmanager
def together(accelerator, what: str) -> Iterator[None]:
    """Run the block on every process, then wait for all of them (as a barrier does) and learn whether the
    block raised on any: the process that raised re-raises its error, the others raise `PeerFailed` naming
    it and `what` it was doing ("saving the state of step 4")."""
    if accelerator.num_processes == 1:
        yield
        return
    try:
        yield
    except BaseException:
        _failed_ranks(accelerator, failed=True)
        raise
    if failed := _failed_ranks(accelerator, failed=False):
        raise PeerFailed(
            f"process {failed[0]} failed while {what} (its own error says why); process "
            f"{accelerator.process_index} stops too, leaving the files of the last complete save as they were"
        )


def _failed_ranks(accelerator, failed: bool) -> list[int]:
    flags = torch.zeros(accelerator.num_processes, device=accelerator.device)
    flags[accelerator.process_index] = float(failed)
    torch.distributed.all_reduce(flags)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


@contextlib.contextmanager
def watching() -> Iterator[PeerWatch | None]:
    """Training inside: a `PeerWatch` over the other processes (None with one process). An error leaving
    the block is noted for the peers, or replaced by the peer failure it follows from; a stop on request
    (`TrainingStopped`) is no failure."""
    watch = PeerWatch.start()
    try:
        yield watch
    except TrainingStopped:
        raise
    except BaseException as e:
        if watch is None:
            raise
        error = watch.note_failure(e)
        if error is e:
            raise
        raise error from e
    finally:
        if watch is not None:
            watch.close()


class PeerWatch:
    """The watch of this process over its peers (see the module docstring); `start()` it as training
    starts and `close()` it before the processes part at the end (`trainers.setup.end_run`)."""

    def __init__(self, rank: int, world: int, host: str, port: int):
        self.rank, self.world, self.address = rank, world, (host, port)
        self.verdict: str | None = None  # what happened to which peer, once known
        self._closed = threading.Event()
        self._ready = threading.Event()  # the store is reached and this process's keys are written
        self._store = None
        self._keys = ""
        self._thread = threading.Thread(target=self._run, name="tuner-peer-watch", daemon=True)

    @classmethod
    def start(cls) -> PeerWatch | None:
        """A running watch when this process is one of several started by a launcher, else None."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1 or not {"RANK", "MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
            return None
        watch = cls(int(os.environ["RANK"]), world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        watch._thread.start()
        return watch

    def note_failure(self, error: BaseException) -> BaseException:
        """Called as training ends with `error` on this process: the error to raise. One that follows from a
        peer's failure (`PeerFailed`, or a collective broken by a peer that died, found within `GRACE`)
        becomes that peer's line; any other is written to the store for the peers to name, and kept."""
        if isinstance(error, PeerFailed):
            return error
        if not isinstance(error, TunerError):  # a broken collective, or a failure of this process's own
            deadline = time.monotonic() + GRACE
            while self.verdict is None and self._thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.verdict is not None:
                return PeerFailed(self.verdict)
        if self._ready.is_set():
            with contextlib.suppress(Exception):
                line = " ".join(f"{type(error).__name__}: {error}".split())[:500]
                self._store.set(f"{self._keys}/failed/{self.rank}", line)
                # until the peers have read it (or ended): the store may close with this process (rank 0)
                peers = [f"{self._keys}/off/{r}" for r in range(self.world) if r != self.rank]
                self._store.wait(peers, datetime.timedelta(seconds=GRACE))
        return error

    def close(self) -> None:
        """Stop watching (every process, before the last barrier of a run: after it, peers end freely)."""
        self._closed.set()
        self._thread.join(timeout=2 * BEAT)
        if self._ready.is_set():
            with contextlib.suppress(Exception):
                self._store.set(f"{self._keys}/off/{self.rank}", "1")

    # ---- the thread ----
    def _run(self) -> None:
        try:
            self._connect()
        except Exception:  # noqa: BLE001 (no store: the run goes on unwatched, as before)
            return
        beats: dict[int, tuple[int, float]] = {}  # peer -> (last counter seen, when it last moved)
        while not self._closed.wait(BEAT):
            try:
                self._store.add(f"{self._keys}/beat/{self.rank}", 1)
                verdict = self._look(beats)
            except Exception:  # noqa: BLE001 (the store's host is gone: it died with it)
                if self._closed.is_set():
                    return
                host, port = self.address
                verdict = (f"the rendezvous store at {host}:{port} stopped answering: process 0 (which hosts it "
                           "when no launcher does) or the launcher died")  # fmt: skip
            if verdict:
                self.verdict = f"{verdict}; process {self.rank} stops too"
                with contextlib.suppress(Exception):  # seen: a failed peer waiting for that may end now
                    self._store.set(f"{self._keys}/off/{self.rank}", "1")
                if not self._closed.wait(GRACE):  # the main thread did not end by itself meanwhile
                    print(f"error: {self.verdict}", file=sys.stderr, flush=True)
                    os._exit(PEER_EXIT)
                return

    def _connect(self) -> None:
        from torch.distributed import TCPStore

        host, port = self.address
        self._store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=600))
        # the n-th run started in these processes (a caller may train several runs in one process group)
        run = self._store.add(f"{_PREFIX}/runs/{self.rank}", 1)
        self._keys = f"{_PREFIX}/{run}"
        self._store.set(f"{self._keys}/pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._ready.set()

    def _look(self, beats: dict[int, tuple[int, float]]) -> str | None:
        """The first peer that failed or died, said in words, or None."""
        store, now = self._store, time.monotonic()
        for peer in range(self.world):
            if peer == self.rank or store.check([f"{self._keys}/off/{peer}"]):
                continue
            if store.check([f"{self._keys}/failed/{peer}"]):
                return f"process {peer} failed: {store.get(f'{self._keys}/failed/{peer}').decode()}"
            if not store.check([f"{self._keys}/pid/{peer}"]):
                continue  # still starting up
            host, pid = store.get(f"{self._keys}/pid/{peer}").decode().rsplit(" ", 1)
            if host == socket.gethostname() and not _alive(int(pid)):
                return (
                    f"process {peer} (pid {pid}) died without an error of its own (killed by a signal: "
                    "SIGKILL, the out-of-memory killer?)"
                )
            count = store.add(f"{self._keys}/beat/{peer}", 0)
            last, since = beats.get(peer, (-1, now))
            beats[peer] = (count, now if count != last else since)
            if now - beats[peer][1] > SILENT:
                return f"process {peer} on {host} has not answered for {SILENT:.0f} s (its machine or process died?)"
        return None


def _alive(pid: int) -> bool:
    """Whether process `pid` (on this host) runs: it exists and is not a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
