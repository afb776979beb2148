"""A tiny random-weight LTX-2 (video + audio) as a diffusers pipeline folder.

Built from the `tiny` configs in `tuner/archs/ltx2/configs/` (transformer: 2 blocks, 2 heads of 16
per stream, 128 video and 128 audio input channels as the release; video VAE with the real 32×/8×
compression and 128 channels; audio VAE over 64 mel bins with 8 latent channels; connectors of one
layer with 8 registers; Gemma 3 text model of 2 layers of width 32) and the offline Gemma tokenizer.

    out_dir/
      single/ltx-2-tiny.safetensors   the release's layout: transformer (`model.diffusion_model.*`),
                                      video VAE (`vae.*`) and audio VAE (`audio_vae.*`) in one file
      single/ltx-2-tiny-transformer.safetensors   the transformer alone (what a full fine-tune saves)
      diffusers/   what `LTX2Pipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  vae/  audio_vae/  vocoder/  connectors/  text_encoder/
        tokenizer/  scheduler/
"""

from __future__ import annotations

from pathlib import Path

from tuner.archs.ltx2.keys import AUDIO_VAE_LAYOUT, LTX2_LAYOUT, VIDEO_VAE_LAYOUT
from tuner.fixtures import Fixture, model_section, write_layouts
from tuner.fixtures.encoders import prefixed
from tuner.fixtures.tokenizers import build_gemma_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

CHECKPOINT_FILE = "ltx-2-tiny.safetensors"  # the release's file: transformer, video and audio VAE
TRANSFORMER_FILE = "ltx-2-tiny-transformer.safetensors"  # the transformer alone, in the same names


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
    transformer_file}."""
    from diffusers import LTX2Pipeline

    parts = build_ltx2_components(seed)
    # the release bundles the transformer, both VAEs (and the vocoder, connectors) in one file; a full
    # fine-tune saves the transformer alone, in the same names
    alone = prefixed("model.diffusion_model.", LTX2_LAYOUT.to_original(parts["transformer"].state_dict()))
    vaes = prefixed("vae.", VIDEO_VAE_LAYOUT.to_original(parts["vae"].state_dict()))
    vaes |= prefixed("audio_vae.", AUDIO_VAE_LAYOUT.to_original(parts["audio_vae"].state_dict()))
    single = {
        "checkpoint_file": (CHECKPOINT_FILE, alone | vaes),
        "transformer_file": (TRANSFORMER_FILE, alone),
    }
    return write_layouts(out_dir, "ltx2", LTX2Pipeline(**parts), single)


FIXTURE = Fixture(
    write=write_ltx2_fixture,
    model_section=model_section(
        "ltx2", transformer=CHECKPOINT_FILE, vae=CHECKPOINT_FILE, text_encoder="diffusers"
    ),
)
