"""Jobs and what they write: the queue's actions, live log / metrics / samples, and the run's adapters.

The queue (`tuner.ui.jobs.JobQueue`) runs the CLI's commands; these routes only read what it and the
trainer write (the log, `logs/metrics.jsonl`, the samples, the adapter files) and call `tuner lora`'s
library functions (`describe_adapter`, `convert_adapter`, `merge_adapters`) on the adapters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import RedirectResponse
from pydantic import BaseModel

from tuner.errors import ConfigError
from tuner.registry import SAVE_LAYOUTS
from tuner.ui.jobs import Job, UnknownJob
from tuner.ui.pages import render, state

router = APIRouter()
ACTIONS = ("start", "stop", "resume", "delete")


def _job(request: Request, job_id: int) -> Job:
    try:
        return state(request).queue.get(job_id)
    except UnknownJob:
        raise HTTPException(404, f"no job {job_id}") from None


def job_dict(job: Job) -> dict:
    data = dataclasses.asdict(job)
    return {
        **{k: str(v) if isinstance(v, Path) else v for k, v in data.items()},
        "ranks_text": ranks_text(job),
    }


def ranks_text(job: Job) -> str:
    """The current (or last) stage's processes as the job page shows them: "rank 0 (pid 812): running ·
    rank 1 (pid 813): exit code 1"."""
    return " · ".join(f"rank {r['rank']} (pid {r['pid']}): {_process_state(r['code'])}" for r in job.ranks)


def _process_state(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return "ended" if code == 0 else f"exit code {code}"


def _samples(request: Request, job_id: int) -> list[dict]:
    return [{**s, "path": str(s["path"])} for s in state(request).queue.samples(job_id)]


@router.get("/jobs")
def jobs(request: Request):
    return render(request, "jobs.html", jobs=[job_dict(j) for j in state(request).queue.list()])


@router.get("/jobs/{job_id}")
def job_page(request: Request, job_id: int):
    job = job_dict(_job(request, job_id))
    samples = _samples(request, job_id)
    prompts = list(dict.fromkeys(s["prompt"] for s in samples))
    return render(request, "job.html", job=job, prompts=prompts, layouts=SAVE_LAYOUTS,
                  adapters=adapter_infos(request, job_id))  # fmt: skip


@router.post("/jobs/{job_id}/{action}")
def job_action(request: Request, job_id: int, action: str):
    if action not in ACTIONS:
        raise ConfigError(f"unknown job action {action!r}; one of {', '.join(ACTIONS)}.")
    _job(request, job_id)
    getattr(state(request).queue, action)(job_id)
    return RedirectResponse("/jobs" if action == "delete" else f"/jobs/{job_id}", status_code=303)


@router.get("/jobs/{job_id}/compare")
def compare(request: Request, job_id: int, prompt: str = ""):
    job = job_dict(_job(request, job_id))
    samples = _samples(request, job_id)
    prompts = list(dict.fromkeys(s["prompt"] for s in samples))
    prompt = prompt or (prompts[0] if prompts else "")
    row = sorted((s for s in samples if s["prompt"] == prompt), key=lambda s: s["step"])
    return render(request, "compare.html", job=job, prompts=prompts, prompt=prompt, row=row)


# ---------------------------------------------------------------- live data (the page's script polls)


@router.get("/api/jobs")
def api_jobs(request: Request):
    return [job_dict(j) for j in state(request).queue.list()]


@router.get("/api/jobs/{job_id}")
def api_job(request: Request, job_id: int, lines: int = 200):
    job = job_dict(_job(request, job_id))
    return {**job, "log": state(request).queue.log_tail(job_id, min(max(lines, 1), 2000))}


@router.get("/api/jobs/{job_id}/metrics")
def api_metrics(request: Request, job_id: int):
    _job(request, job_id)
    return state(request).queue.metrics(job_id)


@router.get("/api/jobs/{job_id}/samples")
def api_samples(request: Request, job_id: int):
    _job(request, job_id)
    return _samples(request, job_id)


# ---------------------------------------------------------------- adapters


def adapter_infos(request: Request, job_id: int) -> list[dict]:
    """`tuner lora info`'s content for each adapter the run saved, newest last."""
    from tuner.tools.info import describe_adapter, format_info

    out = []
    for path in state(request).queue.adapters(job_id):
        path = Path(path)
        try:
            info = format_info(describe_adapter(path))
        except Exception as e:  # a file being written, or damaged: say so, list the others
            info = f"{path}: cannot be read ({e})"
        out.append({"path": str(path), "name": path.name, "info": info})
    return out


class Convert(BaseModel):
    path: str
    to: str
    arch: str | None = None


@router.post("/api/adapters/convert")
def convert(request: Request, body: Convert):
    """`tuner lora convert IN OUT --to LAYOUT`; OUT is IN's name with the layout, beside it."""
    from tuner.tools.convert import convert_adapter

    roots = state(request).roots
    src = roots.resolve(body.path)
    if body.to not in SAVE_LAYOUTS:
        raise ConfigError(f"--to {body.to!r}: one of {', '.join(SAVE_LAYOUTS)}.")
    dst = roots.resolve(src.with_name(f"{src.stem}-{body.to}{src.suffix}"))
    count, layout = convert_adapter(src, dst, body.to, arch=body.arch)
    return {"path": str(dst), "modules": count, "layout": layout}


class Merge(BaseModel):
    model: str
    loras: list[tuple[str, float]]
    out: str
    fp8: bool = False
    arch: str | None = None


@router.post("/api/adapters/merge")
def merge(request: Request, body: Merge):
    """`tuner lora merge --model FILE --lora FILE:STRENGTH ... --out FILE`."""
    from tuner.tools.merge import merge_adapters

    roots = state(request).roots
    model, out = roots.resolve(body.model), roots.resolve(body.out)
    adapters = [(str(roots.resolve(path)), strength) for path, strength in body.loras]
    changed = merge_adapters(model, adapters, out, fp8=body.fp8, arch=body.arch)
    return {"path": str(out), "merged": {str(k): v for k, v in changed.items()}}
