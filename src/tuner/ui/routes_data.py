"""Dataset pages and file access: browse folders, thumbnails, caption edits, bucket check, downloads."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, RedirectResponse, Response
from pydantic import BaseModel

from tuner.errors import DataError
from tuner.registry import ARCHITECTURES
from tuner.ui import folders, toml_text
from tuner.ui.app import render, state

router = APIRouter()


@router.get("/")
def home():
    return RedirectResponse("/jobs", status_code=303)


@router.get("/datasets")
def datasets(
    request: Request, path: str = "", architecture: str = "wan", width: int = 512, height: int = 512,
    frames: int = 1, check: bool = False,
):  # fmt: skip
    roots = state(request).roots
    folder = roots.resolve(path) if path else roots.folders[0]
    if not folder.is_dir():
        raise DataError(f"{path}: not a folder.")
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
    try:
        return Response(
            folders.thumbnail(media), media_type="image/jpeg", headers={"Cache-Control": "max-age=60"}
        )
    except DataError as e:
        return Response(str(e), status_code=422, media_type="text/plain")


@router.get("/file")
def file(request: Request, path: str, download: bool = False):
    target = state(request).roots.resolve(path)
    if not target.is_file():
        raise DataError(f"{path}: no such file.")
    return FileResponse(target, filename=target.name if download else None)


class CaptionEdit(BaseModel):
    path: str
    text: str


@router.post("/api/caption")
def caption(request: Request, edit: CaptionEdit):
    media = state(request).roots.resolve(edit.path)
    written = folders.save_caption(media, edit.text)
    return {"path": str(written), "text": written.read_text(encoding="utf-8")}


def dataset_text_for(request: Request, folder: str, width: int, height: int, frames: int) -> str:
    """The dataset TOML of a folder the user browsed, for the new-run form."""
    path = state(request).roots.resolve(folder)
    return toml_text.dumps(folders.dataset_toml(Path(path), (width, height), frames))
