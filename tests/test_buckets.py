import math
import random

import numpy as np
import pytest
from PIL import Image

from tuner.data.buckets import (
    Crop,
    bucket_sizes,
    choose_bucket,
    dataset_buckets,
    plan_batches,
    plan_crop,
    resize_and_crop,
    short_batch_warnings,
)
from tuner.errors import ConfigError


@pytest.mark.parametrize(
    "resolution,step", [((960, 544), 16), ((1024, 1024), 16), ((832, 480), 32), ((64, 48), 16)]
)
def test_bucket_sizes_keep_area_and_step(resolution, step):
    area = resolution[0] * resolution[1]
    sizes = bucket_sizes(resolution, step)
    assert len(sizes) == len(set(sizes)) >= 2
    for w, h in sizes:
        assert w % step == 0 and h % step == 0
        assert w * h <= area  # never more memory than the user sized for
        if min(resolution) >= 256:
            assert w * h >= 0.95 * area
        assert 1 / 4 <= w / h <= 4
        assert (h, w) in sizes  # both orientations


def test_bucket_sizes_include_the_target_and_span_1_to_4():
    sizes = bucket_sizes((960, 544), 16)
    assert (960, 544) in sizes
    ratios = [w / h for w, h in sizes]
    assert min(ratios) < 0.3 and max(ratios) > 3.5


def test_bucket_sizes_too_small_for_step():
    with pytest.raises(ConfigError, match="step 32"):
        bucket_sizes((16, 16), 32)


def test_disabled_buckets_are_the_one_target_size():
    assert dataset_buckets((960, 544), 16, enable_bucket=False) == [(960, 544)]
    assert dataset_buckets((970, 550), 16, enable_bucket=False) == [(960, 544)]


def test_choose_bucket_picks_nearest_aspect():
    buckets = bucket_sizes((960, 544), 16)
    assert choose_bucket(1920, 1080, buckets, False, 16) == (960, 544)
    assert choose_bucket(1080, 1920, buckets, False, 16) == (544, 960)
    w, h = choose_bucket(500, 500, buckets, False, 16)
    assert w == h
    for src in [(640, 480), (300, 1200), (4000, 1000), (1234, 567)]:
        chosen = choose_bucket(*src, buckets, False, 16)
        best = min(abs(math.log(b[0] / b[1]) - math.log(src[0] / src[1])) for b in buckets)
        assert abs(math.log(chosen[0] / chosen[1]) - math.log(src[0] / src[1])) == pytest.approx(best)


def test_no_upscale_never_exceeds_the_source():
    buckets = bucket_sizes((960, 544), 16)
    assert choose_bucket(300, 200, buckets, True, 16) == (288, 192)  # the source's size, floored to 16
    assert choose_bucket(1920, 1080, buckets, True, 16) == (960, 544)  # large sources use the buckets
    rng = random.Random(0)
    for _ in range(300):
        sw, sh = rng.randint(16, 2500), rng.randint(16, 2500)
        w, h = choose_bucket(sw, sh, buckets, True, 16)
        assert w <= sw and h <= sh, (sw, sh, w, h)
        assert w % 16 == 0 and h % 16 == 0
        assert w * h <= 960 * 544


def test_resize_and_crop_covers_then_centers():
    img = Image.new("RGB", (96, 32))
    for i, color in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255)]):
        img.paste(color, (32 * i, 0, 32 * i + 32, 32))
    out, crop = resize_and_crop(img, (32, 32))
    assert crop == Crop(resized=(96, 32), box=(32, 0, 64, 32))
    assert out.shape == (32, 32, 3) and out.dtype == np.uint8
    assert (out == [0, 255, 0]).all()  # only the middle stripe survives


def test_resize_and_crop_frames_and_plan_crop_agree():
    frames = np.random.default_rng(0).integers(0, 256, (3, 48, 64, 3), dtype=np.uint8)
    out, crop = resize_and_crop(frames, (32, 32))
    assert out.shape == (3, 32, 32, 3)
    assert crop == plan_crop(64, 48, (32, 32))
    rw, rh = crop.resized
    assert rw >= 32 and rh == 32 and crop.box[2] - crop.box[0] == 32


def test_plan_crop_upscales_to_cover():
    crop = plan_crop(50, 20, (64, 64))
    assert crop.resized[1] == 64 and crop.resized[0] >= 64


def test_plan_batches_keeps_every_item_and_is_deterministic():
    items = {"64x48x1": list(range(10)), "48x64x1": list(range(100, 103))}
    batches = plan_batches(items, batch_size=4, seed=1, epoch=0)
    seen = sorted(x for b in batches for x in b.items)
    assert seen == sorted(items["64x48x1"] + items["48x64x1"])
    for b in batches:
        assert all(x in items[b.bucket_key] for x in b.items)
    sizes = sorted((b.bucket_key, len(b.items)) for b in batches)
    assert sizes == [("48x64x1", 3), ("64x48x1", 2), ("64x48x1", 4), ("64x48x1", 4)]
    assert plan_batches(items, 4, seed=1, epoch=0) == batches
    orders = {tuple(x for b in plan_batches(items, 4, seed=1, epoch=e) for x in b.items) for e in range(5)}
    assert len(orders) > 1  # a new epoch reshuffles


def test_short_batch_warnings():
    items = {"832x480x33": [1, 2, 3], "480x832x33": list(range(10)), "512x512x1": list(range(8))}
    assert short_batch_warnings(items, 4) == [
        "bucket 480x832x33: 10 items, batch_size 4 → 2 batches of 4 and one of 2",
        "bucket 832x480x33: 3 items, batch_size 4 → one batch of 3",
    ]
    assert short_batch_warnings(items, 1) == []
