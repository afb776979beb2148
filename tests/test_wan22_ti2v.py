"""Wan 2.2 TI2V-5B (`wan22_ti2v`): the Wan 2.2 VAE in both layouts, per-token timesteps with a clean
first frame, training on images and videos, generation from a first frame, and what is refused.

The contract suite (test_contract*.py) runs the architecture's user paths on its fixture; here is what
is particular to it.
"""

import pytest
import torch
from diffusers import AutoencoderKLWan
from PIL import Image

from project import cfg, make_cached_project, make_project, run
from test_first_frame_conditioning import sample_from_first_frame
from tuner.archs.wan import loaders as wan
from tuner.archs.wan.keys import vae22_key_to_original
from tuner.archs.wan.trainer_ti2v import Wan22TI2VModel
from tuner.archs.wan.wan22_vae import VAE22_VARIANTS, vae_generation
from tuner.diffusion.timesteps import flow_loss
from tuner.errors import CheckpointError, ConfigError
from tuner.fixtures import write_fixture
from tuner.generate import GenerateOptions, check_options
from tuner.models.identify import diffusers_meta_keys
from tuner.trainers import trainer_class


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan22_ti2v")
    paths = write_fixture("wan22_ti2v", root / "model")
    return make_cached_project(root / "project", root / "model", architecture="wan22_ti2v"), paths


@pytest.fixture(scope="module")
def trainer(project):
    return Wan22TI2VModel(cfg(project[0]))


@pytest.fixture(scope="module")
def model(trainer):
    return trainer.load_transformer(torch.float32).eval().requires_grad_(False)


