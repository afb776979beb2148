"""The audio modality in the data layer and the cache: a video's sound, windowed to the frames a clip
takes, decoded with PyAV, keyed and cached beside the clip's latents (`tuner.data.audio`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from project import make_project, run, summary
from tuner.archs.parts.audio import SoundStream
from tuner.archs.wan.trainer import WanModel
from tuner.cache.store import CacheStore
from tuner.data.audio import audio_window, has_audio, log_mel, plan_audio, read_audio, read_audio_window
from tuner.errors import DataError
from tuner.fixtures.dataset import TONE_RATE, write_videos


@pytest.fixture
def videos(tmp_path):
    """Two 24-frame 24 fps clips with a tone (220 Hz, 440 Hz) and one without."""
    sound = write_videos(tmp_path / "sound", 2, (64, 48), 24, 24, 0, tone=True)
    silent = write_videos(tmp_path / "silent", 1, (64, 48), 24, 24, 0)
    return sound, silent[0]


def test_tone_leaves_the_pictures_and_other_fixtures_alone(tmp_path, videos):
    from tuner.data.media import read_video_frames

    sound, silent = videos
    again = write_videos(tmp_path / "again", 1, (64, 48), 24, 24, 0)[0]
    assert again.read_bytes() == silent.read_bytes()  # without a tone: the same bytes as before
    assert (read_video_frames(sound[0], range(24)) == read_video_frames(silent, range(24))).all()
    assert has_audio(sound[0]) and not has_audio(silent)


def test_window_is_the_sound_of_exactly_the_frames_taken(videos):
    sound, _ = videos
    whole = read_audio(sound[0], TONE_RATE, 2)
    assert whole.shape[1] >= TONE_RATE  # one second of tone
    window = audio_window(tuple(range(6, 15)), 24.0, TONE_RATE, 2)  # frames 6..14: 0.25 s to 0.625 s
    clip = read_audio_window(sound[0], window)
    assert clip.shape == (2, 6000)
    assert torch.equal(clip, whole[:, 4000:10000])
    # it is the 220 Hz tone: its spectrum peaks there
    peak = torch.fft.rfft(clip[0]).abs().argmax().item() * TONE_RATE / clip.shape[1]
    assert abs(peak - 220) < 5
    mel = log_mel(clip, TONE_RATE, 1024, 160, 64)
    assert mel.shape == (2, 6000 // 160 + 1, 64) and torch.isfinite(mel).all()


def test_audio_shorter_than_the_clip_is_refused_naming_the_file(videos):
    sound, _ = videos
    window = audio_window(tuple(range(20, 49)), 24.0, TONE_RATE, 2)  # runs to 2.04 s; the tone lasts 1 s
    with pytest.raises(DataError, match=r"video_000\.mp4: its audio track lasts .* shorter than the clip"):
        read_audio_window(sound[0], window)


def test_items_without_sound_follow_the_audio_option(videos):
    _, silent = videos
    assert plan_audio(str(silent), "optional", (0, 1, 2), 24.0, (TONE_RATE, 2)) is None
    assert plan_audio(str(silent), "ignore", (0, 1, 2), 24.0, (TONE_RATE, 2)) is None
    with pytest.raises(DataError, match=r"video_000\.mp4: no audio track.*audio = \"require\""):
        plan_audio(str(silent), "require", (0, 1, 2), 24.0, (TONE_RATE, 2))


def test_a_broken_audio_stream_is_a_data_error(tmp_path, videos):
    sound, _ = videos
    data = bytearray(sound[0].read_bytes())
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(bytes(data[: len(data) // 3]))  # cut inside the media data
    with pytest.raises(DataError, match=r"broken\.mp4"):
        read_audio_window(broken, audio_window(tuple(range(24)), 24.0, TONE_RATE, 2))


class _SoundModel(WanModel):
    """Wan with a sound stream: the clip's log-mel stands in for an audio VAE's latents."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.record = replace(self.record, audio_format=(TONE_RATE, 2))

    def sound_stream(self):
        return _LogMelSound(self)


class _LogMelSound(SoundStream):
    def encode(self, encoder, waveform):
        return {"audio_latents": log_mel(waveform.float(), TONE_RATE, 1024, 160, 64)}


@pytest.fixture
def sound_project(tmp_path, wan_model, monkeypatch):
    from tuner.archs.record import Architecture
    from tuner.fixtures.dataset import write_demo_dataset

    monkeypatch.setattr(Architecture, "family_model", lambda record, cfg: _SoundModel(cfg))
    config = make_project(tmp_path, wan_model)
    write_demo_dataset(config.parent / "data", videos=2, tone=True)  # the same pictures, now with sound
    return config


def _entries(config):
    store = CacheStore(config.parent / "cache", readonly=True)
    return store, {store.meta(k)["source"]: k for k in store.keys("latent")}


