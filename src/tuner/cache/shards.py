"""Reading tensors out of a shard by slicing one memory map, without copying.

A shard is a plain safetensors file: an 8-byte little-endian header length, a JSON header mapping
each tensor name to its dtype, shape and byte range, then the tensor data. `ShardReader` maps the
file once, parses the header once, and turns each read into `torch.frombuffer` over a slice of the
map: no syscall, no copy; pages are faulted in from the page cache when the tensor is first used.

Why not `safetensors.safe_open(...).get_tensor`: it does the same in spirit but each call costs more;
measured on 2 CPU cores, a read plus a `torch.stack` of a 1.7 MiB bf16 latent took 96 us this way
against 119 us through `safe_open` (and 213 us for `load_file` of one file per entry); for 0.6 MiB
text embeddings 58 us against 90 us.

The map is private copy-on-write (`ACCESS_COPY`): a caller that edits a returned tensor in place
gets its own copy of those pages and never writes to the shard (a read-only map would crash the
process with SIGSEGV instead). A map stays valid after its file is deleted or replaced by a
compaction: the old inode lives on until the last map of it is gone. Note that the copy belongs to
the map, not to the tensor: a later read of the same bytes through the same map sees the edit, so
code that edits in place should copy first (training stacks entries into a fresh batch tensor).

A read can also be split across processes (`tuner.cache.reads`): `locate` turns a tensor name into
a `TensorLocation` (absolute file offset, dtype, shape), a few dozen bytes that any process can
`view` through its own map of the same shard. Shards are immutable and never renamed, so a
location stays valid as long as its file exists, and forever for a process that has it mapped.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors dtype names (the format's spec) and the torch dtypes they hold.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SUPPORTED_DTYPES = frozenset(DTYPES.values())


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """Return a safetensors file's header dict and the offset where its data starts."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return header, 8 + length


def shard_data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file: its size minus the length field and the header."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - length


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor lies in a shard file. Small and picklable: what crosses process boundaries."""

    name: str  # the entry's name for the tensor (without the shard's prefix)
    offset: int  # byte offset of the data from the start of the file
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


class ShardReader:
    """One memory-mapped shard. Cheap to keep open: it holds a mapping, not a file descriptor."""

    def __init__(self, path: str | os.PathLike):
        self._header, self._data_start = read_header(path)
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._located: dict[str, TensorLocation] = {}  # by stored name; a read is then one lookup

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor stored under `name`, backed by the map."""
        return self.view(self.locate(name))

    def locate(self, name: str, prefix: str = "") -> TensorLocation:
        """Where the tensor stored under `prefix + name` lies (the location calls it `name`)."""
        stored = prefix + name
        location = self._located.get(stored)
        if location is None:
            info = self._header[stored]
            offset = self._data_start + info["data_offsets"][0]
            location = TensorLocation(name, offset, DTYPES[info["dtype"]], tuple(info["shape"]))
            self._located[stored] = location
        return location

    def view(self, location: TensorLocation) -> torch.Tensor:
        """The tensor at `location` (found in this shard by any process), backed by this map."""
        count = math.prod(location.shape)
        if count == 0:  # frombuffer refuses empty slices
            return torch.empty(location.shape, dtype=location.dtype)
        flat = torch.frombuffer(self._map, dtype=location.dtype, count=count, offset=location.offset)
        return flat.view(location.shape)

    def prefetch(self, location: TensorLocation) -> None:
        """Bring the tensor's bytes into the OS page cache, reading them from disk if they are not
        there yet; returns when they are. Copies no tensor data into this process."""
        if location.nbytes == 0:
            return
        if hasattr(mmap, "MADV_WILLNEED"):  # not on Windows
            # One readahead request for the whole range instead of one per page fault below.
            start = location.offset - location.offset % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_WILLNEED, start, location.offset + location.nbytes - start)
        # Read one byte of every page: each fault waits for its page to arrive (the kernel maps
        # cached neighbours along with it, so this is a few dozen faults per MiB).
        with memoryview(self._map) as pages:
            bytes(pages[location.offset : location.offset + location.nbytes : mmap.PAGESIZE])
