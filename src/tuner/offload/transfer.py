"""Where swapped weights and offloaded activations travel: a CUDA copy stream, or a fake device on CPU.

Block swap and activation offload decide *what* moves *when*; a `Transfer` does the moving. The CUDA one
copies on side streams so copies overlap compute, and orders the two with events instead of waiting on
the host:

- A block load allocates device memory on the compute stream, makes the copy stream wait for an event
  recorded on the compute stream *now* (so memory freed by earlier kernels is not overwritten while they
  still read it), copies from pinned host memory with `non_blocking=True`, and records an *arrival*
  event on the copy stream. The compute stream waits for that event right before the block runs, so it
  stalls only when the copy is slower than the compute before it.
- Dropping a block (H2D-only mode) just drops the device tensors: the caching allocator reuses their
  memory for later compute-stream work, which is ordered after the kernels that read them.
- Copying a block back (full mode) waits for the compute stream, copies device → host on the copy stream
  and marks the device tensors as used by that stream (`record_stream`), so the allocator does not hand
  their memory out before the copy has read it.
- Activations leave on a second copy stream (device → host and host → device use separate copy engines)
  with the same event discipline.

`FakeTransfer` runs all of that on the CPU so tests drive the real scheduling: its "device" tensors are
separate CPU tensors, tensors at rest are poisoned with NaN (a block computed while not loaded gives NaN),
fresh device tensors start as NaN and their copies are queued until someone waits for the arrival event
(`lazy=True`: computing before the wait gives NaN), and every operation is logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Packed:
    """An activation parked in host memory until backward needs it."""

    host: torch.Tensor
    device: torch.device
    ready: Any = None  # event after which `host` holds the data


class Transfer:
    """What block swap and activation offload need from a device. See the module docstring."""

    device: torch.device

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """The host master copy of a weight (pinned on CUDA)."""
        raise NotImplementedError

    def at_rest(self, master: torch.Tensor) -> torch.Tensor:
        """What a weight's `.data` points to while its block is not on the device."""
        return master

    def load(self, masters: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """Start copying `masters` to the device; returns the device tensors and the arrival event."""
        raise NotImplementedError

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for `event` (no host synchronisation)."""
        raise NotImplementedError

    def store(self, device_tensors: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        """Copy device tensors back into their masters once the compute issued so far is done."""
        raise NotImplementedError

    def release(self, device_tensors: list[torch.Tensor]) -> None:
        """The scheduler no longer uses these device tensors (their memory may be reused)."""

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A synchronous copy onto the device (setup, and blocks that stop being swapped)."""
        return t.to(self.device)

    def page_lock(self, host: torch.Tensor) -> bool:
        """Page-lock host memory allocated elsewhere (a shared mapping, `shared.py`) so copies from it are
        asynchronous; False when the system refuses (copies from it then wait for the host)."""
        return True

    def page_unlock(self, host: torch.Tensor) -> None:
        """Undo `page_lock` before the memory is unmapped."""

    def offload(self, t: torch.Tensor) -> Packed:
        raise NotImplementedError

    def restore(self, packed: Packed) -> torch.Tensor:
        raise NotImplementedError

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.device == self.device

    def peak_bytes(self) -> int:
        """Peak device memory allocated since the last `reset_peak`."""
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError

    def total_bytes(self) -> int:
        """The device's memory."""
        raise NotImplementedError


class CudaTransfer(Transfer):
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.load_stream = torch.cuda.Stream(self.device)
        self.offload_stream = torch.cuda.Stream(self.device)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)
        return host

    def page_lock(self, host: torch.Tensor) -> bool:
        # what `pin_memory=True` gives, for memory torch did not allocate (cudaHostRegisterPortable = 1)
        return (
            int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 1))
            == 0
        )

    def page_unlock(self, host: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())

    def load(self, masters):
        tensors = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in masters]
        self.load_stream.wait_stream(self._compute())
        with torch.cuda.stream(self.load_stream):
            for dst, src in zip(tensors, masters):
                dst.copy_(src, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.load_stream)
        return tensors, arrived

    def wait(self, event) -> None:
        self._compute().wait_event(event)

    def store(self, device_tensors, masters) -> None:
        self.load_stream.wait_stream(self._compute())
        with torch.cuda.stream(self.load_stream):
            for src, dst in zip(device_tensors, masters):
                dst.copy_(src, non_blocking=True)
                src.record_stream(self.load_stream)

    def offload(self, t: torch.Tensor) -> Packed:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.offload_stream.wait_stream(self._compute())
        with torch.cuda.stream(self.offload_stream):
            host.copy_(t, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.offload_stream)
        t.record_stream(self.offload_stream)
        return Packed(host, t.device, ready)

    def restore(self, packed: Packed) -> torch.Tensor:
        self._compute().wait_event(packed.ready)
        return packed.host.to(packed.device, non_blocking=True)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def total_bytes(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory


class FakeTransfer(Transfer):
    """A CPU stand-in for a GPU that makes scheduling mistakes visible (see the module docstring).

    `log` lists ("load" | "store" | "wait" | "release" | "offload" | "restore", tag) tuples, where a tag
    is what `label` returns for the first tensor (tests set it to name blocks), and ("page_lock" |
    "page_unlock", bytes) for shared host copies (`lockable` says what page_lock answers). `device_bytes` counts the bytes of
    block weights on the "device" (loaded and not yet released, or moved for good); `peak_bytes()` is
    their peak plus `extra_bytes` (what a test says the rest of the model and the activations take)."""

    def __init__(self, lazy: bool = True, extra_bytes: int = 0, total: int = 1 << 40):
        self.device = torch.device("cpu")
        self.lazy = lazy
        self.extra_bytes = extra_bytes
        self.total = total
        self.log: list[tuple[str, Any]] = []
        self.label = lambda t: None
        self._pending: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self._next_event = 0
        self._device_ids: dict[int, int] = {}  # storage pointer -> bytes, for live device tensors
        self.device_bytes = 0
        self._peak = 0
        self.lockable = True
        self.page_locked: set[int] = set()  # addresses page-locked and not unlocked

    # weights
    def to_host(self, t):
        return t.detach().clone()

    def at_rest(self, master):
        return _poisoned(master)

    def load(self, masters):
        tensors = [_poisoned(m) for m in masters]
        for t in tensors:
            self._track(t)
        event = self._next_event
        self._next_event += 1
        self.log.append(("load", self.label(masters[0]) if masters else None))
        copies = list(zip(tensors, masters))
        if self.lazy:
            self._pending.append((event, copies))
        else:
            _copy_all(copies)
        return tensors, event

    def wait(self, event) -> None:
        while self._pending and self._pending[0][0] <= event:
            _copy_all(self._pending.pop(0)[1])
        self.log.append(("wait", event))

    def store(self, device_tensors, masters) -> None:
        self.log.append(("store", self.label(masters[0]) if masters else None))
        _copy_all(list(zip(masters, device_tensors)))

    def release(self, device_tensors) -> None:
        # Poisoned, so anything still reading them (a saved view, a late kernel) gives NaN.
        self.log.append(("release", self.label(device_tensors[0]) if device_tensors else None))
        for t in device_tensors:
            self.device_bytes -= self._device_ids.pop(t.untyped_storage().data_ptr(), 0)
            with torch.no_grad():
                t.copy_(_poisoned(t))

    def to_device(self, t):
        out = t.detach().clone()
        self._track(out)
        return out

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._device_ids

    def page_lock(self, host: torch.Tensor) -> bool:
        self.log.append(("page_lock", host.numel() * host.element_size()))
        self.page_locked.add(host.data_ptr())
        return self.lockable

    def page_unlock(self, host: torch.Tensor) -> None:
        self.log.append(("page_unlock", host.numel() * host.element_size()))
        self.page_locked.discard(host.data_ptr())

    # activations
    def offload(self, t):
        self.log.append(("offload", tuple(t.shape)))
        return Packed(t.detach().clone(), t.device)

    def restore(self, packed):
        self.log.append(("restore", tuple(packed.host.shape)))
        return packed.host.clone()

    # memory
    def _track(self, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        self._device_ids[t.untyped_storage().data_ptr()] = size
        self.device_bytes += size
        self._peak = max(self._peak, self.device_bytes)

    def peak_bytes(self) -> int:
        return self._peak + self.extra_bytes

    def reset_peak(self) -> None:
        self._peak = self.device_bytes

    def total_bytes(self) -> int:
        return self.total


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    if out.is_floating_point():
        out.fill_(float("nan"))
    else:
        out.copy_(like)
    return out


def _copy_all(pairs) -> None:
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)


def transfer_for(device: torch.device | str) -> Transfer:
    """The real transfer for `device`: CUDA streams. Other devices have no swap support yet."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTransfer(device)
    from tuner.errors import TunerError

    raise TunerError(
        f"block swap and activation offload need a CUDA device, got {device}. Set memory.blocks_to_swap = 0 "
        "and memory.activation_offload = false."
    )
