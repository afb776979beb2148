"""Building networks: from the `[network]` config for training, and from a file for inference.

`build_network` is the one call a trainer makes, whatever is trained. It reads the config section by
attribute (`type`, `rank`, `alpha`, dropouts, `include` / `exclude`, `dora`, LoKr's `factor`,
`decompose_both`, `full_matrix`, and `stochastic_rounding` for a full fine-tune) and turns it into flat
arguments of one constructor. Every result has the same interface (`TrainableNetwork`).

`apply_adapter_file` attaches whatever a file holds (LoRA, LoHa, LoKr, each with or without DoRA, in the
comfy, kohya or diffusers layout, from tuner or another trainer) to a model for inference; shapes,
ranks and alphas come from the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from tuner.errors import ConfigError, TunerError
from tuner.networks.base import AdapterModule, AdapterNetwork
from tuner.networks.delta import LOHA, LOKR, LORA, ModuleWeights
from tuner.networks.dora import DoRAModule
from tuner.networks.formats import layout_state, read_modules
from tuner.networks.full import FullNetwork
from tuner.networks.fused import expand_fused
from tuner.networks.keys import COMFY_PREFIX, KOHYA_PREFIXES, ModuleNameIndex, NameMap, describe_source
from tuner.networks.loha import LoHaModule, LoHaNetwork
from tuner.networks.lokr import LoKrLayout, LoKrModule, LoKrNetwork
from tuner.networks.lora import LoRAModule, LoRANetwork
from tuner.networks.options import check_network_options
from tuner.networks.targets import TargetSpec


class TrainableNetwork(Protocol):
    """What the trainer needs from whatever it trains."""

    def param_groups(self, lr: float, loraplus_lr_ratio: float | None = None) -> list[dict[str, Any]]: ...
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer: ...
    def load_weights(
        self, source: str | os.PathLike, name_map_inverse: NameMap | None = None
    ) -> dict[str, str]: ...
    def save(self, path: str | os.PathLike, name_map: NameMap | None = None, *, metadata=None, dtype=torch.float32,
             format: str = "comfy") -> None: ...  # fmt: skip
    def to(self, *args: Any, **kwargs: Any) -> Any: ...
    def parameters(self, recurse: bool = True) -> Any: ...
    def __len__(self) -> int: ...


def build_network(
    model: nn.Module,
    default_targets: Sequence[str],
    cfg: Any,
    name_map: NameMap | None,
    *,
    seed: int = 0,
    save_format: str | None = None,
) -> AdapterNetwork | FullNetwork:
    """The network the `[network]` section `cfg` describes, attached to `model` (adapters are fp32; the
    base model is left as it is, except that a full fine-tune makes its weights trainable). `seed` (the
    run's) seeds the adapters' initial values (`base.init_generator`) and a full fine-tune's stochastic
    rounding. With `save_format`, an adapter that could not be saved in that layout
    is refused now rather than after training."""
    check_network_options(cfg)
    if cfg.type == "full":
        return FullNetwork(model, stochastic_rounding=cfg.stochastic_rounding, seed=seed)
    spec = TargetSpec(tuple(default_targets), tuple(cfg.include), tuple(cfg.exclude))
    common = {
        "dropout": cfg.dropout,
        "rank_dropout": cfg.rank_dropout,
        "module_dropout": cfg.module_dropout,
        "dora": cfg.dora,
        "name_map": name_map,
        "seed": seed,
    }
    if cfg.type == "lokr":
        lokr = {"factor": cfg.factor, "decompose_both": cfg.decompose_both, "full_matrix": cfg.full_matrix}
        network = LoKrNetwork.apply_to(model, spec, cfg.rank, cfg.alpha, **lokr, **common)
    else:
        network_class = LoHaNetwork if cfg.type == "loha" else LoRANetwork
        network = network_class.apply_to(model, spec, cfg.rank, cfg.alpha, **common)
    _check_exportable(network, name_map, save_format)
    return network


def _check_exportable(network: AdapterNetwork, name_map: NameMap | None, save_format: str | None) -> None:
    """Write the saved file's tensors once, now, and drop them: a layer the release's layout has no name
    for, or a fused layer adapted only in part, would otherwise fail the save after training."""
    if name_map is None or save_format is None:
        return
    try:
        layout_state(network.weights(), save_format, name_map, prefix=network.prefix)
    except (KeyError, TunerError) as e:
        raise ConfigError(
            f"network.include / exclude: the adapter could not be saved in the {save_format} layout after "
            f"training ({e.args[0] if e.args else e}); change the targets"
        ) from None


# ---------------------------------------------------------------------------------------------------
# From a file
# ---------------------------------------------------------------------------------------------------


def module_from_weights(
    name: str, layer: nn.Linear, weights: ModuleWeights, dtype: torch.dtype, source: str
) -> AdapterModule:
    """An adapter shaped like `weights` on `layer`, holding its tensors."""
    if weights.kind == LORA:
        module: AdapterModule = LoRAModule(name, layer, weights.rank, weights.alpha, dtype=dtype)
    elif weights.kind == LOHA:
        module = LoHaModule(name, layer, weights.rank, weights.alpha, dtype=dtype)
    else:
        module = LoKrModule(name, layer, 0, weights.alpha, dtype=dtype, layout=LoKrLayout.of(weights))
    if weights.dora_scale is not None:
        module = DoRAModule(module, weights.dora_scale)
    module.load(weights, source)
    return module


_NETWORK_CLASSES = {LORA: LoRANetwork, LOHA: LoHaNetwork, LOKR: LoKrNetwork}


def apply_adapter_file(
    model: nn.Module,
    path: str | os.PathLike,
    multiplier: float = 1.0,
    name_map: NameMap | None = None,
    prefix: str = COMFY_PREFIX,
    dtype: torch.dtype = torch.float32,
    name_map_inverse: NameMap | None = None,
    keep: Callable[[str], bool] | None = None,
) -> AdapterNetwork:
    """Attach the adapter stored in `path` to `model` for inference: the network is in eval mode and
    frozen. `name_map` and `prefix` are the architecture's, as used when saving; original-name stems
    (comfy or kohya) need `name_map`, diffusers/PEFT stems need nothing; fused layers are split when the
    name map declares them. `name_map_inverse` is a fallback for comfy stems, as in `load_weights`.
    `keep` picks the file's stems that belong to `model` (a file may also hold a text encoder's)."""
    modules, metadata = read_modules(path)
    if keep is not None:
        modules = {stem: weights for stem, weights in modules.items() if keep(stem)}
    where = describe_source(path)
    modules = expand_fused(modules, getattr(name_map, "fused", ()), metadata, prefix, KOHYA_PREFIXES)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    resolved = ModuleNameIndex(linears, name_map, prefix).resolve(modules, where, name_map_inverse)
    adapters = [
        module_from_weights(name, linears[name], modules[stem], dtype, where)
        for stem, name in resolved.items()
    ]
    kinds = {a.kind for a in adapters}
    network_class = _NETWORK_CLASSES[kinds.pop()] if len(kinds) == 1 else AdapterNetwork
    network = network_class(adapters, name_map=name_map, prefix=prefix)
    network.set_multiplier(multiplier)
    network.requires_grad_(False)
    return network.eval()
