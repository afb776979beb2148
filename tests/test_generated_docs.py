"""The documentation that depends on the records is generated from them (`tuner.archs.docs`) and current."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from tuner import registry
from tuner.archs import docs
from tuner.config import tomllib


def test_every_generated_fragment_is_current():
    assert docs.stale() == [], "run `python -m tuner.archs.docs --write` and commit the result"


def test_a_stale_fragment_is_found_and_rewritten(tmp_path, monkeypatch):
    for file in {file for file, _ in docs.FRAGMENTS.values()}:
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(docs.REPO / file, tmp_path / file)
    shutil.copytree(docs.REPO / "examples", tmp_path / "examples")
    flux = registry.ARCHITECTURES["flux"]
    monkeypatch.setitem(registry.ARCHITECTURES, "flux", replace(flux, save_format_loads="ComfyUI only"))
    assert docs.stale(tmp_path) == ["README.md: architectures", "docs/architectures.md: adapter-layouts"]
    assert docs.write(tmp_path) == ["README.md: architectures", "docs/architectures.md: adapter-layouts"]
    assert docs.stale(tmp_path) == []
    assert "| `flux` | `kohya` | ComfyUI only |" in (tmp_path / "docs/architectures.md").read_text()


def test_a_missing_marker_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    for file in {file for file, _ in docs.FRAGMENTS.values()}:  # every file a fragment lives in
        (tmp_path / file).write_text("# none here either\n")
    (tmp_path / "README.md").write_text("# no markers\n")
    assert "README.md: architectures" in docs.stale(tmp_path)
    with pytest.raises(SystemExit, match="no '<!-- generated: [a-z-]+ ... -->' marker"):
        docs.write(tmp_path)
    assert (tmp_path / "README.md").read_text() == "# no markers\n"


def test_every_example_is_listed_under_its_architecture():
    readme = (docs.REPO / "README.md").read_text()
    for path in sorted((docs.REPO / "examples").glob("*.toml")):
        data = tomllib.loads(path.read_text())
        assert f"`{path.name}`" in readme, f"{path.name} is named nowhere in the README"
        if "model" in data:
            assert data["model"]["architecture"] in registry.ARCHITECTURES, path.name


def test_every_architecture_has_an_example():
    missing = [name for name in registry.ARCHITECTURES if name not in docs.examples()]
    assert not missing, f"no examples/*.toml trains {missing}"


@pytest.mark.parametrize("name", list(registry.ARCHITECTURES))
def test_variants_are_shipped_configs(name):
    record = registry.ARCHITECTURES[name]
    shipped = {p.name for p in (record.variant_dir / "transformer").iterdir() if p.is_dir()}
    assert record.variants and set(record.variants) <= shipped - {n for n in shipped if n.startswith("tiny")}
    assert record.checkpoints.strip() and record.save_format_loads.strip()


def test_every_real_config_is_some_architectures_variant():
    claimed = {(r.folder, v) for r in registry.ARCHITECTURES.values() for v in r.variants}
    for record in registry.ARCHITECTURES.values():
        for p in (record.variant_dir / "transformer").iterdir():
            if p.is_dir() and not p.name.startswith("tiny"):
                assert (record.folder, p.name) in claimed, f"{p} is no architecture's variant"
