"""Atomic file writes, and the one reader of a safetensors file's header.

Nothing tuner writes may be left half-written: a crash or a kill during a save must leave either the
previous file or the new one, never a truncated mix. Every writer goes through `atomic_path`, which
hands out a temporary name in the same directory and renames it over the target only after the
data is flushed to disk (rename within one filesystem is atomic on POSIX and Windows).

A safetensors file starts with an 8-byte little-endian length and that many bytes of JSON (name ->
dtype, shape, data offsets; plus `__metadata__`), then the tensor data. `safetensors_header_bytes` and
`safetensors_header` read it without the data for the checkpoint loaders and the cache, which wrap its
`NotSafetensors` in their own errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError
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
        try:
            save_file(contiguous, str(tmp), metadata=meta)
        except SafetensorError as e:  # its I/O errors as the OSError they are, so every caller handles them
            code = re.search(r"os error (\d+)|code: (\d+)", str(e))
            if code is None:
                raise
            number = int(code.group(1) or code.group(2))
            raise OSError(number, os.strerror(number), str(path)) from e


def probe_writable(folder: Path) -> None:
    """Create `folder` if needed and write and remove an empty file in it; raises the `OSError` a later
    write would meet (read-only mount, permissions, a file where the folder should be)."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".tuner-write-test-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------------------------------------------
# Reading safetensors headers
# ---------------------------------------------------------------------------------------------------

MAX_HEADER_BYTES = 100_000_000  # a longer "header" means the file is not safetensors (or is damaged)


class NotSafetensors(ValueError):
    """A file's start is not a safetensors header (too short, a length past its end, not a JSON object);
    the message says which, in words that follow "not a readable checkpoint (...)"."""


def safetensors_header_bytes(f: BinaryIO, max_bytes: int = MAX_HEADER_BYTES) -> bytes:
    """The header of the safetensors file open as `f` (binary, seekable), unparsed: the bytes after its
    8-byte length, read from the start of the file. Raises `NotSafetensors` when the length does not fit."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise NotSafetensors(f"the file has only {size} bytes")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(size - 8, max_bytes):
        raise NotSafetensors(f"its header claims {length} bytes but the file has {size}")
    return f.read(length)


def safetensors_header(path: str | os.PathLike) -> tuple[dict, int]:
    """The parsed header of a safetensors file (its `__metadata__` included) and the offset where its
    data starts. Raises `NotSafetensors` when the file does not start with one."""
    with open(path, "rb") as f:
        raw = safetensors_header_bytes(f)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotSafetensors(f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise NotSafetensors("its header is not a JSON object")
    return header, 8 + len(raw)
