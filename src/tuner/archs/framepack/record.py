"""The framepack family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from dataclasses import replace

from tuner.archs.hunyuan_video.record import HUNYUAN_VIDEO
from tuner.archs.record import SamplingDefaults

# FramePack: HunyuanVideo's network plus the history embedder and SigLIP projection, trained on sections;
# adapters on the same modules as HunyuanVideo's, exported in its Tencent names
FRAMEPACK = replace(
    HUNYUAN_VIDEO,
    name="framepack",
    sampling=SamplingDefaults(
        steps=50,
        guidance=1.0,
        embedded_guidance=6.0,
        shift=3.0,
        source="diffusers HunyuanVideoFramepackPipeline's defaults (50 steps, embedded guidance 6.0, "
        "`true_cfg_scale` 1); shift: its scheduler config's 3",
    ),
    # diffusers' HunyuanVideo converter finds no Tencent name in musubi-tuner's (diffusers') names
    diffusers_reads={**HUNYUAN_VIDEO.diffusers_reads, "musubi": "ignores"},
    variants=("i2v",),
    checkpoints=(
        "Variants: `i2v` (FramePackI2V_HY; the F1 file has the same shapes and loads, but sections are "
        "built with the base model's inverted anti-drifting indices, not F1's forward ones). "
        "`transformer`: the release's single file (`FramePackI2V_HY_bf16.safetensors` / `_fp8_e4m3fn`: "
        "lllyasviel's class, diffusers' names, `model.diffusion_model.` optional), the same weights in "
        "HunyuanVideo's Tencent names (fused qkv / `linear1`, plus `clean_x_embedder.*`, "
        "`image_projection.*`; what a full fine-tune saves), or the diffusers folder "
        "(`lllyasviel/FramePackI2V_HY`); `image_encoder`: SigLIP so400m-patch14-384, ComfyUI's "
        "`sigclip_vision_patch14_384.safetensors` (`vision_model.*`) or the diffusers `image_encoder/` (+ "
        "`feature_extractor/`; configs in `configs/framepack/siglip/`); VAE, `text_encoder` (+ "
        "`tokenizer`) and `text_encoder_2` (+ `tokenizer_2`) as `hunyuan_video`. Video datasets only (5+ "
        "frames). A HunyuanVideo file is refused naming `hunyuan_video` and a FramePack file given to "
        "`hunyuan_video` names `framepack`. Adapters save by default in HunyuanVideo's names with fused "
        "qkv / `linear1` (comfy, as `hunyuan_video`); diffusers' FramePack pipeline and ComfyUI's "
        "FramePack wrapper (which passes LoRAs through diffusers' HunyuanVideo LoRA converter) read "
        '`save.format = "diffusers"` only: that converter cannot take the `.alpha` keys of fused layers'
    ),
    save_format_loads='ComfyUI (HunyuanVideo\'s names); diffusers\' FramePack pipeline needs `save.format = "diffusers"`, musubi-tuner `"musubi"`',
    title="FramePack image-to-video (HunyuanVideo-based, next-section prediction, SigLIP)",
    family="FramePackModel",
    # the transformer; VAE, text and image encoders are HunyuanVideo's (`hunyuanvideo-community/HunyuanVideo`)
    # and SigLIP (`lllyasviel/flux_redux_bfl`), as diffusers' FramePack example loads them
    hub_repos=(("i2v", "lllyasviel/FramePackI2V_HY"),),
    comfy_files=(),
    first_frame=1.0,
    # every section is anchored on the image: its latent is the clean prefix and its SigLIP tokens the image
    # context, and the release's sampler (and diffusers') cannot run without one
    first_frame_required="every section's clean prefix and SigLIP tokens are the image's; its sampler needs one",
    supports_images=False,
    min_frames=5,
    frame_images=1,
    latent_encoders=("vae", "image_encoder"),
    flow_sampler="sections:sample_sections",
)


RECORDS = (
    FRAMEPACK,
    # FramePack-F1: the same network trained forwards (each section from the frames before it)
    replace(
        FRAMEPACK,
        name="framepack_f1",
        checkpoints=(
            "Variants: `i2v` (`FramePack_F1_I2V_HY_20250503`: the same shapes as FramePackI2V_HY, so it is told "
            'apart by the config key `model.architecture = "framepack_f1"`, not by its file; given the base '
            "file it trains and samples, but in an order that model was not trained in). The files of "
            "`framepack` otherwise. Video datasets only (5+ frames): a clip trains its last section with the "
            "19 latent frames before it as history; `tuner generate --image FIRST` makes the sections forwards"
        ),
        title="FramePack-F1 image-to-video (forward next-section prediction, history before the section)",
        family="FramePackF1Model",
        fixture="F1_FIXTURE",
        hub_repos=(("i2v", "lllyasviel/FramePack_F1_I2V_HY_20250503"),),
        flow_sampler="sections:sample_sections_f1",
    ),
    # FramePack's single-frame mode: one target image from one reference image (image editing)
    replace(
        FRAMEPACK,
        name="framepack_1f",
        variants=("i2v",),
        checkpoints=(
            "the files of `framepack`. Image datasets with one or two control images (the references) per "
            "item, placed on the time axis by the `[one_frame]` section (musubi-tuner's `fp_1f_*` keys); `tuner "
            "generate --control REF [--control REF2] --frames 1`"
        ),
        title="FramePack single-frame image editing (one target frame from one reference image)",
        family="FramePackOneFrameModel",
        fixture="ONE_FRAME_FIXTURE",
        first_frame_required="the reference image is the edit's input; without it there is nothing to edit",
        supports_video=False,
        supports_images=True,
        min_frames=1,
        frame_images=0,
        latent_encoders=("vae",),
        text_extra_encoders=("image_encoder",),
        control_images=(1, 2),
        text_uses_controls=True,
        one_frame="section",
        flow_sampler="",  # one section: one pass
    ),
)
