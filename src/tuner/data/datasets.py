"""Finding a dataset's items: media files, their captions and their control images.

A dataset (`DatasetSpec`) has one source:

- a **directory**: every image (png, jpg, jpeg, webp, bmp) or video (mp4, mov, webm, mkv, avi, gif,
  or a sub-folder of frame images) directly inside it, each with a caption sidecar of the same stem
  (`cat.png` + `cat.txt`; a frame folder `clip/` + `clip.txt`);
- a **JSONL manifest**: one object per line, `{"image_path": ..., "caption": ...}` (or `video_path`),
  with optional `control_path` or `control_path_0`, `control_path_1`, ...; relative paths are taken
  from the manifest's folder. Other keys are ignored (manifests often carry extra metadata).

With `control_directory`, control images are paired by stem: `cat.png` for one control, or
`cat_0.png`, `cat_1.png`, ... for several (any number of digits, ordered by value). An exact stem wins
over numbered ones, and a numbered file that is itself an item's stem belongs to that item.

Problems that leave the item usable (a missing caption: trained with "") are returned as messages for
the caller to print; problems that make a source unusable raise `DataError` naming the file (and line).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from tuner.config.dataset import DatasetSpec, OnError
from tuner.data.items import Item, describe, is_frame_folder, media_stem
from tuner.data.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from tuner.errors import DataError


def _read_caption(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise DataError(f"{path}: caption is not UTF-8 text. Re-save it as UTF-8.") from None


# ---------------------------------------------------------------- directories


def _media_extensions(kind: str) -> tuple[str, ...]:
    return IMAGE_EXTENSIONS if kind == "image" else VIDEO_EXTENSIONS


def _scan_directory(spec: DatasetSpec, problems: list[str]) -> list[Item]:
    folder = Path(spec.source)
    exts = _media_extensions(spec.kind)
    caption_ext = (
        spec.caption_extension if spec.caption_extension.startswith(".") else f".{spec.caption_extension}"
    )
    items, others = [], []
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        is_media = path.is_file() and path.suffix.lower() in exts
        if not is_media and not (spec.kind == "video" and is_frame_folder(path)):
            if path.suffix.lower() != caption_ext:
                others.append(path)
            continue
        caption_path = path.parent / (media_stem(path) + caption_ext)
        caption = _read_caption(caption_path)
        if caption is None:
            problems.append(
                f"{path}: no caption file {caption_path.name}; training it with an empty caption."
            )
        variants: tuple[str, ...] = ()
        if caption and spec.captions_per_line:  # one caption per non-empty line
            variants = tuple(line.strip() for line in caption.splitlines() if line.strip())
            caption = variants[0]
        items.append(Item(str(path), caption or "", spec.kind, (), spec.index, captions=variants))
    if not items:
        raise DataError(_empty_message(spec, exts, others))
    return items


def _empty_message(spec: DatasetSpec, exts: tuple[str, ...], others: list[Path]) -> str:
    looked = ", ".join(exts) + (", or sub-folders of frame images" if spec.kind == "video" else "")
    msg = f"{describe(spec)}: no {spec.kind}s found (looked for {looked})"
    if not others:
        return msg + "; the folder is empty."
    msg += f"; found {len(others)} other entr{'y' if len(others) == 1 else 'ies'}: "
    msg += ", ".join(p.name for p in others[:5]) + (" ..." if len(others) > 5 else "")
    wrong_kind = "video" if spec.kind == "image" else "image"
    if any(p.suffix.lower() in _media_extensions(wrong_kind) for p in others):
        msg += f". These are {wrong_kind}s: use {wrong_kind}_directory for them."
    return msg


# ---------------------------------------------------------------- JSONL manifests

_CONTROL_KEY = re.compile(r"control_path(?:_(\d+))?")


def _manifest_controls(obj: dict, where: str, base: Path) -> tuple[str, ...]:
    found = []
    for key, value in obj.items():
        m = _CONTROL_KEY.fullmatch(key)
        if not m:
            continue
        if not isinstance(value, str) or not value:
            raise DataError(f'{where}: "{key}" must be a non-empty string (a file path).')
        found.append((-1 if m.group(1) is None else int(m.group(1)), str(base / value)))
    return tuple(path for _, path in sorted(found))


def _read_manifest(spec: DatasetSpec, problems: list[str]) -> list[Item]:
    manifest = Path(spec.source)
    base = manifest.parent  # Path("/abs") / "rel" is "/abs/rel"; an absolute entry replaces the base
    key = f"{spec.kind}_path"
    try:
        lines = manifest.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DataError(f"{manifest}: not UTF-8 text.") from None
    items = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{manifest}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}).") from None
        if not isinstance(obj, dict):
            raise DataError(
                f'{where}: expected one JSON object per line, like {{"{key}": "a.png", "caption": "..."}}.'
            )
        media = obj.get(key)
        if not isinstance(media, str) or not media:
            other = "video_path" if spec.kind == "image" else "image_path"
            hint = f' It has "{other}": list it in a {other[:5]}_jsonl_file instead.' if other in obj else ""
            raise DataError(f'{where}: missing "{key}" (a file path).{hint}')
        caption = obj.get("caption")
        variants: tuple[str, ...] = ()
        if isinstance(caption, list):  # several captions: one is drawn per epoch
            if not caption or not all(isinstance(c, str) for c in caption):
                raise DataError(f'{where}: "caption" as a list must hold one or more strings.')
            variants = tuple(c.strip() for c in caption)
            caption = caption[0]
        if caption is not None and not isinstance(caption, str):
            raise DataError(
                f'{where}: "caption" must be a string or a list of strings, got {type(caption).__name__}.'
            )
        path = base / media
        if caption is None:
            problems.append(f'{where}: {path.name} has no "caption"; training it with an empty caption.')
        items.append(
            Item(
                str(path),
                (caption or "").strip(),
                spec.kind,
                _manifest_controls(obj, where, base),
                spec.index,
                captions=variants,
            )
        )
    if not items:
        raise DataError(
            f'{describe(spec)}: the manifest has no entries; expected lines like {{"{key}": ..., "caption": ...}}.'
        )
    return items


# ---------------------------------------------------------------- control pairing

_NUMBERED = re.compile(r"(.+)_(\d+)")


def _pair_controls(
    spec: DatasetSpec, items: list[Item], on_error: OnError, problems: list[str]
) -> list[Item]:
    folder = Path(spec.control_directory)
    if not folder.is_dir():
        raise DataError(f"{describe(spec)}: control_directory {folder} is not a folder.")
    exts = IMAGE_EXTENSIONS + (VIDEO_EXTENSIONS if spec.kind == "video" else ())
    by_stem: dict[str, list[Path]] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() in exts or (spec.kind == "video" and is_frame_folder(path)):
            by_stem.setdefault(media_stem(path), []).append(path)
    for stem, paths in by_stem.items():
        if len(paths) > 1:
            problems.append(
                f"{folder}: several controls named {stem!r} ({', '.join(p.name for p in paths)}); using {paths[0].name}."
            )
    item_stems = {media_stem(Path(it.path)) for it in items}
    numbered: dict[str, list[tuple[int, Path]]] = {}
    for stem, paths in by_stem.items():
        m = _NUMBERED.fullmatch(stem)
        if m and stem not in item_stems:  # "cat_1.png" is item cat_1's own control, not cat's second one
            numbered.setdefault(m.group(1), []).append((int(m.group(2)), paths[0]))
    paired = []
    for item in items:
        if item.control_paths:  # a manifest's explicit control_path wins
            paired.append(item)
            continue
        stem = media_stem(Path(item.path))
        controls = [by_stem[stem][0]] if stem in by_stem else [p for _, p in sorted(numbered.get(stem, []))]
        if not controls:
            msg = f"{item.path}: no control image {stem}.* or {stem}_0.* in {folder}"
            if on_error == "stop":
                raise DataError(msg + '. Add it, or set on_error = "skip" to leave the item out.')
            problems.append(msg + "; item skipped.")
            continue
        paired.append(dataclasses.replace(item, control_paths=tuple(map(str, controls))))
    _refuse_orphan_controls(spec, by_stem, paired)
    return paired


def _refuse_orphan_controls(spec: DatasetSpec, by_stem: dict[str, list[Path]], paired: list[Item]) -> None:
    """A control image no item takes is an error naming it, as an orphan mask is: a typo in its name
    would otherwise train its item without it (or leave the item out) and say nothing."""
    used = {Path(p).resolve() for item in paired for p in item.control_paths}
    orphans = [paths[0] for _, paths in sorted(by_stem.items()) if paths[0].resolve() not in used]
    if orphans:
        stem = media_stem(orphans[0])
        raise DataError(
            f"{orphans[0]}: a control image for a missing item (no {spec.kind} named {stem}.* in "
            f"{describe(spec)})"
            + (f", and {len(orphans) - 1} more" if len(orphans) > 1 else "")
            + ". Rename it to its item's file name (or <item>_0, <item>_1, ... for several) or remove it."
        )


# ---------------------------------------------------------------- entry point


def discover_items(spec: DatasetSpec, on_error: OnError | None = None) -> tuple[list[Item], list[str]]:
    """The items of one dataset, and problems worth telling the user (missing captions, skipped items).

    Nothing is decoded here; `plan_latent_jobs` probes each file. `on_error` (default: the spec's)
    decides whether an item without its control image stops discovery or is skipped and reported.
    """
    on_error = on_error or spec.on_error
    problems: list[str] = []
    items = _read_manifest(spec, problems) if spec.source_is_manifest else _scan_directory(spec, problems)
    if spec.control_directory:
        items = _pair_controls(spec, items, on_error, problems)
        if not items:
            raise DataError(f"{describe(spec)}: no item has a control image in {spec.control_directory}.")
    if spec.mask_directory:
        from tuner.data.masks import pair_masks

        items = pair_masks(spec, items, problems)
    from tuner.data.captions import apply_caption_options

    return apply_caption_options(spec, items, problems), problems
