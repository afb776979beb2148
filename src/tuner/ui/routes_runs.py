"""The new-run form: presets, inline validation (`tuner check`'s), TOML download, and submitting a job."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from tuner.errors import ConfigError, TunerError
from tuner.registry import ARCHITECTURES
from tuner.ui import components, form
from tuner.ui.jobs import JobError
from tuner.ui.pages import render, state
from tuner.ui.paths import OutsideRoots
from tuner.ui.responses import attachment, one_line
from tuner.ui.routes_data import Frames, Side, dataset_text_for

router = APIRouter()
MAX_NAME = 100
"""Longest job name kept (its run folder's name holds the first 40 characters)."""
MAX_TOML = 1 << 20
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


async def _form_fields(request: Request) -> tuple[dict[str, str], str, str | None, str]:
    """(the config keys' texts, the job name, the dataset TOML text or None, the processes' text) of a
    submitted form."""
    data = await request.form()
    fields: dict[str, str] = {}
    for key in data:
        values = data.getlist(key)
        fields[key] = "true" if "true" in values else str(values[-1])
    name = one_line(fields.pop("_name", ""))[:MAX_NAME] or "run"
    dataset = fields.pop("_dataset", "").strip()
    dataset = dataset.replace("\r\n", "\n") + "\n" if dataset else None  # browsers send CRLF
    return fields, name, dataset, fields.pop("_processes", "1").strip() or "1"


def _processes(request: Request, text: str) -> int:
    """The form's process count, checked against this machine (`JobQueue.check_processes`)."""
    try:
        processes = int(text) if len(text) < 10 else -1
    except ValueError:
        raise JobError(
            f"processes: {text!r} is not a whole number ≥ 1 (processes each stage runs as)"
        ) from None
    state(request).queue.check_processes(processes)
    return processes


def _processes_note(request: Request) -> str:
    """What the form says beside its processes input: what one process is on this machine."""
    slots = state(request).queue.slots
    if slots == ["cpu"]:
        return "CPU processes (no GPU here; they talk through gloo)"
    return f"one per GPU, at most {len(slots)} ({', '.join(slots)})"


@router.get("/runs/new")
def new_run(
    request: Request, preset: str = "", config: str = "", dataset: str = "", width: Side = 512, height: Side = 512,
    frames: Frames = 1,
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
        if not path.is_file() or path.stat().st_size > MAX_TOML:
            raise ConfigError(f"{config}: not a training TOML (a file of at most {MAX_TOML >> 10} KiB).")
        try:
            values, source = form.toml_to_form(path.read_text(encoding="utf-8"), path.parent), str(path)
        except (ValueError, UnicodeDecodeError) as e:  # TOMLDecodeError is a ValueError
            raise ConfigError(f"{config}: not a training TOML ({e}).") from None
    else:
        values = dict(form.NEW_RUN_VALUES)
    dataset_text = dataset_text_for(request, dataset, width, height, frames) if dataset else ""
    return _page(request, values, source=source, dataset_text=dataset_text, name=Path(source).stem or "run")


def _page(request: Request, values: dict[str, str], source: str = "", dataset_text: str = "", name: str = "run",
          error: form.Check | None = None, status_code: int = 200, processes: str = "1"):  # fmt: skip
    """The new-run form holding `values` (`section.key` → text)."""
    sections = form.sections()
    return render(
        request, "new_run.html", sections=sections, fields={f.key: f for s in sections for f in s.fields},
        simple=form.SIMPLE, values=values, source=source, presets=presets(), architectures=ARCHITECTURES,
        dataset_text=dataset_text, error=error, name=name, status_code=status_code, processes=processes,
        processes_note=_processes_note(request),
        model_keys=components.model_keys_by_architecture(),
        downloads={a: components.downloads(a) for a in ARCHITECTURES},
    )  # fmt: skip


@router.post("/runs/check")
async def check(request: Request):
    fields, _, dataset, processes = await _form_fields(request)
    text = form.form_to_toml(fields)
    result = form.validate(text, dataset)
    if result.ok:
        try:
            _processes(request, processes)
        except JobError as e:
            result = form.check_of(str(e))
    return JSONResponse({"ok": result.ok, "message": result.message, "key": result.key, "toml": text})


@router.post("/runs/toml")
async def download_toml(request: Request):
    fields, name, _, _ = await _form_fields(request)
    text = form.form_to_toml(fields)
    return Response(
        text, media_type="application/toml", headers={"Content-Disposition": attachment(f"{name}.toml")}
    )


@router.post("/runs")
async def submit(request: Request):
    fields, name, dataset, processes = await _form_fields(request)
    text = form.form_to_toml(fields)
    result = form.validate(text, dataset)
    status = 400
    if result.ok:
        if dataset is not None:  # the queue writes it beside the config as dataset.toml
            text = form.with_dataset_file(text, "dataset.toml")
        try:  # the queue checks the job's paths against the roots in its run folder
            job_id = state(request).queue.submit(name, text, dataset, _processes(request, processes))
        except TunerError as e:
            status = 403 if isinstance(e, OutsideRoots) else 400
            result = form.check_of(str(e))
        else:
            return RedirectResponse(f"/jobs/{job_id}", status_code=303)
    return _page(request, fields, dataset_text=dataset or "", name=name, error=result, status_code=status,
                 processes=processes)  # fmt: skip
