import json

import pytest
import torch
from PIL import Image

from tuner.config import load_datasets
from tuner.config.dataset import GENERAL_DEFAULTS, DatasetSpec
from tuner.data import (
    FrameRule,
    discover_items,
    load_control_pixels,
    load_job_pixels,
    plan_latent_jobs,
)
from tuner.errors import ConfigError, DataError
from tuner.fixtures.dataset import write_videos

WAN = FrameRule(4, 1)


def make_spec(source, kind="image", manifest=False, **overrides) -> DatasetSpec:
    fields = {**GENERAL_DEFAULTS, "cache_directory": "cache", "resolution": (64, 48), **overrides}
    fields.setdefault("control_directory", None)
    return DatasetSpec(index=0, kind=kind, source=str(source), source_is_manifest=manifest, **fields)


def image(path, size=(64, 48), color=(90, 120, 200), caption=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------- discovery


def test_directory_discovery_with_captions(tmp_path):
    image(tmp_path / "a.png", caption="a cat")
    image(tmp_path / "b.jpg", caption="a dog")
    image(tmp_path / "c.webp")  # no caption
    (tmp_path / "notes.md").write_text("not data")
    items, problems = discover_items(make_spec(tmp_path))
    assert [(p.split("/")[-1], i.caption, i.kind) for p, i in ((i.path, i) for i in items)] == [
        ("a.png", "a cat", "image"),
        ("b.jpg", "a dog", "image"),
        ("c.webp", "", "image"),
    ]
    assert len(problems) == 1 and "c.webp" in problems[0] and "c.txt" in problems[0]


def test_caption_extension_is_honoured(tmp_path):
    image(tmp_path / "a.png")
    (tmp_path / "a.caption").write_text("from the sidecar")
    items, problems = discover_items(make_spec(tmp_path, caption_extension=".caption"))
    assert items[0].caption == "from the sidecar" and problems == []


def test_dataset_toml_exposes_repeats(tmp_path):
    image(tmp_path / "imgs" / "a.png", caption="x")
    (tmp_path / "data.toml").write_text(
        '[general]\nresolution = [64, 48]\n[[datasets]]\nimage_directory = "imgs"\nnum_repeats = 3\n'
    )
    (spec,) = load_datasets(tmp_path / "data.toml")
    items, _ = discover_items(spec)
    assert spec.num_repeats == 3 and len(items) == 1  # repeats are applied when training reads the cache


def test_empty_dataset_names_source_and_what_was_looked_for(tmp_path):
    with pytest.raises(DataError, match=r"datasets\[0\].*no images found.*\.png.*folder is empty"):
        discover_items(make_spec(tmp_path))
    write_videos(tmp_path, 1, (64, 48), frames=3, fps=8, seed=0)
    with pytest.raises(DataError, match=r"video_000\.mp4.*use video_directory"):
        discover_items(make_spec(tmp_path))


def test_video_directory_with_frame_folder(tmp_path):
    write_videos(tmp_path, 1, (64, 48), frames=5, fps=8, seed=0)
    for i in range(5):
        image(tmp_path / "clip" / f"{i:04d}.png")
    (tmp_path / "clip.txt").write_text("frames")
    items, problems = discover_items(make_spec(tmp_path, kind="video"))
    assert [i.path.split("/")[-1] for i in items] == ["clip", "video_000.mp4"]
    assert items[0].caption == "frames" and problems == []


def write_manifest(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_jsonl_manifest(tmp_path):
    image(tmp_path / "img" / "a.png")
    image(tmp_path / "img" / "b.png")
    manifest = write_manifest(
        tmp_path / "train.jsonl",
        [
            {"image_path": "img/a.png", "caption": "first", "control_path": "ctl/a.png", "extra": 1},
            "",
            {
                "image_path": str(tmp_path / "img" / "b.png"),
                "control_path_1": "c1.png",
                "control_path_0": "c0.png",
            },
        ],
    )
    items, problems = discover_items(make_spec(manifest, manifest=True))
    assert items[0].path == str(tmp_path / "img" / "a.png") and items[0].caption == "first"
    assert items[0].control_paths == (str(tmp_path / "ctl" / "a.png"),)
    assert items[1].control_paths == (str(tmp_path / "c0.png"), str(tmp_path / "c1.png"))
    assert items[1].caption == "" and len(problems) == 1 and "train.jsonl:3" in problems[0]


@pytest.mark.parametrize(
    "bad,message",
    [
        ('{"image_path": "a.png", "caption": }', "not valid JSON"),
        ('["a.png"]', "one JSON object per line"),
        ('{"caption": "no path"}', 'missing "image_path"'),
        ('{"video_path": "v.mp4"}', "video_jsonl_file"),
        ('{"image_path": "a.png", "caption": 3}', '"caption" must be a string'),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, bad, message):
    manifest = write_manifest(tmp_path / "m.jsonl", [{"image_path": "a.png", "caption": "ok"}, bad])
    with pytest.raises(DataError, match=rf"m\.jsonl:2: .*{message}"):
        discover_items(make_spec(manifest, manifest=True))


def test_control_pairing_single_and_numbered(tmp_path):
    for stem in ("a", "b", "c", "b_1"):
        image(tmp_path / "data" / f"{stem}.png", caption=stem)
    ctl = tmp_path / "ctl"
    for stem in ("a", "b_0", "b_2", "b_10", "b_1", "c_0"):
        image(ctl / f"{stem}.png")
    items, problems = discover_items(make_spec(tmp_path / "data", control_directory=str(ctl)))
    controls = {i.path.split("/")[-1]: [p.split("/")[-1] for p in i.control_paths] for i in items}
    assert controls == {
        "a.png": ["a.png"],
        "b.png": ["b_0.png", "b_2.png", "b_10.png"],  # b_1.png is item b_1's own control
        "b_1.png": ["b_1.png"],
        "c.png": ["c_0.png"],
    }
    assert problems == []


def test_missing_control_stop_or_skip(tmp_path):
    image(tmp_path / "data" / "a.png", caption="a")
    image(tmp_path / "data" / "b.png", caption="b")
    image(tmp_path / "ctl" / "a.png")
    spec = make_spec(tmp_path / "data", control_directory=str(tmp_path / "ctl"))
    with pytest.raises(DataError, match=r"b\.png: no control image"):
        discover_items(spec)
    items, problems = discover_items(spec, on_error="skip")
    assert [i.path.split("/")[-1] for i in items] == ["a.png"]
    assert len(problems) == 1 and "b.png" in problems[0] and "skipped" in problems[0]


# ---------------------------------------------------------------- planning


def test_image_jobs_buckets_and_params(tmp_path):
    image(tmp_path / "wide.png", size=(200, 60), caption="wide")
    image(tmp_path / "tall.png", size=(48, 64), caption="tall")
    spec = make_spec(tmp_path)
    items, _ = discover_items(spec)
    jobs, problems = plan_latent_jobs(spec, items, step=16)
    assert problems == []
    by_name = {j.source.split("/")[-1]: j for j in jobs}
    assert by_name["wide.png"].bucket_key == "96x32x1"
    assert by_name["tall.png"].bucket_key == "48x64x1"
    params = by_name["wide.png"].params()
    assert params["bucket"] == [96, 32, 1] and params["frame_indices"] == []
    assert params["resize_method"] == "lanczos" and len(params["crop"]) == 4
    json.dumps(params)  # the store hashes it
    assert by_name["wide.png"].input_paths == (by_name["wide.png"].source,)


def test_no_upscale_and_fixed_bucket(tmp_path):
    image(tmp_path / "small.png", size=(40, 36), caption="s")
    items, _ = discover_items(make_spec(tmp_path))
    (job,) = plan_latent_jobs(make_spec(tmp_path, bucket_no_upscale=True), items, 16)[0]
    assert job.bucket[:2] == (32, 32)
    (job,) = plan_latent_jobs(make_spec(tmp_path, enable_bucket=False), items, 16)[0]
    assert job.bucket[:2] == (64, 48)


def test_on_error_skip_vs_stop(tmp_path):
    image(tmp_path / "good.png", caption="g")
    (tmp_path / "bad.png").write_bytes(b"garbage")
    (tmp_path / "bad.txt").write_text("b")
    items, _ = discover_items(make_spec(tmp_path))
    with pytest.raises(DataError, match="bad.png"):
        plan_latent_jobs(make_spec(tmp_path, on_error="stop"), items, 16)
    jobs, problems = plan_latent_jobs(make_spec(tmp_path, on_error="skip"), items, 16)
    assert [j.source.split("/")[-1] for j in jobs] == ["good.png"]
    assert len(problems) == 1 and "bad.png" in problems[0]
    with pytest.raises(DataError, match="bad.png"):  # the argument overrides the spec
        plan_latent_jobs(make_spec(tmp_path, on_error="skip"), items, 16, on_error="stop")


def test_video_jobs_resample_and_report_short_targets(tmp_path):
    write_videos(tmp_path, 1, (64, 48), frames=20, fps=30, seed=0)
    spec = make_spec(tmp_path, kind="video", target_frames=(5, 9, 17), source_fps=30.0)
    items, _ = discover_items(spec)
    jobs, problems = plan_latent_jobs(spec, items, 16, valid_frames=WAN, model_fps=16)
    assert [j.bucket_key for j in jobs] == ["64x48x5", "64x48x9"]
    assert jobs[0].frame_indices == (0, 2, 4, 6, 8)
    assert jobs[0].params() != jobs[1].params()
    assert len(problems) == 1 and "video_000.mp4" in problems[0] and "17" in problems[0]

    no_fps = make_spec(tmp_path, kind="video", target_frames=(17,))  # source_fps not set: frames kept as is
    jobs, problems = plan_latent_jobs(no_fps, items, 16, valid_frames=WAN, model_fps=16)
    assert jobs[0].frame_indices == tuple(range(17))
    assert len(problems) == 1 and "30 fps" in problems[0] and "source_fps" in problems[0]


def test_target_frames_the_model_cannot_take(tmp_path):
    write_videos(tmp_path, 1, (64, 48), frames=10, fps=16, seed=0)
    spec = make_spec(tmp_path, kind="video", target_frames=(8,))
    items, _ = discover_items(spec)
    with pytest.raises(ConfigError, match=r"target_frames 8 .*4N\+1.*use 5 or 9"):
        plan_latent_jobs(spec, items, 16, valid_frames=WAN)


def test_load_job_pixels_shape_and_range(tmp_path):
    write_videos(tmp_path / "v", 1, (64, 48), frames=12, fps=16, seed=0)
    image(tmp_path / "ctl" / "video_000.png", size=(80, 40))
    spec = make_spec(
        tmp_path / "v", kind="video", target_frames=(9,), control_directory=str(tmp_path / "ctl")
    )
    items, _ = discover_items(spec)
    (job,), _ = plan_latent_jobs(spec, items, 16, valid_frames=WAN, model_fps=16)
    pixels = load_job_pixels(job)
    assert pixels.shape == (3, 9, 48, 64) and pixels.dtype == torch.float32
    assert pixels.min() >= -1 and pixels.max() <= 1 and pixels.std() > 0.05
    (control,) = load_control_pixels(job)
    assert control.shape == (3, 1, 48, 64)
    assert job.bucket_key == "64x48x9_c1" and len(job.params()["controls"]) == 1

    image(tmp_path / "i" / "a.png", size=(200, 60), caption="x")
    ispec = make_spec(tmp_path / "i")
    (ijob,), _ = plan_latent_jobs(ispec, discover_items(ispec)[0], 16)
    assert load_job_pixels(ijob).shape == (3, 1, 32, 96)
    image(tmp_path / "i" / "a.png", size=(60, 200))  # the file changed after planning
    with pytest.raises(DataError, match="a.png: its size changed since"):
        load_job_pixels(ijob)
