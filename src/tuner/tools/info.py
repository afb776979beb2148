"""`tuner lora info`: what an adapter file holds, read from its keys (and its metadata when it has some).

Layout, adapter type, rank and alpha are read from the tensors themselves, so files from any trainer
are described the same way; tuner's own metadata (architecture, training settings) is shown as well.
A full model file (tuner's full fine-tune) is described by its size. Which tools load the file, and which
modules each would drop, comes from `tuner.networks.receivers`. Tensors holding NaN or infinity are
flagged first: such a file loads without complaint everywhere else and draws black images.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any

from tuner.errors import TunerError
from tuner.networks.delta import KIND_NAMES
from tuner.networks.formats import layout_of, parse_modules
from tuner.networks.keys import describe_source, nonfinite_keys, read_safetensors

_ADAPTER_KEY = re.compile(r"\.(lora_|hada_|lokr_|alpha$|dora_scale$)")
_BLOCK_INDEX = re.compile(r"(?<=[._])\d+(?=[._])")
_SHOWN_METADATA = 200  # characters of a metadata value shown


def describe_adapter(path: str | os.PathLike) -> dict[str, Any]:
    """A summary of an adapter (or full model) file, as plain data."""
    tensors, metadata = read_safetensors(path)
    info: dict[str, Any] = {"file": str(path), "metadata": metadata}
    info["parameters"] = sum(t.numel() for t in tensors.values())
    info["dtypes"] = dict(Counter(str(t.dtype).removeprefix("torch.") for t in tensors.values()))
    info["nonfinite"] = nonfinite_keys(tensors)
    if metadata.get("tuner.network_type") == "full" or not any(_ADAPTER_KEY.search(k) for k in tensors):
        return {**info, "type": "model (not an adapter)", "tensors": len(tensors)}
    modules = parse_modules(tensors, metadata, describe_source(path))
    layouts = Counter(layout_of(stem) for stem in modules)
    kinds = Counter(
        KIND_NAMES[w.kind] + (" + DoRA" if w.dora_scale is not None else "") for w in modules.values()
    )
    targets = Counter(_BLOCK_INDEX.sub("N", stem) for stem in modules)
    info["tools"] = _tools(modules, metadata, describe_source(path))
    return {
        **info,
        "format": "/".join(sorted(layouts)),
        "type": ", ".join(f"{k} ×{n}" if len(kinds) > 1 else k for k, n in kinds.items()),
        "modules": len(modules),
        "rank": _counted(w.rank if w.rank is not None else "full" for w in modules.values()),
        "alpha": _counted(w.alpha for w in modules.values() if w.rank is not None),
        "targets": dict(targets),
    }


def _tools(modules, metadata, where: str) -> dict[str, str]:
    """Per tool, whether it loads the file and which modules it would drop (`receivers.py`)."""
    from tuner.networks.architectures import detect_architecture
    from tuner.networks.receivers import describe, read_by_tools

    try:
        arch = metadata.get("tuner.architecture") or detect_architecture(modules, metadata, where).name
        readings = read_by_tools(arch, modules, metadata)
        return {tool: describe(reading) for tool, reading in readings.items()}
    except TunerError as e:
        return {"(unknown)": f"cannot tell which tools load it: {e}"}


def _counted(values) -> str:
    counts = Counter(values)
    if len(counts) == 1:
        return str(next(iter(counts)))
    return ", ".join(f"{v} ×{n}" for v, n in counts.most_common())


def format_info(info: dict[str, Any]) -> str:
    """`describe_adapter`'s summary as text."""
    lines = [f"{info['file']}"]
    if bad := info.get("nonfinite"):
        lines.append(f"  WARNING    {len(bad)} tensors hold NaN or infinity (e.g. {bad[0]}): this file is damaged "
                     "(trained to NaN?) and draws black or noisy images; do not use it.")  # fmt: skip
    for key in ("format", "type", "modules", "tensors", "rank", "alpha"):
        if key in info:
            lines.append(f"  {key:10s} {info[key]}")
    lines.append(
        f"  {'parameters':10s} {info['parameters']:,} ({', '.join(f'{k} ×{n}' for k, n in info['dtypes'].items())})"
    )
    if info.get("tools"):
        lines.append("  loads in")
        lines += [f"    {tool}: {text}" for tool, text in info["tools"].items()]
    if info.get("targets"):
        lines.append("  targets")
        lines += [f"    {stem}" + (f"  ×{n}" if n > 1 else "") for stem, n in info["targets"].items()]
    if info["metadata"]:
        lines.append("  metadata")
        for key, value in sorted(info["metadata"].items()):
            shown = (
                value
                if len(value) <= _SHOWN_METADATA
                else value[:_SHOWN_METADATA] + f"... ({len(value)} chars)"
            )
            lines.append(f"    {key}: {shown}")
    return "\n".join(lines)
