"""Caching jobs: what the VAE and text encoder will encode, and the params that identify each result.

Caching walks the datasets once. `plan_latent_jobs` probes every file (size, frame count, frame rate,
read from headers: files that are not images or videos surface here; one damaged past its header
fails when it is encoded), chooses its bucket and, for videos, its frame windows. The probe is a
parameter so that the cache can remember its answers (`tuner.cache.plan`). Each `LatentJob` is one tensor the VAE will encode:

    job.input_paths   files whose *contents* the result depends on (source, then controls)
    job.params()      every setting that changes the encoded pixels: bucket, frame indices, resize and
                      crop, resize method, pixel pipeline version
    job.bucket_key    "832x480x33": jobs with equal keys stack into one batch

so a content-addressed store can key on hash(contents of input_paths) + params(). `num_repeats` is not
part of a job: repeating an item reuses the same latent; training applies it when it reads the cache.

`load_job_pixels(job)` then reads and crops the pixels exactly as planned: float [C, F, H, W] in [-1, 1].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image

from tuner.config.dataset import DatasetSpec, OnError
from tuner.data.audio import AudioWindow, plan_audio, read_audio_window
from tuner.data.buckets import (
    RESIZE_METHOD,
    Crop,
    apply_crop,
    choose_bucket,
    dataset_buckets,
    plan_crop,
    upscale_note,
)
from tuner.data.frames import ANY_COUNT, largest_valid, video_windows
from tuner.data.items import Item, describe
from tuner.data.media import (
    VIDEO_EXTENSIONS,
    VideoInfo,
    probe_media,
    read_image,
    read_video_frames,
    to_tensor,
)
from tuner.errors import ConfigError, DataError

# Bump when the way pixels are produced changes (EXIF handling, alpha compositing, crop rounding...):
# it is part of params(), so old cache entries stop matching instead of being silently reused.
PIXEL_PIPELINE_VERSION = 1
MASK_PIPELINE_VERSION = 1  # likewise for loss masks (`tuner.data.masks`: resize, latent-grid reduction)


Probe = Callable[[str, bool], VideoInfo]
"""(path, is a video) -> VideoInfo; `probe_media` or a memoized version of it."""


def _is_video_file(path: str) -> bool:
    return Path(path).suffix.lower() in VIDEO_EXTENSIONS or Path(path).is_dir()


@dataclass(frozen=True)
class LatentJob:
    """One VAE encode: a source (image, or a window of video frames) resized and cropped to a bucket."""

    source: str
    kind: Literal["image", "video"]
    bucket: tuple[int, int, int]  # (width, height, frames); frames is 1 for images
    frame_indices: tuple[int, ...]  # source frame indices; empty for images
    crop: Crop
    control_paths: tuple[str, ...]
    control_crops: tuple[Crop, ...]  # one per control, each to the same bucket as the source
    caption: str  # not in params(): the latent does not depend on it; training pairs the two
    dataset_index: int
    audio: AudioWindow | None = None  # the sound the clip takes (audio-video models); None: pictures only
    captions: tuple[str, ...] = ()  # caption variants (`tuner.data.captions`); empty: just `caption`
    mask: str | None = None  # loss mask: a mask file, `masks.ALPHA` (the source's alpha), or None
    mask_min_weight: float = 0.0

    @property
    def mask_file(self) -> tuple[str, ...]:
        return (self.mask,) if self.mask and self.mask != "alpha" else ()

    @property
    def bucket_key(self) -> str:
        w, h, f = self.bucket
        # the control count is part of the key: a batch must have the same number of control latents
        key = f"{w}x{h}x{f}" + (f"_c{len(self.control_paths)}" if self.control_paths else "")
        key += "_m" if self.mask else ""  # masked items batch together: their loss_mask stacks
        # so does the sound: clips with and without it, or of other lengths, do not stack
        return key + (f"_a{self.audio.samples}" if self.audio else "")

    @property
    def input_paths(self) -> tuple[str, ...]:
        return (self.source, *self.control_paths, *self.mask_file)

    def params(self) -> dict:
        """Everything besides input file contents that changes the encoded result (JSON-friendly)."""
        return {
            "kind": self.kind,
            "bucket": list(self.bucket),
            "frame_indices": list(self.frame_indices),
            "resize": list(self.crop.resized),
            "crop": list(self.crop.box),
            "resize_method": RESIZE_METHOD,
            "controls": [{"resize": list(c.resized), "crop": list(c.box)} for c in self.control_crops],
            "pixel_pipeline": PIXEL_PIPELINE_VERSION,
            **({"audio": self.audio.params()} if self.audio else {}),
        } | (self._mask_params() if self.mask else {})  # unmasked jobs keep the keys they always had

    def _mask_params(self) -> dict:
        return {"mask": {"source": "alpha" if self.mask == "alpha" else "file", "min_weight": self.mask_min_weight,
                         "version": MASK_PIPELINE_VERSION}}  # fmt: skip


# ---------------------------------------------------------------- planning


def _check_targets(spec: DatasetSpec, valid_frames: Callable[[int], bool]) -> None:
    if spec.kind != "video" or spec.frame_extraction == "full":
        return
    for t in spec.target_frames:
        if not valid_frames(t):
            lower = largest_valid(t, valid_frames)
            upper = next(n for n in range(t + 1, t + 10_000) if valid_frames(n))
            raise ConfigError(
                f"{describe(spec)}: target_frames {t} is not a frame count this model accepts "
                f"({valid_frames}); use {lower or upper}" + (f" or {upper}." if lower else ".")
            )


def _probe_controls(
    item: Item, bucket: tuple[int, int], windows: list[tuple[int, ...]], probe: Probe
) -> tuple[Crop, ...]:
    crops = []
    for path in item.control_paths:
        video = _is_video_file(path)
        if video and item.kind == "image":
            raise DataError(f"{path}: a video cannot be the control of an image ({item.path}).")
        info = probe(path, video)
        if video:
            needed = max(max(w) for w in windows) + 1
            if info.n_frames < needed:
                raise DataError(f"{path}: control video has {info.n_frames} frames; its item needs {needed}.")
        crops.append(plan_crop(info.width, info.height, bucket))
    return tuple(crops)


def _probe_mask(
    spec: DatasetSpec, item: Item, size: tuple[int, int], windows: list[tuple[int, ...]], probe: Probe
) -> str | None:
    """The job's `mask`: the item's mask file (checked: the item's size, enough frames), "alpha", or None."""
    if spec.alpha_mask:
        return "alpha"
    if not item.mask_path:
        return None
    from tuner.data.masks import check_mask_size

    video = item.kind == "video" and _is_video_file(item.mask_path)
    info = probe(item.mask_path, video)
    check_mask_size(item.mask_path, (info.width, info.height), item.path, size)
    if video:
        needed = max(max(w) for w in windows) + 1 if windows and windows[0] else 1
        if info.n_frames < needed:
            raise DataError(
                f"{item.mask_path}: mask video has {info.n_frames} frames; its item needs {needed}."
            )
    return item.mask_path


def _jobs_for_item(
    spec: DatasetSpec,
    item: Item,
    buckets: list[tuple[int, int]],
    step: int,
    valid_frames: Callable[[int], bool],
    model_fps: float | None,
    problems: list[str],
    mismatched_fps: set[float],
    scales: list[float],
    probe: Probe,
    audio_format: tuple[int, int] | None,
) -> list[LatentJob]:
    no_upscale = spec.bucket_no_upscale and spec.enable_bucket  # one fixed size means no per-item sizes
    info = probe(item.path, item.kind != "image")
    w, h = info.width, info.height
    if item.kind == "image":
        windows: list[tuple[int, ...]] = [()]
    else:
        if spec.source_fps is None and model_fps and info.fps and abs(info.fps - model_fps) > 0.5:
            mismatched_fps.add(round(info.fps, 2))
        windows, short = video_windows(
            info.n_frames, spec.source_fps, model_fps, spec.target_frames, spec.frame_extraction,
            spec.frame_stride, spec.frame_sample, spec.max_frames, valid_frames,
        )  # fmt: skip
        if short:
            resampled = spec.source_fps and model_fps and model_fps < spec.source_fps
            at = f" at {model_fps:g} fps" if resampled else ""
            targets = ", ".join(map(str, short))
            outcome = "no clip of that length" if windows else "the video is not used"
            problems.append(
                f"{item.path}: {info.n_frames} frames, too short for target_frames {targets}{at}; {outcome}."
            )
    bucket = choose_bucket(w, h, buckets, no_upscale, step)
    crop = plan_crop(w, h, bucket)
    scales.append(max(bucket[0] / w, bucket[1] / h))
    control_crops = _probe_controls(item, bucket, windows, probe)
    mask = _probe_mask(spec, item, (w, h), windows, probe)
    fps = spec.source_fps or info.fps
    sounds = [
        plan_audio(item.path, spec.audio, win, fps, audio_format) if audio_format else None for win in windows
    ]
    return [
        LatentJob(
            source=item.path,
            kind=item.kind,
            bucket=(bucket[0], bucket[1], max(len(win), 1)),
            frame_indices=win,
            crop=crop,
            control_paths=item.control_paths,
            control_crops=control_crops,
            caption=item.caption,
            dataset_index=item.dataset_index,
            captions=item.captions,
            mask=mask,
            mask_min_weight=spec.mask_min_weight if mask else 0.0,
            audio=sound,
        )
        for win, sound in zip(windows, sounds)
    ]


def _resolution_note(spec: DatasetSpec, buckets: list[tuple[int, int]], step: int) -> str | None:
    """What a bucketed `resolution` whose sides are not multiples of the model's step becomes (its buckets
    are the sizes of at most its area with sides multiples of the step), with the nearest valid values."""
    if spec.resolution[0] % step == 0 and spec.resolution[1] % step == 0:
        return None
    w, h = max(buckets, key=lambda b: b[0] * b[1])
    area = spec.resolution[0] * spec.resolution[1]
    nearest = [max(step, round(r / step) * step) for r in spec.resolution]
    return (
        f"{describe(spec)}: key 'resolution' {list(spec.resolution)} is not a multiple of the model's spatial "
        f"step {step}; its buckets are the sizes of at most {area} pixels with sides multiples of {step}, the "
        f"largest {w}×{h} ({w * h / area:.0%} of the area). Use {nearest} to train at the size you mean."
    )


def plan_latent_jobs(
    spec: DatasetSpec,
    items: list[Item],
    step: int,
    valid_frames: Callable[[int], bool] = ANY_COUNT,
    model_fps: float | None = None,
    on_error: OnError | None = None,
    probe: Probe = probe_media,
    audio_format: tuple[int, int] | None = None,
) -> tuple[list[LatentJob], list[str]]:
    """Probe every item (with `probe`) and plan its latent jobs; return (jobs, problems).

    `step` is the model's spatial step (16 for Wan), `valid_frames` its frame-count rule (e.g.
    FrameRule(4, 1)), `model_fps` the rate videos are resampled to when the spec sets source_fps.
    A file that cannot be read raises DataError with on_error="stop" (default: the spec's), or is
    reported by name and left out with "skip". A target_frames the model cannot take is a ConfigError.
    `audio_format` = (sample rate, channels) of models that also learn sound: video jobs then carry
    the sound of their frames as the dataset's `audio` option says (`tuner.data.audio.plan_audio`).
    """
    on_error = on_error or spec.on_error
    _check_targets(spec, valid_frames)
    if not spec.enable_bucket and (spec.resolution[0] % step or spec.resolution[1] % step):
        fit = [max(step, r // step * step) for r in spec.resolution]
        raise ConfigError(
            f"{describe(spec)}: key 'resolution' {list(spec.resolution)} is not a multiple of the model's "
            f"spatial step {step} (with enable_bucket = false it is the size trained); use {fit}."
        )
    buckets = dataset_buckets(spec.resolution, step, spec.enable_bucket)
    jobs: list[LatentJob] = []
    problems: list[str] = [note] if (note := _resolution_note(spec, buckets, step)) else []
    mismatched_fps: set[float] = set()
    scales: list[float] = []  # per item: how much it is scaled to cover its bucket
    for item in items:
        try:
            jobs += _jobs_for_item(
                spec, item, buckets, step, valid_frames, model_fps, problems, mismatched_fps, scales, probe,
                audio_format,
            )  # fmt: skip
        except DataError as e:
            if on_error == "stop":
                raise
            problems.append(f"skipped: {e}")
    if mismatched_fps:
        rates = ", ".join(f"{fps:g}" for fps in sorted(mismatched_fps))
        problems.append(
            f"{describe(spec)}: clips are {rates} fps but the model runs at {model_fps:g} fps and source_fps "
            f"is not set, so frames are used as they are (motion plays at a different speed). "
            f"Set source_fps to drop frames to {model_fps:g} fps."
        )
    if note := upscale_note(scales):
        problems.append(f"{describe(spec)}: {note}")
    if items and not jobs:
        raise DataError(
            f"{describe(spec)}: none of its {len(items)} items could be used: " + " | ".join(problems[:3])
        )
    return jobs, problems


# ---------------------------------------------------------------- pixels


def _load(
    path: str, kind: str, indices: tuple[int, ...], crop: Crop, bucket: tuple[int, int]
) -> torch.Tensor:
    def check(
        w: int, h: int
    ) -> None:  # a file that changed size since planning would be cached under a wrong key
        if plan_crop(w, h, bucket) != crop:
            raise DataError(
                f"{path}: its size changed since caching was planned ({w}x{h}). Run caching again."
            )

    def crop_frame(frame: np.ndarray) -> np.ndarray:
        check(frame.shape[1], frame.shape[0])
        return apply_crop(Image.fromarray(frame), crop)

    if kind == "video" and _is_video_file(path):
        return to_tensor(read_video_frames(path, indices, transform=crop_frame))  # cropped while decoding
    img = read_image(path)
    check(*img.size)
    return to_tensor(apply_crop(img, crop))


def load_job_pixels(job: LatentJob) -> torch.Tensor:
    """The job's source pixels, resized and cropped as planned: float32 [3, F, H, W] in [-1, 1]."""
    return _load(job.source, job.kind, job.frame_indices, job.crop, job.bucket[:2])


def load_control_pixels(job: LatentJob) -> list[torch.Tensor]:
    """Each control, cropped to the job's bucket: [3, F, H, W] (the job's frames for a control video,
    F=1 for a control image)."""
    return [
        _load(path, job.kind, job.frame_indices, crop, job.bucket[:2])
        for path, crop in zip(job.control_paths, job.control_crops)
    ]


def load_job_audio(job: LatentJob) -> torch.Tensor | None:
    """The sound of the job's clip as planned: float32 [channels, samples], or None (pictures only)."""
    return None if job.audio is None else read_audio_window(job.source, job.audio)
