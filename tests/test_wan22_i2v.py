"""Wan 2.2 I2V A14B (`wan22_i2v`): two experts on Wan 2.1 I2V's 36-channel input without CLIP.

The contract suite (test_contract*.py) runs the architecture's user paths with the fixture's
`expert = "high"`; the expert machinery shared with T2V is tested in test_wan22.py. Here: the inputs
and expert switch against diffusers' `WanImageToVideoPipeline` without an image encoder, what the cache
holds and keys on, exact resume of both experts, generation from a first frame with two LoRA lists, and
the checkpoints refused with the fix.
"""

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image
from safetensors import safe_open

from project import cfg, make_cached_project, run
from test_wan22 import BOTH, QUIET, check_both_experts_resume_exactly
from tuner.archs.wan import loaders as wan
from tuner.archs.wan.trainer_i2v import LatentEncoders, frame_mask
from tuner.archs.wan.trainer_wan22 import Wan22I2VModel
from tuner.cache.plan import latent_encoder, open_training_data
from tuner.data.media import to_tensor
from tuner.errors import CheckpointError
from tuner.fixtures import write_fixture
from tuner.registry import ARCHITECTURES
from tuner.trainers import trainer_class


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan22_i2v")
    paths = write_fixture("wan22_i2v", root / "model")
    return make_cached_project(root / "project", root / "model", architecture="wan22_i2v"), paths


