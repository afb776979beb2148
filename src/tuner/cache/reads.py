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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from tuner.cache.store import CacheStore, EntryLocation


class EntryReads(Dataset):
    """Groups of cache entries (a batch each) read the split way; iterate with `load`.

    `groups[i]` lists (cache_dir, key) pairs. Item i, produced in a worker, is the group's
    locations; `materialize` turns it into the entries' tensor dicts in the main process. A whole
    group is one item so that one queue message carries one batch. Picklable (stores travel as
    their address), so spawn-started workers work too.
    """

    def __init__(self, groups: Sequence[Sequence[tuple[str, str]]]):
        self.groups = groups
        self._stores: dict[str, CacheStore] = {}

    def __len__(self) -> int:
        return len(self.groups)

    def store(self, cache_dir: str) -> CacheStore:
        if cache_dir not in self._stores:
            self._stores[cache_dir] = CacheStore(cache_dir, readonly=True)
        return self._stores[cache_dir]

    def __getitem__(self, i: int) -> list[tuple[str, EntryLocation]]:
        """Worker side: locate the group's entries and prefetch their bytes."""
        # In the main process (num_workers=0) `materialize` reads the bytes right after: no prefetch.
        in_worker = get_worker_info() is not None
        located = []
        for cache_dir, key in self.groups[i]:
            store = self.store(cache_dir)
            location = store.locate(key)
            if in_worker:
                store.prefetch(location)
            located.append((cache_dir, location))
        return located

    def materialize(self, located: list[tuple[str, EntryLocation]]) -> list[dict[str, torch.Tensor]]:
        """Main side: the located entries' tensors, views of this process's shard maps."""
        return [self.store(cache_dir).view(location) for cache_dir, location in located]

    def load(
        self,
        num_workers: int,
        shuffle: bool = False,
        generator: torch.Generator | None = None,
        multiprocessing_context: str | None = None,
    ) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Each group's entries, in loader order (group order unless `shuffle`)."""
        loader = DataLoader(
            self,
            batch_size=None,
            shuffle=shuffle,
            num_workers=num_workers,
            collate_fn=_as_is,  # the default walks the list and turns its tuples into lists
            generator=generator,
            multiprocessing_context=multiprocessing_context if num_workers else None,
        )
        for located in loader:
            yield self.materialize(located)


def _as_is(item):
    return item
