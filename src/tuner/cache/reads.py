"""Reading cache entries through DataLoader workers without sending tensor bytes between processes.

A DataLoader worker hands each item to the main process through a queue, and torch sends a tensor
by moving its storage into freshly allocated shared memory: a copy of every byte (about 1.8 ms for
a 1.7 MiB latent on 2 cores), which the main process then maps and faults in again. Reading from
the store is a slice of a memory map, far cheaper than that copy, so the copy decides the speed.

So the read is split where the bytes are:

- In a worker, `CacheStore.locate` turns a key into an `EntryLocation` (shard file, byte offsets,
  dtypes, shapes) and `CacheStore.prefetch` pulls those bytes into the OS page cache, waiting on
  the disk if it must. Waiting on the disk is the slow part of a cold read and what workers are
  for. The worker returns the locations: a few hundred bytes each.
- In the main process, `CacheStore.view` slices each tensor out of the main process's own map of
  the shard. Nothing is copied: a mapped page is the page cache's page, shared by every process
  that maps the file.

Why not send the mapped storages themselves: torch shares without copying only storages it
allocated for sharing. A storage from `torch.UntypedStorage.from_file(path, shared=True)` cannot be
sent under the default file_descriptor strategy (torch keeps no descriptor for it) and is copied
whole, the entire 256 MiB shard for each tensor, under file_system.

The tensors `load` yields are backed by the main process's maps, so they stay valid after workers
exit and after a prune deletes their shard (a mapped file lives until it is unmapped); a location
whose shard was compacted away before the main process mapped it is located again by key. The
maps are private copy-on-write: an in-place edit never reaches the file, but a later read of the
same entry in the same process sees it (`tuner.cache.shards`), so copy before editing in place.

Workers persist. Starting a worker costs a fork (or a spawn and the imports) and, in it, opening
each store and loading its index; restarting them every epoch halved the read rate. So `load`
takes an idle loader of the same worker count from a pool kept for the process and hands it back
when its pass ends (or is abandoned: the next pass discards what the workers had read ahead). A
pass that starts while another is running (validation inside a training epoch) gets a loader of its
own. The workers read whatever groups the pass sends them, in the order sent, so the epoch order is
still the caller's. `close_workers` ends them (they also end with the process).
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from tuner.cache.store import CacheStore, EntryLocation
from tuner.errors import CacheError

Group = Sequence[tuple[str, str]]  # (cache_dir, key) pairs: one batch's entries
Located = list[tuple[str, EntryLocation]]


class _Stores:
    """Read-only stores by cache directory, opened on first use in whichever process uses them.
    Picklable (stores travel as their address), so spawn-started workers work too."""

    def __init__(self) -> None:
        self._stores: dict[str, CacheStore] = {}

    def __call__(self, cache_dir: str) -> CacheStore:
        if cache_dir not in self._stores:
            self._stores[cache_dir] = CacheStore(cache_dir, readonly=True)
        return self._stores[cache_dir]

    def locate(self, group: Group, prefetch: bool) -> Located:
        located = []
        for cache_dir, key in group:
            try:
                location = self(cache_dir).locate(key)
            except CacheError:
                # A worker outlives a pass: its store may predate a directory deleted and made anew.
                self._stores.pop(cache_dir).close()
                location = self(cache_dir).locate(key)
            if prefetch:
                self(cache_dir).prefetch(location)
            located.append((cache_dir, location))
        return located


class EntryReads(Dataset):
    """Groups of cache entries (a batch each) read the split way; iterate with `load`.

    `groups[i]` lists (cache_dir, key) pairs. Item i is the group's locations; `materialize` turns
    them into the entries' tensor dicts in the main process. A whole group is one item so that one
    queue message carries one batch.
    """

    def __init__(self, groups: Sequence[Group]):
        self.groups = groups
        self._stores = _Stores()

    def __len__(self) -> int:
        return len(self.groups)

    def store(self, cache_dir: str) -> CacheStore:
        return self._stores(cache_dir)

    def __getitem__(self, i: int) -> Located:
        """The group's locations (read in this process, so without prefetching)."""
        return self._stores.locate(self.groups[i], prefetch=False)

    def materialize(self, located: Located) -> list[dict[str, torch.Tensor]]:
        """Main side: the located entries' tensors, views of this process's shard maps."""
        return [self.store(cache_dir).view(location) for cache_dir, location in located]

    def load(
        self,
        num_workers: int,
        shuffle: bool = False,
        generator: torch.Generator | None = None,
        multiprocessing_context: str | None = None,
    ) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Each group's entries, in group order (or shuffled by `generator` with `shuffle`), located
        by `num_workers` pooled workers (none: in this process)."""
        order = list(self.groups)
        if shuffle:
            order = [order[i] for i in torch.randperm(len(order), generator=generator).tolist()]
        if not num_workers:
            for group in order:
                yield self.materialize(self._stores.locate(group, prefetch=False))
            return
        loader = _checkout(num_workers, multiprocessing_context)
        try:
            loader.sampler.groups = order
            for located in loader:
                yield self.materialize(located)
        finally:
            loader.sampler.groups = []
            _IDLE.setdefault((num_workers, multiprocessing_context), []).append(loader)


# --- the worker pool ---------------------------------------------------------------------------


class _Locate(Dataset):
    """Worker side: the "index" is the group itself; locate its entries and prefetch their bytes."""

    def __init__(self) -> None:
        self.stores = _Stores()

    def __getitem__(self, group: Group) -> Located:
        return self.stores.locate(group, prefetch=get_worker_info() is not None)


class _Groups(Sampler):
    """The groups of the current pass, in order; a persistent loader draws a new iterator per pass."""

    def __init__(self) -> None:
        self.groups: list[Group] = []

    def __iter__(self):
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)


_IDLE: dict[tuple[int, str | None], list[DataLoader]] = {}  # by (num_workers, multiprocessing context)


def _checkout(num_workers: int, context: str | None) -> DataLoader:
    idle = _IDLE.get((num_workers, context))
    if idle:
        return idle.pop()
    atexit.unregister(close_workers)
    atexit.register(close_workers)  # end the workers before the interpreter tears modules down
    return DataLoader(
        _Locate(),
        batch_size=None,
        sampler=_Groups(),
        num_workers=num_workers,
        collate_fn=_as_is,  # the default walks the list and turns its tuples into lists
        persistent_workers=True,
        multiprocessing_context=context,
        # the workers' seed comes from a private generator: starting a loader must not draw from the
        # global RNG, or a run resumed mid-epoch would see other dropout than an uninterrupted one
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=_ignore_stop_signals,
    )


def _ignore_stop_signals(worker_id: int) -> None:
    """A worker ignores SIGTERM and SIGINT: `kill` of the process group or Ctrl-C reaches it too, and the
    trainer, which stops gracefully on them (`tuner.trainers.stop`), still needs its batches. The workers
    end with the trainer (torch ends them when their parent is gone)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def close_workers() -> None:
    """End the pooled workers of every idle loader (a loader in use keeps its own until it is idle)."""
    for loaders in _IDLE.values():
        for loader in loaders:
            iterator = loader._iterator  # DataLoader keeps no public handle on its persistent workers
            if iterator is not None:
                iterator._shutdown_workers()
            loader._iterator = None
    _IDLE.clear()


def _as_is(item):
    return item
