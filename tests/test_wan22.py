"""Wan 2.2 T2V A14B (`wan22_t2v`): two experts, what trains, how files are named, what is refused.

The contract suite (test_contract*.py) runs the architecture's user paths with the fixture's
`expert = "high"`; here: training both experts (one adapter file each, exact resume after the experts
have taken turns), each expert's timestep range, generation with two LoRA lists, and the errors for
swapped, mismatched or wrong-variant checkpoints.
"""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from project import cfg, contract_inputs, killed_at_first_save, make_cached_project, make_project, run
from tuner.archs.parts.experts import TimestepExperts, expert_file
from tuner.archs.wan import loaders as wan
from tuner.archs.wan.trainer_wan22 import Wan22T2VModel, WanExpertsModel
from tuner.cli import main
from tuner.errors import CheckpointError, ConfigError
from tuner.fixtures import write_fixture
from tuner.trainers import trainer_class

QUIET = ("log.tensorboard=false",)
BOTH = ("model.expert='both'", "model.boundary=0.5")  # a boundary both experts see early in the tiny run


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan22")
    paths = write_fixture("wan22_t2v", root / "model")
    return make_cached_project(root / "project", root / "model", architecture="wan22_t2v"), paths


def _train(config, out, *overrides, resume=None) -> WanExpertsModel:
    c = cfg(config, f"save.output_dir='{out}'", *QUIET, *overrides)
    trainer = trainer_class(c.model.architecture)(c)
    trainer.train(resume=resume, log=lambda s: None)
    return trainer


# --- training both experts --------------------------------------------------------------------------


def test_both_experts_train_into_one_file_each_and_resume_exactly(project, tmp_path, monkeypatch):
    check_both_experts_resume_exactly(project[0], tmp_path, monkeypatch)


def check_both_experts_resume_exactly(config, tmp_path, monkeypatch) -> None:
    """Killed after step 2 (both experts have had samples by then), resumed to step 4: both files equal
    an uninterrupted run's, bit for bit. For any two-expert architecture (`config` trains it)."""
    common = (
        *BOTH,
        "train.max_steps=4",
        "train.lr_warmup_steps=0",
        "save.every_n_steps=2",
        "save.every_n_epochs=0",
        "network.dropout=0.1",
    )
    _train(config, tmp_path / "straight", *common)
    killed_at_first_save(monkeypatch, lambda: _train(config, tmp_path / "resumed", *common))
    # the experts switched before the kill: each one's adapter moved off its zero-initialised up matrices
    for expert in ("high", "low"):
        at_kill = load_file(expert_file(tmp_path / "resumed" / "demo_lora-step000002.safetensors", expert))
        assert any(v.abs().sum() > 0 for k, v in at_kill.items() if k.endswith("lora_B.weight")), expert
    resumed = _train(config, tmp_path / "resumed", *common, resume="latest")
    assert len(resumed.history) == 2
    for expert in ("high", "low"):
        straight = load_file(tmp_path / "straight" / f"demo_lora_{expert}_noise.safetensors")
        again = load_file(tmp_path / "resumed" / f"demo_lora_{expert}_noise.safetensors")
        assert straight.keys() == again.keys()
        for key in straight:
            assert torch.equal(straight[key], again[key]), (expert, key)
    assert not (tmp_path / "straight" / "demo_lora.safetensors").exists()


def test_keep_last_keeps_both_experts_files_of_the_last_saves(project, tmp_path):
    c = cfg(project[0], f"save.output_dir='{tmp_path}'", *QUIET, *BOTH, "train.max_steps=6", "save.every_n_steps=2",
            "save.every_n_epochs=0", "save.keep_last=1")  # fmt: skip
    said = []
    final = trainer_class(c.model.architecture)(c).train(log=said.append)
    assert final == tmp_path / "demo_lora_high_noise.safetensors"  # a file that exists, not `demo_lora`
    assert said[-1] == f"saved {final}, {tmp_path / 'demo_lora_low_noise.safetensors'}"
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "demo_lora-step000004_high_noise.safetensors", "demo_lora-step000004_low_noise.safetensors",
        "demo_lora_high_noise.safetensors", "demo_lora_low_noise.safetensors",
    ]  # fmt: skip


