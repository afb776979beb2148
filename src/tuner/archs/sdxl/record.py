"""The sdxl family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import (
    ALPHA_REFUSED,
    LOADS_EVERY_LAYOUT,
    Architecture,
    ReferencePipeline,
    SamplingDefaults,
    hub_tokenizers,
)

SDXL = Architecture(
    name="sdxl",
    pipeline_refused=(
        "a UNet: each down block's output skips to its up block, so a cut would carry every skip tensor "
        "across stages"
    ),
    sampling=SamplingDefaults(
        steps=50,
        guidance=5.0,
        shift=None,
        zero_empty_negative=True,
        source="diffusers StableDiffusionXLPipeline's defaults (50 steps, guidance 5.0, "
        "`force_zeros_for_empty_prompt`)",
    ),
    variants=("sdxl",),
    checkpoints=(
        "Variants: `sdxl` (SDXL 1.0 base and its fine-tunes), `tiny`. `transformer`, `vae`, "
        "`text_encoder`, `text_encoder_2`: the bundled A1111 / ComfyUI checkpoint "
        "(`model.diffusion_model.*` UNet in the original `sgm` layout, `first_stage_model.*` VAE, "
        "`conditioner.embedders.0.transformer.*` CLIP-L, `conditioner.embedders.1.model.*` OpenCLIP "
        "bigG), or each part alone (UNet-only file, `sdxl_vae.safetensors` / fp16-fix VAE, ComfyUI's "
        "`clip_l` / `clip_g`), or the diffusers folder (`unet/`, `vae/`, `text_encoder/`, "
        "`text_encoder_2/`); `tokenizer`, `tokenizer_2` for single files. SD 1.x / 2.x files and the "
        "refiner are refused by name; a `v_pred` marker key warns when trained as epsilon"
    ),
    save_format_loads="ComfyUI, A1111 / Forge; diffusers (`load_lora_weights`)",
    title="SDXL text-to-image (base 1.0 and fine-tunes: Pony, Illustrious, NoobAI; epsilon or v-pred)",
    family="SDXLModel",
    # the UNet's levels (the mid block is one module, not a list, and stays resident)
    block_lists=("down_blocks", "up_blocks"),
    # every linear layer of the attention modules: their projections in and out, self- and
    # cross-attention and the feed-forward (kohya's default set for SDXL); resnets and embeddings left alone
    default_targets=(
        r".*attentions\.\d+\.(proj_in|proj_out)",
        r".*attentions\.\d+\.transformer_blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)",
        r".*attentions\.\d+\.transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)",
    ),
    tokenizers=hub_tokenizers("stabilityai/stable-diffusion-xl-base-1.0", "tokenizer", "tokenizer_2"),
    hub_repos=(("base", "stabilityai/stable-diffusion-xl-base-1.0"),),
    # kohya's `lora_unet_input_blocks_4_1_...` names: A1111, Forge, ComfyUI and diffusers all load them
    save_format="kohya",
    pipeline=ReferencePipeline("StableDiffusionXLPipeline"),
    diffusers_loader="StableDiffusionXLLoraLoaderMixin",
    diffusers_reads={**LOADS_EVERY_LAYOUT, "comfy": ALPHA_REFUSED, "comfy_folded": "ignores"},
    spatial_step=64,
    timestep_mode="uniform",
    latent_patch=(1, 1),
    objective="ddpm",
    text_encoder_training="text_training:SDXLTextEncoders",
    size_conditioning=True,
    full_layout="trainer:bundled_layout",
)


RECORDS = (SDXL,)
