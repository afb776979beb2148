"""How every answer of the UI is sent: the headers that keep a browser from running what it shows, error
answers as one line, and download headers that cannot be bent by a file or job name.

- Every response carries `SECURITY_HEADERS`: a Content-Security-Policy that lets pages run only our own
  script and style (no inline script, no other site), `nosniff` (a browser takes the type we say, never
  guesses HTML from a file's bytes), no framing, no referrer sent elsewhere.
- Files under the roots (`/file`) are sent inline only when they are images or videos a page shows
  (`INLINE_TYPES`), with a CSP that sandboxes them; anything else (an `.html` or `.svg` in a downloaded
  dataset, a TOML, a log) is sent as `application/octet-stream` and as an attachment, so it is saved,
  never rendered on the UI's origin.
- `error_response`: a bad request is answered with its status and one line saying why: JSON
  (`{"error": ...}`) for `/api/` paths, a small HTML page for the others.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from urllib.parse import quote

from starlette.responses import HTMLResponse, JSONResponse, Response

PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; media-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
FILE_CSP = "default-src 'none'; img-src 'self'; media-src 'self'; sandbox"
"""What a file opened on its own may do: show itself, nothing else (no script, no requests)."""

SECURITY_HEADERS = (
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "same-origin"),
    ("cross-origin-opener-policy", "same-origin"),
)

INLINE_TYPES = {
    ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
    ".gif": "image/gif", ".bmp": "image/bmp", ".mp4": "video/mp4", ".webm": "video/webm",
}  # fmt: skip
"""The files `/file` sends inline (samples and dataset media on the pages); never HTML, SVG or script."""


def file_headers(path: Path, download: bool) -> tuple[str, dict[str, str]]:
    """(media type, headers) `/file` sends `path` with."""
    media_type = INLINE_TYPES.get(path.suffix.lower())
    headers = {"content-security-policy": FILE_CSP}
    if media_type is None or download:
        headers["content-disposition"] = attachment(path.name)
    return media_type or "application/octet-stream", headers


_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9._ ()+-]+")


def attachment(filename: str) -> str:
    """A `Content-Disposition` that saves the body as `filename`: an ASCII fallback with every other
    character replaced, and the exact name percent-encoded (RFC 6266 / 5987), so quotes, `;` or a CR/LF in
    a name cannot end the header or start another."""
    fallback = _UNSAFE_FILENAME.sub("_", filename).strip(" .") or "download"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"


def one_line(message: str) -> str:
    """A message as one line (control characters and line breaks become spaces)."""
    return " ".join(re.sub(r"[\x00-\x1f\x7f]", " ", message).split())


def error_response(path: str, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """`status` with `message` (made one line): JSON for `/api/` paths, a small page for the others."""
    message = one_line(message)
    if path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{status} · tuner ui</title>"
        '<link rel="stylesheet" href="/static/style.css"><link rel="icon" href="/favicon.ico"></head><body>'
        '<header><a class="brand" href="/jobs">tuner</a></header><main>'
        f'<h1>{status}</h1><p class="error" id="error-message">{html.escape(message)}</p>'
        '<p><a href="/jobs">back to the jobs</a></p></main></body></html>'
    )
    return HTMLResponse(page, status_code=status, headers=headers)
