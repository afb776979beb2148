"""The new-run form: generated from the config schema, read back into a TOML the CLI uses unchanged.

Every key of every `TrainingFile` section becomes one input carrying the key's doc, type, range and
default (the same walk `tuner.config.docs` does for docs/config.md). What the browser sends comes back
as a dict of `section.key` → text; `form_to_toml` turns it into a training TOML holding the keys that
differ from their defaults, and `validate` runs exactly what `tuner check` runs (`load_config`) on that
text, so an error (and its "did you mean") reads as it would on the command line.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tuner.config import apply_override, load_config
from tuner.config.docs import bounds_text, default_text
from tuner.config.fields import describe_type
from tuner.config.schema import TrainingFile
from tuner.errors import TunerError
from tuner.hub import parse_ref
from tuner.ui import toml_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

OPEN_SECTIONS = ("model", "data", "network", "train")
"""Sections shown open; the others start collapsed."""
RUN_RELATIVE = ("save.output_dir",)
"""Paths kept relative when a TOML is loaded into the form: a job resolves them in its own run folder, so
each run of the same config writes its outputs apart."""


@dataclass(frozen=True)
class FieldView:
    """One config key as the form shows it."""

    key: str  # dotted: "train.learning_rate"
    name: str
    doc: str
    type: str  # "a number", "'constant' or 'linear' ...", as docs/config.md says it
    default: str
    range: str
    widget: Literal["checkbox", "choice", "text"]
    choices: tuple[str, ...]
    required: bool
    raw: bool  # the text is the value itself (strings); otherwise it is TOML (numbers, lists, tables)
    default_value: Any


@dataclass(frozen=True)
class SectionView:
    name: str
    doc: str
    open: bool
    fields: tuple[FieldView, ...]


def _literal_strings(tp: Any) -> tuple[str, ...]:
    if typing.get_origin(tp) is Literal:
        return tuple(str(a) for a in typing.get_args(tp))
    return ()


def _field_view(section: str, f: dataclasses.Field, tp: Any) -> FieldView:
    choices = _literal_strings(tp)
    if tp is bool:
        widget = "checkbox"
    elif choices:
        widget = "choice"  # a text input with the choices offered: a typo meets the same check as the CLI's
    else:
        widget = "text"
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    if f.default is not dataclasses.MISSING:
        default_value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default_value = f.default_factory()
    else:
        default_value = None
    return FieldView(
        key=f"{section}.{f.name}", name=f.name, doc=f.metadata["doc"], type=describe_type(tp),
        default=default_text(f), range=bounds_text(f), widget=widget, choices=choices, required=required,
        raw=tp is str or bool(choices), default_value=default_value,
    )  # fmt: skip


def sections() -> list[SectionView]:
    """Every section of the training TOML with its keys, in the schema's order."""
    out = []
    top = typing.get_type_hints(TrainingFile)
    for section in dataclasses.fields(TrainingFile):
        cls = top[section.name]
        hints = typing.get_type_hints(cls)
        fields = tuple(_field_view(section.name, f, hints[f.name]) for f in dataclasses.fields(cls))
        out.append(SectionView(section.name, section.metadata["doc"], section.name in OPEN_SECTIONS, fields))
    return out


def _fields() -> dict[str, FieldView]:
    return {f.key: f for s in sections() for f in s.fields}


# ---------------------------------------------------------------- form → TOML


