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
adapter type: parameters (and LoRA+ groups), multiplier, merge, and files. Each adapter hands its
tensors over as a layout-independent `ModuleWeights` (`delta.py`) and takes them back in `load`; the
network writes them in any layout of `formats.py` (the original-release "comfy" layout by default) and
reads files of any layout. Each adapter type subclasses `AdapterModule` (its parameters, forward and
delta) and `AdapterNetwork` (how it is built from a model).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from tuner.errors import CheckpointError, TunerError
from tuner.io import save_safetensors
from tuner.networks.delta import KIND_NAMES, ModuleWeights
from tuner.networks.formats import LAYOUTS, describe_modules, layout_state, module_tensors, read_modules
from tuner.networks.fused import expand_fused
from tuner.networks.keys import (
    COMFY_PREFIX,
    KOHYA_PREFIXES,
    ModuleNameIndex,
    NameMap,
    describe_source,
    identity_name_map,
)

_HOOK_ATTR = "_tuner_adapter_hook"


def init_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator one adapter module draws its initial values from, seeded from the run's seed and
    the module's name: neither the global RNG (so nothing built before the network) nor the other modules
    (so changing `network.include`) shift them, and a seed gives the same adapter on any device."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def adapter_device(base: nn.Module) -> torch.device:
    """Where an adapter of the layer `base` is created: on the base's device, or on the CPU where the base
    was left on the meta device (a pipeline stage's view of the blocks other stages hold and load). Under a
    meta default device (`with torch.device("meta")`: shapes alone, as `benchmarks/distributed_memory.py`
    counts parameters) adapters stay on meta too."""
    device = base.weight.device
    if device.type == "meta" and torch.get_default_device().type != "meta":
        return torch.device("cpu")
    return device


def check_probability(p: float, what: str) -> None:
    """Dropout probabilities must leave something to keep (p = 1 would divide by zero)."""
    if not 0.0 <= p < 1.0:
        raise TunerError(f"{what} must be in [0, 1), got {p}")


