"""Random-order read throughput of cached latents: our shard store versus one file per entry.

Training reads every cached latent once per epoch in random order through DataLoader workers. Other
tools store one safetensors file per entry: each worker opens, parses and memory-maps the item's file
and returns its tensor, which torch copies into fresh shared memory to hand it to the main process.
Our store is read the way training reads it (`tuner.cache.reads.EntryReads`): a worker returns where
the item lies (after pulling its bytes into the page cache) and the main process slices it out of its
own map of the shard and stacks the batch, so no bytes cross processes. Both then hand the batch to
the same consumer, which reads every byte as a training step's copy to the GPU would.

The baseline gets the best set-up such a tool can have: one DataLoader for the whole run with
`persistent_workers`, started by an untimed warm-up read, so no timed pass pays for starting workers.
The store is read as `TrainingData.epoch` reads it: `EntryReads.load` takes a loader from a pool kept for
the process, so its workers persist from pass to pass as the baseline's do; only the store's first
timed pass with workers includes starting them.

This script writes `--n` entries both ways, reads each set in the same run without workers and with
`--workers` workers, and prints items/s for both and the ratio store/files of each mode.

    python benchmarks/cache_read.py                       # 2,000 Wan-sized latents (~7 GB of disk)
    python benchmarks/cache_read.py --n 40 --workers 2    # smoke run
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset

from tuner.cache import CacheStore
from tuner.cache.reads import EntryReads

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class FileLatents(Dataset):
    """What one-file-per-entry tools do: load the item's file on every read."""

    def __init__(self, paths: list[Path]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return load_file(self.paths[i])["latents"]


def _write(root: Path, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[CacheStore, list, list]:
    # Distinct contents without generating n random tensors (2 CPU cores): one base plus an offset.
    base = torch.randn(shape).to(dtype)
    store = CacheStore(root / "store")
    keys = [f"{i:064x}" for i in range(n)]
    paths = [root / "files" / f"item{i:05d}_latent.safetensors" for i in range(n)]
    paths[0].parent.mkdir(parents=True)
    with store.writer() as w:
        for i, (key, path) in enumerate(zip(keys, paths)):
            latents = base + i
            w.put(key, "latent", {"latents": latents}, {"bucket": "x".join(map(str, shape))})
            save_file({"latents": latents}, str(path))
    return store, keys, paths


def _file_loader(paths: list[Path], workers: int, batch_size: int) -> DataLoader:
    """One loader for every pass: each pass is a new shuffle; workers, once started, are kept."""
    loader = DataLoader(
        FileLatents(paths),
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(0),
    )
    next(iter(loader))  # warm-up: starts the workers, untimed
    return loader


def _file_batches(loader: DataLoader) -> Iterator[torch.Tensor]:
    yield from loader  # a generator, so the pass starts (and prefetches) only once it is timed


def _store_batches(
    store: CacheStore, keys: list[str], workers: int, batch_size: int, seed: int
) -> Iterator[torch.Tensor]:
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    root = str(store.root)
    groups = [[(root, keys[i]) for i in order[j : j + batch_size]] for j in range(0, len(order), batch_size)]
    for entries in EntryReads(groups).load(workers):
        yield torch.stack([e["latents"] for e in entries])  # as `TrainingData.epoch` does


def _items_per_s(batches: Iterator[torch.Tensor]) -> float:
    # Workers run torch with one thread each; do the same in-process (workers=0) so both modes
    # measure reads, not intra-op thread scheduling (pathological on small VMs).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # The consumer: what a training step does first, copy the batch to the GPU (here into a
        # reused buffer). It reads every byte, so neither method can win by leaving pages untouched.
        device_batch = None
        start = time.perf_counter()
        count = 0
        for batch in batches:
            if device_batch is None:
                device_batch = torch.empty_like(batch)
            device_batch[: batch.shape[0]].copy_(batch)
            count += batch.shape[0]
        return count / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="entries to write and read")
    parser.add_argument("--workers", type=int, default=4, help="DataLoader workers")
    parser.add_argument("--batch-size", type=int, default=1, help="DataLoader batch size")
    parser.add_argument("--shape", default="16,9,60,104", help="latent shape (Wan 480x832, 33 frames)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes per method (median reported)")
    parser.add_argument("--dir", type=Path, help="where to write (default: a temp dir, deleted after)")
    args = parser.parse_args(argv)

    shape = tuple(int(s) for s in args.shape.split(","))
    dtype = DTYPES[args.dtype]
    item_mib = torch.Size(shape).numel() * dtype.itemsize / 2**20
    root = Path(tempfile.mkdtemp(prefix="cache_read_", dir=args.dir))
    try:
        print(
            f"writing {args.n} entries of {args.dtype} {list(shape)} ({item_mib:.2f} MiB each, "
            f"{args.n * item_mib / 1024:.2f} GiB per method) to {root}"
        )
        start = time.perf_counter()
        store, keys, paths = _write(root, args.n, shape, dtype)
        print(f"  written in {time.perf_counter() - start:.1f} s ({store.info()['shards']} shards)")

        # The in-process pass (no workers) shows the read paths alone; with workers, the file method
        # also pays torch's copy of each batch into shared memory, which the store's split avoids.
        modes = [("in-process", 0), (f"{args.workers} workers", args.workers)]
        file_loaders = {workers: _file_loader(paths, workers, args.batch_size) for _, workers in modes}
        rates: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for mode, workers in modes:
                # Interleave the methods so page-cache state and machine noise hit both alike.
                for name, batches in (
                    ("files", _file_batches(file_loaders[workers])),
                    ("store", _store_batches(store, keys, workers, args.batch_size, seed=r)),
                ):
                    rate = _items_per_s(batches)
                    rates.setdefault((mode, name), []).append(rate)
                    print(f"  round {r} {mode:<11} {name:<5} {rate:8.1f} items/s")
        del file_loaders  # stops the persistent workers
        print(f"n={args.n} batch_size={args.batch_size}, median of {args.rounds} rounds, items/s:")
        for mode, _ in modes:
            files, ours = statistics.median(rates[mode, "files"]), statistics.median(rates[mode, "store"])
            print(
                f"{mode:<11}  one file per entry {files:8.1f}  cache store {ours:8.1f}  ratio {ours / files:.2f}x"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
