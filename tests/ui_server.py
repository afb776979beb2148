"""A live `tuner ui` server in a subprocess, for the browser tests (and the script that takes the README's
screenshots): started through the real CLI on a free loopback port, stopped with SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`python -m tuner ui ARGS...`; `address` is the line it printed (with `?token=` when it has one)."""

    def __init__(self, *args: str, host: str = "127.0.0.1"):
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tuner", "ui", "--host", host, "--port", str(self.port), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        self.output: list[str] = []
        self.address = self._wait_for_address()
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_until_listening()

    def _wait_for_address(self, timeout: float = 120) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            self.output.append(line)
            m = re.search(r"tuner ui: (\S+)", line)
            if m:
                return m.group(1)
        self.stop()
        raise RuntimeError("tuner ui did not start:\n" + "".join(self.output))

    def _wait_until_listening(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"tuner ui printed its address but does not listen on port {self.port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def ui_client(app, base_url: str = "http://127.0.0.1:7860"):
    """A TestClient of `app` that behaves as the UI's own pages: it holds the session's CSRF cookie (from a
    first request) and sends the token with every request, as the pages' script does."""
    from fastapi.testclient import TestClient

    client = TestClient(app, base_url=base_url)
    client.get("/favicon.ico")  # any answer sets the cookie
    client.headers["X-CSRF-Token"] = client.cookies.get("tuner_ui_csrf", "")
    return client
