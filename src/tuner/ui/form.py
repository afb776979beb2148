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
from tuner.ui.job_check import refuse_code_references

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

OPEN_SECTIONS = ("model", "data", "network", "train")
"""Sections shown open under "advanced" (which itself starts collapsed)."""
SIMPLE = (
    "model.architecture", "model.transformer", "model.transformer_2", "model.expert", "model.vae",
    "model.text_encoder", "model.text_encoder_2", "model.text_encoder_3", "model.text_encoder_4",
    "model.image_encoder", "data.dataset_config", "network.type", "network.rank", "network.alpha",
    "train.learning_rate", "train.optimizer", "train.lr_scheduler", "train.max_steps", "train.epochs",
    "save.output_name", "save.every_n_steps", "save.keep_last", "sample.prompts", "sample.every_n_steps",
)  # fmt: skip
"""The keys a first run needs, shown first in this order; every other key is under "advanced"."""
SAVES_PER_RUN = 10
"""`save.every_n_steps = "auto"` (the form's default) saves about this many adapters over the run."""
NEW_RUN_VALUES = {"save.every_n_steps": "auto", "save.every_n_epochs": "0", "save.keep_last": "3"}
"""What a blank new-run form holds besides the schema's defaults: adapters about `SAVES_PER_RUN` times
over the run, not every epoch (an epoch of a 4-image set is 4 steps), and the last 3 adapters and states
kept, not all of them."""
UPPER_BOUNDS = {
    "data.num_workers": 64, "cache.batch_size": 256, "cache.text_max_length": 8192,
    "cache.text_encoder_blocks_to_swap": 1000, "network.rank": 1024, "network.alpha": 4096,
    "train.max_steps": 1_000_000, "train.epochs": 10_000, "train.lr_warmup_steps": 1_000_000,
    "train.lr_num_cycles": 1000, "train.gradient_accumulation_steps": 1024, "train.max_nonfinite_steps": 10_000,
    "train.validate_every_n_steps": 1_000_000, "save.every_n_steps": 1_000_000, "save.every_n_epochs": 10_000,
    "save.keep_last": 1000, "sample.every_n_steps": 1_000_000, "sample.width": 4096, "sample.height": 4096,
    "sample.frames": 257, "sample.steps": 1000, "log.every_n_steps": 1_000_000,
    "distributed.pipeline_microbatches": 1024,
}  # fmt: skip
"""The UI's upper bounds on numbers (the CLI takes any): a run the form starts cannot ask for 10^26 steps or a
rank of 10^8. Whole numbers not listed stay below `MAX_INT`."""
MAX_INT = 2**31 - 1
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
    placeholder: str  # what an empty input shows: the default as the user would type it
    simple: bool  # shown among the basics (`SIMPLE`); the others are under "advanced"
    path: bool  # a file or folder: the input gets a picker limited to the roots


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
    key = f"{section}.{f.name}"
    return FieldView(
        key=key, name=f.name, doc=f.metadata["doc"], type=describe_type(tp), default=default_text(f),
        range=_range_text(key, f), widget=widget, choices=choices, required=required,
        raw=tp is str or bool(choices), default_value=default_value,
        placeholder=_placeholder(key, required, default_value), simple=key in SIMPLE,
        path=bool(f.metadata.get("path")),
    )  # fmt: skip


def _placeholder(key: str, required: bool, default: Any) -> str:
    if key == "save.every_n_steps":
        return f"auto: about {SAVES_PER_RUN} saves over the run"
    if required:
        return "required"
    if default in ("", (), None, {}):
        return ""
    return toml_text.value(default) if not isinstance(default, str) else default


def _range_text(key: str, f: dataclasses.Field) -> str:
    bound = UPPER_BOUNDS.get(key)
    text = bounds_text(f)
    return f"{text + ', ' if text else ''}≤ {bound} here" if bound is not None else text


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
        if not text or (key == "save.every_n_steps" and text == "auto"):
            continue  # the default (auto: see `form_to_toml`); a required key left empty is named by the loader
        if view.raw:
            value = text
        else:
            scratch: dict[str, Any] = {}
            apply_override(scratch, f"{key}={text}", source="form")
            value = scratch[key.split(".")[0]][view.name]
        data.setdefault(key.split(".")[0], {})[view.name] = value
    return data


def form_to_toml(form: dict[str, str]) -> str:
    data = form_to_data(form)
    if form.get("save.every_n_steps", "").strip() == "auto":
        _auto_save_interval(data)
    return toml_text.dumps(data)


def _auto_save_interval(data: dict[str, dict[str, Any]]) -> None:
    """`save.every_n_steps = "auto"`: about `SAVES_PER_RUN` saves over the run: every max_steps / 10
    steps, or every epochs / 10 epochs when the run is counted in epochs."""
    train, save = data.get("train", {}), data.setdefault("save", {})
    steps, epochs = train.get("max_steps", 0), train.get("epochs", 1)
    if isinstance(steps, int) and steps > 0:
        save["every_n_steps"], save["every_n_epochs"] = max(1, steps // SAVES_PER_RUN), 0
    elif isinstance(epochs, int) and epochs > 0:
        save["every_n_epochs"] = max(1, epochs // SAVES_PER_RUN)


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
            return check_of(message)
        try:
            refuse_code_references(cfg)
        except TunerError as e:
            return check_of(str(e))
        too_large = _above_bounds(cfg.file)
        if too_large:
            return too_large
    return Check(
        True,
        f"ok: {len({s.index for s in cfg.datasets})} dataset(s), architecture {cfg.model.architecture}, "
        f"adapters saved in the {cfg.save.format} layout",
        None,
    )


def check_of(message: str) -> Check:
    """A failed check with `message`, placed beside the key it names."""
    found = _KEY.search(message)
    return Check(False, message, found.group(1) if found else None)


def _above_bounds(file: TrainingFile) -> Check | None:
    """The first number above the UI's bound (`UPPER_BOUNDS`, `MAX_INT`), as a failed check."""
    for section in dataclasses.fields(file):
        values = getattr(file, section.name)
        for f in dataclasses.fields(values):
            key, value = f"{section.name}.{f.name}", getattr(values, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            bound = UPPER_BOUNDS.get(key, MAX_INT if isinstance(value, int) else None)
            if bound is not None and abs(value) > bound:
                return Check(
                    False,
                    f"key '{key}': {value} is above what the UI runs ({bound}); use a smaller value (or the "
                    "CLI, which takes any).",
                    key,
                )
    return None


def with_dataset_file(config_text: str, dataset_file: str) -> str:
    """The training TOML with `data.dataset_config` pointing at `dataset_file`."""
    try:
        data = tomllib.loads(config_text)
    except tomllib.TOMLDecodeError:
        return config_text  # the loader reports it
    data.setdefault("data", {})["dataset_config"] = dataset_file
    return toml_text.dumps(data)
