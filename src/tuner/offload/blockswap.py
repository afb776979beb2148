"""Block swap: keep N transformer blocks in host memory and stream them to the GPU just before use.

A diffusion transformer is a stack of identical blocks run in order, forward 0 → n-1 and backward
n-1 → 0. Only the block being computed needs its weights on the GPU, so the last N blocks keep their
frozen weights in pinned host memory and a small *ring* of R device slots (R = 2 by default) holds the
ones in use: while block k computes, block k+1 (forward) or k-1 (backward) is already being copied on a
separate CUDA stream. Each copy records an arrival event and the compute stream waits for it right before
the block runs, so compute stalls only when a copy is slower than the block before it (see
`transfer.py`). Swapping the *last* N blocks means the first swapped ones load while the resident blocks
compute, and after the forward pass the ring already holds the blocks the backward pass starts with.

Scheduling follows a window: when swapped block k is about to run, the next R swapped blocks in the
current direction must be on the device; any other block in the ring is dropped (H2D-only mode: nothing
is copied back, the host master is the truth) or copied back first (full mode, for weights that could
change on the device). The backward pass is followed with an identity autograd function on each swapped
block's outputs: its backward runs right before the block's backward, which is when the block is fetched
back (it is normally there already), waited for, and the window moves on in reverse order. A second one
on the inputs reports when the block's backward is done.

Two facts of autograd make this safe:
- With gradient checkpointing (diffusers' or ours), a block's saved tensors are dropped after the forward
  and recomputed in backward — after the output marker has put the block back on the device.
- Without it, autograd saves what backward needs, and `F.linear` saves a *view* of the weight, which
  would keep the block's device copy alive until backward and save nothing. Inside a swapped block a
  saved-tensor hook therefore replaces every saved tensor that lives in a block weight by a reference to
  the weight, and rebuilds it from the weight's current data in backward, when the block is back.

The ring's slots are not fixed buffers: each load allocates from PyTorch's caching allocator on the
compute stream and each drop frees, so a slot's memory is reused only by work ordered after the kernels
that read it (see `transfer.py`), whatever else may still hold a reference.

Trainable parameters (and anything else with requires_grad) never move: they stay on the device. LoRA
adapters are not submodules of the blocks at all (they patch Linear forwards from outside), so they are
untouched too. `blocks_to_swap = "auto"` starts with every block swapped, measures the peak memory of the
first `probe_forwards` passes, and at the next forward un-swaps as many leading blocks as the budget holds.

Given `peers` (the other processes on this machine, swapping the same blocks), the host copies are one
segment of shared memory mapped by all of them instead of one pinned copy each (see `shared.py`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tuner.errors import TunerError
from tuner.offload.shared import Peers, SharedHostCopy, share_host_copies
from tuner.offload.sizing import choose_blocks_to_swap
from tuner.offload.transfer import Transfer

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Block:
    index: int  # position in execution order
    module: nn.Module
    tensors: list[torch.Tensor] = field(default_factory=list)  # frozen params + buffers that travel
    masters: list[torch.Tensor] = field(default_factory=list)  # their host copies
    nbytes: int = 0
    device_copies: list[torch.Tensor] | None = None  # set while in the ring
    arrival: Any = None


class _Forward:
    """Installed as `block.forward` of a swapped block."""

    def __init__(self, swap: BlockSwap, block: _Block):
        self.swap, self.block = swap, block
        self.had_instance_forward = "forward" in block.module.__dict__
        self.original = block.module.forward
        self.signature = signature_of(self.original)

    def __call__(self, *args, **kwargs):
        args, kwargs = as_positional(self.signature, args, kwargs)
        return self.swap._run(self.block, self.original, args, kwargs)


class _BackwardDone(torch.autograd.Function):
    """Identity on a block's inputs; its backward runs once the block's backward has finished."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class _BackwardStart(torch.autograd.Function):
    """Identity on a block's outputs; its backward runs right before the block's backward."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


@dataclass
class _WeightRef:
    """A saved tensor that lives in a block weight, kept as the weight plus the view's geometry."""

    tensor: torch.Tensor
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class BlockSwap:
    """Streams the last `blocks_to_swap` blocks of `model` through a ring of device slots. Create it
    with the model's tensors anywhere (CPU or device); it places everything: non-swapped parts on the
    device, swapped block weights in host memory. Do not call `model.to(device)` afterwards. Given `peers`, each
    of them must create its BlockSwap at the same point (they agree on one shared host copy)."""

    def __init__(
        self,
        model: nn.Module,
        block_lists: Sequence[str],
        blocks_to_swap: int | str,
        transfer: Transfer,
        *,
        mode: str = "h2d_only",
        ring: int = 2,
        budget_bytes: int | None = None,
        probe_forwards: int = 1,
        trace: list[str] | None = None,
        peers: Peers | None = None,
    ):
        if mode not in ("full", "h2d_only"):
            raise TunerError(f"swap mode must be 'full' or 'h2d_only', got {mode!r}")
        if peers is not None and mode == "full":
            raise TunerError(
                "swap mode 'full' copies blocks back to their host copies, which cannot be shared"
            )
        if ring < 1:
            raise TunerError(f"the block-swap ring needs at least one slot, got {ring}")
        self.model, self.transfer, self.mode, self.ring, self.trace = model, transfer, mode, ring, trace
        # a block without tensors (a pipeline stage's stand-in for a block another stage holds) has
        # nothing to stream: the count and the order are the blocks this process holds
        held = [m for m in block_modules(model, block_lists) if next(_tensors(m), None) is not None]
        self.blocks = [_Block(i, m) for i, m in enumerate(held)]
        for block in self.blocks:
            self._collect(block)
        n = len(self.blocks)
        self.auto = blocks_to_swap == "auto"
        count = n if self.auto else int(blocks_to_swap)
        if not 0 <= count <= n:
            raise TunerError(
                f"blocks_to_swap must be between 0 and {n} (the model's blocks), got {blocks_to_swap}"
            )
        self.budget_bytes = budget_bytes
        self.probe_forwards = probe_forwards
        self.swapped: list[_Block] = self.blocks[n - count :]
        self._resident: dict[int, _Block] = {}  # swapped blocks now on the device, by index
        self._order: list[int] = []
        self._position: dict[int, int] = {}
        self._phase: str | None = None  # "forward" | "backward"
        self._outer_checkpoint = False
        self._forwards = 0
        self.decisions: list[int] = []  # N chosen by "auto"
        self.shared: SharedHostCopy | None = None  # the host copies' segment, when shared with `peers`
        self._page_locked = False
        self.sharing = ""  # how the host copies are kept, for the summary (empty: privately, alone)
        self._place(peers)
        self._hook = model.register_forward_pre_hook(self._on_model_forward)

    # --- setup ---------------------------------------------------------------------------------

    def _place(self, peers: Peers | None) -> None:
        """Swapped block weights to host masters, everything else to the device."""
        travelling: set[int] = set()
        masters = iter(self._host_copies([t.data for block in self.swapped for t in block.tensors], peers))
        for block in self.swapped:
            travelling.update(id(t) for t in block.tensors)
            block.masters = [next(masters) for _ in block.tensors]
            for t, master in zip(block.tensors, block.masters):
                t.data = self.transfer.at_rest(master)
            block.module.forward = _Forward(self, block)
        with torch.no_grad():
            for t in _tensors(self.model):
                if id(t) not in travelling and not self.transfer.is_device_tensor(t):
                    t.data = self.transfer.to_device(t.data)

    def _host_copies(self, tensors: list[torch.Tensor], peers: Peers | None) -> list[torch.Tensor]:
        """The host masters of `tensors`: a private pinned copy each, or views of the segment shared with
        `peers`, page-locked here (each process locks its own mapping)."""
        if peers is not None:
            self.shared, self.sharing = share_host_copies(tensors, peers)
            if self.shared is None and self.sharing:
                logger.warning("block swap: %s; this process keeps its own host copy", self.sharing)
                self.sharing = "host copy per process"
            if self.shared is not None:
                self._page_locked = self.transfer.page_lock(self.shared.buffer)
                if not self._page_locked:
                    logger.warning(
                        "block swap: could not page-lock the shared host copy (%s); copies from it wait for the "
                        "host. Set memory.share_swapped_weights = false for a pinned copy per process.",
                        self.shared.path,
                    )
                return self.shared.masters
        return [self.transfer.to_host(t) for t in tensors]

    @staticmethod
    def _collect(block: _Block) -> None:
        seen: set[int] = set()
        for t in _tensors(block.module):
            if id(t) in seen or t.requires_grad:
                continue
            seen.add(id(t))
            block.tensors.append(t)
        block.nbytes = sum(t.numel() * t.element_size() for t in block.tensors)

    def remove(self) -> None:
        """Stop swapping: every block goes to the device for good and the forwards are restored."""
        self._unswap(len(self.swapped))
        self._hook.remove()
        if self.shared is not None and self._page_locked:
            self.transfer.page_unlock(self.shared.buffer)
        self.shared = None

    # --- the schedule ----------------------------------------------------------------------------

    @staticmethod
    def streaming(block: nn.Module) -> BlockSwap | None:
        """The BlockSwap that streams `block`, if one does."""
        forward = block.__dict__.get("forward")
        return forward.swap if isinstance(forward, _Forward) else None

    def forward_starts(self) -> None:
        """A forward through the blocks begins without a call of the model (pipeline stages run their
        blocks themselves, one micro-batch at a time, forwards between backwards under 1F1B)."""
        self._on_model_forward(self.model, ())

    def _on_model_forward(self, module: nn.Module, args: Any) -> None:
        self._forwards += 1
        if self.auto and self._forwards == self.probe_forwards + 1:
            self._resize_to_budget()
        if self._forwards == 1:
            self.transfer.reset_peak()
        self._phase = "forward"
        self._set_order([b.index for b in self.swapped])
        self._outer_checkpoint = torch.is_grad_enabled() and bool(
            getattr(self.model, "gradient_checkpointing", False)
        )
        if self._order:
            self._move_window(self._order[0])

    def _set_order(self, order: list[int]) -> None:
        self._order = order
        self._position = {index: i for i, index in enumerate(order)}

    def _move_window(self, index: int) -> None:
        """Make the R swapped blocks from `index` on (in the current order) resident or in flight."""
        start = self._position[index]
        window = self._order[start : start + self.ring]
        for k in window:
            if k in self._resident:
                continue
            while len(self._resident) >= self.ring:
                victim = next(v for v in self._resident if v not in window)
                self._evict(self._resident[victim])
            self._load(self.blocks[k])

    def _load(self, block: _Block) -> None:
        block.device_copies, block.arrival = self.transfer.load(block.masters)
        for t, copy in zip(block.tensors, block.device_copies):
            t.data = copy
        self._resident[block.index] = block
        self._note(f"load {block.index}")

    def _evict(self, block: _Block) -> None:
        if self.mode == "full":
            self.transfer.store(block.device_copies, block.masters)
        for t, master in zip(block.tensors, block.masters):
            t.data = self.transfer.at_rest(master)
        self.transfer.release(block.device_copies)
        block.device_copies, block.arrival = None, None
        del self._resident[block.index]
        self._note(f"leave {block.index}")

    def _use(self, block: _Block, what: str) -> None:
        if block.index not in self._position:  # called outside the model's forward (or stale order)
            self._set_order([b.index for b in self.swapped])
        self._move_window(block.index)
        self.transfer.wait(block.arrival)
        self._note(f"{what} {block.index}")

    def _note(self, event: str) -> None:
        if self.trace is not None:
            self.trace.append(event)

    # --- one swapped block -----------------------------------------------------------------------

    def _run(self, block: _Block, original: Callable, args: tuple, kwargs: dict):
        recompute = self._phase == "backward"  # checkpointing recomputes the block inside backward
        if recompute:
            if block.index not in self._resident:
                self._use(block, "recompute")
        else:
            if self._phase is None:
                self._on_model_forward(self.model, args)
            self._use(block, "fwd")
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        args = self._mark_inputs(block, args)
        hooks = (
            contextlib.nullcontext()
            if self._outer_checkpoint or recompute
            else self._saved_as_weight_refs(block)
        )
        with hooks:
            out = original(*args, **kwargs)
        if recompute:
            return out
        return _mark_outputs(out, functools.partial(self._backward_start, block), block.index)

    def _mark_inputs(self, block: _Block, args: tuple) -> tuple:
        """Route the inputs that require grad through `_BackwardDone` (it only reports; the schedule moves
        on `_BackwardStart`). Nothing changes which tensors require grad, so a checkpoint's
        recomputation saves exactly what the forward did."""
        marked = [i for i, a in enumerate(args) if _markable(a) and a.requires_grad]
        if not marked:
            return args
        views = _BackwardDone.apply(functools.partial(self._backward_done, block), *(args[i] for i in marked))
        args = list(args)
        for i, v in zip(marked, views):
            args[i] = v
        return tuple(args)

    def _backward_start(self, block: _Block) -> None:
        if self._phase != "backward":
            self._phase = "backward"
            self._set_order([b.index for b in reversed(self.swapped)])
        self._use(block, "bwd")

    def _backward_done(self, block: _Block) -> None:
        self._note(f"bwd-done {block.index}")

    def _saved_as_weight_refs(self, block: _Block):
        by_storage = {t.untyped_storage().data_ptr(): t for t in block.tensors if t.numel()}

        def pack(x: torch.Tensor):
            weight = by_storage.get(x.untyped_storage().data_ptr()) if x.numel() else None
            if weight is None or weight.dtype != x.dtype:
                return x
            return _WeightRef(weight, x.size(), x.stride(), x.storage_offset())

        def unpack(saved):
            if isinstance(saved, _WeightRef):
                return saved.tensor.data.as_strided(saved.size, saved.stride, saved.offset)
            return saved

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    # --- auto sizing -------------------------------------------------------------------------------

    def _resize_to_budget(self) -> None:
        budget = self.budget_bytes or self.transfer.total_bytes()
        n = choose_blocks_to_swap(
            [b.nbytes for b in self.blocks], len(self.swapped), self.transfer.peak_bytes(), budget, self.ring
        )
        self.decisions.append(n)
        self._unswap(len(self.swapped) - n)
        self._note(f"auto {n}")

    def _unswap(self, count: int) -> None:
        """Move the first `count` swapped blocks to the device for good."""
        for block in self.swapped[:count]:
            if block.index in self._resident:
                self._evict(block)
            with torch.no_grad():
                for t, master in zip(block.tensors, block.masters):
                    t.data = self.transfer.to_device(master)
            forward = block.module.__dict__.get("forward")
            if isinstance(forward, _Forward):
                if forward.had_instance_forward:
                    block.module.forward = forward.original
                else:
                    del block.module.forward
            block.masters = []
        self.swapped = self.swapped[count:]
        self._set_order([b.index for b in self.swapped])

    # --- reporting -----------------------------------------------------------------------------------

    @property
    def blocks_to_swap(self) -> int:
        return len(self.swapped)

    def summary(self) -> str:
        if not self.swapped:
            return "block swap off"
        size = max(b.nbytes for b in self.swapped) / 2**20
        return (
            f"{len(self.swapped)} of {len(self.blocks)} blocks swapped ({self.mode}, ring of {self.ring}, "
            f"largest {size:.0f} MiB){' [auto]' if self.auto else ''}{'; ' + self.sharing if self.sharing else ''}"
        )


