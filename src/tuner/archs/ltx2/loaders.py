"""LTX-2 (Lightricks): one transformer that denoises a video and its sound together.

The pieces, as diffusers' `LTX2Pipeline` holds them (a diffusers folder has one sub-folder each):

* `transformer`: `LTX2VideoTransformer3DModel`, two token streams (video and audio) with their own
  self-attention, text cross-attention and feed-forward in every block, plus audio↔video
  cross-attention between them. Video latents enter as `[B, F·H·W, C]` tokens (patch 1×1×1), audio
  latents as `[B, L, C·M]` tokens (one token per latent audio frame: all mel bins of all channels).
* `vae`: `AutoencoderKLLTX2Video`, 32× spatial and 8× temporal compression (frame counts 8N+1), 128
  channels, normalized with its per-channel `latents_mean` / `latents_std`.
* `audio_vae`: `AutoencoderKLLTX2Audio`, a 2-D VAE over a stereo log-mel spectrogram `[B, 2, T, M]`
  (16 kHz, hop 160, 64 mel bins), 4× compression in time and mel bins, 8 channels; its latents are
  normalized per packed feature (`latents_mean` / `latents_std` over C·M).
* `vocoder`: `LTX2Vocoder`, mel → 24 kHz waveform (generation only).
* `connectors`: `LTX2TextConnectors`: the text encoder's hidden states of every layer, normalized per
  layer over the prompt's tokens and projected, then one small transformer per stream (with learnable
  registers in place of the padding) gives the video and the audio text context.
* `text_encoder`: Gemma 3 (12B; every layer's hidden states are used) with its tokenizer, left-padded
  to a fixed length.

The spectrogram the audio VAE takes is computed by `tuner.data.audio.log_mel` (magnitude STFT with
n_fft 1024, Slaney mel filters, natural log clamped at 1e-5), the front end of Lightricks' release.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.ltx2.keys import (
    AUDIO_VAE_LAYOUT,
    BWE_VOCODER_LAYOUT,
    CONNECTORS_LAYOUT,
    LTX2_LAYOUT,
    VAE_STATISTICS_UNUSED,
    VIDEO_VAE_LAYOUT,
    VOCODER_LAYOUT,
)
from tuner.data.audio import log_mel
from tuner.errors import CheckpointError
from tuner.models.component import component_spec
from tuner.models.encoders import (
    CAUSAL_LM_COLUMNS,
    base_model_keys,
    causal_lm_key,
    load_encoder_file,
    model_keys,
)
from tuner.models.identify import (
    SingleFileSpec,
    Variant,
    check_keys,
    identify_shapes,
    pick_variant,
    variant_table,
)
from tuner.models.loading import (
    from_state_dict,
    load_diffusers_folder,
    load_tensors_of,
    load_tokenizer,
    normalize_shapes,
    normalize_state_dict,
    read_safetensors_header,
    read_shapes_of,
    resolve_folder,
)

if TYPE_CHECKING:
    from torch import nn

N_FFT = 1024  # the STFT window of the audio VAE's mel front end
GEMMA_PADDING_SIDE = "left"  # LTX2Pipeline pads Gemma's prompts on the left
NORM_SCALE = 8  # the connectors' per-layer normalization scale (LTX2Pipeline's `scale_factor`)


def _component(path: str | Path, name: str) -> Path:
    """The component `name` of a diffusers layout: the `name/` sub-folder of a pipeline root, the `name/`
    sibling of a given component folder (the audio VAE beside `vae/`), else the given folder itself."""
    root = Path(path)
    for folder in (root / name, root.parent / name, root):
        if (folder / "config.json").is_file():
            return folder
    raise CheckpointError(
        f"{path}: no LTX-2 {name} here (looked for {name}/config.json in a diffusers folder)."
    )


def _from_pretrained(cls, path: str | Path, name: str, dtype: torch.dtype):
    return load_diffusers_folder(cls, _component(path, name), dtype, cls.__name__)


CONFIGS = Path(__file__).parent / "configs"
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("patchify_proj.weight", "audio_patchify_proj.weight", "transformer_blocks.{}.attn1.to_q.weight",
     "prompt_adaln_single.linear.weight"),
    {
        # LTX-2 19B (dev and distilled): 48 blocks, video width 4096, audio width 2048
        "19b": ((4096, 128), (2048, 128), (48, (4096, 4096)), None),
        # LTX-2.3 (22B with its connectors): the same sizes, plus the text cross-attention's timestep
        # modulation (and attention gates, no caption projections)
        "22b": ((4096, 128), (2048, 128), (48, (4096, 4096)), (8192, 4096)),
        # the test fixtures (tuner.archs.ltx2.fixture): 2 blocks, 2 heads of 16 per stream
        "tiny": ((32, 128), (32, 128), (2, (32, 32)), None),
        "tiny23": ((32, 128), (32, 128), (2, (32, 32)), (64, 32)),
    },
)  # fmt: skip
CONNECTORS_VARIANTS = variant_table(
    CONFIGS / "connectors",
    ("text_embedding_projection.aggregate_embed.weight", "text_embedding_projection.video_aggregate_embed.weight",
     "video_embeddings_connector.transformer_1d_blocks.{}.attn1.to_q.weight",
     "audio_embeddings_connector.transformer_1d_blocks.{}.attn1.to_q.weight"),
    {
        # LTX-2: one projection of Gemma 3 12B's 49 hidden states, two connectors of 2 blocks of width 3840
        "19b": ((3840, 188160), None, (2, (3840, 3840)), (2, (3840, 3840))),
        # LTX-2.3: a projection per stream to its width, connectors of 8 blocks (4096 and 2048 wide)
        "22b": (None, (4096, 188160), (8, (4096, 4096)), (8, (2048, 2048))),
        "tiny": ((32, 96), None, (1, (32, 32)), (1, (32, 32))),
        "tiny23": (None, (32, 96), (1, (32, 32)), (1, (32, 32))),
    },
)  # fmt: skip
TEXT_ENCODER_VARIANTS = variant_table(
    CONFIGS / "text_encoder",
    CAUSAL_LM_COLUMNS,
    {
        # Gemma 3 12B (google/gemma-3-12b-it's text config): 48 layers of width 3840
        "gemma3-12b": ((262208, 3840), (48, (15360, 3840))),
        "tiny": ((1536, 32), (2, (64, 32))),  # the fixture's: 2 layers of width 32
    },
)  # fmt: skip


_ORIGINAL_MARKERS = (
    "patchify_proj.weight",
    "audio_patchify_proj.weight",
    "av_ca_a2v_gate_adaln_single.linear.weight",
)
_DIFFUSERS_MARKERS = ("proj_in.weight", "audio_proj_in.weight", "av_cross_attn_video_a2v_gate.linear.weight")
TRANSFORMER_SPEC = component_spec(
    "LTX-2 transformer", "LTX2VideoTransformer3DModel", TRANSFORMER_VARIANTS,
    _ORIGINAL_MARKERS, _DIFFUSERS_MARKERS, LTX2_LAYOUT.key_to_original)  # fmt: skip


def load_transformer(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The transformer from a diffusers folder, or from the release's single file (`ltx-2-19b-*.safetensors`,
    `model.diffusion_model.` optional, fp8 too; its bundled connectors, VAEs and vocoder are skipped)."""
    from diffusers import LTX2VideoTransformer3DModel

    return load_release_transformer(
        LTX2VideoTransformer3DModel, path, dtype, TRANSFORMER_SPEC, LTX2_LAYOUT, LTX2_LAYOUT.bundled
    )


