"""Aspect-ratio buckets: train on every shape without padding, in batches of equal size.

A model trained at 960x544 can still learn from a portrait photo or a panorama. Rather than squash
everything to one size, we build a set of *buckets*: sizes with about the same pixel area as the target
resolution (so memory use and step time stay flat) and aspect ratios from 1:4 to 4:1. Each item goes to
the bucket nearest its own aspect ratio, is scaled just enough to cover it, and is center-cropped to it;
little is cropped because the aspect ratios nearly match. Batches are drawn within a bucket so that every
tensor in a batch has one shape.

Both sides of a bucket are multiples of `step`, the model's spatial step (VAE downscale factor times the
transformer's patch size, 16 for Wan), so latents split evenly into patches.

    buckets = dataset_buckets((960, 544), step=16, enable_bucket=True)
    bucket = choose_bucket(1920, 1080, buckets, no_upscale=False, step=16)   # (960, 544)
    pixels, crop = resize_and_crop(image, bucket)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
from PIL import Image

from tuner.errors import ConfigError

T = TypeVar("T")

MAX_ASPECT = 4.0  # buckets span 1:4 .. 4:1; beyond that a crop throws away most of the picture
RESIZE_METHOD = "lanczos"  # part of every latent job's params: changing it changes the encoded result


def _floor_to(x: float, step: int) -> int:
    return int(x // step) * step


# ---------------------------------------------------------------- bucket sizes


def bucket_sizes(resolution: tuple[int, int], step: int) -> list[tuple[int, int]]:
    """Sizes (w, h) of area at most w*h of `resolution`, sides multiples of `step`, aspect 1:4..4:1.

    For each short side s (a multiple of step, from the 1:4 limit up to the square), the long side is
    the largest multiple of step that keeps the area under the target; both orientations are added.
    Rounding the *long* side down loses at most step/long of the area (about 2% at 960x544, step 16)
    and never exceeds the target, so the memory a user sized for is never overrun.
    """
    area = resolution[0] * resolution[1]
    sizes: set[tuple[int, int]] = set()
    short = math.ceil(math.sqrt(area / MAX_ASPECT) / step) * step
    while short * short <= area:
        long = _floor_to(area / short, step)
        if long / short <= MAX_ASPECT:
            sizes.update({(long, short), (short, long)})
        short += step
    if not sizes:
        raise ConfigError(
            f"resolution {list(resolution)} is too small for the model's spatial step {step}: "
            f"use at least [{step}, {step}]."
        )
    return sorted(sizes, key=lambda s: s[0] / s[1])


def dataset_buckets(resolution: tuple[int, int], step: int, enable_bucket: bool) -> list[tuple[int, int]]:
    """The buckets of a dataset: many aspect ratios, or with enable_bucket=False the one target size."""
    if enable_bucket:
        return bucket_sizes(resolution, step)
    w, h = _floor_to(resolution[0], step), _floor_to(resolution[1], step)
    if w == 0 or h == 0:
        raise ConfigError(f"resolution {list(resolution)} is smaller than the model's spatial step {step}.")
    return [(w, h)]


def choose_bucket(
    src_w: int, src_h: int, buckets: Sequence[tuple[int, int]], no_upscale: bool, step: int
) -> tuple[int, int]:
    """The bucket for a source of size src_w x src_h: the nearest aspect ratio (compared in log space,
    so 2:1 and 1:2 are equally far from 1:1).

    With no_upscale, a bucket that would need the source enlarged (either side larger than the source)
    is replaced by the source's own size, shrunk to at most the buckets' area and rounded down to the
    step: small images are trained at their own resolution instead of being blown up. A side smaller
    than one step is the one exception; it becomes one step.
    """
    ratio = math.log(src_w / src_h)
    best = min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - ratio), -b[0] * b[1]))
    if not no_upscale or (best[0] <= src_w and best[1] <= src_h):
        return best
    max_area = max(w * h for w, h in buckets)
    scale = min(1.0, math.sqrt(max_area / (src_w * src_h)))
    return max(step, _floor_to(src_w * scale, step)), max(step, _floor_to(src_h * scale, step))


UPSCALE_NOTE = 1.5  # an item scaled up more than this to cover its bucket is "much smaller" than it


def upscale_note(scales: Sequence[float]) -> str | None:
    """One line about the items (given by the scale each needs to cover its bucket) that are scaled up
    by more than `UPSCALE_NOTE`, or None when there are none."""
    big = [s for s in scales if s > UPSCALE_NOTE]
    if not big:
        return None
    return (
        f"{len(big)} of {len(scales)} items are much smaller than their bucket and are upscaled (up to "
        f"{max(big):.1f}×), which blurs them; set bucket_no_upscale = true to train them at their own "
        "size, or use a lower resolution."
    )


# ---------------------------------------------------------------- resize and crop


@dataclass(frozen=True)
class Crop:
    """How a source becomes a bucket: resize to `resized` (w, h), then cut `box` (left, top, right, bottom).

    Computed from sizes alone (see `plan_crop`), so a job's crop is known before any pixel is read and
    is part of what identifies its cache entry.
    """

    resized: tuple[int, int]
    box: tuple[int, int, int, int]


def plan_crop(src_w: int, src_h: int, bucket: tuple[int, int]) -> Crop:
    """Scale to cover the bucket (the smallest scale at which both sides fit), then center-crop."""
    bw, bh = bucket
    scale = max(bw / src_w, bh / src_h)
    # max() guards against float rounding leaving the covering side one pixel short
    rw, rh = max(bw, round(src_w * scale)), max(bh, round(src_h * scale))
    left, top = (rw - bw) // 2, (rh - bh) // 2
    return Crop(resized=(rw, rh), box=(left, top, left + bw, top + bh))


def apply_crop(img: Image.Image, crop: Crop) -> np.ndarray:
    """Resize `img` and cut the crop box: uint8 [H, W, 3] of the bucket's size."""
    if img.size != crop.resized:
        # Pillow's Lanczos filter widens with the scale factor, so downscaling is properly antialiased
        img = img.resize(crop.resized, Image.Resampling.LANCZOS)
    return np.array(img.crop(crop.box).convert("RGB"))  # np.array, not asarray: a writable copy


