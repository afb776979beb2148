"""Cosmos-Predict2 Video2World: loading both layouts, the Text2Image / Video2World refusals, and the model
inputs (given frames, condition mask, per-frame timesteps, no fps modulation) against diffusers'
Cosmos2VideoToWorldPipeline on the tiny fixture."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import (
    Cosmos2VideoToWorldPipeline,
    CosmosTransformer3DModel,
)
from PIL import Image
from safetensors.torch import load_file, save_file

from project import assert_equal_weights, cfg, make_project, run
from test_cosmos_predict2_models import PROMPT, load_pipeline
from tuner.archs.cosmos_predict2 import loaders as cosmos
from tuner.archs.cosmos_predict2.trainer_v2w import T_CONDITIONING, CosmosPredict2V2WModel
from tuner.errors import CheckpointError, ConfigError
from tuner.fixtures import write_fixture
from tuner.generate import GenerateOptions, check_options, encode_conditions, sample_latents


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("cosmos_predict2_v2w", tmp_path_factory.mktemp("cosmos_predict2_v2w_model"))


@pytest.fixture
def pipe(paths, monkeypatch):
    return load_pipeline(Cosmos2VideoToWorldPipeline, paths["diffusers"], monkeypatch)


def _trainer(text_length: int = 512) -> CosmosPredict2V2WModel:
    return CosmosPredict2V2WModel(SimpleNamespace(cache=SimpleNamespace(text_max_length=text_length),
                                                    train=SimpleNamespace(first_frame_conditioning_p=None)))  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def test_single_file_loads_like_the_diffusers_folder(paths, tmp_path):
    single = cosmos.load_transformer(paths["transformer_file"], torch.float32, video2world=True)
    folder = cosmos.load_transformer(paths["diffusers"], torch.float32, video2world=True)
    assert_equal_weights(single, folder)
    assert single.config.in_channels == 18  # 16 latents + condition mask + padding mask
    comfy = tmp_path / "cosmos_predict2_2B_video2world_480p_16fps.safetensors"
    save_file(
        {f"model.diffusion_model.{k}": v for k, v in load_file(paths["transformer_file"]).items()}, comfy
    )
    assert_equal_weights(cosmos.load_transformer(comfy, torch.float32, video2world=True), single)


def test_each_architecture_names_the_other(paths, tmp_path):
    t2i = write_fixture("cosmos_predict2", tmp_path / "t2i")
    for path in (paths["transformer_file"], paths["diffusers"]):
        with pytest.raises(CheckpointError, match='architecture = "cosmos_predict2_v2w"'):
            cosmos.load_transformer(path, torch.float32)
    for path in (t2i["transformer_file"], t2i["diffusers"]):
        with pytest.raises(CheckpointError, match='architecture = "cosmos_predict2"'):
            cosmos.load_transformer(path, torch.float32, video2world=True)


def test_video2world_configs_have_the_releases_rope_scale():
    """NVIDIA's config_video2world.py: one RoPE extrapolation per size, the same for 480p and 720p
    (2B: h, w 3.0, t 1.0; 14B: h, w 2.0, t 20/24); a condition-mask channel beside the 16 latents."""
    for name, heads, layers, rope in [("2B-v2w", 16, 28, [1.0, 3.0, 3.0]), ("14B-v2w", 40, 36, [20 / 24, 2.0, 2.0])]:  # fmt: skip
        config = CosmosTransformer3DModel.load_config(cosmos.CONFIGS / "transformer" / name)
        assert (config["num_attention_heads"], config["num_layers"], config["in_channels"]) == (
            heads,
            layers,
            17,
        )
        assert list(config["rope_scale"]) == pytest.approx(rope)


# ---------------------------------------------------------------------------------------------------
# Model inputs against the pipeline
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_text_encoding_matches_the_pipeline(pipe):
    """Video2World's `encode_prompt`: the prompt's rows, then zeros, as Text2Image's."""
    captions = [PROMPT, "a b c d e f g h i j k l m n o p q r s t"]
    embeds, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=16)
    trainer = _trainer(16)
    assert torch.equal(trainer.collate_text(trainer.encode_text((pipe.text_encoder, pipe.tokenizer), captions))["context"], embeds)  # fmt: skip


def _frames(count: int) -> list[Image.Image]:
    rng = np.random.default_rng(3)
    return [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(count)]