def _inputs(batch=2, frames=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    noisy = torch.randn(batch, 48, frames, 4, 4, generator=g)
    context = torch.randn(batch, 8, 64, generator=g)
    return noisy, {"context": context}


# --- the Wan 2.2 VAE --------------------------------------------------------------------------------


def test_vae_original_names_are_the_release_ones():
    """The names of the release's `vae2_2.py` modules (one more nesting level than 2.1), including the
    tensor ComfyUI tells a Wan 2.2 VAE by, for every weight of the real 48-channel VAE."""
    real = next(v for v in VAE22_VARIANTS if v.name == "wan2.2")
    keys = diffusers_meta_keys(AutoencoderKLWan, real.config_dir)
    original = {vae22_key_to_original(k) for k in keys}
    assert len(original) == len(keys)
    for name in (
        "decoder.upsamples.0.upsamples.0.residual.2.weight",  # ComfyUI's marker for a Wan 2.2 VAE
        "encoder.downsamples.0.downsamples.0.residual.0.gamma",
        "encoder.downsamples.0.downsamples.2.resample.1.weight",  # the level's downsample follows 2 blocks
        "encoder.downsamples.1.downsamples.2.time_conv.weight",
        "decoder.upsamples.0.upsamples.3.time_conv.weight",  # ... the decoder's follows 3
        "decoder.upsamples.2.upsamples.0.shortcut.weight",
        "encoder.middle.1.to_qkv.weight",
        "decoder.head.2.weight",
        "conv1.weight",
        "conv2.weight",
    ):
        assert name in original, name


def test_both_layouts_load_the_same_weights(project):
    _, paths = project
    for generation, component in (("2.2", "vae"), (None, "transformer")):
        if generation:
            a = wan.load_vae(paths["vae_file"], torch.float32, "2.2", "wan22_ti2v")
            b = wan.load_vae(paths["diffusers"], torch.float32, "2.2", "wan22_ti2v")
        else:
            a = wan.load_transformer(paths["transformer_file"], torch.float32, "wan22_ti2v")
            b = wan.load_transformer(paths["diffusers"], torch.float32, "wan22_ti2v")
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys(), component
        assert all(torch.equal(sa[k], sb[k]) for k in sa), component


def test_vae_compression_and_first_frame(trainer, project):
    """48 channels at 16× / 4×; a video's first latent frame is its first picture encoded alone, which is
    what image-to-video training takes from cached video latents (and the pipeline from the image)."""
    vae = trainer.load_vae(torch.device("cpu"), torch.float32)
    pixels = torch.rand(1, 3, 9, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = trainer.encode_pixels(vae, pixels)
    assert latents.shape == (1, *trainer.latent_shape(96, 64, 9)) == (1, 48, 3, 4, 6)
    assert torch.equal(trainer.encode_pixels(vae, pixels[:, :, :1])[:, :, 0], latents[:, :, 0])
    assert trainer.decode_latents(vae, latents).shape == pixels.shape


def test_a_vae_of_the_wrong_generation_is_refused_by_name(project, wan_model):
    _, paths = project
    wan21_vae = wan_model / "single" / "wan_2.1_vae.safetensors"
    assert vae_generation(wan21_vae) == "2.1" and vae_generation(paths["vae_file"]) == "2.2"
    trainer = Wan22TI2VModel(cfg(project[0], f"model.vae='{wan21_vae}'"))
    with pytest.raises(CheckpointError, match=r"wan_2\.1_vae\.safetensors: this is the Wan 2\.1 VAE.*wan22_ti2v.*"
                       r"needs the Wan 2\.2 VAE \(Wan2\.2_VAE\.pth / ComfyUI's wan2\.2_vae\.safetensors\)"):  # fmt: skip
        trainer.load_vae(torch.device("cpu"), torch.float32)
    with pytest.raises(
        CheckpointError, match=r"this is the Wan 2\.2 VAE.*architecture 'wan' needs the Wan 2\.1"
    ):
        wan.load_vae(paths["vae_file"], torch.float32, "2.1", "wan")


def test_transformer_variants_name_the_architecture(project, wan_model):
    _, paths = project
    with pytest.raises(CheckpointError, match=r"TI2V test transformer.*use architecture = \"wan22_ti2v\""):
        wan.load_transformer(paths["transformer_file"], torch.float32, "wan")
    with pytest.raises(
        CheckpointError, match=r"architecture 'wan22_ti2v' does not train; use architecture = \"wan\""
    ):
        wan.load_transformer(
            wan_model / "single" / "wan2.1_t2v_tiny.safetensors", torch.float32, "wan22_ti2v"
        )
    assert wan.transformer_variant(paths["transformer_file"]) == "tiny-ti2v"


# --- the model's inputs -----------------------------------------------------------------------------


def test_predict_matches_the_pipelines_call_with_a_clean_first_frame(trainer, model):
    """What diffusers' WanImageToVideoPipeline (expand_timesteps) feeds the transformer: the condition in
    the first latent frame, and the first-frame mask at stride 2 times t as the per-token timestep."""
    noisy, cond = _inputs(batch=1)
    first = torch.randn(1, 48, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.7])
    mask = torch.ones(1, 1, 3, 4, 4)
    mask[:, :, 0] = 0
    condition = torch.cat([first, torch.zeros(1, 48, 2, 4, 4)], dim=2)
    with torch.no_grad():
        want = model(hidden_states=(1 - mask) * condition + mask * noisy,
                     timestep=(mask[0][0][:, ::2, ::2] * 700.0).flatten().unsqueeze(0),
                     encoder_hidden_states=cond["context"], return_dict=False)[0]  # fmt: skip
        got = trainer.predict(
            model, noisy, t, {**cond, "first_frame": first, "clean_first": torch.tensor([True])}
        )
    torch.testing.assert_close(got[:, :, 1:], want[:, :, 1:], rtol=0, atol=0)
    # the given frame's velocity is the straight line to it
    torch.testing.assert_close(got[:, :, :1], (noisy[:, :, :1] - first) / 0.7)


def test_one_timestep_per_sample_is_the_per_token_computation(trainer, model):
    """Batches without a given frame skip the per-token embedding; the result is the same."""
    noisy, cond = _inputs()
    t = torch.tensor([0.3, 0.8])
    tokens = noisy.shape[2] * 2 * 2
    with torch.no_grad():
        per_sample = trainer.predict(model, noisy, t, cond)
        per_token = model(hidden_states=noisy, timestep=(t * 1000).view(-1, 1).expand(-1, tokens),
                          encoder_hidden_states=cond["context"], return_dict=False)[0]  # fmt: skip
    torch.testing.assert_close(per_sample, per_token, rtol=1e-5, atol=1e-5)


def test_mixed_batch_rows_are_independent(trainer, model):
    """In a batch where one sample is given its first frame and one is not, each row is what it would be
    alone."""
    noisy, cond = _inputs()
    first = torch.randn(2, 48, 1, 4, 4, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.4, 0.9])
    clean = torch.tensor([True, False])
    with torch.no_grad():
        both = trainer.predict(model, noisy, t, {**cond, "first_frame": first, "clean_first": clean})
        for i in range(2):
            row = {
                "context": cond["context"][i : i + 1],
                "first_frame": first[i : i + 1],
                "clean_first": clean[i : i + 1],
            }
            alone = trainer.predict(model, noisy[i : i + 1], t[i : i + 1], row)
            torch.testing.assert_close(both[i : i + 1], alone, rtol=1e-5, atol=1e-5)


