"""A dataset folder as the UI shows it: items with captions, thumbnails, caption edits, buckets.

Items are found by the data layer's own `discover_items` (the folder read as an `image_directory` and,
when it holds videos, as a `video_directory`), so the grid lists exactly what training would take.
Which bucket each item lands in, and which items cannot be used, comes from `tuner data check`'s
`check_datasets` at the resolution and architecture the user picks. Captions are written atomically
(`tuner.io.write_text`: a temporary file renamed over the sidecar), so two browsers saving the same
caption at once leave one whole caption or the other, never a mix.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from PIL import Image

from tuner.config.dataset import DatasetSpec, parse_dataset_table
from tuner.data.check import check_datasets
from tuner.data.datasets import discover_items
from tuner.data.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, frame_files, read_image, read_video_frames
from tuner.errors import DataError
from tuner.io import write_text

CAPTION_EXTENSION = ".txt"
THUMBNAIL_SIZE = 256


@dataclass(frozen=True)
class FolderItem:
    path: str
    name: str
    kind: str  # "image" or "video"
    caption: str  # the sidecar's text as it is on disk ("" when there is none)
    has_caption: bool


def _kinds(folder: Path) -> list[str]:
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    kinds = []
    if any(p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS for p in entries):
        kinds.append("image")
    if any(
        (p.is_file() and p.suffix.lower() in VIDEO_EXTENSIONS) or (p.is_dir() and frame_files(p))
        for p in entries
    ):
        kinds.append("video")
    return kinds


def dataset_toml(folder: Path, resolution: tuple[int, int], frames: int = 1) -> dict:
    """The dataset TOML (as data) that trains on `folder`: one table per kind of media it holds."""
    tables = []
    for kind in _kinds(folder):
        table = {f"{kind}_directory": str(folder)}
        if kind == "video":
            table["target_frames"] = [frames]
        tables.append(table)
    general = {"resolution": list(resolution), "caption_extension": CAPTION_EXTENSION,
               "cache_directory": "cache"}  # fmt: skip
    return {"general": general, "datasets": tables}


def folder_specs(folder: Path, resolution: tuple[int, int], frames: int = 1) -> list[DatasetSpec]:
    data = dataset_toml(folder, resolution, frames)
    if not data["datasets"]:
        raise DataError(
            f"{folder}: no images ({', '.join(IMAGE_EXTENSIONS)}) or videos ({', '.join(VIDEO_EXTENSIONS)})."
        )
    data["general"]["on_error"] = "skip"
    return parse_dataset_table(data, str(folder), folder)


def list_items(folder: Path) -> tuple[list[FolderItem], list[str]]:
    """The folder's items as training finds them, with each caption as its sidecar holds it; and the
    problems discovery reports (missing captions)."""
    items, problems = [], []
    for spec in folder_specs(folder, (512, 512)):
        found, notes = discover_items(spec)
        problems += notes
        for item in found:
            sidecar = caption_path(Path(item.path))
            text = sidecar.read_text(encoding="utf-8") if sidecar.is_file() else ""
            items.append(FolderItem(item.path, Path(item.path).name, item.kind, text, sidecar.is_file()))
    return items, problems


def caption_path(media: Path) -> Path:
    stem = media.name if media.is_dir() else media.stem
    return media.parent / (stem + CAPTION_EXTENSION)


def save_caption(media: Path, text: str) -> Path:
    """Write `media`'s caption sidecar atomically; `media` must be an image or video the folder holds."""
    is_media = media.is_file() and media.suffix.lower() in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS
    if not (is_media or (media.is_dir() and frame_files(media))):
        raise DataError(f"{media}: not an image or video of a dataset; its caption cannot be written.")
    path = caption_path(media)
    write_text(path, text)
    return path


def thumbnail(media: Path) -> bytes:
    """A JPEG of at most THUMBNAIL_SIZE pixels a side: the image, or a video's first frame. `DataError`
    naming the file when it cannot be decoded."""
    stat = media.stat()
    return _thumbnail(str(media), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=2048)
def _thumbnail(path: str, mtime_ns: int, size: int) -> bytes:  # mtime and size: a changed file is new
    p = Path(path)
    if p.is_dir() or p.suffix.lower() in VIDEO_EXTENSIONS:
        img = Image.fromarray(read_video_frames(p, [0])[0])
    else:
        img = read_image(p)
    img.thumbnail((THUMBNAIL_SIZE, THUMBNAIL_SIZE))
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=85)
    return out.getvalue()


@dataclass(frozen=True)
class ItemCheck:
    buckets: tuple[str, ...]  # bucket keys of its jobs ("832x480x1"); empty when it is not used
    problem: str  # why it is left out: "undecodable", "too short", ...; "" when it is used


def check_folder(
    folder: Path, architecture: str, resolution: tuple[int, int], frames: int = 1
) -> tuple[dict[str, ItemCheck], list[str]]:
    """Per item path: the buckets it lands in or why it is dropped, as `tuner data check` plans them for
    `architecture` at `resolution`; and the report's lines."""
    from tuner.registry import ARCHITECTURES

    lines: list[str] = []
    reports = check_datasets(
        ARCHITECTURES[architecture], folder_specs(folder, resolution, frames), lines.append
    )
    result: dict[str, ItemCheck] = {}
    for report in reports:
        if report.error:
            continue
        buckets: dict[str, list[str]] = {}
        for job in report.jobs:
            buckets.setdefault(job.source, []).append(job.bucket_key)
        for source, keys in buckets.items():
            result[source] = ItemCheck(tuple(dict.fromkeys(keys)), "")
        for reason, paths in report.dropped.items():
            for path in paths:
                result[path] = ItemCheck((), reason)
    return result, lines