def form_to_data(form: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The training TOML's tables from the form's `section.key` texts: every key filled in (an empty text is
    the default, left out; a checkbox is written when it differs from its default).

    Strings (and choices) are taken as typed; other values are read as `--set` reads them (TOML syntax,
    a bare word being a string), so a wrong type is reported by the config loader, by key."""
    data: dict[str, dict[str, Any]] = {}
    for key, view in _fields().items():
        if key not in form:
            continue
        text = form[key]
        if view.widget == "checkbox":
            value = text in (True, "true", "on", "1")
            if value != view.default_value:
                data.setdefault(key.split(".")[0], {})[view.name] = value
            continue
        text = text.strip()
        if not text:
            continue  # the default; a required key left empty is named by the loader
        if view.raw:
            value = text
        else:
            scratch: dict[str, Any] = {}
            apply_override(scratch, f"{key}={text}", source="form")
            value = scratch[key.split(".")[0]][view.name]
        data.setdefault(key.split(".")[0], {})[view.name] = value
    return data


def form_to_toml(form: dict[str, str]) -> str:
    return toml_text.dumps(form_to_data(form))


# ---------------------------------------------------------------- TOML → form


def toml_to_form(text: str, base_dir: Path | None = None) -> dict[str, str]:
    """A training TOML's keys as the form's texts. Relative paths become absolute against `base_dir` (the
    folder the TOML came from), so the form's TOML means the same files wherever it is saved."""
    data = tomllib.loads(text)
    fields = _fields()
    out: dict[str, str] = {}
    top = typing.get_type_hints(TrainingFile)
    for section, table in data.items():
        if not isinstance(table, dict):
            continue
        cls = top.get(section)
        path_keys = {f.name for f in dataclasses.fields(cls) if f.metadata.get("path")} if cls else set()
        for name, value in table.items():
            view = fields.get(f"{section}.{name}")
            if view is None:
                continue  # an unknown key: the loader names it when the TOML itself is checked
            if base_dir is not None and name in path_keys and view.key not in RUN_RELATIVE:
                value = _absolute(value, base_dir)
            if view.widget == "checkbox":
                out[view.key] = "true" if value else "false"
            elif view.raw and isinstance(value, str):
                out[view.key] = value
            else:
                out[view.key] = toml_text.value(value)
    return out


def _absolute(value: Any, base: Path) -> Any:
    if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
        if parse_ref(value) and not (base / value.split("/")[0]).exists():
            return value  # a hub id ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers"), by the loader's own rule
        return str((base / value).resolve())
    if isinstance(value, list):
        return [_absolute(v, base) for v in value]
    return value


# ---------------------------------------------------------------- validation


@dataclass(frozen=True)
class Check:
    ok: bool
    message: str  # the loader's own message, or `tuner check`'s summary
    key: str | None  # the dotted key the message names, for showing it beside its input


_KEY = re.compile(r"key '([\w.]+)")


def validate(config_text: str, dataset_text: str | None = None) -> Check:
    """What `tuner check` says about this training TOML (and dataset TOML, when one is given: it replaces
    the file `data.dataset_config` names, as the job will)."""
    with tempfile.TemporaryDirectory(prefix="tuner-ui-check-") as tmp:
        config = Path(tmp) / "train.toml"
        text = config_text
        if dataset_text is not None:
            (Path(tmp) / "dataset.toml").write_text(dataset_text, encoding="utf-8")
            text = with_dataset_file(config_text, "dataset.toml")
        config.write_text(text, encoding="utf-8")
        try:
            cfg = load_config(config)
        except TunerError as e:
            message = (
                str(e)
                .replace(str(config), "train.toml")
                .replace(str(Path(tmp) / "dataset.toml"), "dataset.toml")
            )
            found = _KEY.search(message)
            return Check(False, message, found.group(1) if found else None)
    return Check(
        True,
        f"ok: {len({s.index for s in cfg.datasets})} dataset(s), architecture {cfg.model.architecture}, "
        f"adapters saved in the {cfg.save.format} layout",
        None,
    )


def with_dataset_file(config_text: str, dataset_file: str) -> str:
    """The training TOML with `data.dataset_config` pointing at `dataset_file`."""
    try:
        data = tomllib.loads(config_text)
    except tomllib.TOMLDecodeError:
        return config_text  # the loader reports it
    data.setdefault("data", {})["dataset_config"] = dataset_file
    return toml_text.dumps(data)