def test_each_expert_file_loads_into_its_expert_in_comfy_names(project, tmp_path):
    config, paths = project
    trainer = _train(config, tmp_path, *BOTH, "train.max_steps=2")
    for expert in ("high", "low"):
        path = tmp_path / f"demo_lora_{expert}_noise.safetensors"
        with safe_open(str(path), "pt") as f:
            assert f.metadata()["tuner.expert"] == f"{expert}_noise"
            assert all(k.startswith("diffusion_model.blocks.") for k in f.keys())
    # generate: the high-noise file on model.transformer, the low-noise one on model.transformer_2
    sample = tmp_path / "sample.mp4"
    code = main(["generate", "--config", str(config), "--set", "model.expert='both'", "--prompt", "a red circle",
                 "--lora", str(tmp_path / "demo_lora_high_noise.safetensors"),
                 "--lora-2", str(tmp_path / "demo_lora_low_noise.safetensors"), "--size", "64x48", "--frames", "5",
                 "--steps", "2", "--device", "cpu", "--out", str(sample)])  # fmt: skip
    assert code == 0 and sample.is_file()
    assert trainer.history


def test_a_mixed_batch_goes_to_each_samples_expert(project):
    config, _ = project
    trainer = Wan22T2VModel(cfg(config, *BOTH))
    experts = trainer.load_experts(torch.float32)
    noisy, _, cond = contract_inputs(trainer)
    noisy, cond = noisy.repeat(2, 1, 1, 1, 1), {k: v.repeat(2, *[1] * (v.ndim - 1)) for k, v in cond.items()}
    t = torch.tensor([0.9, 0.2])
    with torch.no_grad():
        mixed = trainer.predict(experts, noisy, t, cond)
        high = trainer.predict(experts.transformer, noisy[:1], t[:1], {k: v[:1] for k, v in cond.items()})
        low = trainer.predict(experts.transformer_2, noisy[1:], t[1:], {k: v[1:] for k, v in cond.items()})
    torch.testing.assert_close(mixed, torch.cat([high, low]))


@pytest.mark.parametrize("expert", ["high", "low"])
def test_one_expert_trains_only_on_its_timesteps(project, expert):
    config, _ = project
    trainer = Wan22T2VModel(cfg(config, f"model.expert='{expert}'"))
    t = trainer.timestep_sampler().sample(4096, generator=torch.Generator().manual_seed(0))
    assert ((t >= 0.875) if expert == "high" else (t < 0.875)).all()
    model = trainer.load_transformer(torch.float32)
    assert not isinstance(model, TimestepExperts)


def test_generate_refuses_a_second_lora_list_for_one_transformer(project, wan_model, tmp_path, capsys):
    config, paths = project
    lora = tmp_path / "x.safetensors"
    lora.write_bytes(b"")
    wan_config = make_project(tmp_path / "wan", wan_model)
    code, log = run(capsys, "generate", "--config", wan_config, "--prompt", "x", "--lora-2", lora, "--size",
                    "64x48", "--frames", "5", "--steps", "1", "--device", "cpu", "--out", tmp_path / "x.mp4")  # fmt: skip
    assert code == 2 and "--lora-2" in log and "one transformer" in log, log


# --- configs checked when read ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model.expert=''",), "choose which one trains"),
        (("model.expert='low'", "model.transformer_2=''"), "set model.transformer_2"),
        (("model.expert='high'", "timesteps.max_timestep=0.5"), "outside the high-noise expert"),
        (("sample.prompts=['x']", "sample.every_n_steps=5"), "need both experts"),
        (("model.expert='both'", "network.network_weights='x.safetensors'"), "one expert at a time"),
    ],
)
def test_config_mistakes_are_caught_when_read(project, overrides, message):
    config, _ = project
    with pytest.raises(ConfigError, match=message):
        cfg(config, *overrides)


def test_one_transformer_architectures_refuse_expert_keys(wan_model, tmp_path):
    config = make_project(tmp_path, wan_model)
    with pytest.raises(ConfigError, match="model.transformer_2.*one transformer"):
        cfg(config, f"model.transformer_2='{config}'")


