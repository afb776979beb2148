"""The ltx2 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import CONVERTS_FOLDED, Architecture, SamplingDefaults, hub_tokenizers

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
    variants=("19b",),
    checkpoints=(
        "Variants: `19b` (LTX-2 dev / distilled: 48 blocks, video width 4096, audio width 2048; configs "
        "from diffusers' class defaults), `tiny`. `transformer`: Lightricks' single file "
        "(`ltx-2-19b-dev.safetensors`: `model.diffusion_model.*` with `patchify_proj`, `adaln_single`, "
        "`av_ca_*_adaln_single`, `q_norm` / `k_norm`; its bundled connectors, `vae.*`, `audio_vae.*`, "
        "`vocoder.*` are skipped; fp8 too) or the diffusers folder; `vae`: the same release file (`vae.*` "
        "in one sequence of stages and resamplers, `res_blocks`, `per_channel_statistics.*`; "
        "`audio_vae.*`; read alone, not the whole file) or the diffusers folder (`vae/`, and `audio_vae/` "
        "beside it); the file's or folders' fingerprint keys latent entries; `text_encoder`: the "
        "diffusers folder (`text_encoder/` Gemma 3 + `tokenizer/` + `connectors/`: text entries hold the "
        "connectors' video and audio contexts). Adapters: `comfy_folded` by default (the release's "
        "names with alpha folded into `lora_B`: ComfyUI's key map, and diffusers' LTX-2 loader, which "
        "refuses `.alpha` keys, converts them)"
    ),
    save_format_loads="ComfyUI; diffusers (`load_lora_weights` converts the release's names; no `.alpha` keys)",
    title="LTX-2 text-to-video with sound (19B; video and audio streams trained together)",
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
    hub_repos=(("19b", "Lightricks/LTX-2"),),
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
