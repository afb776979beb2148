"""The registry: the list of architecture families, and the one view of their records.

An architecture is one `Architecture` record (`tuner.archs.record`), declared in its family's folder
(`tuner/archs/<family>/record.py`). The training loop, the cache commands, generation, the adapter file
tools (`tuner lora ...`), memory settings, fixtures, the demo and the contract test suite all read it
from here; nothing else keeps a per-architecture table. Adding a family means writing its folder (see
`docs/architectures.md`) and one line in `FAMILIES`; `tests/test_registry.py` fails while any piece is
missing, and the contract suite then runs every user path on its fixture.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

from tuner.archs.record import Architecture
from tuner.errors import ConfigError

SAVE_LAYOUTS = ("comfy", "comfy_folded", "diffusers", "kohya", "musubi")
SAVE_FORMATS = ("auto", *SAVE_LAYOUTS)
"""What `save.format` (and the file tools' `--to` / `--format`) accept: a layout, or "auto"."""

FAMILIES = (
    "wan",
    "flux",
    "chroma",
    "qwen_image",
    "hunyuan_video",
    "hunyuan_video15",
    "framepack",
    "hidream",
    "sd3",
    "flux2",
    "z_image",
    "lumina2",
    "cosmos_predict2",
    "anima",
    "sdxl",
    "kandinsky5",
    "kandinsky6",
    "ltx2",
    "ltx_video",
    "krea2",
    "aura_flow",
    "ernie_image",
    "ideogram4",
    "hunyuan_image",
    "minimax_h3",
    "omnigen2",
    "hidream_o1",
    "flux3",
)
"""The folders under `tuner/archs/`, each declaring `RECORDS` in its `record.py`: the records' `folder`,
which their code is named relative to."""

ARCHITECTURES: dict[str, Architecture] = {
    record.name: replace(record, folder=family)
    for family in FAMILIES
    for record in importlib.import_module(f"tuner.archs.{family}.record").RECORDS
}


def architecture(name: str) -> Architecture:
    """The record of `name`, or a `ConfigError` listing the known ones."""
    if name not in ARCHITECTURES:
        from tuner.errors import did_you_mean

        raise ConfigError(
            f"unknown architecture {name!r}.{did_you_mean(name, ARCHITECTURES)} Known: {', '.join(ARCHITECTURES)}."
        )
    return ARCHITECTURES[name]


def resolve_save_format(name: str, format: str, dora: bool = False, full: bool = False) -> str:
    """The key layout `format` means for architecture `name`: "auto" is the record's `save_format` (a
    layout ComfyUI loads, diffusers too only where `tuner.networks.receivers` says so); a layout stands
    for itself. `ConfigError` for an unknown architecture or format. With `dora`, "auto" is never
    a layout that folds alpha (`diffusers`, `comfy_folded`: `networks/options.py`), nor for a `full`
    fine-tune, whose "auto" file is the release's single file: `comfy` instead."""
    if format not in SAVE_FORMATS:
        raise ConfigError(f"unknown adapter format {format!r}; choose one of {', '.join(SAVE_FORMATS)}")
    if format != "auto":
        return format
    layout = architecture(name).save_format
    return "comfy" if (dora or full) and layout in ("diffusers", "comfy_folded") else layout


def describe_architectures() -> str:
    """One line per architecture, for help texts."""
    width = max(map(len, ARCHITECTURES))
    return "\n".join(f"  {name:<{width}}  {record.title}" for name, record in ARCHITECTURES.items())


def describe_sampling() -> str:
    """Each architecture's sampling defaults (and those its transformer's file name picks), for help texts."""
    width = max(map(len, ARCHITECTURES))
    lines = []
    for name, record in ARCHITECTURES.items():
        lines.append(f"  {name:<{width}}  {record.sampling.summary()}")
        lines += [
            f"  {'':<{width}}    name ~ /{pattern}/: {named.summary()}"
            for pattern, named in record.sampling.by_name
        ]
    return "\n".join(lines)
