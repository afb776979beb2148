"""The FastAPI application: `create_app(roots, runs_dir, token)` wires the pages to the library.

Every route reads its state from `request.app.state.ui` (`UIState`); nothing is global, so tests build
as many apps as they like. Routes live in `routes_data.py` (datasets, files), `routes_runs.py` (the
new-run form) and `routes_jobs.py` (jobs, samples, adapters).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from tuner.errors import TunerError
from tuner.ui.auth import SameOriginMiddleware, TokenMiddleware
from tuner.ui.paths import OutsideRoots, Roots

HERE = Path(__file__).parent


@dataclass
class UIState:
    roots: Roots
    runs_dir: Path
    queue: Any  # tuner.ui.jobs.JobQueue
    templates: Jinja2Templates


def state(request: Request) -> UIState:
    return request.app.state.ui


def render(request: Request, template: str, status_code: int = 200, **context) -> Any:
    ui = state(request)
    return ui.templates.TemplateResponse(
        request, template, {"roots": ui.roots.folders, **context}, status_code=status_code
    )


def create_app(
    roots: list[str | os.PathLike], runs_dir: str | os.PathLike, token: str | None = None, queue: Any = None
) -> FastAPI:
    """The app serving `roots` (and `runs_dir`, where jobs run; always a root). With `token`, every request
    must bring it. `queue` defaults to a `JobQueue` in `runs_dir`, polled in the background while serving."""
    runs = Path(runs_dir).expanduser().resolve()
    runs.mkdir(parents=True, exist_ok=True)
    own_queue = queue is None
    if own_queue:
        from tuner.ui.jobs import JobQueue

        queue = JobQueue(runs / "jobs.sqlite", runs)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if own_queue:
            queue.run_in_background()
        yield
        if own_queue:
            queue.close()

    app = FastAPI(title="tuner ui", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.filters["when"] = when
    app.state.ui = UIState(Roots([*roots, runs]), runs, queue, templates)
    if token:
        app.add_middleware(TokenMiddleware, token=token)
    app.add_middleware(SameOriginMiddleware, loopback_only=not token)  # added last: runs first
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.exception_handler(OutsideRoots)
    async def outside(request: Request, exc: OutsideRoots):
        return _error(request, str(exc), 403)

    @app.exception_handler(TunerError)
    async def tuner_error(request: Request, exc: TunerError):
        return _error(request, str(exc), 400)

    from tuner.ui import routes_data, routes_jobs, routes_runs

    app.include_router(routes_data.router)
    app.include_router(routes_runs.router)
    app.include_router(routes_jobs.router)
    return app


def when(seconds: float | None) -> str:
    """A job's time (seconds since the epoch) as the page shows it."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds else ""


def _error(request: Request, message: str, status: int):
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=status)
    return PlainTextResponse(f"{status}: {message}", status_code=status)
