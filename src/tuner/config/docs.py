"""Render docs/config.md from the config dataclasses.

    python -m tuner.config.docs > docs/config.md

A test compares the file with this output, so the reference can never drift from the schema.
"""

from __future__ import annotations

import dataclasses
import typing

from tuner.config.dataset import GENERAL_DEFAULTS, DatasetEntry, SharedOptions
from tuner.config.fields import describe_type
from tuner.config.schema import TrainingFile

HEADER = """# Configuration reference

Generated from `src/tuner/config/schema.py` and `src/tuner/config/dataset.py` by
`python -m tuner.config.docs > docs/config.md`; a test fails if this file is out of date.

Two TOML files drive a run. The **training TOML** is passed to `tuner cache latents`, `tuner cache text`,
`tuner train` and `tuner generate` with `--config`; any key can be overridden on the command line with
`--set section.key=value` (TOML syntax for the value; bare words are strings). It names a **dataset
TOML** in `data.dataset_config`. Relative paths are resolved against the folder of the file that holds
them. Unknown keys, wrong types and out-of-range values stop the command with the file, the key and
the fix.
"""


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "" if f.default is None else repr(f.default).replace("'", '"')
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "{}" if value == {} else "()" if value == () else "(table)"
    return "**required**"


def bounds_text(f: dataclasses.Field) -> str:
    syms = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    return ", ".join(f"{syms[k]} {f.metadata[k]}" for k in syms if f.metadata.get(k) is not None)


def _table(cls: type, defaults: dict | None = None) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | range | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = default_text(f)
        if defaults is not None and f.name in defaults:
            d = defaults[f.name]
            default = "" if d is None else repr(list(d) if isinstance(d, tuple) else d).replace("'", '"')
        rows.append(
            f"| `{f.name}` | {describe_type(hints[f.name])} | {default} | {bounds_text(f)} | {f.metadata['doc']} |"
        )
    return rows


def render() -> str:
    out = [HEADER, "## Training TOML", ""]
    for f in dataclasses.fields(TrainingFile):
        section_cls = typing.get_type_hints(TrainingFile)[f.name]
        out += [f"### `[{f.name}]`", "", f.metadata["doc"], ""]
        out += _table(section_cls) + [""]
    out += [
        "## Dataset TOML",
        "",
        "`[general]` holds defaults; each `[[datasets]]` table names exactly one source and may override",
        "any `[general]` key.",
        "",
        "### `[general]` (and overridable per dataset)",
        "",
    ]
    out += _table(SharedOptions, GENERAL_DEFAULTS) + [""]
    out += ["### `[[datasets]]` sources", ""]
    shared = {f.name for f in dataclasses.fields(SharedOptions)}
    rows = _table(DatasetEntry)
    out += rows[:2] + [r for r in rows[2:] if r.split("`")[1] not in shared] + [""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