def _frame(seed: int, size=(64, 48)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


# --- the model's inputs are the pipeline's ---------------------------------------------------------


def test_inputs_experts_and_boundary_match_the_diffusers_pipeline(project):
    """Condition latents + mask and each expert's call equal WanImageToVideoPipeline's without an image
    encoder (`prepare_latents`; no `encoder_hidden_states_image`), and the boundary is its `boundary_ratio`."""
    config, paths = project
    trainer = Wan22I2VModel(cfg(config, "model.expert='both'"))
    pipe = WanImageToVideoPipeline.from_pretrained(paths["diffusers"], local_files_only=True)
    assert pipe.image_encoder is None and pipe.transformer.config.image_dim is None
    assert trainer.boundary == pipe.config.boundary_ratio == 0.9
    for part in (pipe.transformer, pipe.transformer_2, pipe.vae, pipe.text_encoder):
        part.eval()
    pixels = to_tensor(np.asarray(_frame(1)))[:, 0].unsqueeze(0)  # [1, 3, H, W]
    frames = 9
    with torch.no_grad():
        mine = trainer.encode_frame_images(LatentEncoders(pipe.vae), [pixels], frames)
        noise, condition = pipe.prepare_latents(
            pixels, 1, 16, 48, 64, frames, torch.float32, "cpu", torch.Generator().manual_seed(0)
        )
    assert set(mine) == {"cond_latents"}
    mask = frame_mask(1, noise.shape[2], noise.shape[3:])
    torch.testing.assert_close(torch.cat([mask, mine["cond_latents"]], dim=1), condition, rtol=0, atol=1e-6)

    text = trainer.collate_text(trainer.encode_text((pipe.text_encoder, pipe.tokenizer), ["a red circle"]))
    experts = trainer.load_experts(torch.float32)
    for t, pipe_model in ((0.95, pipe.transformer), (0.9, pipe.transformer), (0.3, pipe.transformer_2)):
        t = torch.tensor([t])
        with torch.no_grad():
            got = trainer.predict(experts, noise, t, {**text, **mine})
            want = pipe_model(
                hidden_states=torch.cat([noise, condition], dim=1), timestep=t * 1000,
                encoder_hidden_states=text["context"], encoder_hidden_states_image=None, return_dict=False,
            )[0]  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- the cache -------------------------------------------------------------------------------------


def test_cached_entries_hold_the_condition_latents_and_no_clip(project):
    config, _ = project
    trainer = Wan22I2VModel(cfg(config))
    batch = next(iter(open_training_data(trainer, trainer.cfg, log=lambda s: None).epoch(0)))
    assert set(batch["extra"]) == {"cond_latents"}
    assert batch["extra"]["cond_latents"].shape == batch["latents"].shape


def test_the_latent_key_depends_on_the_vae_only(project, tmp_path):
    """No image encoder shapes a latent entry: setting model.image_encoder changes nothing."""
    config, paths = project
    assert ARCHITECTURES["wan22_i2v"].latent_encoders == ("vae",)
    before = latent_encoder(Wan22I2VModel(cfg(config)))
    elsewhere = tmp_path / "clip.safetensors"
    elsewhere.write_bytes(b"not read")
    after = latent_encoder(Wan22I2VModel(cfg(config, f"model.image_encoder='{elsewhere}'")))
    assert before == after


# --- training both experts, and generation ---------------------------------------------------------


def test_both_experts_resume_exactly_after_the_switch(project, tmp_path, monkeypatch):
    check_both_experts_resume_exactly(project[0], tmp_path, monkeypatch)


def test_generate_from_a_first_frame_with_each_experts_lora(project, tmp_path, capsys):
    config, _ = project
    c = cfg(config, f"save.output_dir='{tmp_path}'", *QUIET, *BOTH, "train.max_steps=2")
    trainer_class("wan22_i2v")(c).train(log=lambda s: None)
    for expert in ("high", "low"):
        with safe_open(str(tmp_path / f"demo_lora_{expert}_noise.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert keys and all(k.startswith("diffusion_model.blocks.") for k in keys)
        assert not any("_img" in k for k in keys)  # the release has no image cross-attention
    image = tmp_path / "first.png"
    _frame(3).save(image)
    sample = tmp_path / "sample.mp4"
    base = ("generate", "--config", config, "--set", "model.expert='both'", "--prompt", "a red circle",
            "--size", "64x48", "--frames", "5", "--steps", "2", "--device", "cpu", "--out", sample)  # fmt: skip
    code, log = run(capsys, *base)
    assert code != 0 and "--image FIRST" in log, log
    code, log = run(capsys, *base, "--image", image, "--lora", tmp_path / "demo_lora_high_noise.safetensors",
                    "--lora-2", tmp_path / "demo_lora_low_noise.safetensors")  # fmt: skip
    assert code == 0 and sample.is_file(), log


# --- checkpoints refused with the fix --------------------------------------------------------------


def test_the_low_noise_expert_given_as_transformer_names_transformer_2(project):
    config, paths = project
    trainer = Wan22I2VModel(cfg(config, f"model.transformer='{paths['transformer_2_file']}'"))
    with pytest.raises(CheckpointError, match="low-noise expert.*model.transformer_2"):
        trainer.load_transformer(torch.float32)


def test_a_wan21_i2v_file_names_wan_i2v_and_back(project, tmp_path):
    """Wan 2.1 I2V has CLIP layers, the Wan 2.2 I2V experts have none: each is refused by the other."""
    _, paths = project
    wan21 = write_fixture("wan_i2v", tmp_path / "wan21")
    with pytest.raises(CheckpointError, match='use architecture = "wan_i2v"'):
        wan.load_transformer(wan21["transformer_file"], torch.float32, "wan22_i2v")
    with pytest.raises(CheckpointError, match='use architecture = "wan_i2v"'):
        wan.load_transformer(wan21["diffusers"], torch.float32, "wan22_i2v")
    for source in (paths["transformer_file"], paths["diffusers"]):
        with pytest.raises(CheckpointError, match='test expert.*use architecture = "wan22_i2v"'):
            wan.load_transformer(source, torch.float32, "wan_i2v")
    with pytest.raises(CheckpointError, match='Wan 2.1 I2V 14B.*use architecture = "wan_i2v"'):
        wan.check_variant("i2v-14B", "wan22_i2v", "x.safetensors")


def test_experts_of_different_variants_are_refused(project, wan_model):
    config, _ = project
    t2v = wan_model / "single" / "wan2.1_t2v_tiny.safetensors"
    trainer = Wan22I2VModel(cfg(config, "model.expert='both'", f"model.transformer_2='{t2v}'"))
    with pytest.raises(CheckpointError, match="not a pair.*tiny-i2v-A14B.*tiny"):
        trainer.load_experts(torch.float32)


def test_trainer_is_registered():
    assert issubclass(trainer_class("wan22_i2v"), Wan22I2VModel)
