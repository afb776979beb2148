"""Cosmos 1.0 Diffusion Text2World: loading its layouts, refusing Predict2's, key names against diffusers'
converter, the EDM objective against diffusers' EDMEulerScheduler, and generation against
CosmosTextToWorldPipeline on the tiny fixture."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKLCosmos,
    CosmosTextToWorldPipeline,
    CosmosTransformer3DModel,
    EDMEulerScheduler,
)
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, T5EncoderModel

from project import assert_equal_weights
from tuner.archs.cosmos_predict2 import loaders as predict2
from tuner.archs.cosmos_predict2 import loaders_cosmos1 as cosmos1
from tuner.archs.cosmos_predict2.fixture_cosmos1 import SCHEDULER_CONFIG
from tuner.archs.cosmos_predict2.keys_cosmos1 import transformer_key_to_original
from tuner.archs.cosmos_predict2.trainer_cosmos1 import Cosmos1T2WModel
from tuner.config.schema import TimestepConfig
from tuner.diffusion.edm import EDMObjective, edm_sample, sample_sigmas
from tuner.errors import CheckpointError, ConfigError
from tuner.fixtures import write_fixture

PROMPT = "a red cat sits on a blue chair"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("cosmos1_t2w", tmp_path_factory.mktemp("cosmos1_t2w"))


@pytest.fixture(scope="module")
def predict2_paths(tmp_path_factory):
    return write_fixture("cosmos_predict2", tmp_path_factory.mktemp("cosmos_predict2"))


def _family(paths) -> Cosmos1T2WModel:
    model = SimpleNamespace(transformer=str(paths["transformer_file"]), vae=str(paths["diffusers"]))
    cfg = SimpleNamespace(model=model, cache=SimpleNamespace(text_max_length=16), timesteps=TimestepConfig())
    return Cosmos1T2WModel(cfg)


# ---------------------------------------------------------------------------------------------------
# Loading, and the relatives refused
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_file_loads_like_the_diffusers_folder(paths, tmp_path, dtype):
    folder = cosmos1.load_transformer(paths["diffusers"], dtype)
    assert_equal_weights(folder, cosmos1.load_transformer(paths["transformer_file"], dtype))
    # NVIDIA's own file: `net.` names with the loss's `logvar` network and the RoPE table beside them
    release = {f"net.{k}": v for k, v in load_file(paths["transformer_file"]).items()}
    release |= {"net.logvar.0.freqs": torch.zeros(128), "net.logvar.1.weight": torch.zeros(1, 128),
                "net.pos_embedder.seq": torch.zeros(256)}  # fmt: skip
    save_file(release, tmp_path / "model.safetensors")
    assert_equal_weights(folder, cosmos1.load_transformer(tmp_path / "model.safetensors", dtype))


def test_variant_picked_from_shapes(paths):
    assert cosmos1.identify_transformer(paths["transformer_file"]).name == "tiny-cosmos1"
    for variant in cosmos1.TRANSFORMER_VARIANTS:  # the shipped configs build what the table says
        config = CosmosTransformer3DModel.load_config(variant.config_dir)
        hidden = config["num_attention_heads"] * config["attention_head_dim"]
        assert variant.signature["x_embedder.proj.1.weight"] == (hidden, 4 * (config["in_channels"] + 1))
        assert config["extra_pos_embed_type"] == "learnable", variant.name


def test_predict2_and_cosmos1_refuse_each_other(paths, predict2_paths):
    for path in (predict2_paths["transformer_file"], predict2_paths["diffusers"]):
        with pytest.raises(CheckpointError, match='architecture = "cosmos_predict2"'):
            cosmos1.load_transformer(path, torch.float32)
    for path in (paths["transformer_file"], paths["diffusers"]):
        with pytest.raises(CheckpointError, match='architecture = "cosmos1_t2w"'):
            predict2.load_transformer(path, torch.float32)
    with pytest.raises(CheckpointError, match='"cosmos1_v2w"'):  # Text2World is not Video2World
        cosmos1.load_transformer(paths["transformer_file"], torch.float32, video2world=True)
    with pytest.raises(CheckpointError, match="diffusers folder"):
        cosmos1.load_vae(paths["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="AutoencoderKLCosmos"):
        cosmos1.load_vae(predict2_paths["diffusers"], torch.float32)


@pytest.mark.parametrize("variant", cosmos1.TRANSFORMER_VARIANTS, ids=lambda v: v.name)
def test_release_layout_is_what_diffusers_converter_reads(variant):
    """diffusers' release -> diffusers converter (`from_single_file`'s) takes our release names, with
    `net.` and the buffers the loader drops, back to exactly diffusers' keys."""
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    with torch.device("meta"):
        keys = list(CosmosTransformer3DModel.from_config(CosmosTransformer3DModel.load_config(variant.config_dir)).state_dict())  # fmt: skip
    release = _Kept({f"net.{transformer_key_to_original(k)}": torch.empty(0) for k in keys})
    release |= {f"net.{k}": torch.empty(0) for k in ("logvar.0.freqs", "logvar.1.weight", "pos_embedder.seq")}
    assert sorted(convert_cosmos_transformer_checkpoint_to_diffusers(release)) == sorted(keys)


