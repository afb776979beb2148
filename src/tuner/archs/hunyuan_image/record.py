"""The hunyuan_image family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import (
    DUAL_STREAM_ATTENTION,
    DUAL_STREAM_FEED_FORWARD,
    SINGLE_STREAM,
    Architecture,
    SamplingDefaults,
    comfy,
    hub_tokenizers,
)

_COMFY = "Comfy-Org/HunyuanImage_2.1_ComfyUI"
_COMFY_PARTS = dict(
    vae="vae/hunyuan_image_2.1_vae_fp16.safetensors",
    text_encoder="text_encoders/qwen_2.5_vl_7b.safetensors",
    text_encoder_2="text_encoders/byt5_small_glyphxl_fp16.safetensors",
)

HUNYUAN_IMAGE = Architecture(
    name="hunyuan_image",
    sampling=(
        SamplingDefaults(
            steps=50,
            guidance=3.5,
            shift=5.0,
            source="HunyuanImagePipeline's 50 steps; Tencent's pipeline config (base: guidance 3.5, shift 5; "
            "distilled: 8 steps, shift 4; its embedded guidance 3.25 is fixed by `loaders`)",
        ).named(r"distill", steps=8, guidance=1.0, shift=4.0)
    ),
    variants=("base", "distilled"),
    checkpoints=(
        "Variants: `base`, `distilled` (+ guidance and MeanFlow embedders), told apart by shapes. "
        "`transformer`: Tencent's `dit/hunyuanimage2.1.safetensors` / `hunyuanimage2.1-distilled.safetensors` "
        "or ComfyUI's `hunyuanimage2.1_bf16.safetensors` (HunyuanVideo 1.0's names: fused `img_attn_qkv` / "
        "`linear1`, `byt5_in`; fp8 too), or the diffusers folder "
        "(`hunyuanvideo-community/HunyuanImage-2.1-Diffusers`); the refiner and HunyuanVideo files are "
        "refused by name. `vae`: a single file in Tencent's names (`encoder.down.0.block.0...`) or diffusers' "
        "or `vae/`; `text_encoder`: Qwen2.5-VL-7B as HunyuanVideo 1.5's (ComfyUI's `qwen_2.5_vl_7b*` + "
        "`tokenizer`, or `text_encoder/`); `text_encoder_2`: the ByT5 glyph encoder "
        "(`byt5_small_glyphxl_fp16.safetensors` or `text_encoder_2/`). Train the base; training the "
        "distilled model warns"
    ),
    save_format_loads=(
        "ComfyUI (`lora_unet_` + its module names); diffusers has no HunyuanImage LoRA loader; musubi-tuner "
        "does not train HunyuanImage 2.1"
    ),
    title="HunyuanImage 2.1 text-to-image (17B base / distilled; Qwen2.5-VL-7B + ByT5 glyphs)",
    family="HunyuanImageModel",
    training_warning="trainer:distilled_warning",
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # as HunyuanVideo's: the attention and MLP linears of both streams in the double blocks and q/k/v,
    # MLP input and output of the single blocks, so the export can fuse `img_attn_qkv`, `txt_attn_qkv` and
    # `linear1`. Modulations, norms, the token refiner, the ByT5 mapper and the embedders are left alone.
    default_targets=(DUAL_STREAM_ATTENTION, DUAL_STREAM_FEED_FORWARD, SINGLE_STREAM),
    tokenizers=hub_tokenizers(
        "hunyuanvideo-community/HunyuanImage-2.1-Diffusers", "tokenizer", "tokenizer_2"
    ),
    hub_repos=(
        ("base", "hunyuanvideo-community/HunyuanImage-2.1-Diffusers"),
        ("distilled", "hunyuanvideo-community/HunyuanImage-2.1-Distilled-Diffusers"),
    ),
    comfy_files=(
        (
            "base",
            comfy(_COMFY, transformer="diffusion_models/hunyuanimage2.1_bf16.safetensors", **_COMFY_PARTS),
        ),
    ),
    # ComfyUI's module names with "_" under `lora_unet_` (q/k/v and linear1 fused): what its key map holds
    # for HunyuanImage 2.1, whose model is no HunyuanVideo (the release's names under `diffusion_model.`,
    # the comfy layout, are not)
    save_format="kohya",
    dora_refused=(
        "ComfyUI's HunyuanImage 2.1 model (its HunyuanVideo class) keeps q, k and v in one linear "
        "(img_attn.qkv / txt_attn.qkv, the single blocks' linear1) and maps no adapter name onto a part of it; "
        "a column-wise DoRA of q, k or v alone has no fused form"
    ),
    spatial_step=32,
    latent_patch=(1, 1),
    timestep_mode="shift",
    # the distilled model is MeanFlow-distilled: generation gives it the step's end time r, as
    # HunyuanImagePipeline does (the base model has no r and ignores it). Training gives r = t (the
    # instantaneous velocity, the only target flow matching has) and warns (`training_warning`).
    flow_next_time=True,
    # the base model samples as Tencent's pipeline (`cfg_mode = "MIX_mode_0"`) and diffusers'
    # `AdaptiveProjectedMixGuidance` do: CFG at the user's scale (3.5) up to step 5, then APG at 10
    # (`tuner.diffusion.guidance`). Their prompts with quoted text start APG at step 38 instead: not done.
    sample_guidance=(
        ("scale", 10.0),
        ("momentum", -0.5),
        ("norm_threshold", 10.0),
        ("eta", 0.0),
        ("start_step", 5),
    ),
)


RECORDS = (HUNYUAN_IMAGE,)
