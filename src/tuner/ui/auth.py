"""Who may use the server, and what every request must bring: `Guard`, the one middleware in front of it.

**The access token.** Required when the server listens beyond the loopback interface (`tuner ui` refuses
to start there without one, and an empty token is an error). A browser brings it once as `?token=...`
(the address `tuner ui` prints); the answer sets it as an HTTP-only cookie, so later requests carry it
without putting it in every link. Scripts may send it as an `Authorization: Bearer` header instead.
Every request is checked, static files included; a missing or wrong token gets 401 and nothing else.

**Other sites.** Without a token (loopback), any web page the user has open could still send requests to
127.0.0.1: a form posted from another site, or a site whose name is made to resolve to 127.0.0.1 (DNS
rebinding). So without a token the `Host` must be a loopback name, and a request that changes something
(any method but GET / HEAD / OPTIONS) must come from a page of this server when the browser says where it
comes from (`Origin`), and must carry this browser session's CSRF token: a random value set as a
SameSite=Strict, HTTP-only cookie on the first answer, which our pages repeat in a `<meta>` tag (the
script sends it as `X-CSRF-Token`) and in each form (`_csrf`). A page of another site can neither read
it nor make the browser send the cookie. A script using the bearer token needs none (a browser never
adds that header by itself).

**Sizes.** A request body larger than `MAX_BODY` is refused with 413 before it is read.

Every answer gets `tuner.ui.responses.SECURITY_HEADERS` and, unless the route set its own, the pages'
Content-Security-Policy.
"""

from __future__ import annotations

import ipaddress
import secrets
from urllib.parse import parse_qs, urlsplit

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import RedirectResponse

from tuner.ui.responses import PAGE_CSP, SECURITY_HEADERS, error_response

COOKIE = "tuner_ui_token"
CSRF_COOKIE = "tuner_ui_csrf"
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "_csrf"
MAX_BODY = 8 << 20
"""Largest request body (bytes): captions, forms and dataset TOMLs are far smaller."""
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


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
    return bool(given) and secrets.compare_digest(given.encode(), token.encode())


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


class Guard:
    """The ASGI middleware described above; `token` None means a loopback-only server without one."""

    def __init__(self, app, token: str | None, max_body: int = MAX_BODY):
        if token is not None and not token.strip():
            raise ValueError("the access token is empty")
        self.app, self.token, self.max_body = app, token, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        cookie = request.cookies.get(CSRF_COOKIE, "")
        csrf = cookie if len(cookie) >= 32 and cookie.isascii() else secrets.token_urlsafe(32)
        scope.setdefault("state", {})["csrf"] = csrf  # the pages repeat it (request.state.csrf)
        try:
            response = self._token_redirect(request)
            if response is None:
                receive = await self._check(request, receive, csrf == cookie)
        except _Refused as refused:
            response = error_response(request.url.path, refused.status, refused.message)
        send = self._with_headers(send, None if csrf == cookie else csrf)
        if response is not None:
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)

    def _token_redirect(self, request: Request):
        """The address with `?token=` (the one `tuner ui` prints): the token becomes a cookie, and the
        browser is sent to the same address without it (out of the address bar and the history)."""
        if self.token is None or not _matches(request.query_params.get("token"), self.token):
            return None
        response = RedirectResponse(str(request.url.remove_query_params("token")), status_code=303)
        response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
        return response

    async def _check(self, request: Request, receive, has_csrf_cookie: bool):
        """Refuse (`_Refused`) what this server does not answer; returns the `receive` the app reads the
        (already read) body from."""
        host = request.headers.get("host", "")
        bearer = None
        if self.token is None:
            if not is_loopback(urlsplit(f"//{host}").hostname or ""):
                raise _Refused(403, f"this tuner ui answers on 127.0.0.1 only, not as {host!r}.")
        else:
            header = request.headers.get("authorization", "")
            bearer = header[7:] if header.lower().startswith("bearer ") else None
            if not (_matches(request.cookies.get(COOKIE), self.token) or _matches(bearer, self.token)):
                raise _Refused(
                    401,
                    "this tuner ui needs its access token: open the address `tuner ui` printed (…?token=...).",
                )
        if request.method in _SAFE_METHODS:
            return receive
        origin = request.headers.get("origin")
        if origin and urlsplit(origin).netloc != host:
            raise _Refused(403, f"a request from another site ({origin}) was refused.")
        body = await self._body(request, receive)
        if bearer is None:
            given = request.headers.get(CSRF_HEADER) or await _form_field(request, body, CSRF_FIELD)
            if not (has_csrf_cookie and _matches(given, request.cookies.get(CSRF_COOKIE, ""))):
                raise _Refused(
                    403, "the request did not carry this page's CSRF token (sent from another page, or the "
                    "page is older than the session): reload the page and try again."
                )  # fmt: skip
        return _replay(body, receive)

    async def _body(self, request: Request, receive) -> bytes:
        length = request.headers.get("content-length", "")
        if length and (not length.isdigit() or int(length) > self.max_body):
            raise _Refused(413, f"the request body is larger than {self.max_body >> 20} MiB.")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                raise _Refused(413, f"the request body is larger than {self.max_body >> 20} MiB.")
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    @staticmethod
    def _with_headers(send, new_csrf: str | None):
        async def sending(message):
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS:
                    headers[name] = value
                if "content-security-policy" not in headers:
                    headers["content-security-policy"] = PAGE_CSP
                if new_csrf is not None:
                    headers.append(
                        "set-cookie", f"{CSRF_COOKIE}={new_csrf}; Path=/; HttpOnly; SameSite=Strict"
                    )
            await send(message)

        return sending


async def _form_field(request: Request, body: bytes, name: str) -> str | None:
    """A field of a form body (urlencoded or multipart), or None."""
    kind = request.headers.get("content-type", "")
    if kind.startswith("application/x-www-form-urlencoded"):
        values = parse_qs(body.decode("latin-1"), keep_blank_values=True).get(name)
        return values[-1] if values else None
    if kind.startswith("multipart/form-data"):
        form = await Request(request.scope, _replay(body, None)).form()
        value = form.get(name)
        await form.close()
        return value if isinstance(value, str) else None
    return None


def _replay(body: bytes, receive):
    """A `receive` that hands the app the body already read, then passes on (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if receive is None:
            return {"type": "http.disconnect"}
        return await receive()

    return replay
