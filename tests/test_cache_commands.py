"""`tuner cache latents|text|info` on the tiny Wan fixture: incremental, invalidating, resumable."""

import re
from pathlib import Path

import pytest

from project import make_project, run, summary
from tuner.cache.store import CacheStore


@pytest.fixture
def project(tmp_path, wan_model) -> Path:
    return make_project(tmp_path, wan_model)


def test_second_run_encodes_nothing_and_one_caption_edit_encodes_one(project, capsys):
    code, out = run(capsys, "cache", "latents", "--config", project)
    assert code == 0 and summary(out) == (6, 0, 0)  # 4 images + 2 video windows
    code, out = run(capsys, "cache", "text", "--config", project)
    assert code == 0
    encoded, reused, _ = summary(out)
    assert encoded >= 2 and reused == 0
    texts = encoded

    assert summary(run(capsys, "cache", "latents", "--config", project)[1]) == (0, 6, 0)
    assert summary(run(capsys, "cache", "text", "--config", project)[1]) == (0, texts, 0)

    caption = project.parent / "data" / "images" / "image_000.txt"
    caption.write_text("a completely new caption")
    assert summary(run(capsys, "cache", "text", "--config", project)[1])[0] == 1
    assert summary(run(capsys, "cache", "latents", "--config", project)[1]) == (0, 6, 0)


def test_resolution_change_reencodes_latents_and_prune_removes_old(project, capsys):
    run(capsys, "cache", "latents", "--config", project)
    dataset = project.parent / "dataset.toml"
    dataset.write_text(dataset.read_text().replace("resolution = [64, 48]", "resolution = [48, 32]"))
    code, out = run(capsys, "cache", "latents", "--config", project, "--prune")
    assert code == 0 and summary(out) == (6, 0, 6)
    store = CacheStore(project.parent / "cache", readonly=True)
    assert len(store.keys("latent")) == 6
    assert all(store.meta(k)["bucket"].startswith("48x32") for k in store.keys("latent"))


def test_changed_source_file_is_reencoded(project, capsys):
    run(capsys, "cache", "latents", "--config", project)
    from PIL import Image

    img = project.parent / "data" / "images" / "image_001.png"
    Image.new("RGB", (64, 48), (1, 2, 3)).save(img)
    assert summary(run(capsys, "cache", "latents", "--config", project)[1]) == (1, 5, 0)


