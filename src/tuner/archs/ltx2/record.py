"""The ltx2 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import CONVERTS_FOLDED, Architecture, SamplingDefaults, hub_tokenizers

# Comfy-Org's single-file Gemma 3 12B (ComfyUI's LTX-2 text encoder; fp8_scaled and fp4_mixed beside it)
GEMMA_FILE = "Comfy-Org/ltx-2/split_files/text_encoders/gemma_3_12B_it.safetensors"

LTX2 = Architecture(
    name="ltx2",
    pipeline_refused=(
        "its loss covers two streams, video and sound (tuner.archs.parts.audio), where pipeline stages "
        "compute the loss of one prediction"
    ),
    sampling=SamplingDefaults(
        steps=30,
        guidance=3.0,
        shift=3.0,
        source="diffusers LTX2Pipeline's defaults (30 steps, guidance 3.0)",
    ),
    variants=("19b", "22b"),
    checkpoints=(
        "Variants: `19b` (LTX-2 dev / distilled: 48 blocks, video width 4096, audio width 2048), `22b` "
        "(LTX-2.3: the same sizes plus attention gates and prompt modulation, told apart by the shapes of "
        "`prompt_adaln_single`; its connectors project per stream, 8 blocks each; its VAE has a fourth "
        "decoder stage); configs from diffusers' `scripts/convert_ltx2_to_diffusers.py`; `tiny`, `tiny23`. "
        "`transformer`: Lightricks' single file (`ltx-2-19b-dev.safetensors`, `ltx-2.3-22b-dev.safetensors`: "
        "`model.diffusion_model.*` with `patchify_proj`, `adaln_single`, `av_ca_*_adaln_single`, "
        "`q_norm` / `k_norm`; its bundled connectors, `vae.*`, `audio_vae.*`, `vocoder.*` are skipped; fp8 "
        "too) or the diffusers folder; `vae`: the same release file (`vae.*` in one sequence of stages and "
        "resamplers, `res_blocks`, `per_channel_statistics.*`; `audio_vae.*`; `vocoder.*` in HiFi-GAN's "
        "names, LTX-2.3's with its bandwidth extension to 48 kHz, names derived from diffusers' converter; "
        "each read alone, not the whole file) "
        "or the diffusers folder (`vae/`, and `audio_vae/`, "
        "`vocoder/` beside it); the file's or folders' fingerprint keys latent entries; `text_encoder`: "
        "ComfyUI's single-file Gemma 3 12B (`gemma_3_12B_it*.safetensors`: `model.*`, fp8 too; its "
        "`vision_model.*`, `multi_modal_projector.*`, `spiece_model` unused; the tokenizer is "
        "Lightricks/LTX-2's) with the text connectors read from the `transformer` release file "
        "(`text_embedding_projection.*`, `model.diffusion_model.*_embeddings_connector.*`), or the diffusers "
        "folder (`text_encoder/` Gemma 3 + `tokenizer/` + `connectors/`); text entries hold the connectors' "
        "video and audio contexts; the 4-bit `fp4_mixed` Gemma is refused. "
        "Adapters: `comfy_folded` by default (the release's names with alpha folded "
        "into `lora_B`: ComfyUI's key map, and diffusers' LTX-2 loader, which refuses `.alpha` keys, "
        "converts them)"
    ),
    save_format_loads="ComfyUI; diffusers (`load_lora_weights` converts the release's names; no `.alpha` keys)",
    title="LTX-2 / LTX-2.3 text-to-video with sound (19B, 22B; video and audio streams trained together)",
    family="LTX2Model",
    block_lists=("transformer_blocks",),
    # every attention (self, text, and audio<->video of both streams) and both feed-forwards of the
    # blocks; the embedders, modulation and output projections are left alone
    default_targets=(
        r"transformer_blocks\.\d+\.(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn)"
        r"\.(to_q|to_k|to_v|to_out\.0)",
        r"transformer_blocks\.\d+\.(ff|audio_ff)\.net\.(0\.proj|2)",
    ),
    save_format="comfy_folded",  # the release's names, no `.alpha` keys: ComfyUI and diffusers load it
    diffusers_loader="LTX2LoraLoaderMixin",
    diffusers_reads=CONVERTS_FOLDED,
    tokenizers=hub_tokenizers("Lightricks/LTX-2", "tokenizer"),  # Gemma 3
    # the diffusers pipelines (LTX-2.3's repository name as diffusers' converter gives it)
    hub_repos=(("19b", "Lightricks/LTX-2"), ("22b", "Lightricks/LTX-2.3")),
    # what ComfyUI users load: Lightricks' release files (transformer, connectors, VAEs, vocoder in one)
    # and Comfy-Org's single-file Gemma 3
    comfy_files=tuple(
        (variant, (("transformer", release), ("vae", release), ("text_encoder", GEMMA_FILE)))
        for variant, release in (
            ("19b", "Lightricks/LTX-2/ltx-2-19b-dev.safetensors"),
            ("22b", "Lightricks/LTX-2.3/ltx-2.3-22b-dev.safetensors"),
        )
    ),
    spatial_step=32,
    frame_multiple=8,
    frame_remainder=1,
    model_fps=24.0,
    supports_video=True,
    latent_patch=(1, 1, 1),
    audio_format=(16000, 2),
    sound_stream="sound:LTX2Sound",
)


RECORDS = (LTX2,)
