"""What a dataset yields before any decoding: `Item`s, and how files pair into one.

`tuner.data.datasets` finds the items of a source; `tuner.data.masks` and `tuner.data.captions` fill in
their loss masks and caption variants; all three pair files by `media_stem` (`cat.png`, `cat.txt`,
`cat_mask.png`; a frame folder `clip/` with `clip.txt`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tuner.config.dataset import DatasetSpec
from tuner.data.media import frame_files


@dataclass(frozen=True)
class Item:
    """One source file (or frame folder) of a dataset, before any decoding."""

    path: str
    caption: str
    kind: Literal["image", "video"]
    control_paths: tuple[str, ...] = ()
    dataset_index: int = 0
    mask_path: str | None = None  # loss mask paired from mask_directory (`tuner.data.masks`)
    captions: tuple[str, ...] = ()  # caption variants, one drawn per epoch (`tuner.data.captions`)


def describe(spec: DatasetSpec) -> str:
    """How messages name a dataset: its table and source."""
    at = f" at {spec.resolution[0]}x{spec.resolution[1]}" if spec.part else ""
    return f"datasets[{spec.index}]{at} ({spec.source})"


def is_frame_folder(path: Path) -> bool:
    """Whether `path` is a folder of frame images (a video, wherever one is accepted)."""
    return path.is_dir() and bool(frame_files(path))


def media_stem(path: Path) -> str:
    """The name files pair by: a file's stem, a frame folder's name."""
    return path.name if path.is_dir() else path.stem