def test_audio_and_video_round_trip_the_cache_and_one_new_track_re_encodes_one_entry(sound_project, capsys):
    from project import cfg
    from tuner.cache.plan import plan_datasets

    code, out = run(capsys, "cache", "latents", "--config", sound_project)
    assert code == 0 and summary(out) == (6, 0, 0), out
    store, by_source = _entries(sound_project)
    trainer = _SoundModel(cfg(sound_project))
    jobs = {
        j.source: j for plan in plan_datasets(trainer, cfg(sound_project), lambda s: None) for j in plan.jobs
    }
    videos = sorted(s for s in by_source if s.endswith(".mp4"))
    assert len(videos) == 2
    for source in videos:
        job = jobs[source]
        assert job.audio is not None and job.audio.params()["sample_rate"] == TONE_RATE
        expected = trainer.sound_stream().encode(None, read_audio_window(source, job.audio))["audio_latents"]
        assert torch.equal(store.get(by_source[source])["audio_latents"], expected)  # bit-exact
    images = [s for s in by_source if s.endswith(".png")]
    assert all("audio_latents" not in store.get(by_source[s]) for s in images)

    # another sound in one file (same pictures): that entry alone is encoded again
    from pathlib import Path

    target = Path(videos[0])
    replacement = write_videos(target.parent / "other", 2, (64, 48), 24, 24, 0, tone=True)[1]  # 440 Hz
    other_pictures = write_videos(target.parent / "plain", 1, (64, 48), 24, 24, 0)[0]
    assert replacement.stat().st_size and other_pictures.stat().st_size
    _swap_sound(target, replacement)
    for extra in ("other", "plain"):
        import shutil

        shutil.rmtree(target.parent / extra)
    code, out = run(capsys, "cache", "latents", "--config", sound_project)
    assert code == 0 and summary(out) == (1, 5, 0), out
    store = CacheStore(sound_project.parent / "cache", readonly=True)
    (added,) = set(store.keys("latent")) - set(by_source.values())
    assert store.meta(added)["source"] == videos[0]
    old, new = store.get(by_source[videos[0]]), store.get(added)
    # the same pictures (encoded alone now, in a batch of two before: equal up to the VAE's rounding)
    torch.testing.assert_close(old["latents"], new["latents"], rtol=0, atol=1e-5)
    assert not torch.equal(old["audio_latents"], new["audio_latents"])


def test_sound_shorter_than_the_clip_is_skipped_and_named_in_cache_info(sound_project, capsys):
    data = sound_project.parent / "data" / "videos"
    short = write_videos(data / "short", 1, (64, 48), 12, 24, 0, tone=True)[0]  # half a second of tone
    _swap_sound(data / "video_001.mp4", short)
    code, out = run(capsys, "cache", "latents", "--config", sound_project)
    assert code == 2 and "video_001.mp4: its audio track lasts 0.5" in out
    dataset = sound_project.parent / "dataset.toml"
    dataset.write_text(dataset.read_text().replace("[general]\n", '[general]\non_error = "skip"\n'))
    code, out = run(capsys, "cache", "latents", "--config", sound_project)
    assert code == 0 and "skipped 1" in out
    code, out = run(capsys, "cache", "info", sound_project.parent / "cache")
    assert "1 source(s) failed to decode" in out and "video_001.mp4: its audio track lasts" in out


def _swap_sound(video, donor) -> None:
    """Rewrite `video` with its own pictures and `donor`'s audio packets (no re-encoding)."""
    import av

    tmp = video.with_suffix(".tmp.mp4")
    with av.open(str(video)) as pictures, av.open(str(donor)) as sound, av.open(str(tmp), "w") as out:
        v_in, a_in = pictures.streams.video[0], sound.streams.audio[0]
        v_out = out.add_stream_from_template(v_in)
        a_out = out.add_stream_from_template(a_in)
        for packet in pictures.demux(v_in):
            if packet.dts is not None:
                packet.stream = v_out
                out.mux(packet)
        for packet in sound.demux(a_in):
            if packet.dts is not None:
                packet.stream = a_out
                out.mux(packet)
    tmp.replace(video)


def test_clips_with_and_without_sound_never_share_a_batch(videos):
    from tuner.data.buckets import plan_crop
    from tuner.data.jobs import LatentJob

    sound, silent = videos
    window = audio_window(tuple(range(9)), 24.0, TONE_RATE, 2)
    base = dict(kind="video", bucket=(64, 48, 9), frame_indices=tuple(range(9)), crop=plan_crop(64, 48, (64, 48)), control_paths=(),
                control_crops=(), caption="", dataset_index=0)  # fmt: skip
    with_sound = LatentJob(source=str(sound[0]), audio=window, **base)
    without = LatentJob(source=str(silent), **base)
    assert without.bucket_key == "64x48x9" and with_sound.bucket_key == "64x48x9_a6000"
    assert "audio" not in without.params() and with_sound.params()["audio"]["duration"] == 0.375


@pytest.mark.parametrize("mode", ["require", "optional", "ignore"])
def test_planning_follows_the_datasets_audio_option(tmp_path, mode):
    from tuner.config.dataset import parse_dataset_table
    from tuner.data.datasets import discover_items
    from tuner.data.frames import FrameRule
    from tuner.data.jobs import plan_latent_jobs

    folder = tmp_path / "clips"
    write_videos(folder, 1, (64, 48), 24, 24, 0, tone=True)
    (silent,) = write_videos(tmp_path / "other", 1, (64, 48), 24, 24, 0)
    silent.rename(folder / "silent.mp4")
    table = {"general": {"resolution": [64, 48], "target_frames": [9], "audio": mode, "on_error": "skip"},
             "datasets": [{"video_directory": str(folder)}]}  # fmt: skip
    (spec,) = parse_dataset_table(table, "dataset.toml", tmp_path)
    items, _ = discover_items(spec)
    jobs, problems = plan_latent_jobs(spec, items, 32, FrameRule(8, 1), 24.0, audio_format=(TONE_RATE, 2))
    sounds = {job.source.rsplit("/", 1)[1]: job.audio for job in jobs}
    if mode == "require":
        assert list(sounds) == ["video_000.mp4"] and any("silent.mp4: no audio track" in p for p in problems)
    elif mode == "optional":
        assert sounds["silent.mp4"] is None and sounds["video_000.mp4"].samples == 6000
    else:
        assert set(sounds.values()) == {None}
