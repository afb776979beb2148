"""`PeerWatch` (src/tuner/distributed/failures.py) in one process, against a store it hosts itself and a
peer that only exists as the keys a real one would write: it names a peer's failure note, and a peer on
this host whose process is gone. The two-process cases (a killed worker, a failing save) are in
tests/test_stop.py and tests/test_distributed_ddp.py."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time

import pytest
from torch.distributed import TCPStore

from launch import free_port
from tuner.distributed import failures
from tuner.distributed.failures import PeerFailed, PeerWatch


@pytest.fixture
def watched(monkeypatch):
    """A watch as rank 0 of 2 over a fresh store, and the store (the peer's side); no `os._exit` here."""
    monkeypatch.setattr(failures, "BEAT", 0.05)
    monkeypatch.setattr(failures, "GRACE", 60.0)  # the test closes the watch long before it would exit
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30))
    watch = PeerWatch(0, 2, "127.0.0.1", port)
    watch._thread.start()
    assert watch._ready.wait(30)
    yield watch, store, watch._keys
    watch.close()


def _verdict(watch: PeerWatch) -> str | None:
    deadline = time.monotonic() + 30
    while watch.verdict is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return watch.verdict


def test_a_peers_failure_note_is_named_with_its_error(watched):
    watch, store, keys = watched
    store.set(f"{keys}/pid/1", f"{socket.gethostname()} 1")
    store.set(f"{keys}/failed/1", "RuntimeError: CUDA out of memory")
    assert _verdict(watch) == "process 1 failed: RuntimeError: CUDA out of memory; process 0 stops too"
    # an error of this process's own that follows from it (a broken collective) becomes that line
    error = watch.note_failure(RuntimeError("Connection closed by peer"))
    assert isinstance(error, PeerFailed) and str(error) == watch.verdict


def test_a_dead_peer_on_this_host_is_named_by_pid(watched):
    watch, store, keys = watched
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    store.set(f"{keys}/pid/1", f"{socket.gethostname()} {gone.stdout.strip()}")
    assert _verdict(watch) == (
        f"process 1 (pid {gone.stdout.strip()}) died without an error of its own (killed by a signal: SIGKILL, "
        "the out-of-memory killer?); process 0 stops too"
    )


def test_a_live_peer_that_closed_its_watch_is_left_alone(watched):
    watch, store, keys = watched
    store.set(f"{keys}/pid/1", f"{socket.gethostname()} {os.getpid()}")
    store.set(f"{keys}/off/1", "1")
    store.set(f"{keys}/failed/1", "ValueError: after it closed")
    time.sleep(0.5)
    assert watch.verdict is None
