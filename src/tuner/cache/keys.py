"""Cache keys: what an encoded entry depends on, reduced to one hex digest.

A cached latent or text embedding is valid only while everything that produced it is unchanged: the
source file's bytes, the parameters of the encode (bucket size, frame indices, crop box, caption
text...) and the encoder itself (architecture, weights, dtype, and the version of our encode code).
Tools that name cache files after the source file and only check that the file exists serve stale
entries after any of those change. Here an entry is addressed by a digest of all of them, so a
change simply makes a different key, which is missing, which gets encoded.

Hashing choices:

- Source files are hashed whole (blake2b, streamed in 1 MiB blocks): they are small to medium and a
  changed pixel must change the key. `CacheStore.hash_source` memoizes this by (path, size, mtime).
- Model weights can be 30 GB, too big to hash on every run. `fingerprint_weights` hashes the file
  size, the full safetensors header (every tensor's name, dtype, shape and offsets) and 1 MiB read
  at 8 evenly spaced offsets. A fine-tune of the same architecture changes the sampled bytes; a
  different layout changes the header. It is an identity check, not a security check: an edit that
  touches no sampled chunk and keeps the size goes unnoticed.
- Keys hash a canonical JSON (sorted keys, no whitespace, no NaN) so that the same inputs give the
  same key in every process, on every machine, in every Python version.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from tuner.errors import CheckpointError, DataError
from tuner.io import NotSafetensors, safetensors_header_bytes

_BLOCK = 1 << 20  # read size for streamed hashing
_SAMPLE_BYTES = 1 << 20  # bytes read per sampled chunk of a weights file
_SAMPLE_COUNT = 8  # sampled chunks per weights file
_MAX_HEADER = 100 << 20  # larger "headers" mean the file is not safetensors
# Bumped when the key payload below changes shape, so old keys can never collide with new ones.
_KEY_SCHEMA = 1
# Files in a model folder that do not change what the model computes.
_IGNORED_NAMES = {"README.md", "LICENSE", "LICENSE.txt", "LICENSE.md"}


def _blake2b() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=32)


def hash_file(path: str | os.PathLike) -> str:
    """Return the blake2b hex digest of a file's bytes, read in 1 MiB blocks."""
    h = _blake2b()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
    except FileNotFoundError:
        raise DataError(f"source file not found: {path}") from None
    return h.hexdigest()


def _safetensors_header(f) -> bytes | None:
    """Return the JSON header of a safetensors file, or None if `f` is not one."""
    try:
        header = safetensors_header_bytes(f, _MAX_HEADER)
    except NotSafetensors:
        return None
    return header if header[:1] == b"{" else None


def _fingerprint_file(path: Path, h: hashlib.blake2b) -> None:
    size = path.stat().st_size
    h.update(f"size={size}\n".encode())
    with open(path, "rb") as f:
        header = _safetensors_header(f)
        start = 0
        if header is not None:
            h.update(b"safetensors-header\n")
            h.update(header)
            start = 8 + len(header)
        span = size - start
        if span <= _SAMPLE_BYTES * _SAMPLE_COUNT:
            # Small enough to read whole: as cheap as sampling and exact.
            f.seek(start)
            while block := f.read(_BLOCK):
                h.update(block)
            return
        # Evenly spaced chunks, the first at the start of the data and the last at its end.
        last = span - _SAMPLE_BYTES
        for i in range(_SAMPLE_COUNT):
            f.seek(start + i * last // (_SAMPLE_COUNT - 1))
            h.update(f.read(_SAMPLE_BYTES))


def _model_files(folder: Path) -> list[Path]:
    files = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        # Hidden files and folders (.cache, .git, .gitattributes) are download bookkeeping.
        if any(part.startswith(".") for part in rel.parts) or p.name in _IGNORED_NAMES:
            continue
        if p.is_file():
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def fingerprint_weights(path: str | os.PathLike) -> str:
    """Return a cheap identity digest of a weights file or a model folder (e.g. a diffusers folder).

    For a file: its size, its safetensors header if it has one, and 8 sampled 1 MiB chunks (the whole
    data when under 8 MiB). For a folder: every file's relative path and fingerprint, where JSON
    files (configs) are hashed whole because a changed config value changes the model.
    """
    p = Path(path)
    h = _blake2b()
    if p.is_file():
        h.update(b"tuner-weights-file-v1\n")
        _fingerprint_file(p, h)
    elif p.is_dir():
        h.update(b"tuner-weights-folder-v1\n")
        files = _model_files(p)
        if not files:
            raise CheckpointError(f"model folder {p} holds no files; point to the downloaded model")
        for f in files:
            if f.suffix == ".json":
                digest = hash_file(f)
            else:
                sub = _blake2b()
                _fingerprint_file(f, sub)
                digest = sub.hexdigest()
            h.update(f"{f.relative_to(p).as_posix()}\0{digest}\n".encode())
    else:
        raise CheckpointError(f"model weights not found: {p}")
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class EncoderIdentity:
    """Everything about an encoder (VAE or text encoder) that changes what it outputs."""

    architecture: str
    """Model family and role, e.g. "wan2.1-vae" or "umt5-xxl"."""
    weights_fingerprint: str
    """`fingerprint_weights` of the weights file or folder that was loaded."""
    dtype: str
    """Compute dtype of the encode, e.g. "bfloat16" (bf16 and fp32 encodes differ)."""
    format_version: int
    """Version of our encode code for this architecture; bump it when preprocessing changes."""

    def label(self) -> str:
        """Short human-readable name for `CacheStore.info` (store it as entry meta "encoder")."""
        return f"{self.architecture}/{self.dtype}/v{self.format_version}/{self.weights_fingerprint[:8]}"


def _reject(value: object) -> object:
    raise TypeError(
        f"cache key params and entry metadata must be JSON values (str, int, float, bool, None, "
        f"list, dict); "
        f"got {type(value).__name__}: {value!r}"
    )


def canonical_json(value: object) -> str:
    """Serialize `value` the same way everywhere: sorted keys, no whitespace, no NaN."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_reject
    )


@functools.lru_cache(maxsize=64)
def _fields(encoder: EncoderIdentity) -> dict:
    # asdict is slow (a deep copy per call) and an encoder is shared by thousands of keys
    return dataclasses.asdict(encoder)


def entry_key(kind: str, source_hash: str, params: Mapping, encoder: EncoderIdentity) -> str:
    """Return the hex digest addressing one cache entry.

    `kind` names what is stored ("latent", "text", ...), `source_hash` is `hash_file` of the source
    (or of the caption text for text entries), `params` holds every setting that changes the result.
    """
    if not kind:
        raise ValueError("kind must be a non-empty string")
    payload = {
        "schema": _KEY_SCHEMA,
        "kind": kind,
        "source": source_hash,
        "params": dict(params),
        "encoder": _fields(encoder),
    }
    return hashlib.blake2b(canonical_json(payload).encode(), digest_size=32).hexdigest()
