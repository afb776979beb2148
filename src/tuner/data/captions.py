"""Caption handling: several captions per item, tag shuffling and dropout, a prefix and a suffix.

An item may come with several captions (one per line of its sidecar with `captions_per_line`, or a
JSONL `"caption": [...]` list). Booru-style captions are comma-separated tags, and users of tag-trained
models expect them shuffled (`shuffle_tags`) and thinned (`tag_dropout_rate`) so the model does not
learn tag order, with the first `keep_tokens` tags (a trigger word, a character name) left in place.
`caption_prefix` / `caption_suffix` wrap every caption (a trigger word without editing every file).

The text encoder's output is cached, so a caption that changes every step would need an encode per
step. We encode a *finite pool* instead: each item gets `caption_variants` processed captions (its
captions taken in turn, each shuffled / thinned by a generator seeded with the item's file name and
captions), all planned here before anything is encoded, so `tuner cache text` encodes every variant
once and training's key check sees the same set. Training draws one variant per item per epoch from
the run's seed and the epoch (`tuner.cache.batches`), so a resumed run draws what a straight run does.
Why a pool and not one variant per planned step: the pool does not depend on `train.max_steps`,
`epochs` or the batch size, so changing those never invalidates the text cache; 8 variants of a
10-tag caption already show the model most tags in many positions.

Every option changes the caption text itself, and a text entry is keyed by its text, so each enters
the text cache keys without further bookkeeping. Without these options nothing here changes an item.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from tuner.config.dataset import DatasetSpec
from tuner.data.items import Item
from tuner.errors import DataError


def split_tags(caption: str) -> list[str]:
    """A caption's comma-separated tags, stripped, empty ones left out."""
    return [t.strip() for t in caption.split(",") if t.strip()]


def process_tags(caption: str, spec: DatasetSpec, rng: random.Random) -> str:
    """One variant: the first `keep_tokens` tags in place, the rest thinned and shuffled."""
    tags = split_tags(caption)
    kept, rest = tags[: spec.keep_tokens], tags[spec.keep_tokens :]
    if spec.tag_dropout_rate > 0:
        rest = [t for t in rest if rng.random() >= spec.tag_dropout_rate]
    if spec.shuffle_tags:
        rng.shuffle(rest)
    return ", ".join(kept + rest)


def _randomized(spec: DatasetSpec) -> bool:
    return spec.shuffle_tags or spec.tag_dropout_rate > 0


def caption_variants(item: Item, spec: DatasetSpec) -> tuple[str, ...]:
    """The item's final captions (distinct, in a fixed order); the first is its plain caption."""
    raws = item.captions or (item.caption,)
    if _randomized(spec):
        # the same pool on every run and machine, and after the dataset folder moves (the file's name only)
        rng = random.Random("\0".join((Path(item.path).name, *raws)))
        count = max(spec.caption_variants, len(raws))
        texts = [process_tags(raws[j % len(raws)], spec, rng) for j in range(count)]
    else:
        texts = list(raws)
    wrapped = [f"{spec.caption_prefix}{t}{spec.caption_suffix}".strip() for t in texts]
    return tuple(dict.fromkeys(wrapped))


def apply_caption_options(spec: DatasetSpec, items: list[Item], problems: list[str]) -> list[Item]:
    """Items with their caption variants filled in (`Item.captions`, more than one only when they
    differ; `Item.caption` is the first). Variants that tag dropout left empty are named once per item;
    an item that tag dropout leaves with no caption at all is an error naming it."""
    plain = not (_randomized(spec) or spec.caption_prefix or spec.caption_suffix)
    if plain and not any(item.captions for item in items):
        return items
    out = []
    for item in items:
        variants = caption_variants(item, spec)
        if _randomized(spec) and any(split_tags(r) for r in item.captions or (item.caption,)):
            emptied = sum(1 for v in variants if not split_tags(v))
            if emptied == len(variants):
                raise DataError(
                    f"{item.path}: its caption is empty in every variant after tag dropout "
                    f"(tag_dropout_rate = {spec.tag_dropout_rate:g}, keep_tokens = {spec.keep_tokens}). "
                    "Lower tag_dropout_rate or set keep_tokens."
                )
            if emptied:
                problems.append(
                    f"{item.path}: tag dropout left {emptied} of {len(variants)} caption variants empty "
                    f"(tag_dropout_rate = {spec.tag_dropout_rate:g}); they train as the empty caption. "
                    "Lower tag_dropout_rate or set keep_tokens."
                )
        out.append(
            dataclasses.replace(item, caption=variants[0], captions=variants if len(variants) > 1 else ())
        )
    return out
