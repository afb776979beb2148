"""A stand-in for the Hugging Face hub on a loopback port, for tests without the internet.

It speaks the part of the hub's HTTP API that `huggingface_hub` uses to list and download files (the tree
listing, and HEAD / GET of `resolve/` URLs with the commit, etag and size headers and byte ranges), so
tests point `huggingface_hub.constants.ENDPOINT` at it and exercise the real client code. Faults are
switches: a gated repository, a file served corrupt, a download cut after half its bytes.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".bin", ".model")


def _etag(path: str, data: bytes) -> str:
    """The hub's etag: the sha256 of large (LFS) files, the git blob sha1 of others."""
    if path.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    gated: set[str] = field(default_factory=set)
    corrupt: set[str] = field(default_factory=set)
    """`repo/path` of files served with their last byte flipped (the etag stays the true one)."""
    cuts: dict[str, int] = field(default_factory=dict)
    """`repo/path` -> how many more GETs of it are cut short (the first after half its bytes, the rest at once)."""
    requests: list[tuple[str, str, str]] = field(default_factory=list)
    """(method, path, Range header) of every request, for tests to inspect."""

    def __post_init__(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                # a client that hangs up mid-reply (a cut download, a pooled connection dropped) is
                # normal; printed, its traceback lands in the captured stderr of whichever test runs then
                if not isinstance(sys.exc_info()[1], ConnectionError):
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # --- routing ----------------------------------------------------------------------------------

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range", "")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            return self._tree(h, f"{parts[2]}/{parts[3]}", "/".join(parts[6:]))
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(h, f"{parts[0]}/{parts[1]}", "/".join(parts[4:]), body)
        self._reply(h, 404, b"{}", {"X-Error-Code": "RepoNotFound"})

    def _check_repo(self, h: BaseHTTPRequestHandler, repo: str) -> bool:
        if repo not in self.repos:
            self._reply(h, 401, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            return False
        if repo in self.gated:
            self._reply(
                h, 401, b'{"error": "Access to this model is restricted"}', {"X-Error-Code": "GatedRepo"}
            )
            return False
        return True

    def _tree(self, h: BaseHTTPRequestHandler, repo: str, under: str) -> None:
        if not self._check_repo(h, repo):
            return
        entries = []
        for path, data in sorted(self.repos[repo].items()):
            if under and not path.startswith(under + "/"):
                continue
            entry = {"type": "file", "path": path, "size": len(data), "oid": _etag(path, data)}
            if path.endswith(LFS_SUFFIXES):
                entry["oid"] = hashlib.sha1(data).hexdigest()  # the pointer's blob; the content is under lfs
                entry["lfs"] = {"oid": _etag(path, data), "size": len(data), "pointerSize": 130}
            entries.append(entry)
        self._reply(h, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"})

    def _file(self, h: BaseHTTPRequestHandler, repo: str, path: str, body: bool) -> None:
        if not self._check_repo(h, repo):
            return
        files = self.repos[repo]
        if path not in files:
            self._reply(h, 404, b"{}", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
            return
        data, key = files[path], f"{repo}/{path}"
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_etag(path, data)}"'}
        if key in self.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        start = 0
        if body and (rng := h.headers.get("Range", "")).startswith("bytes="):
            start = int(rng[len("bytes=") :].split("-")[0])
        if not body:
            headers["Content-Length"] = str(len(data))
            return self._reply(h, 200, b"", headers, send_body=False)
        chunk = data[start:]
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if self.cuts.get(key, 0) > 0:  # promise the whole file, send part of it, hang up
            self.cuts[key] -= 1
            h.send_response(206 if start else 200)
            for k, v in {**headers, "Content-Length": str(len(chunk))}.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(chunk[: len(chunk) // 2] if not start else b"")
            h.wfile.flush()
            h.close_connection = True
            return
        self._reply(h, 206 if start else 200, chunk, headers)

    @staticmethod
    def _reply(h, status: int, payload: bytes, headers: dict, send_body: bool = True) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if "Content-Length" not in headers:
            h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        if send_body:
            h.wfile.write(payload)