@pytest.mark.parametrize("given_pixels", [1, 5], ids=["image", "video5"])
@torch.no_grad()
def test_predict_matches_the_pipelines_transformer_call(pipe, paths, given_pixels):
    """Every transformer call of two pipeline steps (an image gives one latent frame, five video frames
    two) against `predict` on the same x_t, t and given latents: the same output on the generated frames,
    and on the given ones the velocity whose x̂0 = x_t − t·v is the given latents (what the pipeline puts
    there). Ours runs the transformer loaded from the release file. The pipeline is called with `fps=None`:
    the releases' RoPE has no fps modulation, which diffusers applies for any fps it is given (its default
    16 stretches temporal positions ×1.5; diffusers issue #14768), and that this differs is checked too."""
    calls = []
    forward = pipe.transformer.forward

    def record(**kwargs):
        out = forward(**kwargs)
        calls.append((kwargs, out[0].clone()))
        return out

    pipe.transformer.forward = record
    media = {"image": _frames(1)[0]} if given_pixels == 1 else {"video": _frames(given_pixels)}
    pipe(**media, prompt=PROMPT, height=32, width=32, num_frames=9, num_inference_steps=2, guidance_scale=1.0,
         output_type="latent", max_sequence_length=16, generator=torch.Generator().manual_seed(0), fps=None)  # fmt: skip
    assert len(calls) == 2

    trainer = _trainer(16)
    model = cosmos.load_transformer(paths["transformer_file"], torch.float32, video2world=True)
    context = trainer.collate_text(trainer.encode_text((pipe.text_encoder, pipe.tokenizer), [PROMPT]))
    given = (given_pixels - 1) // 4 + 1
    for kwargs, expected in calls:
        assert kwargs["fps"] is None
        assert not torch.allclose(forward(**{**kwargs, "fps": 16})[0], expected, atol=1e-3)
        hidden, timestep = kwargs["hidden_states"], kwargs["timestep"]
        assert torch.equal(
            kwargs["condition_mask"][0, 0, :, 0, 0], torch.tensor([1.0] * given + [0.0] * (3 - given))
        )
        assert torch.allclose(timestep[0, 0, :given].flatten(), torch.tensor(T_CONDITIONING))
        t = timestep[:, 0, -1, 0, 0]
        noisy = hidden.clone()
        noisy[:, :, :given] = torch.randn(noisy[:, :, :given].shape)  # x_t there is not the model's input
        cond = {**context, "first_frame": hidden[:, :, :given], "given_frames": torch.tensor([given])}
        v = trainer.predict(model, noisy, t, cond)
        torch.testing.assert_close(v[:, :, given:], expected[:, :, given:], rtol=1e-4, atol=1e-4)
        x0 = noisy - t.view(-1, 1, 1, 1, 1) * v
        torch.testing.assert_close(x0[:, :, :given], hidden[:, :, :given], rtol=1e-4, atol=1e-4)


def test_training_gives_one_or_two_frames_and_masks_them():
    trainer = _trainer()
    x0 = torch.randn(64, 16, 3, 2, 2)
    cond = trainer.draw_conditions(x0, {}, torch.Generator().manual_seed(0))
    assert set(cond["given_frames"].tolist()) == {1, 2}
    mask = trainer.loss_mask(x0, cond)
    assert torch.equal(mask[:, 0, :, 0, 0].sum(1), 3 - cond["given_frames"].float())
    assert mask[:, :, 0].eq(0).all() and mask[:, :, 2].eq(1).all()
    two = trainer.draw_conditions(x0[:, :, :2], {}, torch.Generator().manual_seed(0))
    assert two["given_frames"].eq(1).all()  # a two-frame clip keeps a frame to predict


# ---------------------------------------------------------------------------------------------------
# Generation from a first frame
# ---------------------------------------------------------------------------------------------------


def test_generation_ends_on_the_given_first_frame(paths, tmp_path, capsys):
    """`--image` is the first frame: sampling ends exactly on its latent frame, and the CLI writes a video."""
    config = make_project(tmp_path / "project", paths["root"], architecture="cosmos_predict2_v2w")
    trainer = CosmosPredict2V2WModel(cfg(config))
    model = trainer.load_transformer(torch.float32)
    image = tmp_path / "first.png"
    _frames(1)[0].resize((64, 48)).save(image)
    opts = GenerateOptions(prompt="a red square", out="", images=(str(image),), width=64, height=48, frames=9,
                           steps=3, guidance_scale=2.0)  # fmt: skip
    check_options(trainer, opts)
    cond, uncond = encode_conditions(trainer, trainer.cfg, opts, torch.device("cpu"))
    latents = sample_latents(
        trainer, model, opts, cond, uncond, torch.device("cpu"), torch.float32, progress=False
    )
    assert latents.shape == (1, 16, 3, 6, 8) and cond["given_frames"].tolist() == [1]
    torch.testing.assert_close(latents[:, :, :1], cond["first_frame"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="the first frame"):  # the pipeline, too, needs an image or a video
        check_options(trainer, GenerateOptions(prompt="x", out="", width=64, height=48, frames=9))
    out = tmp_path / "v.mp4"
    code, log = run(capsys, "generate", "--config", config, "--prompt", "x", "--image", image, "--size", "64x48",
                    "--frames", "9", "--steps", "1", "--device", "cpu", "--out", out)  # fmt: skip
    assert code == 0 and out.stat().st_size > 0, log