# --- checkpoints refused with the fix ------------------------------------------------------------------


def test_a_swapped_pair_is_refused_by_the_release_names(project):
    config, paths = project
    trainer = Wan22T2VModel(cfg(config, f"model.transformer='{paths['transformer_2_file']}'"))
    with pytest.raises(CheckpointError, match="low-noise expert.*model.transformer_2"):
        trainer.load_transformer(torch.float32)


def test_the_same_file_for_both_experts_is_refused(project):
    config, paths = project
    trainer = Wan22T2VModel(cfg(config, f"model.transformer_2='{paths['transformer_file']}'"))
    with pytest.raises(CheckpointError, match="same checkpoint"):
        trainer.load_experts(torch.float32)


def test_experts_of_different_variants_are_refused(project, tmp_path):
    config, paths = project
    folder = tmp_path / "other_low"
    shutil.copytree(paths["diffusers"] / "transformer_2", folder)
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, "num_layers": 3}))
    trainer = Wan22T2VModel(cfg(config, f"model.transformer_2='{folder}'"))
    with pytest.raises(CheckpointError, match="not a pair"):
        trainer.load_experts(torch.float32)


def test_the_diffusers_folder_loads_the_same_experts(project):
    config, paths = project
    single = Wan22T2VModel(cfg(config, "model.expert='both'")).load_experts(torch.float32)
    root = paths["diffusers"]
    folder = Wan22T2VModel(
        cfg(config, "model.expert='both'", f"model.transformer='{root}'", f"model.transformer_2='{root}'")
    ).load_experts(torch.float32)
    for a, b in ((single.transformer, folder.transformer), (single.transformer_2, folder.transformer_2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(single.transformer.proj_out.weight, single.transformer_2.proj_out.weight)


@pytest.mark.parametrize(
    "variant, arch, names",
    [
        ("ti2v-5B", "wan22_t2v", 'Wan 2.2 TI2V-5B.*architecture = "wan22_ti2v"'),
        ("i2v-A14B", "wan", 'Wan 2.2 I2V A14B expert.*architecture = "wan22_i2v"'),
        ("i2v-14B", "wan22_t2v", "Wan 2.1 I2V"),
    ],
)
def test_a_file_of_another_variant_names_the_architecture_to_use(tmp_path, variant, arch, names):
    """A diffusers folder is recognised from its config (no weights are read before the check)."""
    folder = tmp_path / "transformer"
    folder.mkdir()
    shutil.copy(wan.CONFIGS / "transformer" / variant / "config.json", folder / "config.json")
    with pytest.raises(CheckpointError, match=names):
        wan.load_transformer(folder, torch.float32, arch)


def test_single_files_of_every_wan_release_are_told_apart():
    for variant in wan.TRANSFORMER_VARIANTS:
        assert variant.name in wan.VARIANT_ARCHITECTURES
    wan.check_variant("t2v-14B", "wan22_t2v", "x")  # an A14B expert has Wan 2.1 14B's network
    with pytest.raises(CheckpointError, match='use architecture = "wan"'):
        wan.check_variant("t2v-1.3B", "wan22_t2v", "x.safetensors")


def test_trainer_is_registered():
    assert issubclass(trainer_class("wan22_t2v"), Wan22T2VModel)


def test_memory_settings_apply_to_each_expert(project):
    from tuner.config.schema import MemorySettings

    config, _ = project
    trainer = Wan22T2VModel(cfg(config, *BOTH))
    experts = trainer.load_experts(torch.float32).requires_grad_(False)
    handles = trainer.apply_memory(experts, MemorySettings(fp8_base=True), "cpu")
    assert handles.handles["high"].fp8_layers and handles.handles["low"].fp8_layers
    assert "high expert: fp8 base" in handles.summary() and "low expert: fp8 base" in handles.summary()


def test_one_checkpoint_trains_the_high_noise_expert(project):
    config, _ = project
    assert cfg(config, "model.expert=''", "model.transformer_2=''").model.expert == "high"
