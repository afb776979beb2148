"""LoRA: low-rank adaptation of linear layers (Hu et al. 2021).

A frozen linear layer y = W x + b gets a trainable update of rank r, much smaller than its sizes:

    y = W x + b + multiplier * (alpha / r) * up(down(x))        down: [r, in], up: [out, r]

`down` starts Kaiming-uniform (as nn.Linear initialises its weight) and `up` at zero, so at step 0 the
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

Files are written in the original-release layout ComfyUI loads natively (`down` is `lora_A`, `up` is
`lora_B`, plus a scalar `alpha`) and read in that, the kohya and the diffusers/PEFT layouts (see
`keys.py`). A PEFT file has no alpha tensor: scale 1, unless diffusers' `lora_adapter_metadata`
gives a `lora_alpha`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tuner.errors import CheckpointError, TunerError
from tuner.networks.base import AdapterModule, AdapterNetwork, check_probability
from tuner.networks.keys import (
    COMFY_PREFIX,
    DIFFUSERS_PREFIXES,
    ModuleNameIndex,
    NameMap,
    describe_source,
    read_safetensors,
    split_keys,
)
from tuner.networks.targets import TargetSpec, find_targets

# File suffix -> role. The first two of each role are what tuner and diffusers write, the
# lora_down/lora_up pair is kohya's.
LORA_SUFFIX_ROLES = {
    "lora_A.weight": "down",
    "lora_down.weight": "down",
    "lora_B.weight": "up",
    "lora_up.weight": "up",
    "alpha": "alpha",
}


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
    ) -> None:
        super().__init__(name, base, module_dropout)
        if rank < 1:
            raise TunerError(f"LoRA rank must be at least 1, got {rank}")
        check_probability(dropout, "dropout")
        check_probability(rank_dropout, "rank_dropout")
        self.rank = rank
        self.alpha = float(alpha) if alpha else float(rank)
        self.rank_dropout = rank_dropout
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # Created in the adapter dtype on the base's device, never in the base's dtype: a base
        # stored in fp8 would otherwise give fp8 adapter weights.
        device = base.weight.device
        self.down = nn.Parameter(torch.empty(rank, base.in_features, device=device, dtype=dtype))
        self.up = nn.Parameter(torch.zeros(base.out_features, rank, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.down, a=math.sqrt(5))

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

    def export_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        # alpha stays fp32 whatever the save precision: readers take it with .item(), and bf16 would
        # round values such as 0.3.
        return {
            "lora_A.weight": self.down.to(dtype),
            "lora_B.weight": self.up.to(dtype),
            "alpha": torch.tensor(self.alpha, dtype=torch.float32),
        }

    @torch.no_grad()
    def load(self, weights: LoRAWeights, source: str) -> None:
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

    network_type = "lora"

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
        dtype: torch.dtype = torch.float32,
        name_map: NameMap | None = None,
        prefix: str = COMFY_PREFIX,
    ) -> LoRANetwork:
        """Attach a fresh LoRA to every linear layer `spec` selects. The base model's parameters are
        left as they are (freezing them is the trainer's call); move the network with `.to()`."""
        adapters = [
            LoRAModule(name, layer, rank, alpha, dropout, rank_dropout, module_dropout, dtype)
            for name, layer in find_targets(model, spec).items()
        ]
        return cls(adapters, name_map=name_map, prefix=prefix)

    def param_groups(self, lr: float, loraplus_lr_ratio: float | None = None) -> list[dict[str, Any]]:
        """Optimizer parameter groups. With LoRA+, the up matrices get lr * loraplus_lr_ratio."""
        adapters = [a for a in self if isinstance(a, LoRAModule)]
        if not loraplus_lr_ratio:
            return [{"params": self.trainable_parameters(), "lr": lr, "name": "lora"}]
        down = [p for a in adapters for p in a.parameters() if p.requires_grad and p is not a.up]
        up = [a.up for a in adapters if a.up.requires_grad]
        return [
            {"params": down, "lr": lr, "name": "lora_down"},
            {"params": up, "lr": lr * loraplus_lr_ratio, "name": "lora_up"},
        ]

    def file_metadata(self) -> dict[str, str]:
        adapters = [a for a in self if isinstance(a, LoRAModule)]
        ranks = {a.name: a.rank for a in adapters}
        alphas = {a.name: a.alpha for a in adapters}
        return {
            **super().file_metadata(),
            "tuner.rank": _uniform_or_json(ranks),
            "tuner.alpha": _uniform_or_json(alphas),
        }

    def load_weights(
        self,
        source: str | os.PathLike | Mapping[str, torch.Tensor],
        name_map_inverse: NameMap | None = None,
    ) -> dict[str, str]:
        """Load a LoRA file (any layout) into this network, for resume or continued training. Every
        module of the file must be one of ours and every one of ours must be in the file. Names are
        resolved with the network's own name map; `name_map_inverse` (original -> diffusers name) is
        a fallback for original-layout files when the network was built without one (kohya files
        with original names need the forward map). Alpha is taken from the file. Returns the file's
        metadata ({} for a dict)."""
        weights, metadata = _read_lora(source)
        where = describe_source(source)
        for stem, name in self._resolve_file_modules(weights, where, name_map_inverse).items():
            adapter = self[name]
            assert isinstance(adapter, LoRAModule)
            adapter.load(weights[stem], where)
        return metadata


def load_lora_file(path: str | os.PathLike) -> tuple[dict[str, LoRAWeights], dict[str, str]]:
    """Read a LoRA file in any of the three layouts without a model: tensors per module, keyed by the
    module's stem as written in the file (e.g. `diffusion_model.blocks.0.self_attn.q`), and the
    file's metadata."""
    return _read_lora(path)


def apply_lora_file(
    model: nn.Module,
    path: str | os.PathLike,
    multiplier: float = 1.0,
    name_map: NameMap | None = None,
    prefix: str = COMFY_PREFIX,
    dtype: torch.dtype = torch.float32,
    name_map_inverse: NameMap | None = None,
) -> LoRANetwork:
    """Attach the LoRA stored in `path` to `model` for inference: rank and alpha come from the
    tensors, the network is in eval mode and frozen. `name_map` and `prefix` are the architecture's,
    as used when saving; original-name stems (comfy or kohya) need `name_map`, diffusers/PEFT stems
    need nothing. `name_map_inverse` is a fallback for comfy stems, as in `load_weights`."""
    weights, _ = _read_lora(path)
    where = describe_source(path)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    resolved = ModuleNameIndex(linears, name_map, prefix).resolve(weights, where, name_map_inverse)
    adapters = []
    for stem, name in resolved.items():
        module = LoRAModule(name, linears[name], weights[stem].rank, dtype=dtype)
        module.load(weights[stem], where)
        adapters.append(module)
    network = LoRANetwork(adapters, name_map=name_map, prefix=prefix)
    network.set_multiplier(multiplier)
    network.requires_grad_(False)
    return network.eval()


def _read_lora(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
) -> tuple[dict[str, LoRAWeights], dict[str, str]]:
    where = describe_source(source)
    if isinstance(source, Mapping):
        tensors, metadata = dict(source), {}
    else:
        tensors, metadata = read_safetensors(source)
    peft_alpha = _peft_alpha(metadata, where)
    weights = {}
    for stem, roles in split_keys(tensors, LORA_SUFFIX_ROLES, "LoRA", where).items():
        if "down" not in roles or "up" not in roles:
            raise CheckpointError(
                f"{where}: module {stem!r} lacks its {'up' if 'down' in roles else 'down'} matrix"
            )
        down, up = roles["down"], roles["up"]
        if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
            raise CheckpointError(
                f"{where}: module {stem!r} has down {tuple(down.shape)} and up {tuple(up.shape)}, "
                "expected [rank, in] and [out, rank] (a conv LoRA?)"
            )
        alpha = float(roles["alpha"].item()) if "alpha" in roles else None
        if alpha is None and stem.startswith(DIFFUSERS_PREFIXES):
            alpha = peft_alpha
        weights[stem] = LoRAWeights(down=down, up=up, alpha=alpha)
    return weights, metadata


def _peft_alpha(metadata: Mapping[str, str], where: str) -> float | None:
    """The `lora_alpha` diffusers stores in `lora_adapter_metadata` (keys optionally prefixed with
    `transformer.` when saved by a pipeline). Per-module alpha patterns are refused rather than
    silently ignored."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: lora_adapter_metadata is not JSON: {e}") from e
    config = {key.removeprefix("transformer."): value for key, value in config.items()}
    if config.get("alpha_pattern"):
        raise CheckpointError(f"{where}: per-module alphas (PEFT alpha_pattern) are not supported")
    alpha = config.get("lora_alpha")
    return float(alpha) if alpha else None


def _uniform_or_json(values: Mapping[str, float | int]) -> str:
    """One value when all modules share it (the usual case), else a JSON object per module."""
    distinct = set(values.values())
    return str(distinct.pop()) if len(distinct) == 1 else json.dumps(values)
