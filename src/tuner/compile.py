"""Regional compilation: `torch.compile` on each repeated transformer block instead of the whole model.

A diffusion transformer is a stack of N identical blocks (Wan 14B: 40, FLUX.1: 19 + 38) wrapped in a
little glue (embedders, the output head). Compiling the whole model traces all N blocks into one graph:
minutes of compile time for a large model, and any change anywhere (a new resolution, a graph break in
the glue) recompiles everything. But the blocks run the same code on weights of the same shapes, so
one compiled block can serve them all.

How torch.compile makes that work: TorchDynamo caches compiled code per Python *code object* (here the
block class's `forward`), each entry with *guards*, the conditions under which it is valid (input
shapes and dtypes, `requires_grad`, `self.training`, Python values it read). The block's parameters are
graph inputs, not constants (`inline_inbuilt_nn_modules`, the default), so block 7 passes the guards
block 0's graph was compiled under and reuses it. A guard that checks an object's *identity* breaks
this: every block fails it and compiles its own copy, and after `torch._dynamo.config.recompile_limit`
copies (8) the rest run uncompiled, silently. Dynamo guards a callable *object* by identity, which is
why tuner's forward patches (adapters in `tuner.networks.base`, fp8 in `tuner.fp8`) install bound
methods, which are guarded by their function, shared by every layer.

What is compiled and when: `compile_blocks` replaces each block's `forward` with `torch.compile` of
it. Nothing is traced until the first call, so whatever is attached *inside* a block before then
(fp8 weights, the attention backend, adapters) is part of the traced code. Wrappers around a block
(activation checkpointing, block swap, `tuner.offload`) must stay *outside* the compiled code: they
move weights between devices and wait on CUDA streams. Attach them after `compile_blocks`; they then
wrap the compiled forward (`tuner.memory.apply_memory_settings` does it in that order). diffusers' own
gradient checkpointing calls the block from outside too.

Expect a few compiles, not one: the first block's input does not require grad when only adapters
train (the others' do), evaluation and sampling run in eval mode without grad, and a second latent size
makes dynamo recompile with dynamic shapes. Each is compiled once and reused by every block; on a CPU
each costs seconds. `torch._dynamo.utils.counters["stats"]["unique_graphs"]`, or a counting backend
as in the tests, shows how many there were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tuner.offload.blockswap import block_modules


@dataclass
class CompiledBlocks:
    """What `compile_blocks` changed, to take it off again."""

    modules: list[nn.Module]
    originals: list[Callable | None] = field(default_factory=list)  # the instance forward, or None

    def remove(self) -> None:
        for module, original in zip(self.modules, self.originals):
            if original is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original


def compile_blocks(
    model: nn.Module, block_lists: Sequence[str], *, backend: str | Callable = "inductor", **options
) -> CompiledBlocks:
    """Compile each block of `model`'s block lists (regional compilation; see the module docstring).
    `backend` and `options` (`mode`, `dynamic`, ...) go to `torch.compile`. Call it before activation
    checkpointing or block swap wrap the blocks."""
    modules = block_modules(model, block_lists)
    handle = CompiledBlocks(modules)
    for module in modules:
        handle.originals.append(module.__dict__.get("forward"))
        module.forward = torch.compile(module.forward, backend=backend, **options)
    return handle
