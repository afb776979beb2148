from pathlib import Path

import pytest

from tuner.config import load_config, load_datasets
from tuner.config.docs import render
from tuner.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, train: str, dataset: str | None = None) -> Path:
    (tmp_path / "imgs").mkdir(exist_ok=True)
    (tmp_path / "dataset.toml").write_text(dataset or '[[datasets]]\nimage_directory = "imgs"\n')
    path = tmp_path / "train.toml"
    path.write_text(train)
    return path


BASE = """
[model]
architecture = "wan"
transformer = "model.safetensors"
[data]
dataset_config = "dataset.toml"
"""


def test_minimal_config_loads_with_defaults_and_resolves_paths(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.train.learning_rate == 1e-4
    assert cfg.model.transformer == str(tmp_path / "model.safetensors")
    (ds,) = cfg.datasets
    assert ds.kind == "image" and ds.resolution == (960, 544) and ds.batch_size == 1
    assert ds.cache_directory == str(tmp_path / "cache")


def test_unknown_key_names_file_key_and_suggestion(tmp_path):
    path = write(tmp_path, BASE + "[train]\nlearning_rat = 1e-4\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and "train.learning_rat" in msg and "Did you mean 'learning_rate'" in msg


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match=r"key 'netwrok'.*Did you mean 'network'"):
        load_config(write(tmp_path, BASE + "[netwrok]\nrank = 4\n"))


def test_wrong_type_names_key(tmp_path):
    path = write(tmp_path, BASE + '[network]\nrank = "sixteen"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and "network.rank" in str(e.value) and "integer" in str(e.value)


def test_out_of_range_value(tmp_path):
    with pytest.raises(ConfigError, match=r"network.dropout.*out of range.*< 1"):
        load_config(write(tmp_path, BASE + "[network]\ndropout = 1.5\n"))


def test_bad_choice_suggests(tmp_path):
    with pytest.raises(ConfigError, match=r"train.lr_scheduler.*Did you mean 'cosine'"):
        load_config(write(tmp_path, BASE + '[train]\nlr_scheduler = "cosin"\n'))


def test_cross_field_check_names_file(tmp_path):
    path = write(tmp_path, BASE + "[timesteps]\nmin_timestep = 0.9\nmax_timestep = 0.1\n")
    with pytest.raises(ConfigError, match=r"train.toml: key 'timesteps.min_timestep'"):
        load_config(path)


def test_missing_required_key(tmp_path):
    with pytest.raises(ConfigError, match=r"key 'model.transformer': is required"):
        load_config(
            write(tmp_path, '[model]\narchitecture = "wan"\n[data]\ndataset_config = "dataset.toml"\n')
        )


def test_unknown_architecture(tmp_path):
    with pytest.raises(ConfigError, match=r"model.architecture.*Did you mean 'wan'"):
        load_config(write(tmp_path, BASE.replace('"wan"', '"wann"')))


def test_overrides(tmp_path):
    cfg = load_config(
        write(tmp_path, BASE),
        ["train.learning_rate=5e-5", "network.include=['a.*']", "save.output_name=my_lora"],
    )
    assert cfg.train.learning_rate == 5e-5
    assert cfg.network.include == ("a.*",)
    assert cfg.save.output_name == "my_lora"
    with pytest.raises(ConfigError, match=r"unknown section 'trian'.*Did you mean 'train'"):
        load_config(write(tmp_path, BASE), ["trian.learning_rate=1"])
    with pytest.raises(ConfigError, match=r"train.learning_rate.*out of range"):
        load_config(write(tmp_path, BASE), ["train.learning_rate=-1"])


def test_dataset_general_defaults_and_overrides(tmp_path):
    (tmp_path / "vids").mkdir()
    write(tmp_path, BASE)
    (tmp_path / "dataset.toml").write_text(
        "[general]\nresolution = [512, 512]\nbatch_size = 2\n"
        '[[datasets]]\nimage_directory = "imgs"\n'
        '[[datasets]]\nvideo_directory = "vids"\nbatch_size = 1\ntarget_frames = [17]\nframe_extraction = "slide"\n'
    )
    a, b = load_datasets(tmp_path / "dataset.toml")
    assert a.batch_size == 2 and a.resolution == (512, 512) and a.kind == "image"
    assert (
        b.batch_size == 1 and b.kind == "video" and b.target_frames == (17,) and b.frame_extraction == "slide"
    )


@pytest.mark.parametrize(
    "body, match",
    [
        ("[[datasets]]\nresolution = [64, 64]\n", r"exactly one of image_directory.*found none"),
        (
            '[[datasets]]\nimage_directory = "imgs"\nvideo_directory = "imgs"\n',
            r"found image_directory, video_directory",
        ),
        ('[[datasets]]\nimage_directory = "nope"\n', r"datasets\[0\].image_directory.*does not exist"),
        ('[[datasets]]\nimage_directory = "imgs"\nresolution = [64]\n', r"datasets\[0\].resolution"),
        (
            '[[datasets]]\nimage_directory = "imgs"\nframe_extraction = "middle"\n',
            r"datasets\[0\].frame_extraction",
        ),
        (
            '[general]\nbatch_sise = 2\n[[datasets]]\nimage_directory = "imgs"\n',
            r"general.batch_sise.*batch_size",
        ),
        (
            '[[datasets]]\nimage_directory = "imgs"\ncaption_dropout_rate = 2.0\n',
            r"caption_dropout_rate.*range",
        ),
        ("", r"no \[\[datasets\]\]"),
    ],
)
def test_dataset_errors_name_file_and_key(tmp_path, body, match):
    (tmp_path / "imgs").mkdir()
    path = tmp_path / "dataset.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=match) as e:
        load_datasets(path)
    assert str(path) in str(e.value)


def test_invalid_toml_names_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model\n")
    with pytest.raises(ConfigError, match=r"bad.toml: not valid TOML"):
        load_config(path)


def test_docs_match_schema():
    assert (ROOT / "docs" / "config.md").read_text() == render(), (
        "docs/config.md is stale: run `python -m tuner.config.docs > docs/config.md`"
    )


def test_every_example_toml_loads():
    trains = [p for p in (ROOT / "examples").rglob("*.toml") if "[model]" in p.read_text()]
    datasets = [p for p in (ROOT / "examples").rglob("*.toml") if "[[datasets]]" in p.read_text()]
    assert trains and datasets
    for path in trains:
        load_config(path, check_paths=False)
    for path in datasets:
        assert load_datasets(path, check_paths=False)


def test_full_fine_tune_refuses_memory_settings_for_frozen_weights(tmp_path):
    for setting in ("[memory]\nfp8_base = true\n", "[memory]\nblocks_to_swap = 4\n"):
        path = write(tmp_path, BASE + '[network]\ntype = "full"\n' + setting)
        with pytest.raises(ConfigError, match=r"train.toml: key 'network.type': a full fine-tune"):
            load_config(path)
