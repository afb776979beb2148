"""Training batches read from the cache store.

Each dataset's samples are repeated `num_repeats` times, grouped by bucket and cut into batches of the
dataset's batch size (a short remainder stays a smaller batch and is reported, never dropped); the
batches of all datasets are then shuffled together. The order is a pure function of (seed, epoch), so a
resumed run replays it exactly and can skip the batches it already trained on. Caption dropout swaps
in the empty caption's entry with a draw seeded by the sample's position, for the same reason; an item
with caption variants (`tuner.data.captions`) gets one of them per epoch the same way.

Batches are read with `EntryReads`: workers locate and prefetch a batch's entries, the main process
slices them out of its own shard maps and stacks the latents (`tuner.cache.reads` explains why). When
training on CUDA the stack goes straight into pinned (page-locked) memory, so the copy to the device can
run asynchronously (`non_blocking=True`) without a second host copy; elsewhere pinning is off.

Each epoch's plan is computed once and kept until another epoch is asked for: the start-up summary, the
step count and the epoch itself all read the same plan, and it costs time linear in the items.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tuner.cache.reads import EntryReads
from tuner.config.dataset import DatasetSpec
from tuner.data.buckets import plan_batches, short_batch_warnings
from tuner.data.regularization import draw_regularization, regularization_count


@dataclass(frozen=True)
class TrainingSample:
    cache_dir: str
    latent_key: str
    text_key: str
    empty_text_key: str
    bucket_key: str
    dataset_index: int
    variant_text_keys: tuple[str, ...] = ()  # caption variants: one is drawn per epoch (else text_key)


class WeightedBatch(list):
    """A batch (list of (cache_dir, latent_key, text_key)) of a dataset whose loss is weighted."""

    def __init__(self, entries: list, loss_weight: float):
        super().__init__(entries)
        self.loss_weight = loss_weight


class TrainingData:
    """The batches of every epoch. With several processes (DDP), process `rank` of `world` takes every
    world-th batch of the shared plan; when the count does not divide, the last round wraps around to
    the first batches, so every process steps the same number of times and no batch is left out."""

    def __init__(
        self,
        samples: list[TrainingSample],
        specs: tuple[DatasetSpec, ...],
        seed: int,
        num_workers: int,
        rank: int = 0,
        world: int = 1,
        caption_dropout: bool = True,
        pin_memory: bool = False,
    ):
        self.samples = samples
        self.specs = {s.uid: s for s in specs}  # samples name their dataset (and resolution) by uid
        self.seed = seed
        self.num_workers = num_workers
        self.rank, self.world = rank, world
        self.caption_dropout = caption_dropout
        # pinning needs a CUDA build and driver; checked once, so elsewhere the flag is a no-op
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._planned: tuple[int, list[list[tuple[str, str, str]]]] | None = None  # (epoch, its plan)
        self.by_dataset: dict[int, dict[str, list[TrainingSample]]] = defaultdict(lambda: defaultdict(list))
        prior: dict[int, list[TrainingSample]] = defaultdict(list)
        for s in samples:
            if self.specs[s.dataset_index].regularization:
                prior[s.dataset_index].append(s)
                continue
            self.by_dataset[s.dataset_index][s.bucket_key] += [s] * self.specs[s.dataset_index].num_repeats
        training_items = sum(len(v) for b in self.by_dataset.values() for v in b.values())
        for uid, items in sorted(
            prior.items()
        ):  # a share of the training items (`tuner.data.regularization`)
            count = regularization_count(self.specs[uid].regularization_ratio, training_items)
            for s in draw_regularization(items, count, f"{seed}/regularization/{uid}"):
                self.by_dataset[uid][s.bucket_key].append(s)

    def warnings(self) -> list[str]:
        out = []
        for index, buckets in sorted(self.by_dataset.items()):
            spec = self.specs[index]
            out += [f"datasets[{spec.index}]: {w}" for w in short_batch_warnings(buckets, spec.batch_size)]
        return out

    def plan_epoch(self, epoch: int) -> list[list[tuple[str, str, str]]]:
        """Batches of one epoch: lists of (cache_dir, latent_key, text_key). Computed once per epoch
        (the latest epoch's plan is kept); callers must not edit it."""
        if self._planned is None or self._planned[0] != epoch:
            self._planned = (epoch, self._plan(epoch))
        return self._planned[1]

    def _plan(self, epoch: int) -> list[list[tuple[str, str, str]]]:
        batches = []
        for index, buckets in sorted(self.by_dataset.items()):
            spec = self.specs[index]
            rate = spec.caption_dropout_rate if self.caption_dropout else 0.0
            for b, batch in enumerate(plan_batches(buckets, spec.batch_size, self.seed + index, epoch)):
                texts = [s.text_key for s in batch.items]
                if any(s.variant_text_keys for s in batch.items):  # one caption variant per epoch
                    pick = random.Random(f"{self.seed}/{epoch}/{index}/{b}/caption")
                    texts = [pick.choice(s.variant_text_keys) if s.variant_text_keys else t
                             for s, t in zip(batch.items, texts)]  # fmt: skip
                if rate > 0.0:  # when no draw can drop, skip seeding a generator per batch (most of the cost)
                    drop = random.Random(f"{self.seed}/{epoch}/{index}/{b}")
                    texts = [
                        s.empty_text_key if drop.random() < rate else t for s, t in zip(batch.items, texts)
                    ]
                entries = [(s.cache_dir, s.latent_key, t) for s, t in zip(batch.items, texts)]
                batches.append(
                    entries if spec.loss_weight == 1.0 else WeightedBatch(entries, spec.loss_weight)
                )
        random.Random(f"{self.seed}/{epoch}").shuffle(batches)
        return batches

    def local_plan(self, epoch: int) -> list[list[tuple[str, str, str]]]:
        """This process's share of the epoch's batches."""
        plan = self.plan_epoch(epoch)
        rounds = -(-len(plan) // self.world)
        return [plan[(i * self.world + self.rank) % len(plan)] for i in range(rounds)]

    def batches_per_epoch(self) -> int:
        """Batches each process steps through per epoch: `len(local_plan(e))` for any epoch, counted
        without planning (every bucket gives ceil(items / batch_size) batches in every epoch)."""
        planned = sum(
            -(-len(items) // self.specs[index].batch_size)
            for index, buckets in self.by_dataset.items()
            for items in buckets.values()
        )
        return -(-planned // self.world)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[dict]:
        """Batches of `epoch` from index `start` on (to resume mid-epoch)."""
        # One item per batch: its latent and text entries, interleaved.
        plan = self.local_plan(epoch)[start:]
        reads = EntryReads(
            [
                [
                    (cache_dir, key)
                    for cache_dir, latent_key, text_key in batch
                    for key in (latent_key, text_key)
                ]
                for batch in plan
            ]
        )
        # A private generator: creating a loader must not draw from the global RNG, or a run resumed
        # mid-epoch would see different dropout than an uninterrupted one.
        loaded = reads.load(self.num_workers, generator=torch.Generator().manual_seed(self.seed))
        for batch, entries in zip(plan, loaded):
            # The stack copies the latents out of the shard maps into a batch the step may edit.
            # Every entry of a batch shares one bucket, so each of its tensors (latents, control_0...) stacks.
            latents = entries[0::2]
            stacked = {name: _stack([e[name] for e in latents], self.pin_memory) for name in latents[0]}
            if isinstance(batch, WeightedBatch):  # `ArchitectureModel.loss` multiplies the batch's loss by it
                stacked["loss_weight"] = torch.full((len(latents),), batch.loss_weight)
            yield {"latents": stacked.pop("latents"), "extra": stacked, "text": entries[1::2]}

    def summary(self) -> dict:
        buckets = sorted({s.bucket_key for s in self.samples})
        sizes = {self.specs[i].batch_size for i in self.by_dataset}
        return {
            "samples": sum(len(v) for b in self.by_dataset.values() for v in b.values()),
            "unique_samples": len(self.samples),
            "datasets": len(self.by_dataset),
            "buckets": buckets,
            "batch_size": "/".join(str(s) for s in sorted(sizes)),
            "batches_per_epoch": self.batches_per_epoch(),
        }


def _stack(tensors: list[torch.Tensor], pin: bool) -> torch.Tensor:
    """`torch.stack`, written straight into pinned memory with `pin` (one copy, not stack then pin)."""
    if not pin:
        return torch.stack(tensors)
    return torch.stack(tensors, out=_pinned((len(tensors), *tensors[0].shape), tensors[0].dtype))


def _pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized page-locked host tensor (from torch's caching host allocator)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)
