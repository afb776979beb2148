"""A tiny random-weight LTX-2 (video + audio) as a diffusers pipeline folder and as the single files users have.

Built from the `tiny` configs in `tuner/archs/ltx2/configs/` (transformer: 2 blocks, 2 heads of 16
per stream, 128 video and 128 audio input channels as the release; video VAE with the real 32×/8×
compression and 128 channels; audio VAE over 64 mel bins with 8 latent channels; connectors of one
layer with 8 registers; Gemma 3 text model of 2 layers of width 32) and the offline Gemma tokenizer.
An LTX-2.3 file is built from the `tiny23` configs (the 2.3 transformer: attention gates, prompt
modulation, no caption projections; its connectors: a projection per stream; its vocoder with the
bandwidth extension to 48 kHz) beside the same tiny VAEs.

    out_dir/
      single/ltx-2-tiny.safetensors   the release's layout: transformer (`model.diffusion_model.*`), its
                                      text connectors (`model.diffusion_model.*_embeddings_connector.*`,
                                      `text_embedding_projection.*`), video VAE (`vae.*`), audio VAE
                                      (`audio_vae.*`) and vocoder (`vocoder.*`) in one file
      single/ltx-2-tiny-transformer.safetensors   the transformer alone (what a full fine-tune saves)
      single/ltx-2.3-tiny.safetensors   LTX-2.3's release layout: transformer, connectors, VAEs, vocoder
      single/gemma_3_tiny.safetensors   ComfyUI's single-file Gemma 3 (`model.*`, with its vision tower's,
                                        projector's and `spiece_model` entries, which are not read)
      single/tokenizer/                 the Gemma tokenizer (a single file carries none)
      diffusers/   what `LTX2Pipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  vae/  audio_vae/  vocoder/  connectors/  text_encoder/
        tokenizer/  scheduler/
"""

from __future__ import annotations

from pathlib import Path

import torch

from tuner.archs.ltx2.keys import (
    AUDIO_VAE_LAYOUT,
    BWE_VOCODER_LAYOUT,
    CONNECTORS_LAYOUT,
    LTX2_LAYOUT,
    VIDEO_VAE_LAYOUT,
    VOCODER_LAYOUT,
)
from tuner.fixtures import Fixture, model_section, write_layouts
from tuner.fixtures.encoders import prefixed
from tuner.fixtures.tokenizers import build_gemma_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

CHECKPOINT_FILE = "ltx-2-tiny.safetensors"  # the release's file: transformer, video and audio VAE
TRANSFORMER_FILE = "ltx-2-tiny-transformer.safetensors"  # the transformer alone, in the same names
LTX23_FILE = "ltx-2.3-tiny.safetensors"  # LTX-2.3's release file: transformer, connectors, VAEs
GEMMA_FILE = "gemma_3_tiny.safetensors"  # ComfyUI's single-file Gemma 3


def build_ltx2_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the
    arguments of `LTX2Pipeline`."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3ForCausalLM

    classes = {
        "transformer": LTX2VideoTransformer3DModel,
        "vae": AutoencoderKLLTX2Video,
        "audio_vae": AutoencoderKLLTX2Audio,
        "vocoder": LTX2Vocoder,
        "connectors": LTX2TextConnectors,
        "text_encoder": Gemma3ForCausalLM,
    }
    parts = {
        name: tiny_model(cls, tiny_config("ltx2", name), seed + i)
        for i, (name, cls) in enumerate(classes.items())
    }
    parts["tokenizer"] = build_gemma_tokenizer()
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler(shift_terminal=0.1, use_dynamic_shifting=True)
    return parts


def write_ltx2_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny LTX-2 under `out_dir` in both layouts; returns {root, diffusers, checkpoint_file,
    transformer_file, ltx23_file, gemma_file, tokenizer}."""
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    parts = build_ltx2_components(seed)
    # the release bundles the transformer, its connectors, both VAEs and the vocoder in one file; a full
    # fine-tune saves the transformer alone, in the same names
    alone = _release_transformer(parts["transformer"])
    vaes = prefixed("vae.", VIDEO_VAE_LAYOUT.to_original(parts["vae"].state_dict()))
    vaes |= prefixed("audio_vae.", AUDIO_VAE_LAYOUT.to_original(parts["audio_vae"].state_dict()))
    vocoder = prefixed("vocoder.", VOCODER_LAYOUT.to_original(parts["vocoder"].state_dict()))
    transformer23 = tiny_model(
        LTX2VideoTransformer3DModel, tiny_config("ltx2", "transformer", "tiny23"), seed + 10
    )
    connectors23 = tiny_model(LTX2TextConnectors, tiny_config("ltx2", "connectors", "tiny23"), seed + 11)
    vocoder23 = tiny_model(LTX2VocoderWithBWE, tiny_config("ltx2", "vocoder", "tiny23"), seed + 12)
    release23 = _release_transformer(transformer23) | _release_connectors(connectors23) | vaes
    release23 |= prefixed("vocoder.", BWE_VOCODER_LAYOUT.to_original(vocoder23.state_dict()))
    single = {
        "checkpoint_file": (
            CHECKPOINT_FILE,
            alone | _release_connectors(parts["connectors"]) | vaes | vocoder,
        ),
        "transformer_file": (TRANSFORMER_FILE, alone),
        "ltx23_file": (LTX23_FILE, release23),
        "gemma_file": (GEMMA_FILE, _comfy_gemma(parts["text_encoder"])),
    }
    tokenizers = {"tokenizer": parts["tokenizer"]}
    return write_layouts(out_dir, "ltx2", LTX2Pipeline(**parts), single, tokenizers)


def _release_transformer(model) -> dict:
    return prefixed("model.diffusion_model.", LTX2_LAYOUT.to_original(model.state_dict()))


def _release_connectors(model) -> dict:
    """The connectors as the release's file holds them: the projection at the top level, the connector
    transformers beside the transformer."""
    tensors = CONNECTORS_LAYOUT.to_original(model.state_dict())
    projection = {k: v for k, v in tensors.items() if k.startswith("text_embedding_projection.")}
    return projection | prefixed(
        "model.diffusion_model.", {k: v for k, v in tensors.items() if k not in projection}
    )


def _comfy_gemma(model) -> dict:
    """A `Gemma3ForCausalLM` as ComfyUI's `gemma_3_12B_it.safetensors` holds Gemma 3: the language model's
    `model.*` (the head is tied to the embedding, not stored), beside entries of the vision tower and its
    projector and the SentencePiece model's bytes (`spiece_model`), which the text encoder does not read."""
    tensors = {k: v for k, v in model.state_dict().items() if k.startswith("model.")}
    return tensors | {
        "vision_model.embeddings.patch_embedding.weight": torch.zeros(4, 3, 2, 2),
        "multi_modal_projector.mm_input_projection_weight": torch.zeros(4, 32),
        "spiece_model": torch.zeros(16, dtype=torch.uint8),
    }


FIXTURE = Fixture(
    write=write_ltx2_fixture,
    model_section=model_section(
        "ltx2", transformer=CHECKPOINT_FILE, vae=CHECKPOINT_FILE, text_encoder="diffusers"
    ),
)
