"""Who may use the server: the access token, and requests from the UI's own pages only.

The token is required when the server listens beyond the loopback interface.

A browser brings it once as `?token=...` (the address `tuner ui` prints); the answer sets it as an
HTTP-only cookie, so later requests (and the page's own script) carry it without putting it in every
link. Scripts may send it as an `Authorization: Bearer` header instead. Every request is checked,
static files included; a missing or wrong token gets 401 and nothing else.

Without a token (loopback), any web page the user has open could still send requests to 127.0.0.1: a
form posted from another site, or a site whose name is made to resolve to 127.0.0.1 (DNS rebinding).
`SameOriginMiddleware` refuses both: a request that changes something (POST) must come from a page of
this server when the browser says where it comes from (`Origin`), and without a token the `Host` must
be a loopback name.
"""

from __future__ import annotations

import ipaddress
import secrets
from urllib.parse import urlsplit

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse

COOKIE = "tuner_ui_token"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    return secrets.token_urlsafe(24)


def _matches(given: str | None, token: str) -> bool:
    return given is not None and secrets.compare_digest(given.encode(), token.encode())


class TokenMiddleware(BaseHTTPMiddleware):
    def __init__(self, app, token: str):
        super().__init__(app)
        self.token = token

    async def dispatch(self, request: Request, call_next):
        query = request.query_params.get("token")
        if _matches(query, self.token):
            # drop the token from the address bar (and from the history), keep it as a cookie
            clean = request.url.remove_query_params("token")
            response = RedirectResponse(str(clean), status_code=303)
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
            return response
        header = request.headers.get("authorization", "")
        bearer = header[7:] if header.lower().startswith("bearer ") else None
        if _matches(request.cookies.get(COOKIE), self.token) or _matches(bearer, self.token):
            return await call_next(request)
        return PlainTextResponse(
            "401: this tuner ui needs its access token: open the address `tuner ui` printed (…?token=...).",
            status_code=401,
        )


_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


class SameOriginMiddleware(BaseHTTPMiddleware):
    def __init__(self, app, loopback_only: bool):
        super().__init__(app)
        self.loopback_only = loopback_only

    async def dispatch(self, request: Request, call_next):
        host = request.headers.get("host", "")
        if self.loopback_only and not is_loopback(urlsplit(f"//{host}").hostname or ""):
            return PlainTextResponse(f"403: this tuner ui answers on 127.0.0.1 only, not as {host!r}.", 403)
        origin = request.headers.get("origin")
        if request.method not in _SAFE_METHODS and origin and urlsplit(origin).netloc != host:
            return PlainTextResponse(f"403: a request from another site ({origin}) was refused.", 403)
        return await call_next(request)
