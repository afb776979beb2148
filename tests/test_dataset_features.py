"""Loss masks and caption handling: from the dataset TOML through the cache to the training loss."""

import json
import re
import shutil

import pytest
import torch
from PIL import Image

from project import cfg, make_project, train_wan
from test_datasets import image, make_spec
from tuner.cache.plan import open_training_data
from tuner.cache.store import CacheStore
from tuner.cli import main as tuner
from tuner.data import discover_items, plan_latent_jobs
from tuner.data.captions import process_tags
from tuner.data.masks import load_job_mask, to_latent_grid
from tuner.errors import DataError

# ---------------------------------------------------------------- captions


def test_sidecar_lines_and_jsonl_lists_are_caption_variants(tmp_path):
    image(tmp_path / "imgs" / "a.png")
    (tmp_path / "imgs" / "a.txt").write_text("first caption\n\nsecond caption\n")
    items, _ = discover_items(make_spec(tmp_path / "imgs", captions_per_line=True))
    assert items[0].caption == "first caption" and items[0].captions == ("first caption", "second caption")
    items, _ = discover_items(make_spec(tmp_path / "imgs"))  # off: the file is one caption
    assert items[0].caption == "first caption\n\nsecond caption" and items[0].captions == ()

    image(tmp_path / "m" / "b.png")
    (tmp_path / "m" / "list.jsonl").write_text(json.dumps({"image_path": "b.png", "caption": ["x", "y"]}))
    items, _ = discover_items(make_spec(tmp_path / "m" / "list.jsonl", manifest=True))
    assert items[0].captions == ("x", "y")
    (tmp_path / "m" / "bad.jsonl").write_text(json.dumps({"image_path": "b.png", "caption": []}))
    with pytest.raises(DataError, match=r"bad.jsonl:1: \"caption\" as a list"):
        discover_items(make_spec(tmp_path / "m" / "bad.jsonl", manifest=True))


def test_tag_shuffle_dropout_keep_tokens_prefix_suffix(tmp_path):
    image(tmp_path / "a.png", caption="ohwx, red, round, shiny, small, plain")
    spec = make_spec(tmp_path, shuffle_tags=True, keep_tokens=1, tag_dropout_rate=0.3, caption_variants=6,
                     caption_prefix="photo of ", caption_suffix=", best")  # fmt: skip
    items, problems = discover_items(spec)
    variants = items[0].captions
    assert 1 < len(variants) <= 6 and items[0].caption == variants[0]
    tags = {"red", "round", "shiny", "small", "plain"}
    for v in variants:
        assert v.startswith("photo of ohwx") and v.endswith(", best")
        inner = v.removeprefix("photo of ohwx").removesuffix(", best").strip(", ")
        assert set(filter(None, inner.split(", "))) <= tags
    assert discover_items(spec)[0][0].captions == variants  # the same pool every run


def test_tag_dropout_that_empties_a_variant_is_named(tmp_path):
    image(tmp_path / "a.png", caption="lonely")
    items, problems = discover_items(make_spec(tmp_path, tag_dropout_rate=0.5))
    assert "" in items[0].captions and "lonely" in items[0].captions
    assert any("a.png: tag dropout left" in p and "empty" in p for p in problems)
    with pytest.raises(DataError, match=r"a.png: its caption is empty in every variant after tag dropout"):
        discover_items(make_spec(tmp_path, tag_dropout_rate=1.0))
    assert discover_items(make_spec(tmp_path, tag_dropout_rate=1.0, keep_tokens=1))[0][0].caption == "lonely"


def test_process_tags_keeps_leading_tokens_in_place():
    import random

    spec = make_spec("x", shuffle_tags=True, keep_tokens=2)
    out = process_tags("a, b, c, d, e", spec, random.Random(0))
    assert out.startswith("a, b, ") and sorted(out.split(", ")) == ["a", "b", "c", "d", "e"]


# ---------------------------------------------------------------- masks


