"""Caching with several processes: `accelerate launch --num_processes N -m tuner cache latents ...` (or
`torchrun --nproc_per_node N -m tuner ...`) splits the work without overlap.

Every process plans the same keys and asks the store which are missing *before any of them writes*
(a barrier separates the two), so all agree on the work list. The list is cut into the batches a
one-process run would encode, and batch i goes to process i mod N: each batch is encoded exactly as a
one-process run encodes it, so the entries are the same bytes under the same keys. Each process writes
its own shards through its own writer; the store's one SQLite index takes every writer's rows (it
serializes their commits), so there is one index at the end. Only process 0 holds the caching lock
that keeps a second run out, prunes, and prints the summary, which counts every process's work.

A process killed mid-run leaves what it committed (the writer protocol is crash-safe per process), and
the launcher stops the others; the next run encodes what is missing. The processes talk over gloo
(CPU tensors), so this works the same on GPU machines (each process encodes on its own `cuda:LOCAL_RANK`)
and, for tests, on a CPU-only one.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


class CachingProcesses:
    """The caching run's place among its processes (one process: rank 0 of 1, and every call is free)."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", str(self.rank)))
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
            # a gloo group left to interpreter teardown can abort the process ("terminate called without
            # an active exception") after the run's work is done: all processes close it together
            atexit.register(self._close)

    def _close(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # nobody tears down a connection another is still reading
            torch.distributed.destroy_process_group()

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def first(self, fn: Callable[[], T]) -> T:
        """`fn()` in process 0 first, then in the others: what creates shared files (a new store's SQLite
        index cannot be created by two processes at once)."""
        if self.main:
            result = fn()
            self.barrier()
            return result
        self.barrier()
        return fn()

    def mine(self, batches: Sequence[T]) -> list[T]:
        """The batches this process encodes: every N-th, from its rank."""
        return list(batches[self.rank :: self.world])

    def total(self, *counts: int) -> tuple[int, ...]:
        """Each count summed over the processes."""
        if self.world == 1:
            return counts
        t = torch.tensor(counts, dtype=torch.int64)
        torch.distributed.all_reduce(t)
        return tuple(int(v) for v in t.tolist())

    def device(self, name: str) -> str:
        """`cache.device = "auto"` with several processes on a GPU machine: each its own GPU."""
        if name == "auto" and self.world > 1 and torch.cuda.is_available():
            return f"cuda:{self.local_rank % torch.cuda.device_count()}"
        return name
