"""The dataset TOML: a `[general]` table of defaults plus one `[[datasets]]` table per source.

This is the shape users know from sd-scripts and musubi-tuner. Keys of `[general]` are the defaults
of every dataset; a dataset may override any of them. `resolve_datasets` merges the two into one
fully-specified `DatasetSpec` per dataset, with every check done at load time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tuner.config.fields import option, parse_section
from tuner.errors import ConfigError

FrameExtraction = Literal["head", "chunk", "slide", "uniform", "full"]
OnError = Literal["stop", "skip"]
AudioMode = Literal["require", "optional", "ignore"]


@dataclass(frozen=True)
class SharedOptions:
    """Options allowed both in [general] and in each [[datasets]] table (None = inherit)."""

    resolution: tuple[int, ...] | None = option(None, "Target [width, height]; buckets keep this area.")
    caption_extension: str | None = option(None, "Extension of caption sidecar files, e.g. '.txt'.")
    batch_size: int | None = option(None, "Items per batch for this dataset.", ge=1)
    num_repeats: int | None = option(None, "How many times each item is repeated per epoch.", ge=1)
    enable_bucket: bool | None = option(None, "Group items into aspect-ratio buckets of equal area.")
    bucket_no_upscale: bool | None = option(None, "Never pick a bucket larger than the source image.")
    caption_dropout_rate: float | None = option(
        None, "Probability of training on an empty caption.", ge=0, le=1
    )
    cache_directory: str | None = option(None, "Folder of the cache store for this dataset.", path=True)
    on_error: OnError | None = option(
        None, "What to do with an unreadable file: 'stop' or 'skip' (and report)."
    )
    target_frames: tuple[int, ...] | None = option(
        None, "Video: frame counts to extract (each 4N+1 for Wan)."
    )
    frame_extraction: FrameExtraction | None = option(
        None, "Video: how windows are taken: head, chunk, slide (frame_stride), uniform (frame_sample), full."
    )
    frame_stride: int | None = option(None, "Video, slide mode: frames between window starts.", ge=1)
    frame_sample: int | None = option(
        None, "Video, uniform mode: number of windows spread over the clip.", ge=1
    )
    max_frames: int | None = option(None, "Video, full mode: the most frames taken from a clip.", ge=1)
    source_fps: float | None = option(
        None, "Video: fps of the source clips; frames are dropped to the model fps.", gt=0
    )
    audio: AudioMode | None = option(
        None,
        "Video, audio-video models (ltx2): the sound of each clip's frames, resampled to the model's rate. "
        "'optional' trains clips without an audio track video-only, 'require' refuses them (by on_error), "
        "'ignore' trains pictures only.",
    )


GENERAL_DEFAULTS = {
    "resolution": (960, 544),
    "caption_extension": ".txt",
    "batch_size": 1,
    "num_repeats": 1,
    "enable_bucket": True,
    "bucket_no_upscale": False,
    "caption_dropout_rate": 0.0,
    "cache_directory": None,
    "on_error": "stop",
    "target_frames": (1,),
    "frame_extraction": "head",
    "frame_stride": 1,
    "frame_sample": 1,
    "max_frames": 129,
    "source_fps": None,
    "audio": "optional",
}


@dataclass(frozen=True)
class DatasetEntry(SharedOptions):
    """One [[datasets]] table: exactly one source plus overrides of [general]."""

    image_directory: str | None = option(None, "Folder of images with caption sidecar files.", path=True)
    image_jsonl_file: str | None = option(
        None, 'JSONL manifest: one {"image_path", "caption", "control_path"} object per line.', path=True
    )
    video_directory: str | None = option(None, "Folder of videos with caption sidecar files.", path=True)
    video_jsonl_file: str | None = option(
        None, 'JSONL manifest: one {"video_path", "caption"} object per line.', path=True
    )
    control_directory: str | None = option(
        None,
        "Folder of control/reference images paired with items by file stem (name, name_0, name_1...).",
        path=True,
    )
    validation: bool = option(
        False, "Hold this dataset out of training and report its loss (train.validate_every_n_steps)."
    )


@dataclass(frozen=True)
class DatasetFile:
    """The whole dataset TOML."""

    general: SharedOptions = option(factory=SharedOptions, doc="Defaults for every dataset.")
    datasets: tuple[DatasetEntry, ...] = option(factory=tuple, doc="One table per data source.")


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset with every option resolved; what the data layer works from."""

    index: int
    kind: Literal["image", "video"]
    source: str  # a directory or a JSONL file
    source_is_manifest: bool
    control_directory: str | None
    resolution: tuple[int, int]
    caption_extension: str
    batch_size: int
    num_repeats: int
    enable_bucket: bool
    bucket_no_upscale: bool
    caption_dropout_rate: float
    cache_directory: str
    on_error: OnError
    target_frames: tuple[int, ...]
    frame_extraction: FrameExtraction
    frame_stride: int
    frame_sample: int
    max_frames: int
    source_fps: float | None
    validation: bool = False
    audio: AudioMode = "optional"


SOURCE_KEYS = ("image_directory", "image_jsonl_file", "video_directory", "video_jsonl_file")


def resolve_datasets(
    file: DatasetFile, source: str, base_dir: Path, check_paths: bool = True
) -> list[DatasetSpec]:
    """Merge [general] into each dataset and check what only the combination can show."""
    if not file.datasets:
        raise ConfigError(
            f"{source}: no [[datasets]] table. Add one with image_directory or video_directory."
        )
    specs = []
    for i, entry in enumerate(file.datasets):
        key = f"datasets[{i}]"
        given = [k for k in SOURCE_KEYS if getattr(entry, k)]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ConfigError(
                f"{source}: key '{key}': a dataset needs exactly one of {', '.join(SOURCE_KEYS)} (found {what})."
            )
        src_key = given[0]
        merged = {}
        for f in dataclasses.fields(SharedOptions):
            value = getattr(entry, f.name)
            if value is None:
                value = getattr(file.general, f.name)
            if value is None:
                value = GENERAL_DEFAULTS[f.name]
            merged[f.name] = value
        if len(merged["resolution"]) != 2 or min(merged["resolution"]) < 16:
            raise ConfigError(
                f"{source}: key '{key}.resolution': expected [width, height] of at least 16 px, "
                f"got {list(merged['resolution'])}."
            )
        if any(n < 1 for n in merged["target_frames"]):
            raise ConfigError(f"{source}: key '{key}.target_frames': frame counts must be >= 1.")
        if merged["cache_directory"] is None:
            merged["cache_directory"] = str(base_dir / "cache")
        src = getattr(entry, src_key)
        if check_paths and not Path(src).exists():
            raise ConfigError(f"{source}: key '{key}.{src_key}': {src} does not exist. Fix the path.")
        specs.append(
            DatasetSpec(
                index=i,
                kind="image" if src_key.startswith("image") else "video",
                source=src,
                source_is_manifest=src_key.endswith("jsonl_file"),
                control_directory=entry.control_directory,
                validation=entry.validation,
                **{**merged, "resolution": tuple(merged["resolution"])},
            )
        )
    return specs


def parse_dataset_table(
    data: dict, source: str, base_dir: Path, check_paths: bool = True
) -> list[DatasetSpec]:
    file = parse_section(DatasetFile, data, source, "", base_dir)
    return resolve_datasets(file, source, base_dir, check_paths)