def test_masks_pair_by_stem_and_bad_masks_are_named(tmp_path):
    image(tmp_path / "imgs" / "a.png", caption="a")
    image(tmp_path / "imgs" / "b.png", caption="b")
    (tmp_path / "masks").mkdir()
    Image.new("L", (64, 48), 255).save(tmp_path / "masks" / "a.png")
    spec = make_spec(tmp_path / "imgs", mask_directory=str(tmp_path / "masks"))
    items, problems = discover_items(spec)
    assert items[0].mask_path.endswith("masks/a.png") and items[1].mask_path is None
    assert any("b.png: no mask" in p for p in problems)
    jobs, _ = plan_latent_jobs(spec, items, step=16)
    assert jobs[0].bucket_key.endswith("_m") and "mask" in jobs[0].params() and "mask" not in jobs[1].params()
    assert jobs[0].input_paths[-1].endswith("masks/a.png")

    Image.new("L", (32, 48), 255).save(tmp_path / "masks" / "a.png")  # the wrong size
    with pytest.raises(DataError, match=r"masks/a.png: mask is 32x48 but its item a.png is 64x48"):
        plan_latent_jobs(spec, discover_items(spec)[0], step=16)
    Image.new("L", (64, 48), 255).save(tmp_path / "masks" / "zz.png")  # no item zz
    with pytest.raises(DataError, match=r"masks/zz.png: a mask for a missing item"):
        discover_items(spec)


def test_mask_is_cropped_like_its_image_and_reduced_to_the_latent_grid(tmp_path):
    image(tmp_path / "imgs" / "a.png", size=(128, 48), caption="a")
    (tmp_path / "masks").mkdir()
    m = Image.new("L", (128, 48), 0)
    m.paste(255, (64, 0, 128, 48))  # right half counts
    m.save(tmp_path / "masks" / "a.png")
    spec = make_spec(tmp_path / "imgs", mask_directory=str(tmp_path / "masks"), enable_bucket=False,
                     resolution=(64, 48))  # fmt: skip
    job = plan_latent_jobs(spec, discover_items(spec)[0], step=16)[0][0]
    pixels = load_job_mask(job)  # 128x48 → cover 64x48: resized to 128x48, centre crop 32..96
    assert pixels.shape == (1, 1, 48, 64)
    assert pixels[0, 0, :, :30].max() == 0 and pixels[0, 0, :, 34:].min() == 1
    grid = to_latent_grid(pixels, (1, 6, 8), min_weight=0.25)
    assert grid.shape == (1, 1, 6, 8)
    assert torch.allclose(grid[0, 0, :, :4], torch.tensor(0.25)) and torch.allclose(
        grid[0, 0, :, 4:], torch.tensor(1.0)
    )


def test_video_masks_follow_the_vae_time_compression():
    mask = torch.zeros(1, 9, 8, 8)
    mask[:, 0] = 1  # the first frame, then two groups of four: [1, 0, 0]
    mask[:, 5:9] = 0.5
    grid = to_latent_grid(mask, (3, 1, 1), min_weight=0.0)
    assert torch.allclose(grid.flatten(), torch.tensor([1.0, 0.0, 0.5]))
    assert to_latent_grid(torch.ones(1, 1, 8, 8), (3, 2, 2), 0.0).shape == (
        1,
        3,
        2,
        2,
    )  # image mask of a clip


def test_alpha_mask(tmp_path):
    rgba = Image.new("RGBA", (64, 48), (200, 10, 10, 0))
    rgba.paste((200, 10, 10, 255), (0, 0, 32, 48))
    rgba.save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("a")
    spec = make_spec(tmp_path, alpha_mask=True, enable_bucket=False)
    job = plan_latent_jobs(spec, discover_items(spec)[0], step=16)[0][0]
    mask = load_job_mask(job)
    assert job.mask == "alpha" and mask[0, 0, :, :30].min() == 1 and mask[0, 0, :, 34:].max() == 0


# ---------------------------------------------------------------- cache → train


