"""One host copy of the swapped weights per machine, shared by every training process on it.

With block swap each process keeps the frozen weights of its swapped blocks in host memory. N processes
on one machine (DDP: `accelerate launch --num_processes N`) hold the same weights, so private copies cost
N times the host memory (Wan 14B in bf16: 28 GB per process). Instead the processes on a machine keep
one copy in a file in /dev/shm (RAM-backed), mapped by each of them:

1. They agree: each says what it swaps (a digest of the tensors' shapes and dtypes, in order) and the
   first process on the machine (the *leader*) draws a random key for this copy. Processes that swap
   different weights (a pipeline stage of their own) keep private copies.
2. The leader removes stale segments (files no live process holds a lock on: a run killed before step
   4), reserves `/dev/shm/tuner-swap-<key>` whole with fallocate (too little room: every process keeps
   its own copy, and the warning says how much it needs and how much there is), writes the weights and a
   header (key, digest, size) under a temporary name and renames it.
3. After a barrier the others open it, check its size, header and a sample of every tensor's bytes
   against their own weights, and map it. A process whose check fails keeps its own copy.
4. After a second barrier the leader unlinks the name. The memory stays while any process maps it and
   goes when the last one exits, crashed or not, and no later run can find it.

On CUDA each process then page-locks its mapping (`Transfer.page_lock`, cudaHostRegister) so copies to
the GPU stay asynchronous. Every process maps the file read-write, because page-locking a read-only
mapping needs a flag not every platform supports; only the leader writes, before anyone else maps it.
In swap_mode "h2d_only" nothing writes a host copy after that; "full" mode copies blocks back, so it is
never shared.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tuner.errors import TunerError

SHM = Path("/dev/shm")
PREFIX = "tuner-swap-"
HEADER_BYTES = 4096  # one page: the tensors start page-aligned
ALIGN = 256  # each tensor's offset, so any dtype's view is aligned
MAGIC = "tuner shared swap v1"


class Peers(Protocol):
    """The processes on this machine that swap together: `rank` among them (0 is the leader), `size`, and
    `exchange`, an all-gather among them that is also a barrier."""

    rank: int
    size: int

    def exchange(self, obj: Any) -> list[Any]: ...


class MachinePeers:
    """The processes of the default torch.distributed group that run on this machine (same host name)."""

    def __init__(self, hosts: list[str], my_rank: int):
        self.members = [r for r, host in enumerate(hosts) if host == hosts[my_rank]]
        self.rank, self.size = self.members.index(my_rank), len(self.members)

    def exchange(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return [gathered[r] for r in self.members]


def machine_peers() -> MachinePeers | None:
    """This machine's processes, or None when it runs alone. With several processes every one of them must
    call it at the same point (it gathers host names over the default group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    peers = MachinePeers(hosts, dist.get_rank())
    return peers if peers.size > 1 else None


# --- the file ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where each tensor lives in the segment, after the header."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    nbytes: int
    digest: str

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> Layout:
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        shapes = tuple(tuple(t.shape) for t in tensors)
        dtypes = tuple(t.dtype for t in tensors)
        digest = hashlib.sha256(repr((shapes, [str(d) for d in dtypes])).encode()).hexdigest()
        return cls(shapes, dtypes, tuple(offsets), end, digest)

    def header(self, key: str) -> bytes:
        text = json.dumps({"magic": MAGIC, "key": key, "layout": self.digest, "nbytes": self.nbytes})
        return text.encode().ljust(HEADER_BYTES, b"\0")


class NoRoom(TunerError):
    """The shared-memory file system cannot hold the copy."""


class Mismatch(TunerError):
    """A segment is not the one this process expects (stale, other weights, or cut short)."""


class SharedHostCopy:
    """One process's mapping of the segment: `buffer` (all of it, bytes) and `masters`, the host copies of
    the tensors it was made for, in order."""

    def __init__(self, path: Path, mapping: mmap.mmap, layout: Layout, lock_fd: int | None = None):
        self.path, self.layout, self._lock_fd = path, layout, lock_fd
        self.buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
        self.masters = [
            self.buffer[HEADER_BYTES + offset : HEADER_BYTES + offset + _nbytes(shape, dtype)]
            .view(dtype)
            .view(shape)
            for shape, dtype, offset in zip(layout.shapes, layout.dtypes, layout.offsets)
        ]
        self.inode = os.stat(path).st_ino

    def unlink(self) -> None:
        """Remove the name (the leader, once every process has mapped it) and drop the stale-file lock."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def publish(tensors: Sequence[torch.Tensor], layout: Layout, path: Path, key: str) -> SharedHostCopy:
    """Write `tensors` into a new segment at `path` (the leader). Raises `NoRoom` when it does not fit."""
    size = HEADER_BYTES + layout.nbytes
    free = shm_free_bytes(path.parent)
    if free < size:
        raise NoRoom(_no_room(path.parent, size, free))
    temporary = path.with_name(path.name + ".partial")
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until the name goes: a sweep leaves this file alone
        try:
            os.posix_fallocate(fd, 0, size)  # reserve every page now: writing to a full tmpfs faults
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise NoRoom(_no_room(path.parent, size, free)) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)  # a file system without fallocate
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        copy = SharedHostCopy(temporary, mapping, layout, lock_fd=fd)
        with torch.no_grad():
            for master, t in zip(copy.masters, tensors):
                master.copy_(t)
            copy.buffer[:HEADER_BYTES].copy_(
                torch.frombuffer(bytearray(layout.header(key)), dtype=torch.uint8)
            )
        os.rename(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        os.close(fd)
        raise
    copy.path = path
    return copy


def attach(tensors: Sequence[torch.Tensor], layout: Layout, path: Path, key: str) -> SharedHostCopy:
    """Map the leader's segment at `path` after checking it holds `tensors` (the others). Raises
    `Mismatch` naming what differs."""
    fd = os.open(path, os.O_RDWR)  # never O_CREAT: a missing file is an error, not an empty copy
    try:
        size = os.fstat(fd).st_size
        if size != HEADER_BYTES + layout.nbytes:
            raise Mismatch(f"{path} holds {size} bytes, expected {HEADER_BYTES + layout.nbytes}")
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    header = bytes(mapping[:HEADER_BYTES]).rstrip(b"\0")
    try:
        found = json.loads(header)
    except ValueError:
        found = {}
    want = {"magic": MAGIC, "key": key, "layout": layout.digest, "nbytes": layout.nbytes}
    if found != want:
        mapping.close()
        raise Mismatch(f"{path} has header {found}, expected {want}")
    copy = SharedHostCopy(path, mapping, layout)
    for i, (master, t) in enumerate(zip(copy.masters, tensors)):
        if not _same_bytes(master, t):
            raise Mismatch(f"{path}: tensor {i} of {len(tensors)} differs from this process's weights")
    return copy


def sweep_stale(directory: Path = SHM) -> list[Path]:
    """Remove segments no live process holds (left by a run killed while setting up); returns them."""
    removed = []
    for path in sorted(Path(directory).glob(PREFIX + "*")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a leader is writing it or waiting for its processes
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def shm_free_bytes(directory: Path = SHM) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


# --- the handshake ------------------------------------------------------------------------------------


def share_host_copies(
    tensors: Sequence[torch.Tensor], peers: Peers, directory: Path = SHM
) -> tuple[SharedHostCopy | None, str]:
    """The host copies of `tensors` in one segment shared by `peers` (see the module docstring) and a
    line saying so; or None and why not (empty: nothing to share), and this process keeps its own copy.
    Every peer must call it at the same point."""
    layout = Layout.of(tensors)
    leader = peers.rank == 0
    offers = peers.exchange((layout.digest, secrets.token_hex(8) if leader else ""))
    if layout.nbytes == 0:
        return None, ""
    if any(digest != layout.digest for digest, _ in offers):
        return None, "the processes on this machine swap different weights"
    key = offers[0][1]
    path = Path(directory) / f"{PREFIX}{key}"
    copy, problem = None, None
    if leader:
        try:
            sweep_stale(directory)
            copy = publish(tensors, layout, path, key)
        except NoRoom as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - the others wait at the barrier below: tell them, never hang
            problem = f"could not write {path} ({type(e).__name__}: {e})"
    problem = peers.exchange(problem)[0]  # barrier 1: the leader has written the segment, or gave up
    if problem:
        return None, problem
    if not leader:
        try:
            copy = attach(tensors, layout, path, key)
        except Mismatch as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - as above: the leader waits to remove the name
            problem = f"could not map {path} ({type(e).__name__}: {e})"
    peers.exchange(None)  # barrier 2: every process has mapped it (or given up)
    if leader:
        copy.unlink()
    if copy is None:
        return None, problem or "no segment"
    return copy, f"host copy shared by {peers.size} processes ({copy.nbytes / 2**20:.0f} MiB in {path})"


# --- measuring -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mapping:
    """A mapped segment as /proc/<pid>/smaps reports it, sizes in bytes."""

    path: str
    inode: int
    size: int
    rss: int
    pss: int


def mapped_segments(pid: int | str = "self") -> list[Mapping]:
    """The shared swap segments `pid` maps, with their resident and proportional set sizes (Linux)."""
    found, current = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):  # a mapping's header
                current = None
                if len(fields) >= 6 and Path(fields[5]).name.startswith(PREFIX):
                    current = {"path": " ".join(fields[5:]), "inode": int(fields[4])}
                    found.append(current)
            elif current is not None and fields[0] in ("Size:", "Rss:", "Pss:"):
                current[fields[0][:-1].lower()] = int(fields[1]) * 1024
    return [Mapping(**m) for m in found]


def proportional_set_size(pid: int | str = "self") -> int:
    """The process's proportional set size in bytes (/proc/<pid>/smaps_rollup): private memory plus each
    shared page divided by the number of processes mapping it."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise TunerError(f"/proc/{pid}/smaps_rollup has no Pss line")


# --- helpers ---------------------------------------------------------------------------------------------


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _same_bytes(a: torch.Tensor, b: torch.Tensor, samples: int = 4096) -> bool:
    """Whether `a` and `b` hold the same bytes at up to `samples` evenly spread places (bytes, not values:
    NaN equals itself, fp8 compares too)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    x, y = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
    step = max(1, x.numel() // samples)
    return torch.equal(x[::step], y[::step]) and torch.equal(x[-1:], y[-1:])


def _no_room(directory: Path, needed: int, available: int) -> str:
    return (
        f"{directory} has {available / 2**30:.2f} GiB free, the shared copy of the swapped weights needs "
        f"{needed / 2**30:.2f} GiB (make {directory} larger, e.g. docker's --shm-size, or set "
        "memory.share_swapped_weights = false)"
    )
