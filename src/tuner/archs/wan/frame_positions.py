"""Chosen RoPE time positions for Wan's latent frames, attached to a model from outside.

diffusers' `WanRotaryPosEmbed` (`model.rope`) gives latent frame f the time position f. One-frame training
(`tuner.archs.wan.trainer_1f`) places its frames at chosen indices instead (a reference at 0, the target at
a later time), as musubi-tuner's Wan model takes `f_indices`. A forward hook on `model.rope` replaces the
time part of its output (the first `t_dim` channels of each token's cos / sin) with the rows of the
module's own frequency tables at those indices; the spatial parts are left as computed.
tests/test_wan_1f.py checks that indices 0, 1, ... leave the output unchanged, so a change of the
upstream module's layout fails there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def frame_positions(model: nn.Module, indices: Sequence[int]) -> Iterator[None]:
    """While inside, `model` (a `WanTransformer3DModel`) gives its latent frames the time positions
    `indices` (one per latent frame, the transformer's time patch being 1)."""
    rope = model.rope

    def hook(module: nn.Module, args: tuple, out: tuple[torch.Tensor, torch.Tensor]):
        frames, t_dim = len(indices), module.t_dim
        where = torch.as_tensor(indices, device=module.freqs_cos.device)
        placed = []
        for value, table in zip(out, (module.freqs_cos, module.freqs_sin)):
            value = value.reshape(frames, -1, value.shape[-1]).clone()
            value[..., :t_dim] = table[where, :t_dim].to(value)[:, None]
            placed.append(value.reshape(out[0].shape))
        return tuple(placed)

    handle = rope.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