def _dataset(config, extra: str) -> None:
    path = config.parent / "dataset.toml"
    text = path.read_text()
    path.write_text(re.sub(r'(image_directory = "data/images"\n)', rf"\1{extra}", text))


def _masks(config, value: int) -> None:
    folder = config.parent / "data" / "masks"
    folder.mkdir(exist_ok=True)
    for img in sorted((config.parent / "data" / "images").glob("*.png")):
        m = Image.new("L", (64, 48), value)
        m.paste(255, (0, 0, 32, 48))
        m.save(folder / img.name)


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory, wan_model):
    root = tmp_path_factory.mktemp("plain")
    config = make_project(root, wan_model)
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    assert tuner(["cache", "text", "--config", str(config)]) == 0
    return train_wan(config, root / "out").history


def test_masks_are_cached_and_weight_the_loss(tmp_path, wan_model, plain_losses):
    config = make_project(tmp_path / "white", wan_model)
    _masks(config, 255)  # all white: weight 1 everywhere, the plain loss
    _dataset(config, 'mask_directory = "data/masks"\n')
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    assert tuner(["cache", "text", "--config", str(config)]) == 0
    trainer = train_wan(config, tmp_path / "white" / "out")
    assert trainer.history == pytest.approx(plain_losses, rel=1e-5)

    store = CacheStore(tmp_path / "white" / "cache", readonly=True)
    data = open_training_data(trainer, trainer.cfg, log=lambda s: None)
    masked = [s for s in data.samples if s.bucket_key.endswith("_m")]
    assert len(masked) == 4
    entry = store.get(masked[0].latent_key)
    assert entry["loss_mask"].shape == (1, *entry["latents"].shape[1:])

    _masks(config, 0)  # left half only: other keys, re-encoded, other losses
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    trainer = train_wan(config, tmp_path / "white" / "out2")
    assert trainer.history != pytest.approx(plain_losses, rel=1e-3)


def test_caption_variants_are_encoded_once_and_drawn_per_epoch(tmp_path, wan_model):
    config = make_project(tmp_path, wan_model, steps=6)
    for sidecar in (config.parent / "data" / "images").glob("*.txt"):  # tags: "a, red, circle, ..."
        sidecar.write_text(sidecar.read_text().replace(" ", ", "))
    _dataset(config, 'shuffle_tags = true\ncaption_variants = 3\ncaption_prefix = "ohwx, "\n')
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    assert tuner(["cache", "text", "--config", str(config)]) == 0
    store = CacheStore(tmp_path / "cache", readonly=True)
    captions = {store.meta(k)["caption"] for k in store.keys("text")}
    assert sum(c.startswith("ohwx, ") for c in captions) > 4  # several variants of the 4 image captions
    trainer = train_wan(config, tmp_path / "out")
    data = open_training_data(trainer, cfg(config), log=lambda s: None)
    picked = [{t for batch in data.plan_epoch(e) for _, _, t in batch} for e in range(4)]
    assert len(set.union(*picked)) > len(picked[0])  # other variants in other epochs
    assert data.plan_epoch(1) == open_training_data(trainer, cfg(config), log=lambda s: None).plan_epoch(1)


# ---------------------------------------------------------------- tuner data check


def test_data_check_reports_items_buckets_frames_and_drops(tmp_path, wan_model, capsys):
    from project import run
    from tuner.fixtures.dataset import write_videos

    config = make_project(tmp_path, wan_model)
    videos = config.parent / "data" / "videos"
    write_videos(tmp_path / "short", 1, (64, 48), frames=5, fps=24, seed=3)
    (tmp_path / "short" / "video_000.mp4").rename(videos / "short.mp4")
    (videos / "broken.mp4").write_bytes(b"not a video")
    image(config.parent / "data" / "images" / "wide.png", size=(128, 32), caption="wide")
    code, out = run(capsys, "data", "check", "--config", config)
    assert code == 0, out
    assert re.search(r"datasets\[0\] at 64x48 \(.*images\): 5 items → 5 images", out)
    assert re.search(r"buckets: 64x48x1 ×4, 96x32x1 ×1", out)
    assert re.search(r"datasets\[1\] at 64x48 \(.*videos\): 4 items → 2 clips", out)
    assert "frames per clip: 9 ×2" in out
    assert re.search(r"dropped 2 items: too short ×1 \(short.mp4\), undecodable ×1 \(broken.mp4\)", out)
    assert not (config.parent / "cache").exists()  # nothing encoded, no store made

    code, out = run(
        capsys, "data", "check", "--dataset", config.parent / "dataset.toml", "--architecture", "flux"
    )
    assert code == 0 and "datasets[1]" in out  # flux is an image model: planning still reports


