"""LoRA: low-rank adaptation of linear layers (Hu et al. 2021).

A frozen linear layer y = W x + b gets a trainable update of rank r, much smaller than its sizes:

    y = W x + b + multiplier * (alpha / r) * up(down(x))        down: [r, in], up: [out, r]

`down` starts Kaiming-uniform (as nn.Linear initialises its weight; drawn from the module's own
generator seeded from the run's seed, `base.init_generator`) and `up` at zero, so at step 0 the
model's output is unchanged while gradients still reach `up`. `alpha` keeps the update's size from
depending on r (alpha = r gives scale 1; alpha None or 0 means alpha = r). `multiplier` is the strength
chosen at inference, 1 as trained.

Regularisation, only while the network is in train mode:
- `dropout`: ordinary dropout on the input to `down`.
- `rank_dropout`: zeroes random rank channels of down(x) (one draw per sample, shared across tokens)
  and rescales the rest by 1 / (1 - p), so the expected update is unchanged.
- `module_dropout`: skips the whole adapter for a call (see `base.py`).

LoRA+ (Hayou et al. 2024): `up` learns better with a larger learning rate than `down`;
`param_groups(lr, loraplus_lr_ratio)` puts the up matrices in their own group with lr * ratio.

DoRA (`dora=True`, see `dora.py`) learns a magnitude per input column on top of the LoRA direction.

Files are written in the original-release layout ComfyUI loads natively (`down` is `lora_A`, `up` is
`lora_B`, plus a scalar `alpha`) or the diffusers / kohya layouts, and read in any of them (see
`formats.py`). A PEFT file has no alpha tensor: scale 1, unless diffusers' `lora_adapter_metadata`
gives a `lora_alpha`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tuner.errors import CheckpointError, TunerError
from tuner.networks.base import AdapterModule, AdapterNetwork, adapter_device, init_generator
from tuner.networks.delta import LORA, ModuleWeights
from tuner.networks.dora import wrap_dora
from tuner.networks.formats import read_modules
from tuner.networks.keys import COMFY_PREFIX, NameMap
from tuner.networks.targets import TargetSpec, find_targets


@dataclass
class LoRAWeights:
    """One module's LoRA tensors as read from a file."""

    down: torch.Tensor
    """[rank, in]"""
    up: torch.Tensor
    """[out, rank]"""
    alpha: float | None
    """None when the file has none; None or 0 means alpha = rank (scale 1)."""

    @property
    def rank(self) -> int:
        return self.down.shape[0]


class LoRAModule(AdapterModule):
    """A LoRA adapter on one `nn.Linear`; parameters `down` [rank, in] and `up` [out, rank]."""

    kind = LORA

    def __init__(
        self,
        name: str,
        base: nn.Linear,
        rank: int,
        alpha: float | None = None,
        dropout: float = 0.0,
        rank_dropout: float = 0.0,
        module_dropout: float = 0.0,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        super().__init__(name, base, module_dropout, dropout, rank_dropout)
        if rank < 1:
            raise TunerError(f"LoRA rank must be at least 1, got {rank}")
        self.rank = rank
        self.alpha = float(alpha) if alpha else float(rank)
        # Created in the adapter dtype on the base's device, never in the base's dtype: a base
        # stored in fp8 would otherwise give fp8 adapter weights.
        device = adapter_device(base)
        down = torch.empty(rank, base.in_features)  # drawn on the CPU in fp32 (`init_generator`)
        nn.init.kaiming_uniform_(down, a=math.sqrt(5), generator=init_generator(seed, name))
        self.down = nn.Parameter(down.to(device=device, dtype=dtype))
        self.up = nn.Parameter(torch.zeros(base.out_features, rank, device=device, dtype=dtype))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(self.dropout(x.to(self.down.dtype)), self.down)
        scale = self.scale
        if self.training and self.rank_dropout > 0:
            # One keep-mask per sample, broadcast over the token dimensions: [batch, 1, ..., rank].
            shape = (h.shape[0],) + (1,) * (h.ndim - 2) + (self.rank,) if h.ndim > 1 else (self.rank,)
            keep = torch.rand(shape, device=h.device) >= self.rank_dropout
            h = h * keep.to(h.dtype)
            scale = scale / (1.0 - self.rank_dropout)
        return F.linear(h, self.up) * scale

    def delta_weight(self) -> torch.Tensor:
        return (self.up.float() @ self.down.float()) * self.scale

    def weights(self) -> ModuleWeights:
        return ModuleWeights(LORA, {"down": self.down.detach(), "up": self.up.detach()}, self.alpha)

    def up_parameters(self) -> list[nn.Parameter]:
        return [self.up]

    @torch.no_grad()
    def load(self, weights: LoRAWeights | ModuleWeights, source: str) -> None:
        if isinstance(weights, ModuleWeights):
            self.check_kind(weights, source)
            weights = LoRAWeights(weights.tensors["down"], weights.tensors["up"], weights.alpha)
        if weights.down.shape != self.down.shape or weights.up.shape != self.up.shape:
            raise CheckpointError(
                f"{source}: {self.name}: the file has down {tuple(weights.down.shape)} and up "
                f"{tuple(weights.up.shape)}, the network expects {tuple(self.down.shape)} and {tuple(self.up.shape)}"
            )
        self.down.copy_(weights.down)
        self.up.copy_(weights.up)
        self.alpha = weights.alpha if weights.alpha else float(self.rank)


class LoRANetwork(AdapterNetwork):
    """LoRA adapters on the targeted linear layers of one model."""

    @classmethod
    def apply_to(
        cls,
        model: nn.Module,
        spec: TargetSpec,
        rank: int,
        alpha: float | None = None,
        *,
        dropout: float = 0.0,
        rank_dropout: float = 0.0,
        module_dropout: float = 0.0,
        dora: bool = False,
        dtype: torch.dtype = torch.float32,
        name_map: NameMap | None = None,
        prefix: str = COMFY_PREFIX,
        seed: int = 0,
    ) -> LoRANetwork:
        """Attach a fresh LoRA to every linear layer `spec` selects, initialised from `seed` (the run's).
        The base model's parameters are left as they are (freezing them is the trainer's call); move the
        network with `.to()`."""
        adapters = [
            wrap_dora(
                LoRAModule(name, layer, rank, alpha, dropout, rank_dropout, module_dropout, dtype, seed), dora
            )
            for name, layer in find_targets(model, spec).items()
        ]
        return cls(adapters, name_map=name_map, prefix=prefix)


def load_lora_file(path: str | os.PathLike) -> tuple[dict[str, LoRAWeights], dict[str, str]]:
    """Read a LoRA file in any of the three layouts without a model: tensors per module, keyed by the
    module's stem as written in the file (e.g. `diffusion_model.blocks.0.self_attn.q`), and the
    file's metadata. (`formats.read_modules` reads every adapter type.)"""
    modules, metadata = read_modules(path, {LORA})
    return {s: LoRAWeights(w.tensors["down"], w.tensors["up"], w.alpha) for s, w in modules.items()}, metadata
