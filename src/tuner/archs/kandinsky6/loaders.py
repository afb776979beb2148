"""Kandinsky 6 text-to-video with sound: its transformer, audio VAE and vocoder, and the model's inputs.

The pieces, as diffusers' `Kandinsky6TI2VAPipeline` (diffusers 0.42.1, `pipelines/kandinsky6/`) holds them:

* `transformer`: `Kandinsky6Transformer3DModel`, video and audio denoised together by fused blocks (each a
  video and an audio decoder block plus video↔audio cross-attention), each stream with its own text branch
  over the same Qwen2.5-VL tokens and CLIP pooled embedding; one timestep for both streams. Loaded from a
  diffusers folder (`transformer/`) or a single file in the release's names (`tuner.archs.kandinsky6.keys`,
  what ComfyUI loads) or diffusers' (`model.diffusion_model.` / `diffusion_model.` optional, fp8 too);
* `vae`: HunyuanVideo's (as `kandinsky5`); `audio_vae` (`MMAudioVAE`: mono 44.1 kHz → log-mel → 40
  latent channels, one latent per 1024 samples, × `scaling_factor`) and `vocoder` (`MMAudioVocoder`: mel →
  waveform) from the diffusers folders beside the VAE (`audio_vae/`, `vocoder/`);
* text: Qwen2.5-VL-7B's last hidden states of the prompt in the video template after its first
  `CROP_START` (129) tokens, and CLIP-L's pooled output (`tuner.archs.kandinsky5.loaders` loads both).
  The pipeline pads every prompt to `max_sequence_length` and masks the padding; tuner caches each
  caption's rows at its true length and masks a batch's padding the same way (`predict_velocities`).

Model inputs are the pipeline's: latents channel-last with zeros for the visual condition and its mask
(text to video), audio latents [B, L, 40], timestep σ · 1000 for both streams, RoPE positions from the
token grid (inside the model). Without sound (a clip without an audio track, or generation with
`sample_audio=False`) the model runs its video path alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.kandinsky5.loaders import PROMPT_TEMPLATE as K5_TEMPLATE
from tuner.archs.kandinsky5.loaders import TextEncoders, clip_pooled
from tuner.archs.kandinsky6.keys import KANDINSKY6_LAYOUT
from tuner.errors import CheckpointError
from tuner.models.component import component_spec, load_component
from tuner.models.identify import variant_table
from tuner.models.loading import beside, load_diffusers_folder

if TYPE_CHECKING:
    from torch import nn

CONFIGS = Path(__file__).parent / "configs"

# Kandinsky6TI2VAPipeline's `_PROMPT_TEMPLATE`: Kandinsky 5's with the release's "promt" (one token more,
# hence `_QWEN_CROP_START` 129; a test compares both with the pipeline's own)
PROMPT_TEMPLATE = K5_TEMPLATE.replace("a prompt engineer", "a promt engineer")
CROP_START = 129
MAX_LENGTH = 1024  # the pipeline's `max_sequence_length`: prompt tokens after the crop
AUDIO_RATE = 44100  # MMAudioVAE's sample rate (mono)
AUDIO_HOP = 1024  # waveform samples per audio latent (mel hop 512, the encoder halves the frames)
AUDIO_CHANNELS = 40  # the transformer's `in_audio_dim`

TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("visual_embeddings.in_layer.weight", "audio_embeddings.in_layer.weight",
     "video_text_embeddings.in_layer.weight", "visual_blocks.{}.videoT.visual_modulation.out_layer.weight",
     "video_text_transformer_blocks.{}.text_modulation.out_layer.weight"),
    {
        # Kandinsky 6.0 Pro: 60 fused blocks (video 4096, audio 2048 wide), 4 text blocks per stream (the
        # released dimensions ComfyUI's Kandinsky 6 detection tests name)
        "pro": ((4096, 132), (2048, 40), (4096, 3584), (60, (36864, 1024)), (4, (24576, 1024))),
        # the test fixture (tuner.archs.kandinsky6.fixture): one head of 64 per stream (ca_rope needs equal heads), 2 fused blocks
        "tiny": ((64, 132), (64, 40), (64, 64), (2, (576, 64)), (1, (384, 64))),
    },
)  # fmt: skip
TRANSFORMER_SPEC = component_spec(
    "Kandinsky 6 transformer",
    "Kandinsky6Transformer3DModel",
    TRANSFORMER_VARIANTS,
    ("visual_blocks.0.videoT.self_attention.to_query.weight",),
    ("visual_transformer_blocks.0.video_dec_block.self_attention.to_query.weight",),
    KANDINSKY6_LAYOUT.key_to_original,
)


def load_transformer(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The transformer from a diffusers folder, or a single file in the release's names (ComfyUI's) or in
    diffusers' names, in eval mode, its time embeddings and modulations kept fp32 (`_keep_in_fp32_modules`)."""
    return load_component(
        path, dtype, "Kandinsky6Transformer3DModel", "transformer", TRANSFORMER_SPEC,
        lambda state_dict, _: KANDINSKY6_LAYOUT.to_diffusers(state_dict),
        bundled=("model.diffusion_model.", "diffusion_model."),
    )  # fmt: skip


