"""What an architecture declares for pipeline stages, and how blocks are cut into stages.

`ArchitectureModel.pipeline_parts` returns a `PipelineParts`: its forward as a prologue, its blocks, how one
block is called and an epilogue, with only tensors between them (`tuner.distributed.pipeline` runs them
on several processes). `balanced_stages` cuts the blocks into stages of about equal parameter count.
Plain data and arithmetic: the family folders build on it, the pipeline strategy runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Carried = tuple[torch.Tensor, ...]


@dataclass
class PipelineParts:
    """A transformer's forward cut at its blocks, as `predict` calls it; only tensors between the parts."""

    prologue: Callable[[torch.Tensor, torch.Tensor, dict], Carried]
    """(x_t, t, cond) → the tensors the first block takes (and those later blocks or the epilogue need)."""
    blocks: list[nn.Module]
    """In the order the forward runs them."""
    run_block: Callable[[nn.Module, Carried], Carried]
    """One block on the carried tensors → the carried tensors for the next."""
    epilogue: Callable[[Carried, torch.Tensor, torch.Tensor, dict], torch.Tensor]
    """(carried after the last block, x_t, t, cond) → the prediction, as `predict` returns it."""
    prologue_modules: tuple[nn.Module, ...] = ()
    """The modules only the prologue uses (embeddings): the stages after the first free them."""

    def predict(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The whole forward through the parts (equals `predict`; the tests check it)."""
        carried = self.prologue(noisy, t, cond)
        for block in self.blocks:
            carried = self.run_block(block, carried)
        return self.epilogue(carried, noisy, t, cond)


def cut_at_blocks(model: nn.Module, family, inputs: Callable[[torch.Tensor, torch.Tensor, dict], dict],
                  blocks, prologue_modules) -> PipelineParts:  # fmt: skip
    """The parts of a model whose family module cuts its forward as `embed(model, inputs)` (the forward up
    to its first block on the transformer's keyword arguments), `run_block(model, block, carried)` and
    `project_out(model, carried, noisy)` (the prediction); `inputs(noisy, t, cond)` gives those arguments."""
    return PipelineParts(
        prologue=lambda noisy, t, cond: family.embed(model, inputs(noisy, t, cond)),
        blocks=list(blocks),
        run_block=lambda block, carried: family.run_block(model, block, carried),
        epilogue=lambda carried, noisy, t, cond: family.project_out(model, carried, noisy),
        prologue_modules=tuple(m for m in prologue_modules if m is not None),
    )


def call_block(model: nn.Module, block: nn.Module, *args):
    """Call a block as the model's own loop does: through its checkpointing function when gradient
    checkpointing is on (diffusers' `enable_gradient_checkpointing`)."""
    if torch.is_grad_enabled() and getattr(model, "gradient_checkpointing", False):
        return model._gradient_checkpointing_func(block, *args)
    return block(*args)


def optional(value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A tensor-or-None the blocks take, as a carried tensor: None travels as an empty tensor."""
    return like.new_zeros(0) if value is None else value


def given(value: torch.Tensor) -> torch.Tensor | None:
    """`optional`'s tensor back: None where it was empty."""
    return value if value.numel() else None


def unpatchify(tokens: torch.Tensor, height: int, width: int, patch: int) -> torch.Tensor:
    """Output tokens [B, (H/p)·(W/p), p·p·C] in row-major patch order, each patch's values (row, column,
    channel) → latents [B, C, H, W]: the last step of DiT-style image transformers' forwards (SD3's,
    AuraFlow's)."""
    b, rows, cols = tokens.shape[0], height // patch, width // patch
    grid = tokens.reshape(b, rows, cols, patch, patch, -1)
    return grid.permute(0, 5, 1, 3, 2, 4).reshape(b, -1, rows * patch, cols * patch)


def balanced_stages(sizes: list[int], stages: int) -> list[range]:
    """Cut blocks of these sizes into `stages` contiguous non-empty runs whose largest total is the
    smallest possible (a linear partition, by dynamic programming: a few hundred blocks at most)."""
    n = len(sizes)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {stages} stages")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the smallest largest-stage total cutting the first i blocks into k runs; cut[k][i]: where
    # the last of those runs starts
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    runs, end = [], n
    for k in range(stages, 0, -1):
        runs.append(range(cut[k][end], end))
        end = cut[k][end]
    return runs[::-1]


def cut_stages(parts: PipelineParts, stages: int) -> list[range]:
    """The blocks each stage holds: balanced by parameter count, the prologue's modules counted with the
    first block (the first stage holds them)."""
    sizes = [sum(p.numel() for p in block.parameters()) for block in parts.blocks]
    sizes[0] += sum(p.numel() for m in parts.prologue_modules for p in m.parameters())
    return balanced_stages(sizes, stages)
