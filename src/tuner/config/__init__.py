"""Config loading: TOML files → validated, frozen dataclasses.

    cfg = load_config("train.toml", overrides=["train.learning_rate=5e-5"])
    cfg.train.learning_rate, cfg.datasets[0].resolution

A training TOML names a dataset TOML (`data.dataset_config`); both are read and checked here, and any
mistake is one `ConfigError` that names the file, the key and the fix.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from tuner.config.dataset import DatasetSpec, parse_dataset_table
from tuner.config.fields import parse_section
from tuner.config.schema import TrainingFile
from tuner.errors import ConfigError, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Config", "load_config", "load_datasets", "read_toml", "apply_override"]


@dataclass(frozen=True)
class Config:
    """A loaded training config: the TOML's sections plus the resolved datasets."""

    file: TrainingFile
    datasets: tuple[DatasetSpec, ...]
    path: Path
    overrides: tuple[str, ...] = ()
    """The `--set` overrides applied on top of the file, in order."""

    def command(self, name: str) -> str:
        """The `tuner <name>` command line that loads this same config (file and `--set` overrides)."""
        return " ".join(
            ["tuner", name, "--config", str(self.path), *(f"--set {shlex.quote(o)}" for o in self.overrides)]
        )

    def __getattr__(self, name: str):  # cfg.train, cfg.model ... read through to the file's sections
        return getattr(self.file, name)


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found.")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word is a string: --set model.architecture=wan


def apply_override(data: dict, override: str, source: str = "--set") -> None:
    """Apply one `section.key=value` override (value in TOML syntax, bare words are strings)."""
    if "=" not in override:
        raise ConfigError(
            f"{source} {override!r}: expected section.key=value, e.g. train.learning_rate=1e-4."
        )
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    node = data
    known = TrainingFile.__dataclass_fields__
    for part in parts[:-1]:
        if node is data and part not in known:
            raise ConfigError(f"{source} {override!r}: unknown section '{part}'.{did_you_mean(part, known)}")
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{source} {override!r}: '{part}' is not a table.")
    node[parts[-1]] = _parse_value(text.strip())


def load_datasets(path: str | Path, check_paths: bool = True) -> list[DatasetSpec]:
    path = Path(path).resolve()
    return parse_dataset_table(read_toml(path), str(path), path.parent, check_paths)


def load_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), check_paths: bool = True
) -> Config:
    """Load and validate a training TOML and the dataset TOML it names."""
    path = Path(path).resolve()
    data = read_toml(path)
    for override in overrides:
        apply_override(data, override)
    file = parse_section(TrainingFile, data, str(path), "", path.parent)
    from tuner.registry import architecture  # plain data; importing it loads no model code

    try:
        architecture(file.model.architecture)
    except ConfigError as e:
        raise ConfigError(f"{path}: key 'model.architecture': {e}") from None
    from tuner.hub import resolve_hub_paths, resolve_model_paths  # hub ids, default tokenizers

    model = resolve_model_paths(file.model, data.get("model", {}), path.parent)
    network = resolve_hub_paths(file.network, data.get("network", {}), path.parent)  # network_weights
    if model is not file.model or network is not file.network:
        file = dataclasses.replace(file, model=model, network=network)
    datasets = load_datasets(file.data.dataset_config, check_paths)
    if file.train.validate_every_n_steps and not any(d.validation for d in datasets):
        raise ConfigError(
            f"{path}: key 'train.validate_every_n_steps' is set, but {file.data.dataset_config} has no "
            "[[datasets]] table with validation = true."
        )
    return Config(file=file, datasets=tuple(datasets), path=path, overrides=tuple(overrides))