def test_interrupted_caching_resumes(project, capsys, monkeypatch):
    from tuner.archs.wan.trainer import WanModel

    real = WanModel.encode_pixels
    calls = {"n": 0}

    def crash_after_three(self, vae, pixels):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt("killed")
        return real(self, vae, pixels)

    monkeypatch.setattr(WanModel, "encode_pixels", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        run(capsys, "cache", "latents", "--config", project, "--batch-size", "1")
    monkeypatch.setattr(WanModel, "encode_pixels", real)
    encoded, reused, _ = summary(run(capsys, "cache", "latents", "--config", project)[1])
    assert encoded + reused == 6 and encoded < 6 and reused <= 3
    assert summary(run(capsys, "cache", "latents", "--config", project)[1]) == (0, 6, 0)


def test_another_vae_invalidates_latents(project, capsys, tmp_path):
    from tuner.fixtures import write_fixture

    run(capsys, "cache", "latents", "--config", project)
    other = write_fixture("wan", tmp_path / "other", seed=1)
    code, out = run(
        capsys, "cache", "latents", "--config", project, "--set", f"model.vae='{other['diffusers']}'"
    )
    assert code == 0 and summary(out)[0] == 6


def test_training_stops_on_stale_cache_naming_the_command(project, capsys):
    code, out = run(capsys, "train", "--config", project)
    assert code == 2 and "Run: tuner cache latents --config" in out
    run(capsys, "cache", "latents", "--config", project)
    code, out = run(capsys, "train", "--config", project)
    assert code == 2 and "Run: tuner cache text --config" in out


def test_cache_info_lists_kinds_and_buckets(project, capsys):
    run(capsys, "cache", "latents", "--config", project)
    run(capsys, "cache", "text", "--config", project)
    code, out = run(capsys, "cache", "info", project.parent / "cache")
    assert code == 0
    assert "latent" in out and "text" in out and "64x48x9" in out and "64x48x1" in out


def test_corrupt_image_is_named_or_skipped(project, capsys):
    bad = project.parent / "data" / "images" / "image_002.png"
    bad.write_bytes(b"not a png")
    code, out = run(capsys, "cache", "latents", "--config", project)
    assert code == 2 and "image_002.png" in out
    dataset = project.parent / "dataset.toml"
    dataset.write_text(dataset.read_text().replace("[general]\n", '[general]\non_error = "skip"\n'))
    code, out = run(capsys, "cache", "latents", "--config", project)
    assert code == 0 and "image_002.png" in out and summary(out) == (5, 0, 0)


def test_edit_text_entries_follow_their_control_images(tmp_path, capsys):
    """Qwen-Image-Edit's text encoder sees the control images: editing one re-encodes that item's text."""
    from tuner.fixtures import write_fixture

    write_fixture("qwen_image_edit", tmp_path / "model")
    config = make_project(tmp_path / "p", tmp_path / "model", architecture="qwen_image_edit")
    encoded, _, _ = summary(run(capsys, "cache", "text", "--config", config)[1])
    assert encoded == 8  # 4 items × (caption, empty caption), each with its own control image
    from PIL import Image

    Image.new("RGB", (64, 48), (9, 9, 9)).save(config.parent / "data" / "controls" / "image_002.png")
    assert summary(run(capsys, "cache", "text", "--config", config)[1]) == (2, 6, 0)
    code, out = run(capsys, "cache", "latents", "--config", config, "--set", "model.architecture=qwen_image")
    assert code == 2 and "takes no control images" in out


def test_a_new_transformer_in_the_pipeline_folder_keeps_the_latents(tmp_path, wan_model, capsys):
    """The VAE's identity is its own component folder, not the whole pipeline root it was given."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(wan_model, model)
    project = make_project(tmp_path / "p", model)
    run(capsys, "cache", "latents", "--config", project)
    weights = next((model / "diffusers" / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)  # a different transformer, same VAE
    assert summary(run(capsys, "cache", "latents", "--config", project)[1]) == (0, 6, 0)
    vae = next((model / "diffusers" / "vae").glob("*.safetensors"))
    vae.write_bytes(vae.read_bytes()[:-8] + b"\x00" * 8)  # a different VAE
    assert summary(run(capsys, "cache", "latents", "--config", project)[1])[0] == 6


def test_file_that_fails_to_decode_while_caching_is_skipped_and_left_out(project, capsys, monkeypatch):
    """A video whose frames break mid-stream passes probing but fails at encode time."""
    from tuner.cache import commands
    from tuner.errors import DataError

    real = commands.load_job_pixels

    def broken_video(job):
        if job.source.endswith("video_001.mp4"):
            raise DataError(f"{job.source}: corrupt frame 7")
        return real(job)

    monkeypatch.setattr(commands, "load_job_pixels", broken_video)
    code, out = run(capsys, "cache", "latents", "--config", project)
    assert code == 2 and "video_001.mp4: corrupt frame 7" in out

    dataset = project.parent / "dataset.toml"
    dataset.write_text(dataset.read_text().replace("[general]\n", '[general]\non_error = "skip"\n'))
    code, out = run(capsys, "cache", "latents", "--config", project)
    assert (
        code == 0 and "skipped: " in out and re.search(r"encoded \d+, reused \d+, pruned 0, skipped 1", out)
    )
    assert summary(run(capsys, "cache", "latents", "--config", project)[1]) == (0, 6, 0)  # remembered
    code, out = run(capsys, "cache", "info", project.parent / "cache")
    assert "1 source(s) failed to decode" in out and "video_001.mp4: " in out and "corrupt frame 7" in out
    run(capsys, "cache", "text", "--config", project)
    from project import cfg
    from tuner.archs.wan.trainer import WanModel
    from tuner.cache.plan import open_training_data

    notes = []
    data = open_training_data(WanModel(cfg(project)), cfg(project), notes.append)
    assert len(data.samples) == 5 and any("left out" in n and "video_001.mp4" in n for n in notes)


@pytest.mark.parametrize("precision", ["fp8", "nf4"])
def test_text_encoder_in_lower_precision_is_another_encoder(project, capsys, precision):
    """cache.text_encoder_dtype quantizes the encoder; its entries never mix with the bf16 ones."""
    encoded, _, _ = summary(run(capsys, "cache", "text", "--config", project)[1])
    override = ("--set", f"cache.text_encoder_dtype={precision}")
    code, out = run(capsys, "cache", "text", "--config", project, *override)
    assert code == 0 and summary(out) == (encoded, 0, 0)
    from project import cfg
    from tuner.cache.store import CacheStore

    store = CacheStore(project.parent / "cache", readonly=True)
    encoders = {store.meta(k)["encoder"].split("/")[1] for k in store.keys("text")}
    assert encoders == {"bf16", precision}
    assert cfg(project, f"cache.text_encoder_dtype={precision}").cache.text_encoder_dtype == precision


def test_items_sharing_a_caption_share_one_text_entry(project, capsys):
    for i in range(4):
        (project.parent / "data" / "images" / f"image_{i:03d}.txt").write_text("the same caption")
    videos = {(project.parent / "data" / "videos" / f"video_{i:03d}.txt").read_text() for i in range(2)}
    # one entry for the shared caption, one per distinct video caption, one for the empty caption
    assert summary(run(capsys, "cache", "text", "--config", project)[1]) == (1 + len(videos) + 1, 0, 0)


def test_planning_again_probes_and_hashes_only_changed_files(project, capsys, monkeypatch):
    """Probes and source hashes are remembered in the index by (path, size, mtime, inode), and
    looked up a few hundred paths per query."""
    import os
    import time

    from tuner.cache import plan as plan_module
    from tuner.cache import store as store_module

    data = project.parent / "data"
    past = time.time() - 60  # files younger than 2 s are not remembered (they may change again unseen)
    for f in data.rglob("*.*"):
        os.utime(f, (past, past))
    run(capsys, "cache", "latents", "--config", project)

    probed, hashed, queries = [], [], []
    real_probe, real_hash = plan_module.probe_media, store_module.hash_file
    monkeypatch.setattr(plan_module, "probe_media", lambda p, video: probed.append(p) or real_probe(p, video))
    monkeypatch.setattr(store_module, "hash_file", lambda p: hashed.append(p) or real_hash(p))
    real_connect = store_module.connect

    def traced(root, readonly):
        conn = real_connect(root, readonly)
        conn.set_trace_callback(queries.append)
        return conn

    monkeypatch.setattr(store_module, "connect", traced)
    assert summary(run(capsys, "cache", "latents", "--config", project)[1]) == (0, 6, 0)
    assert probed == [] and hashed == []
    lookups = [q for q in queries if "FROM file_hashes" in q or "FROM probes" in q]
    assert len(lookups) <= 4, lookups  # one per table per dataset, not one per file

    os.utime(data / "images" / "image_001.png", (past + 1, past + 1))
    run(capsys, "cache", "latents", "--config", project)
    assert [os.path.basename(p) for p in probed] == ["image_001.png"] and len(hashed) == 1