class _Kept(dict):
    """A checkpoint that keeps its keys when the converter pops them: diffusers 0.42.1's converter empties
    the checkpoint it is given before it looks for the Cosmos 1.0 marker key in it, so a plain dict always
    takes Predict2's renames there (its `from_single_file` cannot load Cosmos 1.0 release files)."""

    def pop(self, key, *default):
        return self[key]


# ---------------------------------------------------------------------------------------------------
# The EDM objective
# ---------------------------------------------------------------------------------------------------


def test_edm_preconditioning_and_loss_are_the_schedulers():
    """At x_t = x_σ / (1 + σ): the network input is c_in·x_σ, its timestep c_noise, x̂0 from our velocity
    is the scheduler's c_skip·x_σ + c_out·F, and the loss is EDM's λ(σ)·‖D − x0‖²."""
    scheduler, edm = EDMEulerScheduler(**SCHEDULER_CONFIG), EDMObjective()
    g = torch.Generator().manual_seed(0)
    x0, noise, out = (torch.randn(3, 4, 2, 2, 2, generator=g, dtype=torch.float64) for _ in range(3))
    sigma = torch.tensor([0.01, 1.3, 60.0], dtype=torch.float64)
    t = sigma / (1 + sigma)
    x_sigma = x0 + sigma.view(-1, 1, 1, 1, 1) * noise
    x_t = edm.add_noise(x0, noise, t)
    torch.testing.assert_close(x_t, x_sigma / (1 + sigma.view(-1, 1, 1, 1, 1)))
    inputs, c_noise = edm.model_inputs(x_t, t)
    for i in range(3):
        torch.testing.assert_close(inputs[i], scheduler.precondition_inputs(x_sigma[i], sigma[i]))
        torch.testing.assert_close(
            c_noise[i].double(), scheduler.precondition_noise(sigma[i]).double(), rtol=1e-6, atol=1e-6
        )
    v = edm.velocity(out, x_t, t)
    denoised = torch.stack([scheduler.precondition_outputs(x_sigma[i], out[i], sigma[i]) for i in range(3)])
    torch.testing.assert_close(x_t - t.view(-1, 1, 1, 1, 1) * v, denoised, rtol=1e-5, atol=1e-6)
    weight = (sigma**2 + 0.25) / (sigma * 0.5) ** 2  # λ(σ), σ_d = 0.5
    expected = ((denoised - x0).square().flatten(1).mean(1) * weight).mean()
    torch.testing.assert_close(edm.loss(v, x0, noise, t).double(), expected, rtol=1e-5, atol=0)


def test_edm_refuses_flow_and_ddpm_options():
    from tuner.diffusion.ddpm import objective_from_config

    with pytest.raises(ConfigError, match="loss_weighting"):
        objective_from_config("edm", TimestepConfig(loss_weighting="cosmap"), "cosmos1_t2w")
    with pytest.raises(ConfigError, match="min_snr_gamma"):
        objective_from_config("edm", TimestepConfig(min_snr_gamma=5.0), "cosmos1_t2w")
    assert objective_from_config("edm", TimestepConfig(), "cosmos1_t2w") == EDMObjective()


