"""A tiny random-weight Kandinsky 6 (video + sound), written in the layouts users have.

Built from the `tiny` configs shipped with tuner (transformer: one head of 64 per stream, the audio
stream's time embedding narrower, one text block per stream and two fused blocks, the release's flags; audio VAE with the real
44.1 kHz, hop 512 and 40 latent channels; a vocoder upsampling 512×) plus Kandinsky 5's tiny
HunyuanVideo VAE, Qwen2.5-VL and CLIP. The Qwen tokenizer is learned from the prompt template, whose
prefix it cuts into the pipeline's 129 tokens.

    out_dir/
      diffusers/   what `Kandinsky6TI2VAPipeline.from_pretrained` loads: transformer/ vae/ audio_vae/
                   vocoder/ text_encoder/ tokenizer/ text_encoder_2/ tokenizer_2/ scheduler/
      single/      kandinsky6_tiny.safetensors (the release's names), hunyuan_video_vae_tiny.safetensors with
                   audio_vae/ and vocoder/ beside it, qwen_2.5_vl_tiny.safetensors, clip_l.safetensors,
                   tokenizer/ tokenizer_2/
"""

from __future__ import annotations

from pathlib import Path

from tuner.archs.kandinsky5.fixture import (
    CLIP_FILE,
    QWEN_FILE,
    VAE_FILE,
    build_kandinsky5_components,
    template_tokenizer,
)
from tuner.archs.kandinsky6.keys import KANDINSKY6_LAYOUT
from tuner.archs.kandinsky6.loaders import PROMPT_TEMPLATE
from tuner.archs.kandinsky6.record import SAMPLE_SHIFT
from tuner.archs.qwen_image.fixture import qwen_vl_file
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import clip_text_file
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "kandinsky6_tiny.safetensors"

# Words of the template that are more than one token in Qwen's vocabulary ("dynamism", the release's
# "promt" typo): learned split, so the template's prefix is the pipeline's 129 tokens.
_SPLIT_WORDS = (("dynamism", "dynam ism"), ("promt", "pro mt"))


def build_kandinsky6_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments of
    `Kandinsky6TI2VAPipeline`."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        Kandinsky6Transformer3DModel,
        MMAudioVAE,
        MMAudioVocoder,
    )

    parts = build_kandinsky5_components(seed)  # HunyuanVideo's VAE, Qwen2.5-VL and CLIP-L
    parts["tokenizer"] = template_tokenizer(PROMPT_TEMPLATE, _SPLIT_WORDS)
    assert len(parts["tokenizer"]) <= parts["text_encoder"].config.text_config.vocab_size, (
        "the tiny vocabulary outgrew the tiny config"
    )
    return parts | {
        "transformer": tiny_model(
            Kandinsky6Transformer3DModel, tiny_config("kandinsky6", "transformer"), seed
        ),
        "audio_vae": tiny_model(MMAudioVAE, tiny_config("kandinsky6", "audio_vae"), seed + 4),
        "vocoder": tiny_model(MMAudioVocoder, tiny_config("kandinsky6", "vocoder"), seed + 5),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=SAMPLE_SHIFT),
    }


def write_kandinsky6_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Kandinsky 6 under `out_dir`; returns {root, diffusers, transformer_file, vae_file,
    audio_vae, vocoder, text_encoder_file, text_encoder_2_file, tokenizer, tokenizer_2}."""
    from diffusers import Kandinsky6TI2VAPipeline

    parts = build_kandinsky6_components(seed)
    single = {
        "transformer_file": (
            TRANSFORMER_FILE,
            KANDINSKY6_LAYOUT.to_original(parts["transformer"].state_dict()),
        ),
        "vae_file": (VAE_FILE, parts["vae"].state_dict()),
        "audio_vae": ("audio_vae", parts["audio_vae"].save_pretrained),
        "vocoder": ("vocoder", parts["vocoder"].save_pretrained),
        "text_encoder_file": (QWEN_FILE, qwen_vl_file(parts["text_encoder"])),
        "text_encoder_2_file": (CLIP_FILE, clip_text_file(parts["text_encoder_2"])),
    }
    return write_layouts(
        out_dir, "kandinsky6", Kandinsky6TI2VAPipeline(**parts), single, tokenizer_folders(parts)
    )


FIXTURE = Fixture(
    write=write_kandinsky6_fixture,
    # every part from its single file, as ComfyUI users hold them; the audio VAE and vocoder beside the VAE
    model_section=model_section(
        "kandinsky6",
        transformer=TRANSFORMER_FILE,
        vae=VAE_FILE,
        text_encoder=QWEN_FILE,
        text_encoder_2=CLIP_FILE,
    ),
)
