"""Config values written as TOML that `load_config` (and so every CLI command) reads back unchanged.

Only what a training or dataset TOML holds: strings, booleans, integers, finite floats, lists and
tables (inline when they are values, `[section]` or `[[section]]` at the top).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else json.dumps(name)


def value(v: Any) -> str:
    """One value in TOML syntax."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"{v!r} cannot be written to a config")
        return repr(v)  # always has a '.' or an exponent, so it reads back as a float
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON's escapes are a subset of TOML's basic string's
    if isinstance(v, list | tuple):
        return "[" + ", ".join(value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{key(k)} = {value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")


def dumps(data: dict[str, Any]) -> str:
    """A document: top-level scalars first, then one `[table]` per dict and `[[table]]` per list of dicts."""
    lines = [f"{key(k)} = {value(v)}" for k, v in data.items() if not _is_table(v) and not _is_table_list(v)]
    for k, v in data.items():
        if _is_table(v):
            lines += ["", f"[{key(k)}]"] + [f"{key(n)} = {value(x)}" for n, x in v.items()]
        elif _is_table_list(v):
            for table in v:
                lines += ["", f"[[{key(k)}]]"] + [f"{key(n)} = {value(x)}" for n, x in table.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def _is_table(v: Any) -> bool:
    return isinstance(v, dict)


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)