def test_sample_sigmas_are_the_pipelines():
    scheduler = EDMEulerScheduler(**SCHEDULER_CONFIG)
    scheduler.set_timesteps(5)
    torch.testing.assert_close(sample_sigmas(5).float(), scheduler.sigmas)


# ---------------------------------------------------------------------------------------------------
# Against CosmosTextToWorldPipeline
# ---------------------------------------------------------------------------------------------------


class _NoGuardrail:
    """Stands in for NVIDIA's `cosmos_guardrail` checker (not installed): every prompt and video passes
    (the pipeline rounds the video to uint8 around its check)."""

    def to(self, device):
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, video):
        return video


@pytest.fixture
def pipe(paths, monkeypatch):
    """The pipeline on the fixture's folder, its transformer diffusers' own, whose torchvision resize of the
    padding mask (torchvision does not import beside this torch) is given a stand-in doing the same."""
    from diffusers.models.transformers import transformer_cosmos

    resize = lambda x, size, interpolation: F.interpolate(x, size=size, mode="nearest")  # noqa: E731
    transforms = SimpleNamespace(functional=SimpleNamespace(resize=resize),
                                 InterpolationMode=SimpleNamespace(NEAREST="nearest"))  # fmt: skip
    monkeypatch.setattr(transformer_cosmos, "transforms", transforms, raising=False)
    root = paths["diffusers"]
    return CosmosTextToWorldPipeline(
        transformer=CosmosTransformer3DModel.from_pretrained(root / "transformer").eval(),
        vae=AutoencoderKLCosmos.from_pretrained(root / "vae").eval(),
        text_encoder=T5EncoderModel.from_pretrained(root / "text_encoder").eval(),
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
        scheduler=EDMEulerScheduler.from_pretrained(root / "scheduler"),
        safety_checker=_NoGuardrail(),
    )


@torch.no_grad()
def test_generation_matches_the_pipeline(pipe, paths):
    """`tuner generate`'s sampler (`edm_sample` over our velocity, the transformer from the release file)
    lands on the pipeline's latents for the same seed and steps (guidance 7 there is 8 here), and decodes
    to its video."""
    family = _family(paths)
    steps, guidance, frames = 4, 7.0, 9
    out = pipe(prompt=PROMPT, negative_prompt="blurry", height=32, width=32, num_frames=frames, fps=24,
               num_inference_steps=steps, guidance_scale=guidance, output_type="latent", max_sequence_length=16,
               generator=torch.Generator().manual_seed(3)).frames  # fmt: skip
    model = family.load_transformer(torch.float32)
    cond, uncond = (family.collate_text(family.encode_text((pipe.text_encoder, pipe.tokenizer), [p]))
                    for p in (PROMPT, "blurry"))  # fmt: skip
    noise = torch.randn((1, *family.latent_shape(32, 32, frames)), generator=torch.Generator().manual_seed(3))

    def model_fn(x, t, c):
        return family.predict(model, x, t / 1000, c)

    ours = edm_sample(model_fn, noise, steps, cond, uncond, guidance + 1, combine=family.combine_guidance)
    torch.testing.assert_close(ours, out, rtol=1e-4, atol=1e-4)
    video = pipe(prompt=PROMPT, negative_prompt="blurry", height=32, width=32, num_frames=frames, fps=24,
                 num_inference_steps=steps, guidance_scale=guidance, output_type="pt", max_sequence_length=16,
                 generator=torch.Generator().manual_seed(3)).frames  # fmt: skip
    pixels = family.decode_latents(family.load_vae(torch.device("cpu"), torch.float32), ours)
    ours_video = (pixels / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)  # the pipeline's frames first
    torch.testing.assert_close(ours_video, video, rtol=0, atol=1 / 255 + 1e-4)  # its uint8 round trip


