"""The sd3 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import (
    DIFFUSERS_ONLY,
    DUAL_STREAM_ATTENTION,
    DUAL_STREAM_FEED_FORWARD,
    Architecture,
    SamplingDefaults,
    hub_tokenizers,
)

SD3 = Architecture(
    name="sd3",
    sampling=(
        SamplingDefaults(
            steps=28,
            guidance=3.5,
            shift=3.0,
            source="the SD 3.5 model cards (Large 28 steps / guidance 3.5; Medium 40 / 4.5; Large Turbo 4 / "
            "none); shift: the scheduler config's 3",
        )
        .named(r"turbo", steps=4, guidance=1.0)
        .named(r"medium", steps=40, guidance=4.5)
    ),
    variants=("medium", "large"),
    checkpoints=(
        "Variants: `medium` (24 blocks of 1536, `attn2` in blocks 0-12), `large` (38 blocks of 2432; "
        "Large Turbo is the same network). `transformer`: `sd3.5_medium.safetensors` / "
        "`sd3.5_large*.safetensors` (`joint_blocks.N.x_block.attn.qkv`, ...; `model.diffusion_model.` "
        "optional; fp8 too) or the diffusers folder; an SD 3.0 Medium file is refused by name. `vae`: the "
        "diffusers `vae/`, an LDM-layout file, or the release's file itself (`first_stage_model.*`). "
        "`text_encoder` / `text_encoder_2`: CLIP-L / OpenCLIP bigG (`clip_l.safetensors`, "
        "`clip_g.safetensors`, a file bundling `text_encoders.clip_l.*` / `clip_g.*`, or diffusers "
        "folders; bigG found beside CLIP-L or in the same file); `text_encoder_3`: T5-XXL "
        "(`t5xxl_*.safetensors`, `text_encoders.t5xxl.*`, `text_encoder_3/`), optional: unset, its "
        "features are zeros as in `StableDiffusion3Pipeline` (logged once). Tokenizers `tokenizer`, "
        '`tokenizer_2` (bigG pads with "!"), `tokenizer_3`. Adapters: `diffusers` by default (diffusers\' '
        "names, which ComfyUI's SD3 key map cuts out of the release's fused qkv); `comfy` is the release's "
        "names, qkv fused, which diffusers' SD3 loader does not read"
    ),
    save_format_loads="ComfyUI (`transformer.<name>`, onto the fused qkv's rows); diffusers (`load_lora_weights`)",
    title="Stable Diffusion 3.5 text-to-image (Medium, Large, Large Turbo)",
    family="SD3Model",
    block_lists=("transformer_blocks",),
    # the attention and MLP linears of both streams (Medium's attn2 too): together the release's fused
    # `qkv` layers, so the export can fuse them. Modulations, embedders and the output head are left alone.
    default_targets=(
        DUAL_STREAM_ATTENTION,
        r"transformer_blocks\.\d+\.attn2\.(to_q|to_k|to_v|to_out\.0)",
        DUAL_STREAM_FEED_FORWARD,
    ),
    # CLIP-L, OpenCLIP bigG, T5-XXL
    tokenizers=hub_tokenizers(
        "stabilityai/stable-diffusion-3.5-medium", "tokenizer", "tokenizer_2", "tokenizer_3"
    ),
    hub_repos=tuple((v, f"stabilityai/stable-diffusion-3.5-{v}") for v in ("medium", "large", "large-turbo")),
    # diffusers' SD3 loader reads only its own names (it has no converter), and ComfyUI's SD3 key map
    # (`mmdit_to_diffusers`) maps them onto the fused qkv's rows: the one layout both load. `comfy` keeps
    # the release's fused qkv (ComfyUI only); full fine-tunes are written in the release's file layout
    save_format="diffusers",
    diffusers_loader="SD3LoraLoaderMixin",
    diffusers_reads=DIFFUSERS_ONLY,
    latent_patch=(2, 2),
)


RECORDS = (SD3,)
