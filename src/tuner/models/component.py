"""One loader for a diffusers model component (a transformer, a VAE) in either layout users hold.

Every architecture loads its components the same way; what differs is data, declared once per component:

* the diffusers class (by name: importing diffusers costs seconds, so it is imported when a model is
  built) and the pipeline subfolder it lives in (`transformer`, `vae`);
* a `SingleFileSpec`: the known variants with their shipped configs and shape signatures, and how the
  original release's layout is recognised (`tuner.models.identify`);
* the key conversion from the original release's layout to diffusers' (`to_diffusers`), applied when
  the file is in the original layout; a file saved in diffusers' names is loaded as it is.

`load_component` takes a diffusers folder (a pipeline root or the component folder) through
`from_pretrained`, and a single file through `identify_single_file` + `from_state_dict`, so both give
identical models. `diffusers_keys` builds a spec's `expected_keys` from the same class and conversion.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tuner.models.identify import SingleFileSpec, Variant, diffusers_meta_keys, identify_single_file
from tuner.models.loading import (
    from_state_dict,
    load_diffusers_folder,
    load_tensors,
    normalize_state_dict,
    resolve_folder,
)

StateDict = dict[str, torch.Tensor]
ToDiffusers = Callable[[StateDict, Variant], StateDict]
"""(state dict in the original layout, identified variant) -> the same tensors under diffusers' keys."""


def diffusers_class(name: str) -> type:
    """The diffusers model class `name`, imported now (diffusers imports its classes lazily)."""
    import diffusers

    return getattr(diffusers, name)


def diffusers_keys(
    class_name: str, to_original: Callable[[str], str] | None = None
) -> Callable[[Variant], set[str]]:
    """A `SingleFileSpec.expected_keys`: the state-dict keys of `class_name` built from a variant's config,
    renamed by `to_original` to the release's layout (the parts of a fused layer give one key)."""

    def expected_keys(variant: Variant) -> set[str]:
        keys = diffusers_meta_keys(diffusers_class(class_name), variant.config_dir)
        return {to_original(k) for k in keys} if to_original is not None else set(keys)

    return expected_keys


def load_component(
    path: str | Path,
    dtype: torch.dtype,
    class_name: str,
    subfolder: str,
    spec: SingleFileSpec,
    to_diffusers: ToDiffusers | None = None,
    config: Callable[[Variant], Path] | None = None,
) -> torch.nn.Module:
    """A `class_name` from a diffusers folder (a pipeline root's `subfolder`, or the component folder) or
    a single file of a known variant in either layout, in eval mode."""
    folder = resolve_folder(path, subfolder)
    if folder is not None:
        return load_diffusers_folder(diffusers_class(class_name), folder, dtype, class_name)
    return load_single_file(path, dtype, class_name, spec, to_diffusers, config)


def load_single_file(
    path: str | Path,
    dtype: torch.dtype,
    class_name: str,
    spec: SingleFileSpec,
    to_diffusers: ToDiffusers | None = None,
    config: Callable[[Variant], Path] | None = None,
) -> torch.nn.Module:
    """`load_component` for a single file: identified by `spec` (headers only), prefixes stripped and fp8
    dequantized, converted by `to_diffusers` when it holds `spec.original_markers`, built from the config
    folder `config` gives for the variant (default: the variant's own)."""
    variant = identify_single_file(path, spec)
    state_dict = normalize_state_dict(load_tensors(path), dtype)
    if to_diffusers is not None and all(k in state_dict for k in spec.original_markers):
        state_dict = to_diffusers(state_dict, variant)
    config_dir = config(variant) if config is not None else variant.config_dir
    return from_state_dict(diffusers_class(class_name), state_dict, config_dir, dtype, Path(path))


def vae_levels(class_name: str, variant: Variant) -> int:
    """The number of resolution levels of a VAE variant (its config's `block_out_channels`), which the
    LDM key layout needs to number its up blocks."""
    return len(diffusers_class(class_name).load_config(variant.config_dir)["block_out_channels"])