def resize_and_crop(img: Image.Image | np.ndarray, bucket: tuple[int, int]) -> tuple[np.ndarray, Crop]:
    """Resize to cover `bucket` and center-crop to it.

    `img` is a PIL image or uint8 frames [F, H, W, 3]; the result is uint8 [H, W, 3] or [F, H, W, 3]
    of the bucket's size, with the `Crop` that was applied.
    """
    if isinstance(img, Image.Image):
        crop = plan_crop(img.width, img.height, bucket)
        return apply_crop(img, crop), crop
    if img.ndim != 4 or img.shape[-1] != 3:
        raise ValueError(f"expected frames [F, H, W, 3], got shape {tuple(img.shape)}")
    crop = plan_crop(img.shape[2], img.shape[1], bucket)
    return np.stack([apply_crop(Image.fromarray(f), crop) for f in img]), crop


# ---------------------------------------------------------------- batches


@dataclass(frozen=True)
class Batch(Generic[T]):
    """Items that share one bucket, so their tensors stack."""

    bucket_key: str
    items: tuple[T, ...]


def plan_batches(
    items_by_bucket: Mapping[str, Sequence[T]], batch_size: int, seed: int, epoch: int
) -> list[Batch[T]]:
    """Shuffled batches drawn within each bucket, in a shuffled order across buckets.

    Deterministic in (seed, epoch), so a resumed run replays the same order. No item is dropped: a
    bucket's remainder (or a bucket smaller than batch_size) becomes one smaller batch; see
    `short_batch_warnings` for the report.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rng = np.random.default_rng([seed, epoch])
    batches: list[Batch[T]] = []
    for key in sorted(items_by_bucket):  # sorted: dict order must not change the shuffle
        items = list(items_by_bucket[key])
        order = rng.permutation(len(items))
        shuffled = [items[i] for i in order]
        for start in range(0, len(shuffled), batch_size):
            batches.append(Batch(key, tuple(shuffled[start : start + batch_size])))
    return [batches[i] for i in rng.permutation(len(batches))]


def short_batch_warnings(items_by_bucket: Mapping[str, Sequence[object]], batch_size: int) -> list[str]:
    """One line per bucket whose items do not divide into full batches (the same every epoch)."""
    warnings = []
    for key in sorted(items_by_bucket):
        n = len(items_by_bucket[key])
        full, rest = divmod(n, batch_size)
        if rest == 0:
            continue
        if full == 0:
            what = f"one batch of {rest}"
        else:
            what = f"{full} batch{'es' if full > 1 else ''} of {batch_size} and one of {rest}"
        warnings.append(f"bucket {key}: {n} items, batch_size {batch_size} → {what}")
    return warnings