def load_release_transformer(
    model_cls: type,
    path: str | Path,
    dtype: torch.dtype,
    spec: SingleFileSpec,
    layout,
    skip: tuple[str, ...] = (),
) -> nn.Module:
    """An LTX transformer (LTX-2, LTX-Video) from a diffusers folder, or a single file in the release's
    names (`layout`) or in diffusers' names; keys starting with `skip` belong to other components of
    the file."""
    folder = resolve_folder(path, "transformer")
    if folder is not None:
        return load_diffusers_folder(model_cls, folder, dtype, model_cls.__name__)
    shapes = {k: v for k, v in normalize_shapes(read_shapes_of(path)).items() if not k.startswith(skip)}
    variant = identify_shapes(shapes, spec, path)
    state_dict = {
        k: v for k, v in normalize_state_dict(load_tensors_of(path), dtype).items() if not k.startswith(skip)
    }
    if all(k in state_dict for k in spec.original_markers):  # else a file saved with diffusers' names
        state_dict = layout.to_diffusers(state_dict)
    return from_state_dict(model_cls, state_dict, variant.config_dir, dtype, Path(path))


def load_vae(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The video VAE: the diffusers folder's `vae/`, or `vae.*` of the release's single file."""
    from diffusers import AutoencoderKLLTX2Video

    if Path(path).is_file():
        return _bundled(AutoencoderKLLTX2Video, path, "vae", VIDEO_VAE_LAYOUT, dtype, "LTX-2 video VAE")
    return _from_pretrained(AutoencoderKLLTX2Video, path, "vae", dtype)


def load_audio_vae(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The audio VAE: `audio_vae/` of the diffusers folder (beside the `vae/` given), or `audio_vae.*` of
    the release's single file."""
    from diffusers import AutoencoderKLLTX2Audio

    if Path(path).is_file():
        return _bundled(AutoencoderKLLTX2Audio, path, "audio_vae", AUDIO_VAE_LAYOUT, dtype, "LTX-2 audio VAE")
    return _from_pretrained(AutoencoderKLLTX2Audio, path, "audio_vae", dtype)


def load_vocoder(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The vocoder: `vocoder/` of the diffusers folder (beside the `vae/` given), or `vocoder.*` of the
    release's file: LTX-2's HiFi-GAN (`LTX2Vocoder`), or LTX-2.3's, followed by a bandwidth extension to
    48 kHz (`LTX2VocoderWithBWE`, `vocoder.vocoder.*` and `vocoder.bwe_generator.*`)."""
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE

    if not Path(path).is_file():
        folder = _component(path, "vocoder")
        bwe = (
            json.loads((folder / "config.json").read_text()).get("_class_name") == LTX2VocoderWithBWE.__name__
        )
        return _from_pretrained(LTX2VocoderWithBWE if bwe else LTX2Vocoder, folder, "vocoder", dtype)
    if bundles(path, "vocoder.bwe_generator"):
        return _bundled(LTX2VocoderWithBWE, path, "vocoder", BWE_VOCODER_LAYOUT, dtype, "LTX-2.3 vocoder")
    return _bundled(LTX2Vocoder, path, "vocoder", VOCODER_LAYOUT, dtype, "LTX-2 vocoder")


def bundles(path: str | Path, name: str) -> bool:
    """Whether a single file holds the component `name` (`vae`, `audio_vae`, `vocoder`: its `name.*` keys)."""
    return any(k.startswith(f"{name}.") for k in read_safetensors_header(path))


def _entries_under(path: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of a single file stored under `prefix`, prefix dropped (read alone, not the whole file)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k.removeprefix(prefix): f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def _bundled(cls, path: str | Path, name: str, layout, dtype: torch.dtype, what: str) -> nn.Module:
    """A component stored as `<name>.*` in the release's single file; its variant is the config of `cls` in
    `configs/<name>/` whose signature tensor (`_SIGNATURES`) has the file's shape."""
    prefix = f"{name}."
    tensors = _entries_under(path, prefix)
    if not tensors:
        raise CheckpointError(
            f"{path}: holds no {what} (no `{prefix}*` keys, as the release's ltx-2-19b-*.safetensors has). "
            "Point to that file or to the diffusers folder."
        )
    for unused in VAE_STATISTICS_UNUSED:
        tensors.pop(unused, None)
    signature = _SIGNATURES[cls.__name__]
    variants = [
        Variant(d.name, d, {layout.key_to_original(signature): _meta_shapes(cls, d)[signature]})
        for d in sorted((CONFIGS / name).iterdir())
        if cls.load_config(d)["_class_name"] == cls.__name__
    ]
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    variant = pick_variant(shapes, variants, path, what)
    check_keys([layout.key_to_original(k) for k in _meta_shapes(cls, variant.config_dir)], shapes, path, what)
    state_dict = {
        k: v.to(dtype) if v.is_floating_point() else v for k, v in layout.to_diffusers(tensors).items()
    }
    return from_state_dict(cls, state_dict, variant.config_dir, dtype, Path(path))


# the diffusers tensor whose shape tells a bundled component's variant, per class
_SIGNATURES = {
    "AutoencoderKLLTX2Video": "encoder.conv_out.conv.weight",
    "AutoencoderKLLTX2Audio": "encoder.conv_out.conv.weight",
    "LTX2Vocoder": "conv_in.weight",
    "LTX2VocoderWithBWE": "vocoder.conv_in.weight",
}


def _meta_shapes(cls, config_dir: Path) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(config_dir))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


_CONNECTOR_PREFIXES = (
    "text_embedding_projection.",
    "video_embeddings_connector.",
    "audio_embeddings_connector.",
)
_CONNECTORS_WHAT = "LTX-2 text connectors"


def load_connectors(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The text connectors: `connectors/` of a diffusers folder, or the release's single file (LTX-2 and
    LTX-2.3 alike; `tuner.archs.ltx2.keys.CONNECTORS_LAYOUT`), fp8 too."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    if not Path(path).is_file():
        return _from_pretrained(LTX2TextConnectors, path, "connectors", dtype)
    stored = {}  # connector key -> the file's key: the projection at the top level, the connectors under
    for name in read_safetensors_header(path):  # `model.diffusion_model.` (some files put both there)
        key = name.removeprefix("model.diffusion_model.")
        if key.startswith(_CONNECTOR_PREFIXES):
            stored[key] = name
    if not stored:
        raise CheckpointError(
            f"{path}: holds no {_CONNECTORS_WHAT} (no `text_embedding_projection.*` and "
            "`model.diffusion_model.video_embeddings_connector.*` keys, as the release's ltx-2-19b-*.safetensors "
            "and ltx-2.3-22b-*.safetensors have). Set model.transformer to that file, or model.text_encoder "
            "to a diffusers folder with `connectors/`."
        )
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensors = normalize_state_dict({k: f.get_tensor(name) for k, name in stored.items()}, dtype)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    variant = pick_variant(shapes, CONNECTORS_VARIANTS, path, _CONNECTORS_WHAT)
    expected = _meta_shapes(LTX2TextConnectors, variant.config_dir)
    check_keys([CONNECTORS_LAYOUT.key_to_original(k) for k in expected], shapes, path, _CONNECTORS_WHAT)
    state_dict = {k: v.to(dtype) for k, v in CONNECTORS_LAYOUT.to_diffusers(tensors).items()}
    return from_state_dict(LTX2TextConnectors, state_dict, variant.config_dir, dtype, Path(path))


# ComfyUI's single-file Gemma 3 (`gemma_3_12B_it*.safetensors` of Comfy-Org/ltx-2): the language model under
# `model.` (transformers' `Gemma3ForCausalLM` names), beside the vision tower (`vision_model.*`), its
# projector (`multi_modal_projector.*`) and the SentencePiece model as a byte tensor (`spiece_model`),
# which the text encoder does not use. Facts: ComfyUI's `comfy/text_encoders/lt.py` (a Gemma 3 12B file is
# told by `model.layers.47.self_attn.q_norm.weight`) and the Comfy -> transformers converter of
# diffusers' `scripts/convert_ltx2_to_diffusers.py` (`convert_comfy_gemma3_to_transformers`).
_GEMMA_NOT_TEXT = (
    "vision_model.", "multi_modal_projector.", "spiece_model", "lm_head.",
    "model.vision_tower.", "model.multi_modal_projector.", "language_model.lm_head.",
)  # fmt: skip


def _gemma_text_entries(entries: dict) -> dict:
    """A Gemma 3 file's language-model entries under `model.`: ComfyUI's names, or transformers'
    multimodal ones (`language_model.model.*`, `model.language_model.*`)."""
    out = {}
    for key, value in entries.items():
        for multimodal in ("language_model.model.", "model.language_model."):
            if key.startswith(multimodal):
                key = "model." + key.removeprefix(multimodal)
        if not key.startswith(_GEMMA_NOT_TEXT):
            out[key] = value
    return out


def _refuse_fp4(shapes: dict, path: Path) -> None:
    """ComfyUI's `gemma_3_12B_it_fp4_mixed.safetensors` packs NVFP4 weights (two per byte, with a second
    scale `.weight_scale_2`, as diffusers' converter's Comfy dequantizer reads them): not read here."""
    if any(k.endswith(".weight_scale_2") for k in shapes):
        raise CheckpointError(
            f"{path}: a 4-bit (fp4_mixed, NVFP4) Gemma 3 file, which tuner does not read. Use "
            "gemma_3_12B_it.safetensors or gemma_3_12B_it_fp8_scaled.safetensors (Comfy-Org/ltx-2)."
        )


TEXT_ENCODER_SPEC = SingleFileSpec(
    what="Gemma 3 text encoder",
    variants=TEXT_ENCODER_VARIANTS,
    expected_keys=model_keys("Gemma3TextModel", to_original=causal_lm_key),
    original_markers=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"),
    diffusers_markers=("embed_tokens.weight", "layers.0.self_attn.q_proj.weight"),
    to_original=causal_lm_key,
    refuse=_refuse_fp4,
)


def load_text_encoder(path: str | Path, tokenizer: str | None, dtype: torch.dtype):
    """Gemma 3 and its tokenizer: from a diffusers folder (the release's multimodal
    `Gemma3ForConditionalGeneration`, or a text-only `Gemma3ForCausalLM`, with `tokenizer/` beside it),
    or from one single file (ComfyUI's `gemma_3_12B_it*.safetensors`, fp8 too: its language model, as a
    `Gemma3TextModel`) with the `tokenizer` folder given (the record's default when the config names none)."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextModel

    if Path(path).is_file():
        model = load_encoder_file(
            path, dtype, Gemma3TextModel, TEXT_ENCODER_SPEC, base_model_keys, _gemma_text_entries
        )
        return model, load_tokenizer(
            tokenizer or None, path, "Gemma 3 tokenizer (Lightricks/LTX-2's tokenizer/)"
        )
    folder = _component(path, "text_encoder")
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    cls = Gemma3ForConditionalGeneration if model_type == "gemma3" else Gemma3ForCausalLM
    model = cls.from_pretrained(str(folder), torch_dtype=dtype).eval()
    tok_dir = Path(tokenizer) if tokenizer else folder.parent / "tokenizer"
    if not tok_dir.is_dir():
        raise CheckpointError(
            f"{path}: no tokenizer/ beside the text encoder; set model.tokenizer to Gemma 3's."
        )
    return model, AutoTokenizer.from_pretrained(str(tok_dir))


# ---------------------------------------------------------------- text


def tokenize(tokenizer, captions: list[str], max_length: int):
    """The stripped captions' token ids and mask, padded (and truncated) to `max_length` tokens with the
    special tokens, as LTX-2's and LTX-Video's pipelines tokenize prompts."""
    return tokenizer([c.strip() for c in captions], padding="max_length", max_length=max_length,
                     truncation=True, add_special_tokens=True, return_tensors="pt")  # fmt: skip


@torch.no_grad()
def encode_prompts(text_encoder, tokenizer, connectors, captions: list[str], max_length: int) -> dict:
    """Captions → the video and audio text contexts `[B, L, D]` and their 0/1 mask `[B, L]`, as
    `LTX2Pipeline` computes them (Gemma's hidden states of every layer, left-padded to `max_length`,
    through the connectors)."""
    tokenizer.padding_side = GEMMA_PADDING_SIDE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokens = tokenize(tokenizer, captions, max_length)
    device = next(text_encoder.parameters()).device
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    hidden = text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    stacked = torch.stack(hidden, dim=-1).flatten(2, 3)  # [B, L, D · layers]
    conn_param = next(connectors.parameters())
    video, audio, text_mask = connectors(
        stacked.to(conn_param),
        mask.to(conn_param.device),
        padding_side=GEMMA_PADDING_SIDE,
        scale_factor=NORM_SCALE,
    )
    return {"video_context": video, "audio_context": audio, "text_mask": text_mask}


# ---------------------------------------------------------------- latents


def _stats(vae, like: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    return vae.latents_mean.view(shape).to(like), vae.latents_std.view(shape).to(like)


def encode_video(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels [B, 3, F, H, W] in [-1, 1] → normalized latents [B, C, (F-1)/8+1, H/32, W/32]."""
    latents = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
    mean, std = _stats(vae, latents, (1, -1, 1, 1, 1))
    return (latents - mean) * vae.config.scaling_factor / std


def decode_video(vae, latents: torch.Tensor) -> torch.Tensor:
    mean, std = _stats(vae, latents, (1, -1, 1, 1, 1))
    latents = latents * std / vae.config.scaling_factor + mean
    timestep = None
    if vae.config.timestep_conditioning:  # the release's decoder is conditioned on a (zero) noise level
        timestep = torch.zeros(latents.shape[0], device=latents.device, dtype=latents.dtype)
    return vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0].float().clamp(-1, 1)


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, L, M] → audio tokens [B, L, C·M] (what the transformer and the statistics work on)."""
    return latents.transpose(1, 2).flatten(2, 3)


def unpack_audio(tokens: torch.Tensor, mel_bins: int) -> torch.Tensor:
    return tokens.unflatten(2, (-1, mel_bins)).transpose(1, 2)


def encode_audio(audio_vae, waveform: torch.Tensor) -> torch.Tensor:
    """Waveform [channels, samples] at the VAE's rate → normalized latents [C, L, M]."""
    cfg = audio_vae.config
    mel = log_mel(waveform.float(), cfg.sample_rate, N_FFT, cfg.mel_hop_length, cfg.mel_bins)
    latents = audio_vae.encode(mel[None].to(audio_vae.dtype)).latent_dist.mode()  # [1, C, L, M]
    tokens = pack_audio(latents)
    mean, std = _stats(audio_vae, tokens, (1, 1, -1))
    return unpack_audio((tokens - mean) / std, latents.shape[-1])[0]


def decode_audio(audio_vae, vocoder, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, C, L, M] → waveforms [B, channels, samples] at the vocoder's rate."""
    tokens = pack_audio(latents)
    mean, std = _stats(audio_vae, tokens, (1, 1, -1))
    latents = unpack_audio(tokens * std + mean, latents.shape[-1])
    mel = audio_vae.decode(latents.to(audio_vae.dtype), return_dict=False)[0]
    return vocoder(mel.to(next(vocoder.parameters()).dtype)).float()


def audio_latent_frames(audio_vae, samples: int) -> int:
    """Latent audio frames of a waveform of `samples` samples (causal 4× compression of the mel frames)."""
    mel_frames = samples // audio_vae.config.mel_hop_length + 1
    return (mel_frames - 1) // audio_vae.temporal_compression_ratio + 1