def test_latents_match_the_pipelines_normalization(pipe, paths):
    """Encoding normalizes per channel and latent frame and scales by σ_d = 0.5; decoding undoes it as the
    pipeline's decode does."""
    family = _family(paths)
    vae = pipe.vae
    pixels = torch.rand(1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        latents = family.encode_pixels(vae, pixels)
        assert latents.shape == (1, 16, 2, 4, 4)
        raw = vae.encode(pixels).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, -1, 1, 1)[:, :, :2]
        std = torch.tensor(vae.config.latents_std).view(1, 16, -1, 1, 1)[:, :, :2]
        undone = latents * std / pipe.scheduler.config.sigma_data + mean  # the pipeline's decode
        torch.testing.assert_close(undone, raw, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Video2World
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v2w_paths(tmp_path_factory):
    return write_fixture("cosmos1_v2w", tmp_path_factory.mktemp("cosmos1_v2w"))


@torch.no_grad()
def test_video2world_generation_matches_the_pipeline(v2w_paths, paths, monkeypatch):
    """Given a first image: our sampler over `Cosmos1V2WModel.predict` lands on CosmosVideoToWorldPipeline's
    latents, its per-step augmentation noise drawn as zeros (ours draws none)."""
    import numpy as np
    from diffusers import CosmosVideoToWorldPipeline
    from diffusers.pipelines.cosmos import pipeline_cosmos_video2world as module
    from PIL import Image

    from tuner.archs.cosmos_predict2.trainer_cosmos1 import Cosmos1V2WModel

    root = v2w_paths["diffusers"]
    resize = lambda x, size, interpolation: F.interpolate(x, size=size, mode="nearest")  # noqa: E731
    from diffusers.models.transformers import transformer_cosmos

    monkeypatch.setattr(transformer_cosmos, "transforms", SimpleNamespace(functional=SimpleNamespace(resize=resize), InterpolationMode=SimpleNamespace(NEAREST="nearest")), raising=False)  # fmt: skip
    monkeypatch.setattr(module, "randn_tensor", lambda shape, **kw: torch.zeros(shape, dtype=kw.get("dtype")))
    pipe = CosmosVideoToWorldPipeline(
        transformer=CosmosTransformer3DModel.from_pretrained(root / "transformer").eval(),
        vae=AutoencoderKLCosmos.from_pretrained(root / "vae").eval(),
        text_encoder=T5EncoderModel.from_pretrained(root / "text_encoder").eval(),
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
        scheduler=EDMEulerScheduler.from_pretrained(root / "scheduler"),
        safety_checker=_NoGuardrail(),
    )
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    steps, guidance, frames = 3, 7.0, 9
    family = Cosmos1V2WModel(_family(paths).cfg)
    family.cfg.model.transformer = str(v2w_paths["transformer_file"])
    noise = torch.randn((1, *family.latent_shape(32, 32, frames)), generator=torch.Generator().manual_seed(3))
    out = pipe(image=Image.fromarray(pixels), prompt=PROMPT, negative_prompt="blurry", height=32, width=32,
               num_frames=frames, fps=24, num_inference_steps=steps, guidance_scale=guidance,
               latents=noise.clone(), output_type="latent", max_sequence_length=16).frames  # fmt: skip

    model = family.load_transformer(torch.float32)
    image = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 127.5 - 1
    given = family.encode_frame_images(pipe.vae, [image], frames)
    cond, uncond = ({**family.collate_text(family.encode_text((pipe.text_encoder, pipe.tokenizer), [p])), **given}
                    for p in (PROMPT, "blurry"))  # fmt: skip

    def model_fn(x, t, c):
        return family.predict(model, x, t / 1000, c)

    ours = edm_sample(model_fn, noise, steps, cond, uncond, guidance + 1, combine=family.combine_guidance)
    torch.testing.assert_close(ours, out, rtol=1e-4, atol=1e-4)


def test_generation_refuses_flow_and_ddpm_sampling_options(paths):
    from tuner.generate import GenerateOptions, check_options

    family = _family(paths)
    base = dict(prompt="x", out="o.mp4", width=32, height=32, frames=9)
    check_options(family, GenerateOptions(**base))
    with pytest.raises(ConfigError, match="--shift 3.0: a flow-matching option; cosmos1_t2w samples its EDM"):
        check_options(family, GenerateOptions(**base, shift=3.0))
    with pytest.raises(ConfigError, match="--sampler dpm\\+\\+2m: cosmos1_t2w is sampled with Euler steps"):
        check_options(family, GenerateOptions(**base, sampler="dpm++2m"))
