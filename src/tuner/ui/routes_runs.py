"""The new-run form: presets, inline validation (`tuner check`'s), TOML download, and submitting a job."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from tuner.errors import ConfigError
from tuner.registry import ARCHITECTURES
from tuner.ui import form
from tuner.ui.app import render, state
from tuner.ui.routes_data import dataset_text_for

router = APIRouter()
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"  # a source checkout's examples/


def presets() -> dict[str, Path]:
    """The training TOMLs of examples/ (those with a [model] table), by file stem."""
    if not EXAMPLES.is_dir():
        return {}
    found = {}
    for path in sorted(EXAMPLES.glob("*.toml")):
        if "[model]" in path.read_text(encoding="utf-8"):
            found[path.stem] = path
    return found


async def _form_fields(request: Request) -> tuple[dict[str, str], str, str | None]:
    """(the config keys' texts, the job name, the dataset TOML text or None) of a submitted form."""
    data = await request.form()
    fields: dict[str, str] = {}
    for key in data:
        values = data.getlist(key)
        fields[key] = "true" if "true" in values else str(values[-1])
    name = fields.pop("_name", "").strip() or "run"
    dataset = fields.pop("_dataset", "").strip()
    dataset = dataset.replace("\r\n", "\n") + "\n" if dataset else None  # browsers send CRLF
    return fields, name, dataset


@router.get("/runs/new")
def new_run(
    request: Request, preset: str = "", config: str = "", dataset: str = "", width: int = 512, height: int = 512,
    frames: int = 1,
):  # fmt: skip
    values: dict[str, str] = {}
    source = ""
    if preset:
        path = presets().get(preset)
        if path is None:
            raise ConfigError(f"no preset {preset!r}; known: {', '.join(presets())}.")
        values, source = (
            form.toml_to_form(path.read_text(encoding="utf-8"), path.parent),
            f"examples/{path.name}",
        )
    elif config:
        path = state(request).roots.resolve(config)
        values, source = form.toml_to_form(path.read_text(encoding="utf-8"), path.parent), str(path)
    dataset_text = dataset_text_for(request, dataset, width, height, frames) if dataset else ""
    return render(
        request, "new_run.html", sections=form.sections(), values=values, source=source, presets=presets(),
        architectures=ARCHITECTURES, dataset_text=dataset_text, error=None, name=Path(source).stem or "run",
    )  # fmt: skip


@router.post("/runs/check")
async def check(request: Request):
    fields, _, dataset = await _form_fields(request)
    text = form.form_to_toml(fields)
    result = form.validate(text, dataset)
    return JSONResponse({"ok": result.ok, "message": result.message, "key": result.key, "toml": text})


@router.post("/runs/toml")
async def download_toml(request: Request):
    fields, name, _ = await _form_fields(request)
    text = form.form_to_toml(fields)
    return Response(text, media_type="application/toml",
                    headers={"Content-Disposition": f'attachment; filename="{Path(name).name}.toml"'})  # fmt: skip


@router.post("/runs")
async def submit(request: Request):
    fields, name, dataset = await _form_fields(request)
    text = form.form_to_toml(fields)
    result = form.validate(text, dataset)
    if not result.ok:
        return render(
            request, "new_run.html", sections=form.sections(), values=fields, source="", presets=presets(),
            architectures=ARCHITECTURES, dataset_text=dataset or "", error=result, name=name, status_code=400,
        )  # fmt: skip
    if dataset is not None:  # the queue writes it beside the config as dataset.toml
        text = form.with_dataset_file(text, "dataset.toml")
    job_id = state(request).queue.submit(name, text, dataset)
    return RedirectResponse(f"/jobs/{job_id}", status_code=303)
