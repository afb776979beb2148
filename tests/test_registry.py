"""Every registered architecture declares every piece shared code needs (`tuner.registry`).

A new architecture that lacks a piece fails here, before the contract suite (tests/test_contract.py)
runs every user path on its fixture.
"""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import diffusers
import pytest

from tuner.archs.model import ArchitectureModel
from tuner.diffusion.timesteps import MODES
from tuner.fixtures import Fixture
from tuner.networks.architectures import ArchitectureKeys, architecture_keys
from tuner.networks.layouts import CheckpointLayout
from tuner.registry import ARCHITECTURES, SAVE_LAYOUTS, Architecture, architecture
from tuner.trainers import trainer_class
from tuner.trainers.base import NetworkTrainer

DOCS = Path(__file__).parents[1] / "docs" / "architectures.md"


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_record_is_complete(name):
    record = ARCHITECTURES[name]
    assert record.name == name and record.title
    family = record.family_class()
    assert issubclass(family, ArchitectureModel) and family.architecture == name
    assert not issubclass(family, NetworkTrainer)  # the loop is combined with it by trainer_class only
    trainer = trainer_class(name)
    assert (
        issubclass(trainer, NetworkTrainer) and issubclass(trainer, family) and trainer is trainer_class(name)
    )
    for method in ("load_transformer", "load_vae", "load_text_encoder", "encode_pixels", "encode_text",
                   "predict", "decode_latents", "latent_shape"):  # fmt: skip
        assert getattr(family, method) is not getattr(ArchitectureModel, method), f"{name} lacks {method}"
    assert isinstance(record.checkpoint_layout(), CheckpointLayout)
    assert isinstance(record.key_table(), ArchitectureKeys)
    assert architecture_keys(name) is record.key_table()
    fixture = record.load_fixture()
    assert isinstance(fixture, Fixture) and f'architecture = "{name}"' in fixture.model_section
    # diffusers' class, or where diffusers has none the family's own (`model.py`)
    cls = record.transformer_class()
    assert cls.__name__ == record.model_class and (
        hasattr(diffusers, record.model_class) or cls.__module__ == f"tuner.archs.{record.folder}.model"
    ), record.model_class
    for variant in record.variants:  # a family folder may hold another class's configs (Wan VACE)
        config = record.variant_dir / "transformer" / variant / "config.json"
        assert json.loads(config.read_text())["_class_name"] == record.model_class, config
    assert record.block_lists and all(re.fullmatch(r"[a-z_]+(\.[a-z_]+)*", b) for b in record.block_lists)
    assert record.default_targets
    for pattern in record.default_targets:
        re.compile(pattern)
    variants = {
        p.name for p in (record.variant_dir / "transformer").iterdir() if (p / "config.json").is_file()
    }
    assert "tiny" in variants and len(variants) >= 2, f"{name}: ship the real variants' configs too"
    assert record.save_format in SAVE_LAYOUTS


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_record_describes_the_model(name):
    """The per-architecture data caching, generation and the loop read off the record."""
    r = ARCHITECTURES[name]
    assert r.spatial_step in (16, 32, 64)
    assert r.frame_multiple >= 1 and 0 <= r.frame_remainder < r.frame_multiple
    assert r.model_fps > 0 and r.min_frames >= 1 and r.frame_images in (0, 1, 2)
    assert r.supports_video or r.supports_images
    # a VAE's latents (the VAE first of the models that shape them), or the pictures themselves
    assert r.latent_space in ("vae", "pixels")
    assert r.latent_encoders[:1] == ("vae",) if r.latent_space == "vae" else not r.latent_encoders
    low, high = r.control_images
    assert 0 <= low <= high
    assert not r.text_uses_controls or high > 0
    assert r.timestep_mode in MODES
    assert len(r.latent_patch) in (2, 3) and all(p >= 1 for p in r.latent_patch)
    assert r.audio_format is None or (r.audio_format[0] > 0 and r.audio_format[1] in (1, 2))
    assert r.objective in ("flow", "ddpm", "edm") and r.cache_format_version >= 1
    assert r.flow_prediction in ("velocity", "x0") and (
        r.objective == "flow" or r.flow_prediction == "velocity"
    )
    assert not r.noise_scales or r.flow_prediction == "x0"
    assert not r.first_frame_image or r.first_frame is not None


def test_the_loop_and_the_model_share_no_method():
    """`trainer_class` puts the loop first in the MRO: it must not shadow anything a family computes."""
    loop = {n for n in vars(NetworkTrainer) if not n.startswith("__")}
    assert not loop & {n for n in dir(ArchitectureModel) if not n.startswith("__")}
    for record in ARCHITECTURES.values():
        assert not loop & {n for n in dir(record.family_class()) if not n.startswith("__")}, record.name


def test_architectures_sharing_a_model_share_its_tables():
    """Kontext is FLUX.1's network, Qwen-Image-Edit Qwen-Image's: one key table each, so a file's module
    names identify the family and its metadata the member."""
    assert architecture_keys("flux_kontext") is architecture_keys("flux")
    assert architecture_keys("qwen_image_edit") is architecture_keys("qwen_image")


def test_unknown_architecture_is_named_with_a_suggestion():
    with pytest.raises(Exception, match="Did you mean 'flux'.*Known: wan"):
        architecture("flx")


def test_reading_the_registry_imports_no_model_code():
    code = (
        "import sys, tuner.registry, tuner.config, tuner.cli; tuner.cli.build_parser(); "
        "print([m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_docs_checklist_names_every_piece_of_the_record():
    text = DOCS.read_text()
    for field in dataclasses.fields(Architecture):
        assert f"`{field.name}`" in text, f"docs/architectures.md does not explain the record's {field.name}"


@pytest.mark.parametrize("argv", [["--help"], ["fixtures", "--help"]])
def test_help_lists_every_architecture(argv, capsys):
    from tuner.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    out = capsys.readouterr().out
    for name, record in ARCHITECTURES.items():
        assert name in out and record.title in out, name


def _overriding_families() -> dict[str, set[str]]:
    """Public `ArchitectureModel` method -> the family folders whose classes override it (shared code
    such as `tuner.archs.flux_vae` is not a family)."""
    overriders: dict[str, set[str]] = {}
    for record in ARCHITECTURES.values():
        family_class = record.family_class()
        for cls in family_class.__mro__:
            folder = cls.__module__.split(".")
            if cls is ArchitectureModel or folder[:2] != ["tuner", "archs"] or len(folder) < 4:
                continue  # the base, or shared code beside the family folders
            for name in vars(cls):
                if not name.startswith("_") and hasattr(ArchitectureModel, name):
                    overriders.setdefault(name, set()).add(folder[2])
    return overriders


def test_no_model_method_is_overridden_by_exactly_one_family():
    """What one family alone needs is a part (`tuner.archs.parts`) its record declares, not a hook on
    `ArchitectureModel`: a method there is either shared behaviour or implemented by several families."""
    single = {name: families for name, families in _overriding_families().items() if len(families) == 1}
    assert not single, f"overridden by one family only (make them parts): {single}"