def base_weight(layer: nn.Linear, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The frozen layer's weight as `dtype`, dequantized when it is stored in fp8 with scales
    (`tuner.fp8`); fp8 storage without scales (diffusers' layerwise casting) is a plain cast."""
    scale = getattr(layer, "fp8_scale", None)
    if scale is not None:
        from tuner.fp8 import dequantize_weight

        return dequantize_weight(layer.weight, scale, dtype)
    return layer.weight.to(dtype)


def drop_output_channels(y: torch.Tensor, p: float) -> torch.Tensor:
    """Rank dropout for adapters whose update is a whole matrix (LoHa, LoKr) rather than a rank-r
    bottleneck: zero random output channels of the update, one draw per sample shared across tokens,
    and rescale the rest by 1 / (1 - p) so the expected update is unchanged."""
    shape = (y.shape[0],) + (1,) * (y.ndim - 2) + (y.shape[-1],) if y.ndim > 1 else y.shape
    keep = torch.rand(shape, device=y.device) >= p
    return y * keep.to(y.dtype) / (1.0 - p)


class _AdapterHook:
    """Its bound `__call__` is installed as `layer.forward`: original forward plus each adapter's output."""

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
    (x -> delta output in the adapter's dtype, scale included, multiplier not), `delta_weight`,
    `weights` / `load` (their tensors as a `ModuleWeights`) and `up_parameters`."""

    kind: ClassVar[str]
    """"lora", "loha" or "lokr" (see `delta.py`)."""

    def __init__(
        self,
        name: str,
        base: nn.Linear,
        module_dropout: float = 0.0,
        dropout: float = 0.0,
        rank_dropout: float = 0.0,
    ) -> None:
        """The regularisation every type shares: `dropout` on the adapter's input, `rank_dropout`
        (each type says what it drops) and `module_dropout`; all act only in train mode."""
        super().__init__()
        for p, what in (
            (module_dropout, "module_dropout"),
            (dropout, "dropout"),
            (rank_dropout, "rank_dropout"),
        ):
            check_probability(p, what)
        self.name = name
        self.multiplier = 1.0
        self.module_dropout = module_dropout
        self.rank_dropout = rank_dropout
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # A tuple hides the base layer from nn.Module: the adapter's parameters(), state_dict() and
        # .to() must never include (or move) the frozen base weights.
        self._base = (base,)

    @property
    def base(self) -> nn.Linear:
        return self._base[0]

    def delta_weight(self) -> torch.Tensor:
        """The update dW as an fp32 [out, in] matrix, scale included, multiplier not."""
        raise NotImplementedError

    def weights(self) -> ModuleWeights:
        """The adapter's tensors (detached, not copied) as a file stores them."""
        raise NotImplementedError

    def load(self, weights: ModuleWeights, source: str) -> None:
        """Take over a file's tensors; `CheckpointError` naming `source` when they do not fit."""
        raise NotImplementedError

    def up_parameters(self) -> list[nn.Parameter]:
        """The parameters on the output side (LoRA's up), which LoRA+ trains with a larger rate."""
        raise NotImplementedError

    def export_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The tensors written to a file, keyed by their comfy-layout suffix."""
        return module_tensors(self.weights(), "comfy", dtype)

    def check_kind(self, weights: ModuleWeights, source: str) -> None:
        if weights.kind != self.kind:
            raise CheckpointError(
                f"{source}: {self.name} is a {KIND_NAMES[weights.kind]} in the file, but this network "
                f"trains {KIND_NAMES[self.kind]} (set network.type to match the file)"
            )
        if weights.dora_scale is not None:
            raise CheckpointError(f"{source}: {self.name} is a DoRA in the file; set network.dora = true")

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
            # the bound method, not the hook: torch.compile guards a callable object by identity, so each
            # block would compile its own graph; a bound method is guarded by the function they share
            layer.forward = hook.__call__
        hook.adapters.append(self)

    def remove(self) -> None:
        """Stop adding this adapter's output; restores the original forward when none is left."""
        layer = self.base
        hook = layer.__dict__.get(_HOOK_ATTR)
        if hook is None:
            return
        hook.adapters = [a for a in hook.adapters if a is not self]
        if not hook.adapters and getattr(layer.__dict__.get("forward"), "__self__", None) is hook:
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
        if not weight.is_floating_point() or hasattr(self.base, "fp8_scale"):
            raise TunerError(
                f"cannot merge the adapter on {self.name}: its weight is stored as {weight.dtype}"
                + (
                    " with scales (merge into the checkpoint file with `tuner lora merge`)"
                    if weight.is_floating_point()
                    else ""
                )
            )
        delta = self.delta_weight().to(weight.device) * self.multiplier
        weight.copy_((weight.float() + delta).to(weight.dtype))
        self.remove()


class AdapterNetwork(nn.Module):
    """The adapters applied to one model, by diffusers module name. Creating one attaches them."""

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
        self.lr_by_prefix: dict[str, float] = {}  # module-name prefix -> its learning rate (`param_groups`)
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

    @property
    def network_type(self) -> str:
        """The adapters' kind ("lora", "loha", "lokr"), or "mixed" for a file that mixes them."""
        kinds = {adapter.kind for adapter in self}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def param_groups(self, lr: float, loraplus_lr_ratio: float | None = None) -> list[dict[str, Any]]:
        """Optimizer parameter groups. Adapters whose name starts with a key of `lr_by_prefix` (SDXL's
        text encoders, `te1.` / `te2.`) train at that key's rate, the others at `lr`. With LoRA+, the
        output-side parameters (`up_parameters`: LoRA's up matrices) get the rate × loraplus_lr_ratio."""
        own = tuple(self.lr_by_prefix)
        parts = {"": [a for a in self if not a.name.startswith(own)] if own else list(self)}
        parts |= {prefix: [a for a in self if a.name.startswith(prefix)] for prefix in own}
        groups = []
        for prefix, adapters in parts.items():
            name = self.network_type + (f"_{prefix.rstrip('.')}" if prefix else "")
            if adapters:
                groups += _groups(adapters, self.lr_by_prefix.get(prefix, lr), loraplus_lr_ratio, name)
        return groups

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Hook for networks that change how the optimizer steps (full fine-tune's stochastic
        rounding); adapters train in fp32 and need nothing."""
        return optimizer

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

    def weights(self) -> dict[str, ModuleWeights]:
        """Every adapter's tensors, by diffusers module name."""
        return {adapter.name: adapter.weights() for adapter in self}

    def file_name(self, module_name: str, name_map: NameMap | None = None) -> str:
        """The stem under which a module's tensors are written: prefix + original-release name (the
        diffusers name for a module the name map does not know, such as a part of a fused layer)."""
        try:
            return self.prefix + (name_map or self.name_map)(module_name)
        except KeyError:
            return module_name

    def file_state_dict(
        self, dtype: torch.dtype = torch.float32, name_map: NameMap | None = None
    ) -> dict[str, torch.Tensor]:
        """The tensors in the comfy layout: `<prefix><original name>.<suffix>`. `name_map` overrides
        the network's own for this call."""
        return layout_state(
            self.weights(), "comfy", name_map or self.name_map, prefix=self.prefix, dtype=dtype
        )[0]

    def file_metadata(self, format: str = "comfy") -> dict[str, str]:
        """What the network knows about itself, as a file in `format` stores it: type, targets, rank,
        alpha, DoRA."""
        own = {"tuner.targets": json.dumps(self.names()), "tuner.format": format}
        return {**describe_modules(self.weights(), format), **own}

    def save(
        self,
        path: str | os.PathLike,
        name_map: NameMap | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
        dtype: torch.dtype = torch.float32,
        format: str = "comfy",
    ) -> None:
        """Write the adapter atomically in `format` (comfy, the layout ComfyUI loads natively; diffusers;
        or kohya, see `formats.py`). `name_map` overrides the network's own for this file. `metadata`
        from the caller (str -> str; structured values as JSON) is stored too; the network's own
        `tuner.*` entries win over the caller's."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TunerError(f"adapter save precision must be fp32, bf16 or fp16, got {dtype}")
        if format not in LAYOUTS:
            raise TunerError(f"unknown adapter format {format!r}; choose one of {', '.join(LAYOUTS)}")
        state, layout_metadata = layout_state(
            self.weights(), format, name_map or self.name_map, prefix=self.prefix, dtype=dtype
        )
        merged = {**(metadata or {}), **layout_metadata, **self.file_metadata(format)}
        save_safetensors(state, path, metadata=merged)

    def load_weights(
        self,
        source: str | os.PathLike | Mapping[str, torch.Tensor],
        name_map_inverse: NameMap | None = None,
    ) -> dict[str, str]:
        """Load an adapter file (any layout) into this network, for resume or continued training. Every
        module of the file must be one of ours and every one of ours must be in the file. Names are
        resolved with the network's own name map; `name_map_inverse` (original -> diffusers name) is
        a fallback for original-layout files when the network was built without one (kohya files
        with original names need the forward map). alpha is taken from the file. Returns the file's
        metadata ({} for a dict)."""
        modules, metadata = read_modules(source, {adapter.kind for adapter in self})
        where = describe_source(source)
        fused = getattr(self.name_map, "fused", ())
        modules = expand_fused(modules, fused, metadata, self.prefix, KOHYA_PREFIXES)
        for stem, name in self._resolve_file_modules(modules, where, name_map_inverse).items():
            self[name].load(modules[stem], where)
        return metadata

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


def _groups(
    adapters: list[AdapterModule], lr: float, loraplus_lr_ratio: float | None, name: str
) -> list[dict]:
    """One optimizer group of the adapters' trainable parameters, or two with LoRA+ (up × ratio)."""
    trainable = [p for adapter in adapters for p in adapter.parameters() if p.requires_grad]
    if not loraplus_lr_ratio:
        return [{"params": trainable, "lr": lr, "name": name}]
    up_ids = {id(p) for adapter in adapters for p in adapter.up_parameters()}
    return [
        {"params": [p for p in trainable if id(p) not in up_ids], "lr": lr, "name": f"{name}_down"},
        {
            "params": [p for p in trainable if id(p) in up_ids],
            "lr": lr * loraplus_lr_ratio,
            "name": f"{name}_up",
        },
    ]