def _audio_folder(vae: str | Path, name: str) -> Path:
    """`name` (`audio_vae`, `vocoder`) beside the video VAE: in the pipeline root or beside its `vae/`
    folder, or beside a single VAE file."""
    vae = Path(vae)
    folder = vae.parent / name if vae.is_file() else beside(vae, "vae", name)
    if folder is None or not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{vae}: no Kandinsky 6 {name}/ beside this VAE (looked for {name}/config.json). The audio VAE and "
            "the vocoder load from the diffusers folders of a Kandinsky 6 pipeline: point model.vae at the "
            "pipeline folder, its vae/ folder, or a VAE file in a folder that holds audio_vae/ and vocoder/."
        )
    return folder


def load_audio_vae(vae: str | Path, dtype: torch.dtype) -> nn.Module:
    from diffusers import MMAudioVAE

    return load_diffusers_folder(MMAudioVAE, _audio_folder(vae, "audio_vae"), dtype, "MMAudioVAE")


def load_vocoder(vae: str | Path, dtype: torch.dtype) -> nn.Module:
    from diffusers import MMAudioVocoder

    return load_diffusers_folder(MMAudioVocoder, _audio_folder(vae, "vocoder"), dtype, "MMAudioVocoder")


# ---------------------------------------------------------------- text


@torch.no_grad()
def encode_prompts(encoders: TextEncoders, captions: list[str], max_length: int = MAX_LENGTH) -> list[dict]:
    """Per caption {"text": [n, D_qwen], "pooled": [D_clip]}: the pipeline's `_get_prompt_embeds` rows of
    the caption's true length (the pipeline pads to `max_length` and masks the padding; each caption here
    runs alone, unpadded)."""
    qwen = encoders.qwen
    device = qwen.model.device
    texts = []
    for caption in captions:
        ids = qwen.tokenizer(
            text=PROMPT_TEMPLATE.format(caption), max_length=CROP_START + max_length, truncation=True,
            return_tensors="pt",
        ).input_ids  # fmt: skip
        hidden = qwen.model(input_ids=ids.to(device), output_hidden_states=True).hidden_states[-1]
        texts.append(hidden[0, CROP_START:])
    return [{"text": t, "pooled": p} for t, p in zip(texts, clip_pooled(encoders, captions), strict=True)]


# ---------------------------------------------------------------- sound


def audio_latent_length(frames: int, fps: float) -> int:
    """Audio latents beside `frames` video frames, as the pipeline sizes them."""
    return math.ceil(frames / fps * AUDIO_RATE / AUDIO_HOP)


def encode_audio(audio_vae, waveform: torch.Tensor) -> torch.Tensor:
    """Mono waveform [1, samples] at 44.1 kHz → latents [40, L] (the posterior's mean × `scaling_factor`)."""
    latents = audio_vae.encode(waveform.to(audio_vae.dtype)).latent_dist.mode()
    return (latents[0] * audio_vae.config.scaling_factor).float()


def decode_audio(audio_vae, vocoder, latents: torch.Tensor) -> torch.Tensor:
    """Latents [B, 40, L] → waveform [B, samples] at the audio VAE's rate, as the pipeline decodes them."""
    mel = audio_vae.decode(
        (latents / audio_vae.config.scaling_factor).to(audio_vae.dtype), return_dict=False
    )[0]
    return vocoder(mel.to(vocoder.dtype), return_dict=False)[0][:, 0].float()


# ---------------------------------------------------------------- the transformer's inputs


def predict_velocities(
    model: nn.Module,
    noisy: torch.Tensor,
    t: torch.Tensor,
    noisy_sound: torch.Tensor | None,
    cond: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's velocities: video [B, 16, F, H, W] and sound [B, 40, L] (None without sound) for
    latents at t ∈ [0, 1], given collated text (`tuner.archs.kandinsky5.loaders.collate`): padding rows
    masked, no mask when no row is padded (as the pipeline)."""
    dtype = noisy.dtype
    x = noisy.permute(0, 2, 3, 4, 1)
    if model.config.visual_cond:  # text to video: no conditioning latent, zero mask
        x = torch.cat([x, torch.zeros_like(x), x.new_zeros(*x.shape[:-1], 1)], dim=-1)
    text = cond["text"]
    mask = torch.arange(text.shape[1], device=text.device)[None] < cond["length"].to(text.device)[:, None]
    video, *sound = model(
        hidden_states=x,
        encoder_hidden_states=text.to(dtype),
        pooled_projections=cond["pooled"].to(dtype),
        timestep=t.float() * 1000,
        audio_hidden_states=None if noisy_sound is None else noisy_sound.transpose(1, 2).to(dtype),
        encoder_attention_mask=None if mask.all() else mask,
        return_dict=False,
    )
    return video.permute(0, 4, 1, 2, 3), sound[0].transpose(1, 2) if sound else None
