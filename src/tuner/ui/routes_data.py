"""Dataset pages and file access: browse folders, thumbnails, caption edits, bucket check, downloads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, Response
from pydantic import BaseModel

from tuner.errors import DataError
from tuner.registry import ARCHITECTURES
from tuner.ui import folders, toml_text
from tuner.ui.pages import render, state
from tuner.ui.responses import file_headers

router = APIRouter()
MAX_SIDE = 4096
"""Largest width or height a page may ask for (the bucket check plans every item at it)."""
MAX_FRAMES = 257
"""Most frames a page may ask for (the longest clips the video models train on)."""
Side = Annotated[int, Query(ge=16, le=MAX_SIDE)]
Frames = Annotated[int, Query(ge=1, le=MAX_FRAMES)]


@router.get("/")
def home():
    return RedirectResponse("/jobs", status_code=303)


@router.get("/datasets")
def datasets(
    request: Request, path: str = "", architecture: str = "wan", width: Side = 512, height: Side = 512,
    frames: Frames = 1, check: bool = False,
):  # fmt: skip
    roots = state(request).roots
    folder = roots.resolve(path) if path else roots.folders[0]
    if not folder.is_dir():
        raise HTTPException(404, f"{path}: no such folder.")
    if check and architecture not in ARCHITECTURES:
        raise DataError(f"architecture {architecture!r}: not known; one of {', '.join(ARCHITECTURES)}.")
    subfolders = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    items, problems, checks, report, dataset = [], [], {}, [], ""
    if any(p.is_file() for p in folder.iterdir()):
        try:
            items, problems = folders.list_items(folder)
        except DataError as e:
            problems = [str(e)]
    if items:
        dataset = toml_text.dumps(folders.dataset_toml(folder, (width, height), frames))
        if check:
            checks, report = folders.check_folder(folder, architecture, (width, height), frames)
    parent = folder.parent if roots.contains(folder.parent) and folder not in roots.folders else None
    return render(
        request, "datasets.html", folder=folder, parent=parent, subfolders=subfolders, items=items,
        problems=problems, checks=checks, report=report, checked=check, architecture=architecture,
        architectures=ARCHITECTURES, width=width, height=height, frames=frames, dataset=dataset,
    )  # fmt: skip


@router.get("/thumb")
def thumb(request: Request, path: str):
    media = state(request).roots.resolve(path)
    if not media.exists():
        raise HTTPException(404, f"{path}: no such file.")
    try:
        return Response(
            folders.thumbnail(media), media_type="image/jpeg", headers={"Cache-Control": "max-age=60"}
        )
    except DataError as e:
        return Response(str(e), status_code=422, media_type="text/plain")


@router.get("/file")
def file(request: Request, path: str, download: bool = False):
    """A file under the roots: images and videos inline, everything else as a download (never rendered:
    see `tuner.ui.responses`)."""
    target = state(request).roots.resolve(path)
    if not target.is_file():
        raise HTTPException(404, f"{path}: no such file.")
    media_type, headers = file_headers(target, download)
    return FileResponse(target, media_type=media_type, headers=headers)


MAX_ENTRIES = 2000
"""Most entries the file picker lists of one folder."""


@router.get("/api/browse")
def browse(request: Request, path: str = ""):
    """The file picker's view of a folder under the roots: its subfolders and files (the roots themselves
    when `path` is empty); hidden entries left out."""
    roots = state(request).roots
    if not path:
        entries = [{"name": str(r), "path": str(r), "dir": True} for r in roots.folders]
        return {"path": "", "parent": None, "entries": entries}
    folder = roots.resolve(path)
    if not folder.is_dir():
        raise HTTPException(404, f"{path}: no such folder.")
    children = sorted((p for p in folder.iterdir() if not p.name.startswith(".")), key=lambda p: p.name)
    entries = [{"name": p.name, "path": str(p), "dir": p.is_dir()} for p in children[:MAX_ENTRIES]]
    up = str(folder.parent) if folder not in roots.folders and roots.contains(folder.parent) else ""
    return {"path": str(folder), "parent": up, "entries": entries, "more": len(children) > MAX_ENTRIES}


class CaptionEdit(BaseModel):
    path: str
    text: str


@router.post("/api/caption")
def caption(request: Request, edit: CaptionEdit):
    roots = state(request).roots
    media = roots.resolve(edit.path)
    roots.resolve(folders.caption_path(media))  # a frames folder that is a root has its sidecar outside
    written = folders.save_caption(media, edit.text)
    return {"path": str(written), "text": written.read_text(encoding="utf-8")}


def dataset_text_for(request: Request, folder: str, width: int, height: int, frames: int) -> str:
    """The dataset TOML of a folder the user browsed, for the new-run form."""
    path = state(request).roots.resolve(folder)
    return toml_text.dumps(folders.dataset_toml(Path(path), (width, height), frames))
