"""The FastAPI application: `create_app(roots, runs_dir, token)` wires the pages to the library.

Every route reads its state from `request.app.state.ui` (`UIState`); nothing is global, so tests build
as many apps as they like. Routes live in `routes_data.py` (datasets, files), `routes_runs.py` (the
new-run form) and `routes_jobs.py` (jobs, samples, adapters); what they share (the state, rendering) in
`pages.py`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException

from tuner.errors import ConfigError, TunerError
from tuner.ui.auth import Guard
from tuner.ui.pages import UIState, when
from tuner.ui.paths import OutsideRoots, Roots
from tuner.ui.responses import error_response

HERE = Path(__file__).parent


def create_app(
    roots: list[str | os.PathLike], runs_dir: str | os.PathLike, token: str | None = None, queue: Any = None
) -> FastAPI:
    """The app serving `roots` (and `runs_dir`, where jobs run; always a root). With `token`, every request
    must bring it (an empty one is refused). `queue` defaults to a `JobQueue` in `runs_dir`, polled in the
    background while serving; the app checks every job's paths against the roots when it is submitted
    and when it starts (`queue.check`)."""
    if token is not None and not token.strip():
        raise ConfigError("--token: an empty access token lets anyone in; give a real one or leave it out.")
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
    from tuner.ui.job_check import JobCheck

    queue.check = JobCheck(app.state.ui.roots)
    app.add_middleware(Guard, token=token)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon():
        return FileResponse(HERE / "static" / "favicon.svg", media_type="image/svg+xml")

    @app.exception_handler(OutsideRoots)
    async def outside(request: Request, exc: OutsideRoots):
        return error_response(request.url.path, 403, str(exc))

    @app.exception_handler(TunerError)
    async def tuner_error(request: Request, exc: TunerError):
        return error_response(request.url.path, 400, str(exc))

    @app.exception_handler(OSError)
    async def os_error(request: Request, exc: OSError):  # a file name the system refuses (too long, ...)
        return error_response(
            request.url.path, 400, f"{exc.filename or request.url.path}: {exc.strerror or exc}."
        )

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(request.url.path, exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = " ".join(str(part) for part in first.get("loc", ()))
        return error_response(request.url.path, 400, f"{where}: {first.get('msg', 'invalid')}.")

    from tuner.ui import routes_data, routes_jobs, routes_runs

    app.include_router(routes_data.router)
    app.include_router(routes_runs.router)
    app.include_router(routes_jobs.router)
    return app
