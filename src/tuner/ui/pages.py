"""What every page handler shares: the app's state (`UIState`, from `request.app.state.ui`) and
rendering a template with the roots and the request's CSRF token."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.templating import Jinja2Templates

from tuner.ui.auth import CSRF_FIELD
from tuner.ui.paths import Roots


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
    csrf = {"csrf": request.state.csrf, "csrf_field": CSRF_FIELD}  # set by `Guard` for every request
    return ui.templates.TemplateResponse(
        request, template, {"roots": ui.roots.folders, **csrf, **context}, status_code=status_code
    )


def when(seconds: float | None) -> str:
    """A job's time (seconds since the epoch) as the page shows it."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds else ""
