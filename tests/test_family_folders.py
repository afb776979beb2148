"""A family is one folder: what docs/architectures.md says a family folder holds, every family holds; what
its records point to lives in it; and nothing outside `tuner/archs/` keys on an architecture's name."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from tuner import registry

SRC = Path(registry.__file__).parent
DOC = SRC.parents[1] / "docs" / "architectures.md"


def _listed_files() -> list[str]:
    """The paths the 'Adding an architecture family' section lists as `- `path`: ...` items."""
    section = DOC.read_text().split("## Adding an architecture family", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- `([^`]+)`:", section, flags=re.M)


def test_the_doc_lists_the_folder():
    assert _listed_files() == [
        "__init__.py",
        "record.py",
        "loaders.py",
        "keys.py",
        "trainer.py",
        "fixture.py",
        "configs/transformer/tiny/config.json",
    ]


@pytest.mark.parametrize("family", registry.FAMILIES)
def test_each_family_folder_holds_what_the_doc_lists(family):
    folder = SRC / "archs" / family
    # keys.py may be folded into loaders.py (the doc says so); the record's `layout` then names it there
    missing = [f for f in _listed_files() if f != "keys.py" and not (folder / f).exists()]
    assert not missing, (
        f"archs/{family}/ lacks {missing} (docs/architectures.md, 'Adding an architecture family')"
    )


@pytest.mark.parametrize("family", registry.FAMILIES)
def test_records_point_into_their_own_folder(family):
    records = importlib.import_module(f"tuner.archs.{family}.record").RECORDS
    assert records, family
    for declared in records:
        # what a record names is found in its folder (`Architecture.folder`), by construction
        record = registry.ARCHITECTURES[declared.name]
        assert record.folder == family and record.variant_dir == SRC / "archs" / family / record.configs
        assert record.configs.startswith("configs") and record.variant_dir.is_dir(), record.name
        assert record.family_class().__module__.startswith(f"tuner.archs.{family}."), record.name


def test_the_registry_lists_every_folder():
    folders = {p.name for p in (SRC / "archs").iterdir() if (p / "record.py").exists()}
    assert folders == set(registry.FAMILIES)


# Where an architecture's name may stand outside its folder: defaults that pick the demo's model.
_NAMED_ON_PURPOSE = {"demo.py", "ui/routes_data.py"}


def test_nothing_outside_the_family_folders_keys_on_an_architecture_name():
    """No code outside `archs/` (and the registry's list) compares with, branches on or indexes by an
    architecture's name: such data belongs in the record. Docstrings and messages may mention names."""
    names = set(registry.ARCHITECTURES) | set(registry.FAMILIES)
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("archs/") or rel == "registry.py" or rel in _NAMED_ON_PURPOSE:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            compared = isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators]
            )
            keyed = isinstance(node, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value in names for k in node.keys
            )
            subscripted = (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and node.slice.value in names
            )
            members = isinstance(node, ast.Compare) and any(
                isinstance(c, (ast.Tuple, ast.Set, ast.List))
                and any(isinstance(e, ast.Constant) and e.value in names for e in c.elts)
                for c in node.comparators
            )
            if compared or keyed or subscripted or members:
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"architecture names keyed on outside tuner/archs/: {found}"
