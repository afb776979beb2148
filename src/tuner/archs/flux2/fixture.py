"""Tiny random-weight FLUX.2 dev and klein models, written in both layouts users have.

Built from the `tiny` configs shipped with `tuner.archs.flux2.loaders` (transformer: 2 heads of 32, one double
and one single block, rotary axes 4 × 8, text width 3 · 32; VAE: widths 32-64 with the real 8×
compression, 32 latent channels and the 2×2 patch / BatchNorm normalization; Mistral: 30 layers of
width 32, so the pipeline's layers 10, 20, 30 exist), so loaders recognise them like real checkpoints.
The diffusers folder's text encoder is a Mistral3ForConditionalGeneration with a tiny Pixtral vision
tower, as the release's is; the tokenizer is a byte-level BPE with Mistral's control tokens and chat
format (`tuner.fixtures.tokenizers.build_mistral_tokenizer`). klein: the same network without the guidance
embedding (`tiny-klein`) and a Qwen3ForCausalLM of 27 layers of width 32 (the pipeline reads the 27th)
with a Qwen2-vocabulary tokenizer in Qwen3's chat format; its files are `flux-2-klein_tiny.safetensors`
and `qwen_3_tiny.safetensors` (`model.*`, `lm_head.weight`) and the folder is a Flux2KleinPipeline's.

    out_dir/
      diffusers/                      what `Flux2Pipeline.from_pretrained` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/
        flux2-dev_tiny.safetensors    BFL keys (double_blocks.0.img_attn.qkv.weight, single_blocks.0.linear1...)
        flux2-vae.safetensors         the LDM layout (encoder.down.0..., encoder.quant_conv, bn.running_mean)
        mistral_3_small_tiny.safetensors  the language model as transformers 4 named it (language_model.model.*)
        tokenizer/

Both layouts hold the same float32 weights (BatchNorm statistics included, drawn away from 0 / 1 so the
normalization is exercised).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralVisionConfig,
    Qwen3ForCausalLM,
)

from tuner.archs.flux2.keys import transformer_to_original, vae_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import prefixed
from tuner.fixtures.tokenizers import build_mistral_tokenizer, build_qwen3_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "flux2-dev_tiny.safetensors"
VAE_FILE = "flux2-vae.safetensors"
TEXT_ENCODER_FILE = "mistral_3_small_tiny.safetensors"
KLEIN_FILE = "flux-2-klein_tiny.safetensors"
QWEN3_FILE = "qwen_3_tiny.safetensors"

# FLUX.2-dev's scheduler_config.json: flow-matching Euler, the pipeline passes its own empirical μ.
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


def tiny_mistral3_config(text_config) -> Mistral3Config:
    """A Mistral3 config of `text_config` (a language model's config) and a one-layer Pixtral vision tower,
    as the releases' Mistral-Small 3 (FLUX.2 dev) and Ministral 3 (ERNIE-Image) have."""
    vision_config = PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1, head_dim=32,
        image_size=64, patch_size=16,
    )  # fmt: skip
    return Mistral3Config(
        text_config=text_config.to_dict(), vision_config=vision_config.to_dict(), image_token_index=8,
        spatial_merge_size=2,
    )  # fmt: skip


def _tiny_mistral(seed: int) -> Mistral3ForConditionalGeneration:
    """The tiny Mistral (`configs/text_encoder/tiny`) with a tiny Pixtral vision tower, as the release's."""
    text_config = MistralConfig.from_pretrained(tiny_config("flux2", "text_encoder"))
    return tiny_model(Mistral3ForConditionalGeneration, tiny_mistral3_config(text_config), seed)


def tiny_flux2_vae(seed: int, stats_seed: int) -> AutoencoderKLFlux2:
    """The tiny FLUX.2 VAE (`configs/vae/tiny`) filled with `seed`, its BatchNorm statistics drawn away from
    0 / 1 with `stats_seed` so the normalization is exercised."""
    vae = tiny_model(AutoencoderKLFlux2, tiny_config("flux2", "vae"), seed)
    generator = torch.Generator().manual_seed(stats_seed)
    channels = vae.bn.running_mean.shape[0]
    vae.bn.running_mean.copy_(0.3 * torch.randn(channels, generator=generator))
    vae.bn.running_var.copy_(0.5 + torch.rand(channels, generator=generator))
    return vae


def flux2_vae_file(vae: AutoencoderKLFlux2) -> dict[str, torch.Tensor]:
    """The VAE as BFL's `ae.safetensors` / ComfyUI's `flux2-vae.safetensors` hold it (the LDM layout, no
    BatchNorm training counter)."""
    state_dict = {k: v for k, v in vae.state_dict().items() if k != "bn.num_batches_tracked"}
    return vae_to_original(state_dict, len(vae.config.block_out_channels))


def build_flux2_components(seed: int = 0, klein: bool = False) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments of
    `Flux2Pipeline` (or, with `klein`, `Flux2KleinPipeline`): transformer, vae, text_encoder, tokenizer,
    scheduler."""
    transformer = tiny_config("flux2", "transformer", "tiny-klein" if klein else "tiny")
    vae = tiny_flux2_vae(seed + 1, seed + 3)
    if klein:
        text_encoder = tiny_model(
            Qwen3ForCausalLM, tiny_config("flux2", "text_encoder", "tiny-qwen3"), seed + 2
        )
        tokenizer = build_qwen3_tokenizer()
        assert len(tokenizer) <= text_encoder.config.vocab_size, "the tiny vocabulary outgrew the tiny config"
    else:
        text_encoder = _tiny_mistral(seed + 2)
        tokenizer = build_mistral_tokenizer(
            [SYSTEM_MESSAGE], vocab_size=text_encoder.config.text_config.vocab_size
        )
    return {
        "transformer": tiny_model(Flux2Transformer2DModel, transformer, seed),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG),
    }


def write_flux2_fixture(out_dir: str | Path, seed: int = 0, klein: bool = False) -> dict[str, Path]:
    """Write the tiny FLUX.2 dev (or klein) model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file, tokenizer.
    """
    parts = build_flux2_components(seed, klein)
    text_encoder = parts["text_encoder"]
    if klein:  # Hugging Face's causal-LM keys, as ComfyUI's files
        text_encoder_file = (QWEN3_FILE, text_encoder.state_dict())
    else:  # the language model as transformers 4 named it in Mistral3ForConditionalGeneration
        text_encoder_file = (
            TEXT_ENCODER_FILE,
            prefixed("language_model.model.", text_encoder.model.language_model.state_dict()),
        )
    single = {
        "transformer_file": (
            KLEIN_FILE if klein else TRANSFORMER_FILE,
            transformer_to_original(parts["transformer"].state_dict()),
        ),
        "vae_file": (VAE_FILE, flux2_vae_file(parts["vae"])),
        "text_encoder_file": text_encoder_file,
    }
    pipeline = (Flux2KleinPipeline if klein else Flux2Pipeline)(**parts)
    return write_layouts(out_dir, "flux2", pipeline, single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_flux2_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=model_section(
        "flux2", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=TEXT_ENCODER_FILE
    ),
)

KLEIN_FIXTURE = Fixture(
    write=partial(write_flux2_fixture, klein=True),
    # the BFL single file for the transformer, the diffusers folder for the rest (tokenizer found beside)
    model_section=model_section(
        "flux2_klein", transformer=KLEIN_FILE, vae="diffusers", text_encoder="diffusers"
    ),
)
