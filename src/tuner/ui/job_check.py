"""What a job the UI runs may name: files and folders inside the roots only, and no code of its own choosing.

A training config names files it reads (checkpoints, the dataset TOML, adapters to merge, sample images)
and folders it writes (`save.output_dir`, each dataset's `cache_directory`); its dataset TOML names the
image / video / control / mask folders and manifests, and a manifest names files line by line. Any of
them could point anywhere on the machine, so `JobCheck` resolves every one (relative paths from the file
that names them, symlinks followed, as the commands will) and refuses the job when one lies outside the
roots: when the job is submitted, and again when it starts (the files may have changed in between).

A hub id (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`, by the loader's own rule: no local path of that name) is
not a path: it is read from the Hugging Face cache, where `tuner download` and the loaders keep it.

`train.optimizer` may name any importable class by a dotted path on the command line; from the UI only the
optimizers tuner knows by name are run (`refuse_code_references`), so a config cannot make a job import
and call arbitrary code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

from tuner.config import Config, load_config, read_toml
from tuner.config.schema import TrainingFile
from tuner.errors import ConfigError
from tuner.hub import parse_ref
from tuner.ui.paths import OutsideRoots, Roots


class JobCheck:
    """`check(config_path)`: raises `OutsideRoots` or `ConfigError` (naming the key) for a config the UI
    may not run; `JobQueue` calls it on submit and on start."""

    def __init__(self, roots: Roots):
        self.roots = roots

    def __call__(self, config_path: Path) -> None:
        cfg = load_config(config_path)
        refuse_code_references(cfg)
        for key, path in named_paths(cfg, read_toml(config_path)):
            if not self.roots.contains(path):
                folders = ", ".join(map(str, self.roots.folders))
                raise OutsideRoots(
                    f"key '{key}': {path} is outside the folders this UI may use ({folders}); move it into "
                    "one, or start `tuner ui` with --root for it."
                )


def refuse_code_references(cfg: Config) -> None:
    """`ConfigError` for a config that names code to import (a dotted optimizer path)."""
    from tuner.optimizers.build import optimizer_choices

    name = cfg.train.optimizer
    if name.lower() not in {c.lower() for c in optimizer_choices()}:
        raise ConfigError(
            f"key 'train.optimizer': {name!r} is not an optimizer tuner knows by name; the UI does not import "
            "classes by dotted path (that runs any code). Pick one of the names, or train with the CLI."
        )


def named_paths(cfg: Config, raw: dict) -> Iterator[tuple[str, Path]]:
    """(key, path) of every file or folder the config and its datasets name, absolute; hub ids left out.
    `raw` is the training TOML as written (the loaded config has hub ids replaced by cache paths)."""
    base = cfg.path.parent
    for section in (f.name for f in dataclasses.fields(TrainingFile)):
        loaded, table = getattr(cfg.file, section), raw.get(section, {})
        for f in dataclasses.fields(loaded):
            if not f.metadata.get("path"):
                continue
            value = table.get(f.name, getattr(loaded, f.name))
            values = list(value) if isinstance(value, list | tuple) else [value]
            if (section, f.name) == ("model", "merge_adapters"):  # "file.safetensors:strength"
                values = [
                    p for p, _ in dataclasses.replace(loaded, merge_adapters=tuple(values)).adapter_merges()
                ]
            for v in values:
                if isinstance(v, str) and v and not _is_hub_id(v, base):
                    yield f"{section}.{f.name}", _absolute(v, base)
    yield from _dataset_paths(cfg)


def _dataset_paths(cfg: Config) -> Iterator[tuple[str, Path]]:
    from tuner.data.datasets import discover_items

    dataset_file = Path(cfg.data.dataset_config)
    base = dataset_file.parent
    for spec in cfg.datasets:
        where = f"{dataset_file.name}: datasets[{spec.index}]"
        kind = f"{spec.kind}_{'jsonl_file' if spec.source_is_manifest else 'directory'}"
        yield f"{where}.{kind}", _absolute(spec.source, base)
        for key in ("control_directory", "mask_directory", "cache_directory"):
            if getattr(spec, key):
                yield f"{where}.{key}", _absolute(getattr(spec, key), base)
        if spec.source_is_manifest:  # each line names its files
            items, _ = discover_items(spec, on_error="skip")
            for item in items:
                for path in (item.path, *item.control_paths, item.mask_path):
                    if path:
                        yield f"{where}: {Path(spec.source).name}", _absolute(path, base)


def _absolute(value: str, base: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _is_hub_id(value: str, base: Path) -> bool:
    """The loader's rule (`tuner.hub.resolve_hub_paths`): a hub id is one no local path of that name
    shadows."""
    return (
        parse_ref(value) is not None
        and not Path(value).expanduser().is_absolute()
        and not (base / value.split("/")[0]).exists()
    )
