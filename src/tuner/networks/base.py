"""What every adapter network shares: attaching to linear layers from outside, and the collection.

An adapter (LoRA, LoHa, LoKr, ...) adds a learned update to a frozen linear layer:

    y = W x + b + multiplier * delta(x)        (delta(x) = dW x for a weight update dW)

The layer is not replaced. Replacing it would rename the base model's state_dict keys (breaking
checkpoint loading, block swap and fp8 patching, which all address layers by name). Instead, as with
diffusers' own hooks, the layer's `forward` is patched from outside: an `_AdapterHook` is set as the
instance attribute `forward`, calls the original forward and adds the output of each attached adapter.
Several adapters may sit on one layer (two LoRAs at inference) and be removed in any order. When the
last one goes the original forward comes back, unless someone wrapped `forward` after us (diffusers'
layerwise casting does); then our hook stays as a pass-through rather than tearing out their wrapper.

Precision: adapter parameters are fp32 by default whatever the base weight's dtype (bf16, or fp8
storage upcast per call): the adapter computes in its own dtype and its output is cast to the base
output's dtype (the input's dtype, outside autocast) before the add. Small low-rank updates would
mostly round away in bf16.

Training-time regularisation shared by all adapter types: *module dropout* skips a whole adapter for
one call with probability p. It, and the adapters' own dropouts, act only while the adapter is in train
mode (`network.train()`), independent of the base model's mode.

`AdapterNetwork` holds the adapters by diffusers module name and owns what does not depend on the
adapter type: parameters, multiplier, merge, and writing files in the original-release ("comfy")
layout described in `keys.py`. Each adapter type subclasses `AdapterModule` (its tensors and delta)
and `AdapterNetwork` (how it is built from a model, how its files are read).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from tuner.errors import CheckpointError, TunerError
from tuner.io import save_safetensors
from tuner.networks.keys import COMFY_PREFIX, ModuleNameIndex, NameMap, identity_name_map

_HOOK_ATTR = "_tuner_adapter_hook"


def check_probability(p: float, what: str) -> None:
    """Dropout probabilities must leave something to keep (p = 1 would divide by zero)."""
    if not 0.0 <= p < 1.0:
        raise TunerError(f"{what} must be in [0, 1), got {p}")


class _AdapterHook:
    """Installed as `layer.forward`: original forward plus each attached adapter's output."""

    def __init__(self, layer: nn.Module) -> None:
        self.had_instance_forward = "forward" in layer.__dict__
        self.original = layer.forward  # bound method, or an earlier patch (kept so we can restore it)
        self.adapters: list[AdapterModule] = []

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = self.original(x, *args, **kwargs)
        for adapter in self.adapters:
            if not adapter.skips_this_call():
                y = y + (adapter(x) * adapter.multiplier).to(y.dtype)
        return y


class AdapterModule(nn.Module):
    """One adapter on one `nn.Linear`. Subclasses create their parameters and implement `forward`
    (x -> delta output in the adapter's dtype, scale included, multiplier not), `delta_weight` and
    `export_tensors`."""

    def __init__(self, name: str, base: nn.Linear, module_dropout: float = 0.0) -> None:
        super().__init__()
        check_probability(module_dropout, "module_dropout")
        self.name = name
        self.multiplier = 1.0
        self.module_dropout = module_dropout
        # A tuple hides the base layer from nn.Module: the adapter's parameters(), state_dict() and
        # .to() must never include (or move) the frozen base weights.
        self._base = (base,)

    @property
    def base(self) -> nn.Linear:
        return self._base[0]

    def delta_weight(self) -> torch.Tensor:
        """The update dW as an fp32 [out, in] matrix, scale included, multiplier not."""
        raise NotImplementedError

    def export_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The tensors written to a file, keyed by their comfy-layout suffix."""
        raise NotImplementedError

    def skips_this_call(self) -> bool:
        if self.multiplier == 0:
            return True
        return self.training and self.module_dropout > 0 and torch.rand(()).item() < self.module_dropout

    @property
    def attached(self) -> bool:
        hook = self.base.__dict__.get(_HOOK_ATTR)
        return hook is not None and any(a is self for a in hook.adapters)

    def attach(self) -> None:
        """Start adding this adapter's output to the base layer's."""
        if self.attached:
            return
        layer = self.base
        hook = layer.__dict__.get(_HOOK_ATTR)
        if hook is None:
            hook = _AdapterHook(layer)
            layer.__dict__[_HOOK_ATTR] = hook
            layer.forward = hook
        hook.adapters.append(self)

    def remove(self) -> None:
        """Stop adding this adapter's output; restores the original forward when none is left."""
        layer = self.base
        hook = layer.__dict__.get(_HOOK_ATTR)
        if hook is None:
            return
        hook.adapters = [a for a in hook.adapters if a is not self]
        if not hook.adapters and layer.__dict__.get("forward") is hook:
            if hook.had_instance_forward:
                layer.forward = hook.original
            else:
                del layer.forward
            del layer.__dict__[_HOOK_ATTR]

    @torch.no_grad()
    def merge_into_base(self) -> None:
        """Add multiplier * dW to the base weight (summed in fp32, stored in the base's dtype), then
        detach, so the layer alone computes what layer + adapter did."""
        weight = self.base.weight
        if not weight.is_floating_point():
            raise TunerError(
                f"cannot merge the adapter on {self.name}: its weight is stored as {weight.dtype}"
            )
        delta = self.delta_weight().to(weight.device) * self.multiplier
        weight.copy_((weight.float() + delta).to(weight.dtype))
        self.remove()


