"""`tuner lora convert`: rewrite an adapter file in another key layout (comfy, diffusers, kohya, or auto:
the one training writes by default for the file's architecture, which ComfyUI loads). It warns when the
tool the target layout is meant for would drop modules of it silently (`tuner.networks.receivers`).

The file is read in whatever layout it is in, renamed to diffusers module names with the architecture's
table (`networks/architectures.py`; from `--arch`, the file's `tuner.architecture`, or the one table
that names every module), and written in the target layout (`networks/formats.py`). Nothing is
approximated: comfy <-> kohya only renames; the diffusers layout folds alpha into lora_B and writes LoHa
and LoKr in their exact LoRA form, and tuner's metadata lets the way back restore alpha.
"""

from __future__ import annotations

import os
from collections import Counter

import torch

from tuner.dtypes import DTYPES
from tuner.io import save_safetensors
from tuner.networks.architectures import architecture_keys, canonical_modules, detect_architecture
from tuner.networks.formats import FOLDED_ALPHA, describe_modules, layout_state, parse_modules
from tuner.networks.fused import FUSED_METADATA
from tuner.networks.keys import describe_source, read_safetensors
from tuner.registry import resolve_save_format

# Metadata that describes one layout and is rewritten for the new one.
_LAYOUT_METADATA = (FOLDED_ALPHA, FUSED_METADATA, "lora_adapter_metadata", "tuner.format", "tuner.trained_as")


def convert_adapter(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str,
    *,
    arch: str | None = None,
    dtype: str | None = None,
) -> tuple[int, str]:
    """Write `src` in layout `to` ("auto": the architecture's `save_format`) to `dst` (atomically);
    returns the number of modules and the layout written. `dtype` recasts the tensors (default: the
    file's own)."""
    where = describe_source(src)
    tensors, metadata = read_safetensors(src)
    modules = parse_modules(tensors, metadata, where)
    keys = architecture_keys(arch) if arch else detect_architecture(modules, metadata, where)
    canonical = canonical_modules(modules, keys, metadata, where)
    # the file's own architecture when it names one (Kontext and Edit share their base's table)
    architecture = arch or metadata.get("tuner.architecture") or keys.name
    layout = resolve_save_format(architecture, to)
    save_dtype = DTYPES[dtype] if dtype else _file_dtype(tensors)
    state, layout_metadata = layout_state(canonical, layout, keys, dtype=save_dtype)
    kept = {k: v for k, v in metadata.items() if k not in _LAYOUT_METADATA}
    out_metadata = {
        **kept,
        **layout_metadata,
        **describe_modules(canonical, layout),
        "tuner.format": layout,
        "tuner.architecture": architecture,
    }
    save_safetensors(state, dst, metadata=out_metadata)
    return len(canonical), layout


def convert_warning(dst: str | os.PathLike, layout: str) -> str:
    """What `receivers.silent_loss_warning` says of the converted file `dst` (written in `layout`)."""
    from tuner.networks.receivers import silent_loss_warning

    tensors, metadata = read_safetensors(dst)
    modules = parse_modules(tensors, metadata, describe_source(dst))
    return silent_loss_warning(metadata["tuner.architecture"], modules, metadata, layout)


def _file_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype most of the file's matrices are stored in."""
    dtypes = Counter(t.dtype for t in tensors.values() if t.ndim == 2)
    return dtypes.most_common(1)[0][0] if dtypes else torch.float32
