"""One loader for a diffusers model component (a transformer, a VAE) in either layout users hold.

Every architecture loads its components the same way; what differs is data, declared once per component:

* the diffusers class (by name: importing diffusers costs seconds, so it is imported when a model is
  built) and the pipeline subfolder it lives in (`transformer`, `vae`);
* a `SingleFileSpec`: the known variants with their shipped configs and shape signatures, and how the
  original release's layout is recognised (`tuner.models.identify`);
* the key conversion from the original release's layout to diffusers' (`to_diffusers`), applied when
  the file is in the original layout; a file saved in diffusers' names is loaded as it is.

`load_component` takes a diffusers folder (a pipeline root or the component folder) through
`from_pretrained`, and a single file through `read_single_file` (headers identified first, then the
tensors read; also a checkpoint bundling the component under a prefix) + `from_state_dict`, so both give
identical models; a family whose files diffusers' own converter reads (Wan, Qwen-Image, HiDream) passes
`diffusers_converter` instead of a key conversion. The transformers encoders (`tuner.models.encoders`)
read their single files the same way. `component_spec` declares a spec whose expected keys come from
the same class and conversion (`diffusers_keys`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from tuner.models.identify import SingleFileSpec, Variant, apply_aliases, diffusers_meta_keys, identify_shapes
from tuner.models.loading import (
    as_file_list,
    component_entries,
    from_state_dict,
    load_component_tensors,
    load_diffusers_folder,
    load_diffusers_single_file,
    load_tensors_of,
    normalize_shapes,
    normalize_state_dict,
    read_shapes_of,
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


def component_spec(
    what: str,
    class_name: str,
    variants: tuple[Variant, ...],
    original_markers: tuple[str, ...],
    diffusers_markers: tuple[str, ...] = (),
    to_original: Callable[[str], str] | None = None,
    refuse: Callable[[Mapping[str, tuple[int, ...]], Path], None] | None = None,
) -> SingleFileSpec:
    """The `SingleFileSpec` of a diffusers component: a file of a variant holds exactly the tensors of
    `class_name` built from the variant's config, under the release's names (`to_original`, which also
    reads a file saved in diffusers' names, recognised by `diffusers_markers`)."""
    keys = diffusers_keys(class_name, to_original)
    return SingleFileSpec(
        what, variants, keys, original_markers, diffusers_markers, to_original, refuse=refuse
    )


def load_component(
    path: str | Path,
    dtype: torch.dtype,
    class_name: str,
    subfolder: str,
    spec: SingleFileSpec,
    to_diffusers: ToDiffusers | None = None,
    config: Callable[[Variant], Path] | None = None,
    *,
    bundled: tuple[str, ...] = (),
    entries: Callable[[StateDict], StateDict] = dict,
    diffusers_converter: bool = False,
) -> torch.nn.Module:
    """A `class_name` from a diffusers folder (a pipeline root's `subfolder`, or the component folder) or
    a single file of a known variant in either layout, in eval mode.

    A single file (the component alone, or a checkpoint holding it under the first of `bundled` it uses)
    is read by `read_single_file`, converted by `to_diffusers` when it holds `spec.original_markers` and
    built from the config folder `config` gives for the variant (default: the variant's own). With
    `diffusers_converter`, diffusers' own converter (the one `from_single_file` uses) converts it
    instead."""
    folder = resolve_folder(path, subfolder)
    if folder is not None:
        return load_diffusers_folder(diffusers_class(class_name), folder, dtype, class_name)
    variant, _, state_dict = read_single_file(path, dtype, spec, entries, bundled)
    if to_diffusers is not None and all(k in state_dict for k in spec.original_markers):
        state_dict = to_diffusers(state_dict, variant)
    config_dir = config(variant) if config is not None else variant.config_dir
    build = load_diffusers_single_file if diffusers_converter else from_state_dict
    return build(diffusers_class(class_name), state_dict, config_dir, dtype, Path(path))


def read_single_file(
    files: str | Path | Sequence[Path],
    dtype: torch.dtype,
    spec: SingleFileSpec,
    entries: Callable[[StateDict], StateDict] = dict,
    bundled: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
) -> tuple[Variant, dict[str, tuple[int, ...]], StateDict]:
    """(variant, shapes, tensors) of a component's single file (or the shards of one): its entries (under
    the first of `bundled` it uses) normalized (prefixes stripped, fp8 dequantized into `dtype`) and put
    under `spec`'s names by `entries`, identified by `spec` without the `optional` ones (headers only),
    then read with `spec`'s tied-weight aliases resolved."""
    files = as_file_list(files)
    path = files[0] if len(files) == 1 else files[0].parent
    shapes = normalize_shapes(component_entries(read_shapes_of(files), bundled))
    # `entries` may split tensors (OpenCLIP's fused q, k, v): it renames the header's shapes as meta tensors
    meta = entries({k: torch.empty(shape, device="meta") for k, shape in shapes.items()})
    shapes = {k: tuple(v.shape) for k, v in meta.items() if not k.startswith(optional)}
    variant = identify_shapes(shapes, spec, path)
    if len(files) == 1:
        tensors = load_component_tensors(path, bundled)
    else:
        tensors = component_entries(load_tensors_of(files), bundled)
    return variant, shapes, apply_aliases(entries(normalize_state_dict(tensors, dtype)), spec.aliases)


def vae_levels(class_name: str, variant: Variant) -> int:
    """The number of resolution levels of a VAE variant (its config's `block_out_channels`), which the
    LDM key layout needs to number its up blocks."""
    return len(diffusers_class(class_name).load_config(variant.config_dir)["block_out_channels"])