# --- training on both kinds of item ----------------------------------------------------------------


def test_videos_train_image_to_video_with_the_configured_probability(project):
    config, _ = project
    video, image = torch.zeros(64, 48, 3, 2, 2), torch.zeros(64, 48, 1, 2, 2)
    for p, want in ((0.0, 0), (1.0, 64)):
        trainer = Wan22TI2VModel(cfg(config, f"train.first_frame_conditioning_p={p}"))
        assert (
            int(trainer.draw_conditions(video, {}, torch.Generator().manual_seed(0))["clean_first"].sum())
            == want
        )
        assert not trainer.draw_conditions(image, {}, torch.Generator().manual_seed(0))["clean_first"].any()
    trainer = Wan22TI2VModel(cfg(config))  # the default, 0.5
    drawn = [
        trainer.draw_conditions(video, {}, torch.Generator().manual_seed(s))["clean_first"] for s in (3, 3)
    ]
    assert torch.equal(*drawn) and 16 < int(drawn[0].sum()) < 48  # seeded, and about half
    with pytest.raises(ConfigError, match="first_frame_conditioning_p"):
        cfg(config, "train.first_frame_conditioning_p=1.5")
    with pytest.raises(ConfigError, match="'model.i2v_probability': this key is now 'train.first_frame_cond"):
        cfg(config, "model.i2v_probability=0.3")  # the old key says where it went


def test_the_given_frame_is_out_of_the_loss(trainer):
    x0 = torch.randn(2, 48, 3, 2, 2)
    cond = {"first_frame": x0[:, :, :1], "clean_first": torch.tensor([True, False])}
    mask = trainer.loss_mask(x0, cond)
    target, pred = torch.zeros_like(x0), torch.zeros_like(x0)
    pred[:] = 1.0
    pred[0, :, 0] = 100.0  # whatever is returned for the given frame does not count
    t = torch.tensor([0.5, 0.5])
    assert flow_loss(pred, target, t, mask=mask).item() == pytest.approx(1.0)
    assert trainer.loss_mask(x0, {**cond, "clean_first": torch.tensor([False, False])}) is None


# --- generation from a first frame -----------------------------------------------------------------


def test_generation_ends_on_the_given_first_frame(trainer, model, project, tmp_path):
    image = tmp_path / "first.png"
    Image.new("RGB", (64, 64), (200, 40, 40)).save(image)
    assert sample_from_first_frame(trainer, model, image, (64, 64), 5).shape == (1, 48, 2, 4, 4)


def test_image_option_is_checked(project, wan_model, tmp_path, capsys):
    config, _ = project
    image = tmp_path / "first.png"
    Image.new("RGB", (64, 64)).save(image)
    wan_trainer = trainer_class("wan")(cfg(make_project(tmp_path / "wan", wan_model)))
    with pytest.raises(ConfigError, match="takes no frame image; leave --image out"):
        check_options(
            wan_trainer, GenerateOptions(prompt="x", out="", images=(str(image),), width=64, height=48)
        )
    with pytest.raises(ConfigError, match="ask for more"):
        check_options(Wan22TI2VModel(cfg(config)), GenerateOptions(prompt="x", out="", images=(str(image),),
                                                                     width=64, height=64, frames=1))  # fmt: skip
    code, log = run(capsys, "generate", "--config", config, "--prompt", "x", "--image", image, "--size", "64x48",
                    "--frames", "5", "--steps", "1", "--device", "cpu", "--out", tmp_path / "x.mp4")  # fmt: skip
    assert code != 0 and "multiples of 32" in log
    code, log = run(capsys, "generate", "--config", config, "--prompt", "x", "--image", image, "--size", "64x64",
                    "--frames", "5", "--steps", "2", "--device", "cpu", "--out", tmp_path / "x.mp4")  # fmt: skip
    assert code == 0, log
    assert (tmp_path / "x.mp4").stat().st_size > 0
