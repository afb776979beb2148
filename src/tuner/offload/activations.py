"""Activation checkpointing with the saved block inputs offloaded to pinned host memory.

Gradient checkpointing keeps only each block's *inputs* from the forward pass and recomputes everything
inside the block during backward. For a video model those inputs are still large — Wan 14B at 480×832×81
frames holds a 32760 × 5120 bf16 hidden state per block, 335 MB, times 40 blocks — and they sit idle from
the block's forward until its backward. Here each block runs under torch's non-reentrant checkpoint,
wrapped in a saved-tensor hook: the checkpoint saves its inputs through that hook, which copies them to
pinned host memory on a side stream (non-blocking) and lets the device copy go; backward brings them back
just before the block is recomputed. Everything saved *inside* the checkpointed block goes to the
checkpoint's own hook (the innermost hook wins) and is dropped as usual, so only block inputs travel.

Tensors under `min_bytes` (timestep embeddings, rotary tables of short sequences) stay on the device:
their copies would cost more than they save.

This replaces diffusers' own checkpointing for the blocks it wraps (the model's flag is switched off, and
turning it back on is refused at the next forward: two nested checkpoints would recompute twice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tuner.errors import TunerError
from tuner.offload.blockswap import as_positional, block_modules, signature_of
from tuner.offload.transfer import Packed, Transfer


class _CheckpointedForward:
    def __init__(self, owner: CheckpointBlocks, module: nn.Module):
        self.owner = owner
        self.had_instance_forward = "forward" in module.__dict__
        self.original = module.forward
        self.signature = signature_of(self.original)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        args, kwargs = as_positional(self.signature, args, kwargs)  # only positional inputs are offloaded
        self.owner._check_model_flag()
        hooks = self.owner._offload_hooks() if self.owner.offload else contextlib.nullcontext()
        with hooks:
            return checkpoint(self.original, *args, use_reentrant=False, **kwargs)


class CheckpointBlocks:
    """Checkpoints every block of the given block lists; with `offload`, their saved inputs go to host
    memory through `transfer`. Attach before block swap (block swap then wraps these forwards)."""

    def __init__(
        self,
        model: nn.Module,
        block_lists: Sequence[str],
        *,
        offload: bool,
        transfer: Transfer | None = None,
        min_bytes: int = 1 << 20,
    ):
        if offload and transfer is None:
            raise TunerError("activation offload needs a transfer device")
        self.model, self.offload, self.transfer, self.min_bytes = model, offload, transfer, min_bytes
        if getattr(model, "gradient_checkpointing", False):
            model.disable_gradient_checkpointing()
        self.modules = block_modules(model, block_lists)
        for module in self.modules:
            module.forward = _CheckpointedForward(self, module)

    def _check_model_flag(self) -> None:
        if getattr(self.model, "gradient_checkpointing", False):
            raise TunerError(
                "the model's own gradient checkpointing was switched on after activation offload was set up; "
                "enable gradient checkpointing before apply_memory_settings (which then takes over)."
            )

    def _offload_hooks(self):
        transfer, min_bytes = self.transfer, self.min_bytes

        def pack(t: torch.Tensor):
            if t.device != transfer.device or t.numel() * t.element_size() < min_bytes:
                return t
            return transfer.offload(t)

        def unpack(saved):
            return transfer.restore(saved) if isinstance(saved, Packed) else saved

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def remove(self) -> None:
        for module in self.modules:
            forward = module.__dict__.get("forward")
            if isinstance(forward, _CheckpointedForward):
                if forward.had_instance_forward:
                    module.forward = forward.original
                else:
                    del module.forward
