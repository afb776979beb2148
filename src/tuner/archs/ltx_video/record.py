"""The ltx_video family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import (
    CONVERTS_FOLDED,
    FEED_FORWARD,
    SELF_AND_CROSS_ATTENTION,
    Architecture,
    SamplingDefaults,
    hub_tokenizers,
)

LTX_VIDEO = Architecture(
    name="ltx_video",
    sampling=SamplingDefaults(
        steps=50,
        guidance=3.0,
        shift=3.0,
        source="diffusers LTXPipeline's defaults (50 steps, guidance 3.0)",
    ),
    variants=("0.9",),
    checkpoints=(
        "Variants: `0.9` (LTX-Video 0.9 / 0.9.1 2B: 28 blocks of width 2048; configs from diffusers' "
        "class defaults), `tiny`. `transformer`: Lightricks' single file (`model.diffusion_model.*`: "
        "`patchify_proj`, `adaln_single`, `q_norm` / `k_norm`; an LTX-2 file is refused naming `ltx2`) or "
        "the diffusers folder; `vae`: the diffusers folder (`vae/`; the release's bundled `vae.*` is not "
        "read yet); `text_encoder`: T5-XXL as FLUX.1's (`text_encoder/` + `tokenizer/`, or a single file "
        "+ `tokenizer`). Adapters: `comfy_folded` by default (the release's names, alpha "
        "folded into `lora_B`: ComfyUI's key map, and diffusers' LTX-Video loader, which refuses `.alpha` "
        "keys, converts them). 0.9.5 / 0.9.7 and 13B are not shipped variants"
    ),
    save_format_loads="ComfyUI; diffusers (`load_lora_weights` converts the release's names; no `.alpha` keys)",
    title="LTX-Video 0.9 text-to-video (2B)",
    family="LTXVideoModel",
    block_lists=("transformer_blocks",),
    # the self- and text attention and the feed-forward of every block
    default_targets=(SELF_AND_CROSS_ATTENTION, FEED_FORWARD),
    save_format="comfy_folded",  # the release's names, no `.alpha` keys: ComfyUI and diffusers load it
    diffusers_loader="LTXVideoLoraLoaderMixin",
    diffusers_reads=CONVERTS_FOLDED,
    tokenizers=hub_tokenizers("Lightricks/LTX-Video", "tokenizer"),  # T5-XXL
    hub_repos=(("0.9", "Lightricks/LTX-Video"),),
    first_frame=0.0,  # text-to-video unless asked: what training did before the key (one model, both tasks)
    spatial_step=32,
    frame_multiple=8,
    frame_remainder=1,
    model_fps=25.0,
    supports_video=True,
    latent_patch=(1, 1, 1),
    first_frame_image=True,
)


RECORDS = (LTX_VIDEO,)
