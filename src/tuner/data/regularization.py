"""Regularization (prior-preservation) datasets: generic pictures of the class being trained.

DreamBooth-style training teaches a new subject ("ohwx dog") while showing the model ordinary pictures
of its class ("a dog") so it does not forget what the class looks like. Such a set is usually larger
or smaller than the training set, and should weigh a fixed share of each epoch whatever its size. A
dataset marked `regularization = true` therefore contributes `regularization_ratio` × the other
training datasets' items (repeats included) per epoch, drawn from its items in a seeded order and
cycled when it has fewer, and its batches' loss is multiplied by its `loss_weight`.

The draw is made once per run (from `train.seed`), not per epoch: the number of batches per epoch must
not change between epochs (the schedule, gradient accumulation groups and exact resume are computed
from it), and a per-epoch draw would move items between buckets.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def regularization_count(ratio: float, training_items: int) -> int:
    """Items a regularization dataset gives per epoch: ratio × the training items, at least one."""
    return max(1, round(ratio * training_items))


def draw_regularization(items: Sequence[T], count: int, seed: str) -> list[T]:
    """`count` items from `items`: each once in a seeded order, then again in another, ... (cycled)."""
    rng = random.Random(seed)
    out: list[T] = []
    while len(out) < count:
        order = list(items)
        rng.shuffle(order)
        out += order[: count - len(out)]
    return out