class AdapterNetwork(nn.Module):
    """The adapters applied to one model, by diffusers module name. Creating one attaches them."""

    network_type: ClassVar[str]

    def __init__(
        self,
        adapters: Iterable[AdapterModule],
        name_map: NameMap | None = None,
        prefix: str = COMFY_PREFIX,
    ) -> None:
        super().__init__()
        # A ModuleList, not a ModuleDict: module names contain dots, which ModuleDict keys may not.
        self.adapters = nn.ModuleList(adapters)
        self._by_name: dict[str, AdapterModule] = {a.name: a for a in self.adapters}
        self.name_map = name_map or identity_name_map
        self.prefix = prefix
        self.attach()

    # --- the collection ---------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._by_name)

    def __getitem__(self, name: str) -> AdapterModule:
        return self._by_name[name]

    def __iter__(self) -> Iterator[AdapterModule]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def set_multiplier(self, multiplier: float) -> None:
        """Strength of every adapter; 0 turns them off (and skips their compute), 1 is as trained."""
        for adapter in self:
            adapter.multiplier = float(multiplier)

    def attach(self) -> None:
        for adapter in self:
            adapter.attach()

    def remove(self) -> None:
        """Detach every adapter; the model computes as before `apply_to`. `attach()` undoes this."""
        for adapter in self:
            adapter.remove()

    def merge_into_base(self) -> None:
        """Fold every adapter (at its current multiplier) into its base weight and detach it. The
        network is then spent: its adapters no longer act, and attaching them again would count
        them twice."""
        for adapter in self:
            adapter.merge_into_base()

    # --- files ------------------------------------------------------------------------------------

    def file_name(self, module_name: str, name_map: NameMap | None = None) -> str:
        """The stem under which a module's tensors are written: prefix + original-release name."""
        return self.prefix + (name_map or self.name_map)(module_name)

    def file_state_dict(
        self, dtype: torch.dtype = torch.float32, name_map: NameMap | None = None
    ) -> dict[str, torch.Tensor]:
        """The tensors in the comfy layout: `<prefix><original name>.<suffix>`. `name_map` overrides
        the network's own for this call."""
        state: dict[str, torch.Tensor] = {}
        owner: dict[str, str] = {}
        for adapter in self:
            stem = self.file_name(adapter.name, name_map)
            if stem in owner:
                raise TunerError(f"the name map sends both {owner[stem]} and {adapter.name} to {stem}")
            owner[stem] = adapter.name
            for suffix, tensor in adapter.export_tensors(dtype).items():
                state[f"{stem}.{suffix}"] = tensor.detach().cpu()
        return state

    def file_metadata(self) -> dict[str, str]:
        """What the network knows about itself; subclasses add their hyperparameters."""
        return {
            "tuner.network_type": self.network_type,
            "tuner.format": "comfy",
            "tuner.targets": json.dumps(self.names()),
        }

    def save(
        self,
        path: str | os.PathLike,
        name_map: NameMap | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Write the adapter atomically in the layout ComfyUI loads natively. `name_map` overrides the
        network's own for this file. `metadata` from the caller (str -> str; structured values as
        JSON) is stored too; the network's own `tuner.*` entries win over the caller's."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TunerError(f"adapter save precision must be fp32, bf16 or fp16, got {dtype}")
        merged = {**(metadata or {}), **self.file_metadata()}
        save_safetensors(self.file_state_dict(dtype, name_map), path, metadata=merged)

    def _resolve_file_modules(
        self, stems: Iterable[str], source: str, name_map_inverse: NameMap | None = None
    ) -> dict[str, str]:
        """Map a file's stems onto this network's modules; every module must be covered."""
        index = ModuleNameIndex(self.names(), self.name_map, self.prefix)
        resolved = index.resolve(stems, source, name_map_inverse)
        covered = set(resolved.values())
        missing = [name for name in self.names() if name not in covered]
        if missing:
            raise CheckpointError(
                f"{source}: {len(missing)} adapted modules have no weights in the file, e.g. "
                f"{[self.file_name(n) for n in missing[:5]]} (saved with other targets?)"
            )
        return resolved
