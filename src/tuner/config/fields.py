"""Typed, documented config fields and the parser that turns TOML tables into frozen dataclasses.

Every config section is a frozen dataclass whose fields are declared with `option(...)`: a default,
a one-line doc, and optional bounds. `parse_section` walks a TOML table against such a dataclass and
raises one `ConfigError` naming the file, the dotted key and the fix for:

- an unknown key (with a "did you mean"),
- a value of the wrong type,
- a value out of range or not among the allowed choices,
- a number that is not finite (`inf`, `nan`), anywhere, optimizer arguments included.

Validation happens here, at load time, so the training loop never meets a bad value.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from tuner.errors import ConfigError, did_you_mean

MISSING = dataclasses.MISSING


def option(
    default: Any = MISSING,
    doc: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    path: bool = False,
    factory: Any = MISSING,
) -> Any:
    """Declare a config field. `path=True` resolves a relative path against the TOML file's folder."""
    if not doc:
        raise ValueError("every config field needs a doc")
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt, "path": path}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin is dict:
        return "a table"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


class _Ctx(typing.NamedTuple):
    source: str
    base_dir: Path | None


def _fail(ctx: _Ctx, key: str, message: str) -> typing.NoReturn:
    raise ConfigError(f"{ctx.source}: key '{key}': {message}")


def _convert(tp: Any, value: Any, key: str, ctx: _Ctx, is_path: bool) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key, ctx, is_path)
            except ConfigError as e:
                errors.append(e)
        _fail(ctx, key, f"expected {_describe(tp)}, got {value!r}.")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = did_you_mean(str(value), [str(c) for c in choices])
            _fail(ctx, key, f"{value!r} is not one of {', '.join(repr(c) for c in choices)}.{hint}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            value = [value]  # a scalar where a list is expected is a one-item list
        (item_tp,) = typing.get_args(tp)[:1] or (Any,)
        items = [_convert(item_tp, v, f"{key}[{i}]", ctx, is_path) for i, v in enumerate(value)]
        return tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            _fail(ctx, key, f"expected a table, got {value!r}.")
        for k, v in value.items():
            _check_finite(v, f"{key}.{k}", ctx)
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            _fail(ctx, key, f"expected a table, got {value!r}.")
        return parse_section(tp, value, ctx.source, key, ctx.base_dir)
    if tp is Any:
        _check_finite(value, key, ctx)
        return value
    if tp is bool:
        if not isinstance(value, bool):
            _fail(ctx, key, f"expected true or false, got {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(ctx, key, f"expected an integer, got {value!r}.")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            _fail(ctx, key, f"expected a number, got {value!r}.")
        _check_finite(value, key, ctx)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(ctx, key, f"expected a string, got {value!r}.")
        if is_path and ctx.base_dir is not None and value:
            p = Path(value).expanduser()
            return str(p if p.is_absolute() else (ctx.base_dir / p))
        return value
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def _check_finite(value: Any, key: str, ctx: _Ctx) -> None:
    """TOML has `inf` and `nan`; no setting means either (they train to NaN and save black adapters)."""
    if isinstance(value, float) and not math.isfinite(value):
        _fail(ctx, key, f"{value!r} is not a finite number.")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{key}.{k}", ctx)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_finite(v, f"{key}[{i}]", ctx)


def _check_bounds(f: dataclasses.Field, value: Any, key: str, ctx: _Ctx) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return
    m = f.metadata
    checks = [
        ("ge", lambda b: value >= b, ">="),
        ("gt", lambda b: value > b, ">"),
        ("le", lambda b: value <= b, "<="),
        ("lt", lambda b: value < b, "<"),
    ]
    for name, ok, sym in checks:
        bound = m.get(name)
        if bound is not None and not ok(bound):
            _fail(ctx, key, f"{value!r} is out of range: it must be {sym} {bound}.")


def parse_section(cls: type, data: dict, source: str, prefix: str = "", base_dir: Path | None = None) -> Any:
    """Build dataclass `cls` from a TOML table, validating every key. `prefix` is the dotted key path."""
    ctx = _Ctx(source, base_dir)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in data:
        if name not in fields:
            key = f"{prefix}.{name}" if prefix else name
            moved = getattr(cls, "moved_keys", {})  # keys that were renamed: say where they went
            if name in moved:
                _fail(ctx, key, f"this key is now '{moved[name]}' (same meaning); rename it.")
            where = f"section [{prefix}]" if prefix else "the top level"
            _fail(
                ctx,
                key,
                f"unknown key in {where}.{did_you_mean(name, fields)} "
                f"Known keys: {', '.join(sorted(fields))}. See docs/config.md.",
            )
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name in data:
            value = _convert(hints[name], data[name], key, ctx, f.metadata.get("path", False))
            _check_bounds(f, value, key, ctx)
            kwargs[name] = value
        elif f.default is MISSING and f.default_factory is MISSING:
            _fail(ctx, key, f"is required: {f.metadata.get('doc', '')}")
    try:
        return cls(**kwargs)
    except ConfigError as e:  # cross-field checks in __post_init__ name their keys without the file
        raise ConfigError(f"{source}: {e}") from None


def describe_type(tp: Any) -> str:
    """Human-readable type of a field, used by the generated docs."""
    return _describe(tp)
