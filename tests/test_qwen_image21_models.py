"""Qwen-Image 2.1: loading (every layout), clear errors, and generation equal to QwenImage21Pipeline."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

from types import SimpleNamespace

import pytest
import torch
from diffusers import QwenImage21Pipeline
from safetensors.torch import load_file, save_file

from project import assert_equal_weights
from tuner.archs.qwen_image import qwen21
from tuner.archs.qwen_image.fixture import build_qwen_image_21_components, write_qwen_image_21_fixture
from tuner.archs.qwen_image.trainer import QwenImage21Model
from tuner.diffusion.timesteps import FlowObjective
from tuner.errors import CheckpointError
from tuner.registry import architecture

CAPTIONS = ["a red fox in the snow", "a cat"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_qwen_image_21_fixture(tmp_path_factory.mktemp("qwen_image_21"), seed=0)


class TextProcessor:
    """What QwenImage21Pipeline asks of its Qwen3VLProcessor for prompts without images (transformers builds
    no Qwen3-VL processor without torchvision): the tokenizer, and the system turn as Qwen3-VL's chat
    template renders a text message."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages, tokenize=True, return_dict=False):
        text = "".join(
            f"<|im_start|>{m['role']}\n" + "".join(c["text"] for c in m["content"]) + "<|im_end|>\n"
            for m in messages
        )
        return [self.tokenizer(text).input_ids]

    def __call__(self, text, **kwargs):
        return self.tokenizer(text, **kwargs)


@pytest.fixture(scope="module")
def parts():
    return build_qwen_image_21_components(seed=0)


@pytest.fixture(scope="module")
def pipe(parts):
    return QwenImage21Pipeline(
        scheduler=parts["scheduler"],
        vae=parts["vae"],
        text_encoder=parts["text_encoder"],
        processor=TextProcessor(parts["tokenizer"]),
        transformer=parts["transformer"],
    )


def _encoder(parts):
    return qwen21.TextEncoder(parts["text_encoder"].model.language_model, parts["tokenizer"])


def _trainer() -> QwenImage21Model:
    trainer = QwenImage21Model.__new__(QwenImage21Model)
    trainer.record = architecture("qwen_image_21")
    trainer._objective = FlowObjective()
    trainer.cfg = SimpleNamespace(
        cache=SimpleNamespace(text_max_length=512),
        model=SimpleNamespace(transformer="qwen_image_2.1.safetensors"),
    )
    return trainer


def test_every_layout_loads_the_same_weights(fx, tmp_path):
    folder = qwen21.load_transformer(fx["diffusers"], torch.float32)
    assert_equal_weights(folder, qwen21.load_transformer(fx["transformer_file"], torch.float32))
    assert "transformer_blocks.0.img_mlp.gate_up.weight" in load_file(fx["transformer_file"])
    named = tmp_path / "diffusers_names.safetensors"  # diffusers' names under ComfyUI's prefix
    save_file({"model.diffusion_model." + k: v for k, v in folder.state_dict().items()}, named)
    assert_equal_weights(folder, qwen21.load_transformer(named, torch.float32))
    assert_equal_weights(
        qwen21.load_vae(fx["diffusers"], torch.float32), qwen21.load_vae(fx["vae_file"], torch.float32)
    )
    a = qwen21.load_text_encoder(fx["diffusers"], None, torch.float32)
    b = qwen21.load_text_encoder(fx["text_encoder_file"], fx["tokenizer"], torch.float32)
    assert_equal_weights(a.model, b.model)


def test_wrong_component_files(fx):
    with pytest.raises(CheckpointError, match=r"qwen_image_2\.1_vae\.safetensors"):
        qwen21.load_transformer(fx["vae_file"], torch.float32)
    with pytest.raises(CheckpointError, match=r"qwen_image_2\.1_tiny\.safetensors"):
        qwen21.load_vae(fx["transformer_file"], torch.float32)


@torch.no_grad()
def test_prompts_encode_as_the_pipeline_does(pipe, parts):
    embeds, mask, image_mask = pipe.encode_prompt(CAPTIONS, device="cpu")
    rows = qwen21.encode_prompts(_encoder(parts), CAPTIONS)
    assert not image_mask.any()
    for i, row in enumerate(rows):
        torch.testing.assert_close(row, embeds[i, : row.shape[0]], rtol=1e-5, atol=1e-5)
        assert mask is not None and int(mask[i].sum()) == row.shape[0]


@torch.no_grad()
def test_latents_as_the_pipeline_encodes_them(pipe):
    pixels = torch.rand(1, 3, 1, 64, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    rgba = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
    latents = qwen21.encode_images(pipe.vae, pixels)
    assert latents.shape == (1, 64, 1, 4, 2)
    assert torch.equal(latents, pipe._encode_vae_image(rgba, generator=None))
    assert qwen21.decode_latents(pipe.vae, latents).shape == pixels.shape


@torch.no_grad()
@pytest.mark.parametrize("use_kv_cache", [False, True])
def test_generation_equals_the_pipeline(pipe, parts, use_kv_cache):
    """What `tuner generate` computes (our encoding, `sample_flow`'s Euler steps, the record's shift and
    steps-from-σ) gives the latents QwenImage21Pipeline gives for the same noise."""
    trainer = _trainer()
    cond = trainer.collate_text(trainer.encode_text(_encoder(parts), CAPTIONS[:1]))
    x = torch.randn(1, 64, 1, 4, 2, generator=torch.Generator().manual_seed(1))  # a 64x32 image
    packed = x.reshape(1, 64, 8).transpose(1, 2)
    out = pipe(CAPTIONS[0], height=64, width=32, num_inference_steps=3, latents=packed, output_type="latent",
               use_kv_cache=use_kv_cache).images  # fmt: skip
    from tuner.diffusion.sampling import flow_sigmas

    sigmas = flow_sigmas(3, trainer.default_sample_shift(x.shape[1:]))
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas, rtol=1e-6, atol=1e-6)
    got = trainer.sample_flow(
        lambda x, t, c: trainer.predict(parts["transformer"], x, t / 1000, c), x, sigmas, cond, {}, 1.0
    )
    torch.testing.assert_close(got.reshape(1, 64, 8).transpose(1, 2), out, rtol=1e-4, atol=1e-4)