def block_modules(model: nn.Module, block_lists: Sequence[str]) -> list[nn.Module]:
    """The blocks of `model` in execution order, from its block-list attribute names."""
    blocks: list[nn.Module] = []
    for name in block_lists:
        try:
            container = model.get_submodule(name)  # dotted paths too (a text encoder's `encoder.block`)
        except AttributeError:
            raise TunerError(f"{type(model).__name__} has no block list {name!r}") from None
        blocks.extend(container)
    if not blocks:
        raise TunerError(f"{type(model).__name__} has no blocks in {list(block_lists)}")
    return blocks


def signature_of(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def as_positional(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Keyword arguments that can be passed by position, moved there (diffusers calls some blocks with
    keywords; the markers here and torch's checkpoint only see positional tensors)."""
    if not kwargs or signature is None:
        return args, kwargs
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return args, kwargs
    return bound.args, bound.kwargs


def _tensors(module: nn.Module):
    yield from module.parameters()
    yield from module.buffers()


def _markable(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def _mark_outputs(out: Any, callback: Callable, index: int):
    if isinstance(out, torch.Tensor):
        return _BackwardStart.apply(callback, out)[0] if _markable(out) else out
    if isinstance(out, tuple) and any(_markable(o) for o in out):
        marked = [i for i, o in enumerate(out) if _markable(o)]
        views = _BackwardStart.apply(callback, *(out[i] for i in marked))
        result = list(out)
        for i, v in zip(marked, views):
            result[i] = v
        return tuple(result)
    raise TunerError(
        f"block {index} returned {type(out).__name__}; block swap needs a tensor or a tuple of tensors"
    )
