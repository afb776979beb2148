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

    resolution: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = option(
        None,
        "Target [width, height]; buckets keep this area. Several, [[512, 512], [1024, 1024]], train each "
        "item at each (its own cache entries and buckets).",
    )
    caption_extension: str | None = option(None, "Extension of caption sidecar files, e.g. '.txt'.")
    batch_size: int | tuple[int, ...] | None = option(
        None,
        "Items per batch for this dataset; with several resolutions, one for all or one per resolution.",
        ge=1,
    )
    num_repeats: int | tuple[int, ...] | None = option(
        None, "How many times each item is repeated per epoch (one, or one per resolution).", ge=1
    )
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
    alpha_mask: bool | None = option(
        None,
        "Use each image's alpha channel as its loss mask (opaque = weight 1, transparent = mask_min_weight).",
    )
    mask_min_weight: float | None = option(
        None, "Loss weight of fully masked-out (black / transparent) pixels; 0 leaves them out.", ge=0, le=1
    )
    captions_per_line: bool | None = option(
        None, "Each line of a caption sidecar is a caption of its own; one is drawn per epoch."
    )
    caption_prefix: str | None = option(None, "Text put before every caption (e.g. a trigger word and ', ').")
    caption_suffix: str | None = option(None, "Text put after every caption.")
    shuffle_tags: bool | None = option(
        None, "Shuffle a caption's comma-separated tags (after the first keep_tokens) in each variant."
    )
    keep_tokens: int | None = option(
        None, "Leading comma-separated tags that are never shuffled or dropped.", ge=0
    )
    tag_dropout_rate: float | None = option(
        None, "Probability of dropping each tag (after the first keep_tokens) in each variant.", ge=0, le=1
    )
    caption_variants: int | None = option(
        None,
        "Variants of each caption encoded when shuffle_tags or tag_dropout_rate is set; one is drawn per "
        "item per epoch.",
        ge=1,
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
    "alpha_mask": False,
    "mask_min_weight": 0.0,
    "captions_per_line": False,
    "caption_prefix": "",
    "caption_suffix": "",
    "shuffle_tags": False,
    "keep_tokens": 0,
    "tag_dropout_rate": 0.0,
    "caption_variants": 8,
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
        "Folder of control/reference images (for a video item of Wan VACE, a control video and its optional mask "
        "video) paired with items by "
        "file stem (name, name_0, name_1...).",
        path=True,
    )
    mask_directory: str | None = option(
        None,
        "Folder of loss-mask images paired with items by file stem (white = weight 1, black = "
        "mask_min_weight; grey in between); a video's mask is an image or a video of the same size.",
        path=True,
    )
    validation: bool = option(
        False, "Hold this dataset out of training and report its loss (train.validate_every_n_steps)."
    )
    regularization: bool = option(
        False,
        "A regularization (prior) dataset: instead of all its items, regularization_ratio × the training "
        "items per epoch are drawn from it, trained with loss_weight.",
    )
    regularization_ratio: float = option(
        1.0, "Regularization datasets: their items per epoch, as a share of the other datasets' items.", gt=0
    )
    loss_weight: float = option(
        1.0, "Factor on the loss of this dataset's batches (e.g. 0.5 for a prior).", ge=0
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
    mask_directory: str | None = None
    alpha_mask: bool = False
    mask_min_weight: float = 0.0
    captions_per_line: bool = False
    caption_prefix: str = ""
    caption_suffix: str = ""
    shuffle_tags: bool = False
    keep_tokens: int = 0
    tag_dropout_rate: float = 0.0
    caption_variants: int = 8
    regularization: bool = False
    regularization_ratio: float = 1.0
    loss_weight: float = 1.0
    part: int = 0  # which of the table's resolutions (`resolution = [[w, h], ...]`) this spec trains
    audio: AudioMode = "optional"

    @property
    def uid(self) -> int:
        """A number naming this spec among all (seeds and sample grouping use it): the table's index for
        its first resolution, so single-resolution datasets draw what they always did."""
        return self.index + 1_000_003 * self.part


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
        resolutions = _resolutions(merged["resolution"], source, key)
        per = {name: _per_resolution(merged[name], len(resolutions), source, f"{key}.{name}")
               for name in ("batch_size", "num_repeats")}  # fmt: skip
        if any(n < 1 for n in merged["target_frames"]):
            raise ConfigError(f"{source}: key '{key}.target_frames': frame counts must be >= 1.")
        if merged["alpha_mask"] and src_key.startswith("video"):
            raise ConfigError(
                f"{source}: key '{key}.alpha_mask': videos have no alpha channel; use mask_directory."
            )
        if merged["alpha_mask"] and entry.mask_directory:
            raise ConfigError(
                f"{source}: key '{key}.alpha_mask': set either alpha_mask or mask_directory, not both."
            )
        if check_paths and entry.mask_directory and not Path(entry.mask_directory).is_dir():
            raise ConfigError(
                f"{source}: key '{key}.mask_directory': {entry.mask_directory} is not a folder. Fix the path."
            )
        if entry.regularization and entry.validation:
            raise ConfigError(
                f"{source}: key '{key}.regularization': a dataset is either held out (validation) or a "
                "regularization set, not both."
            )
        if merged["cache_directory"] is None:
            merged["cache_directory"] = str(base_dir / "cache")
        src = getattr(entry, src_key)
        if check_paths and not Path(src).exists():
            raise ConfigError(f"{source}: key '{key}.{src_key}': {src} does not exist. Fix the path.")
        for part, resolution in enumerate(resolutions):
            specs.append(
                DatasetSpec(
                    index=i,
                    kind="image" if src_key.startswith("image") else "video",
                    source=src,
                    source_is_manifest=src_key.endswith("jsonl_file"),
                    control_directory=entry.control_directory,
                    mask_directory=entry.mask_directory,
                    validation=entry.validation,
                    regularization=entry.regularization,
                    regularization_ratio=entry.regularization_ratio,
                    loss_weight=entry.loss_weight,
                    part=part,
                    **{**merged, "resolution": resolution, **{k: v[part] for k, v in per.items()}},
                )
            )
    return specs


def _resolutions(value: tuple, source: str, key: str) -> list[tuple[int, int]]:
    """[w, h] or [[w, h], ...] as a list of (w, h), each checked."""
    listed = [tuple(r) for r in value] if value and isinstance(value[0], tuple) else [tuple(value)]
    for r in listed:
        if len(r) != 2 or min(r) < 16:
            raise ConfigError(
                f"{source}: key '{key}.resolution': expected [width, height] (or a list of them) of at least "
                f"16 px, got {list(r)}."
            )
    if len(set(listed)) != len(listed):
        raise ConfigError(f"{source}: key '{key}.resolution': a resolution is listed twice.")
    return listed


def _per_resolution(value: int | tuple, count: int, source: str, key: str) -> list[int]:
    values = list(value) if isinstance(value, tuple) else [value] * count
    if len(values) != count:
        raise ConfigError(
            f"{source}: key '{key}': {len(values)} values for {count} resolution(s); give one, or one per resolution."
        )
    if min(values) < 1:
        raise ConfigError(f"{source}: key '{key}': {min(values)} is out of range: it must be >= 1.")
    return values


def parse_dataset_table(
    data: dict, source: str, base_dir: Path, check_paths: bool = True
) -> list[DatasetSpec]:
    file = parse_section(DatasetFile, data, source, "", base_dir)
    return resolve_datasets(file, source, base_dir, check_paths)