# ---------------------------------------------------------------- several resolutions


def test_several_resolutions_train_each_item_at_each(tmp_path, wan_model):
    from tuner.config import load_datasets
    from tuner.errors import ConfigError

    config = make_project(tmp_path, wan_model, steps=3)
    dataset = config.parent / "dataset.toml"
    text = dataset.read_text()
    multi = text.replace("num_repeats = 2\n", "num_repeats = [2, 1]\nresolution = [[64, 48], [32, 32]]\n", 1)
    dataset.write_text(multi)
    specs = load_datasets(dataset)
    assert [(s.index, s.part, s.resolution, s.num_repeats) for s in specs[:2]] == [
        (0, 0, (64, 48), 2), (0, 1, (32, 32), 1)]  # fmt: skip
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    assert tuner(["cache", "text", "--config", str(config)]) == 0
    trainer = train_wan(config, tmp_path / "out")
    data = open_training_data(trainer, trainer.cfg, log=lambda s: None)
    buckets = {s.bucket_key for s in data.samples if s.bucket_key.endswith("x1")}
    assert buckets == {"64x48x1", "32x32x1"}
    assert data.summary()["samples"] == 4 * 2 + 4 * 1 + 2

    dataset.write_text(
        text.replace("num_repeats = 2\n", "num_repeats = [2, 1, 1]\nresolution = [[64, 48], [32, 32]]\n", 1)
    )
    with pytest.raises(ConfigError, match=r"datasets\[0\].num_repeats': 3 values for 2 resolution"):
        load_datasets(dataset)
    dataset.write_text(text.replace("num_repeats = 2\n", "resolution = [60, 48]\nenable_bucket = false\n", 1))
    with pytest.raises(
        ConfigError, match=r"key 'resolution' \[60, 48\] is not a multiple of the model's spatial step 16"
    ):
        tuner_cfg = cfg(config)
        from tuner.archs.wan.trainer import WanModel
        from tuner.cache.plan import plan_datasets

        plan_datasets(WanModel(tuner_cfg), tuner_cfg, log=lambda s: None)


# ---------------------------------------------------------------- regularization datasets


def test_regularization_dataset_is_mixed_in_at_its_ratio_with_its_loss_weight(tmp_path, wan_model):
    from tuner.cache.batches import WeightedBatch
    from tuner.fixtures.dataset import write_images

    config = make_project(tmp_path, wan_model, steps=9)
    write_images(config.parent / "data" / "prior", 3, (64, 48), seed=7)
    dataset = config.parent / "dataset.toml"
    dataset.write_text(
        dataset.read_text()
        + '\n[[datasets]]\nimage_directory = "data/prior"\nregularization = true\n'
        + "regularization_ratio = 0.5\nloss_weight = 0.0\n"
    )
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    assert tuner(["cache", "text", "--config", str(config)]) == 0
    trainer = train_wan(config, tmp_path / "out")
    data = open_training_data(trainer, trainer.cfg, log=lambda s: None)
    assert sum(len(v) for v in data.by_dataset[2].values()) == 5  # 0.5 × (4 images × 2 repeats + 2 clips)
    plan = data.plan_epoch(0)
    weighted = [i for i, batch in enumerate(plan) if isinstance(batch, WeightedBatch)]
    assert len(plan) == 9 and len(weighted) == 3
    assert [i for i, loss in enumerate(trainer.history) if loss == 0.0] == weighted  # loss_weight 0
    batch = next(b for i, b in enumerate(data.epoch(0)) if i == weighted[0])
    assert batch["extra"]["loss_weight"].tolist() == [0.0] * batch["latents"].shape[0]


