"""Atomic file writes.

Nothing tuner writes may be left half-written: a crash or a kill during a save must leave either the
previous file or the new one, never a truncated mix. Every writer goes through `atomic_path`, which
hands out a temporary name in the same directory and renames it over the target only after the
data is flushed to disk (rename within one filesystem is atomic on POSIX and Windows).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success fsync it and rename it to `path`."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None
) -> None:
    """Save tensors atomically. Metadata values that are not strings are stored as JSON."""
    meta = None
    if metadata:
        meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    contiguous = {k: v.detach().contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(contiguous, str(tmp), metadata=meta)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