def test_video_masks_from_an_image_or_a_video(tmp_path):
    from tuner.fixtures.dataset import write_videos

    write_videos(tmp_path / "clips", 1, (64, 48), frames=12, fps=16, seed=0)
    (tmp_path / "masks").mkdir()
    spec = make_spec(
        tmp_path / "clips", kind="video", target_frames=(9,), mask_directory=str(tmp_path / "masks")
    )
    Image.new("L", (64, 48), 255).save(tmp_path / "masks" / "video_000.png")
    job = plan_latent_jobs(spec, discover_items(spec)[0], step=16)[0][0]
    assert load_job_mask(job).shape == (1, 1, 48, 64)  # one image for every frame
    (tmp_path / "masks" / "video_000.png").unlink()
    shutil.copy(tmp_path / "clips" / "video_000.mp4", tmp_path / "masks" / "video_000.mp4")
    job = plan_latent_jobs(spec, discover_items(spec)[0], step=16)[0][0]
    assert load_job_mask(job).shape == (1, 9, 48, 64)  # the item's frames
    assert to_latent_grid(load_job_mask(job), (3, 6, 8), 0.0).shape == (1, 3, 6, 8)


def test_mask_and_caption_options_enter_the_cache_keys(tmp_path):
    from dataclasses import replace

    image(tmp_path / "imgs" / "a.png", caption="x, y, z")
    (tmp_path / "masks").mkdir()
    Image.new("L", (64, 48), 128).save(tmp_path / "masks" / "a.png")
    spec = make_spec(tmp_path / "imgs", mask_directory=str(tmp_path / "masks"))
    params = [
        plan_latent_jobs(s, discover_items(s)[0], step=16)[0][0].params()
        for s in (spec, replace(spec, mask_min_weight=0.1), replace(spec, mask_directory=None))
    ]
    assert len({json.dumps(p, sort_keys=True) for p in params}) == 3
    captions = {
        discover_items(s)[0][0].captions or (discover_items(s)[0][0].caption,)
        for s in (spec, replace(spec, caption_prefix="t, "), replace(spec, shuffle_tags=True),
                  replace(spec, shuffle_tags=True, keep_tokens=1))
    }  # fmt: skip
    assert len(captions) == 4  # text entries are keyed by these texts


def test_alpha_masks_and_caption_lines_through_cache_and_training(tmp_path, wan_model):
    config = make_project(tmp_path, wan_model, steps=2)
    for path in sorted((config.parent / "data" / "images").glob("*.png")):
        rgba = Image.open(path).convert("RGBA")
        alpha = Image.new("L", rgba.size, 0)
        alpha.paste(255, (0, 0, 32, 48))  # the left half is opaque
        rgba.putalpha(alpha)
        rgba.save(path)
        sidecar = path.with_suffix(".txt")
        sidecar.write_text(sidecar.read_text() + "\nanother caption\n")
    _dataset(config, "alpha_mask = true\ncaptions_per_line = true\nmask_min_weight = 0.1\n")
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    assert tuner(["cache", "text", "--config", str(config)]) == 0
    store = CacheStore(tmp_path / "cache", readonly=True)
    assert "another caption" in {store.meta(k)["caption"] for k in store.keys("text")}
    trainer = train_wan(config, tmp_path / "out")
    data = open_training_data(trainer, trainer.cfg, log=lambda s: None)
    entry = store.get(next(s.latent_key for s in data.samples if s.bucket_key.endswith("_m")))
    weights = entry["loss_mask"][0, 0]
    assert weights[:, 0].min() == 1 and weights[:, -1].max() == pytest.approx(0.1)
    assert len(trainer.history) == 2
