"""The hunyuan_video15 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from dataclasses import replace

from tuner.archs.record import (
    DUAL_STREAM_ATTENTION,
    DUAL_STREAM_FEED_FORWARD,
    Architecture,
    ReferencePipeline,
    SamplingDefaults,
    comfy,
)

_HV15_COMFY = "Comfy-Org/HunyuanVideo_1.5_repackaged"

_HV15_PARTS = {"vae": "vae/hunyuanvideo15_vae_fp16.safetensors",
               "text_encoder": "text_encoders/qwen_2.5_vl_7b.safetensors",
               "text_encoder_2": "text_encoders/byt5_small_glyphxl_fp16.safetensors"}  # fmt: skip


HUNYUAN_VIDEO15 = Architecture(
    name="hunyuan_video15",
    sampling=SamplingDefaults(
        steps=50,
        guidance=6.0,
        shift=5.0,
        source="diffusers HunyuanVideo15Pipeline's 50 steps; guidance 6 and shift 5 (480p): the release's "
        "sampling settings (its guider and scheduler configs)",
    ),
    variants=("480p_t2v", "720p_t2v"),
    checkpoints=(
        "Variants: `480p_t2v`, `720p_t2v` (one 8.3B network: 54 double blocks of 2048; the configs differ "
        "only in the pipeline's default size, picked from `720p` in the file / folder name; ). "
        "`transformer`: Tencent's `transformer/480p_t2v/diffusion_pytorch_model.safetensors` (separate "
        "`img_attn_q/k/v`) or Comfy-Org's `hunyuanvideo1.5_{480p,720p}_t2v_*.safetensors` (fused "
        "`img_attn_qkv` / `txt_attn_qkv`: ComfyUI's HunyuanVideo model has only the fused linear and musubi-tuner "
        "splits it on load, sources in `archs/hunyuan_video15/keys.py`; told apart by the keys), both with the fused refiner `self_attn_qkv`, `byt5_in.*`, `vision_in.*`, "
        "`cond_type_embedding` (`model.diffusion_model.` optional, fp8 too), or the diffusers folder "
        "(`hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v`); a file named `i2v` is refused "
        "naming `hunyuan_video15_i2v` (same shapes, other weights), a HunyuanVideo 1.0 file naming "
        "`hunyuan_video`. `vae`: `AutoencoderKLHunyuanVideo15` (32 channels, 16× spatial) in Tencent's "
        "names (`encoder.down.0.block.0...`, ComfyUI's `hunyuanvideo15_vae_fp16.safetensors`), diffusers' "
        "names, or `vae/`; `text_encoder`: Qwen2.5-VL-7B (ComfyUI's `qwen_2.5_vl_7b*.safetensors`, only "
        "its language model kept, or the diffusers `text_encoder/`) + `tokenizer`, `hidden_states[-3]` "
        "after the chat template (108 tokens cropped); `text_encoder_2`: the ByT5 glyph encoder "
        "(Glyph-SDXL-v2's ByT5-small, `byt5_small_glyphxl_fp16.safetensors` or `text_encoder_2/`) + "
        "`tokenizer_2`, fed the prompt's quoted text. Adapters and full fine-tunes save in ComfyUI's layout "
        "(q/k/v fused; kohya MLP names ComfyUI's `img_mlp_0` / `_2`), DoRA is refused; diffusers has no "
        "HunyuanVideo 1.5 LoRA loader"
    ),
    save_format_loads=(
        'ComfyUI; diffusers has no HunyuanVideo 1.5 LoRA loader; musubi-tuner needs `save.format = "musubi"` '
        "(Tencent's separate q/k/v)"
    ),
    title="HunyuanVideo 1.5 text-to-video (8.3B, 480p / 720p T2V)",
    family="HunyuanVideo15Model",
    block_lists=("transformer_blocks",),
    # the attention and MLP linears of both streams of every double block (q/k/v, so the export can fuse
    # `img_attn_qkv` / `txt_attn_qkv`). Modulations, norms, the text refiner and the text / glyph / image
    # embedders are left alone.
    default_targets=(DUAL_STREAM_ATTENTION, DUAL_STREAM_FEED_FORWARD),
    tokenizers=(  # Qwen2.5-VL and the ByT5 glyph encoder
        ("tokenizer", "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v:tokenizer"),
        ("tokenizer_2", "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v:tokenizer_2"),
    ),
    hub_repos=tuple(
        (r, f"hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{r}_t2v") for r in ("480p", "720p")
    ),
    comfy_files=(
        (
            "720p",
            comfy(
                _HV15_COMFY,
                transformer="diffusion_models/hunyuanvideo1.5_720p_t2v_fp16.safetensors",
                **_HV15_PARTS,
            ),
        ),
    ),  # fmt: skip
    # Tencent names under `diffusion_model.`, q/k/v fused: ComfyUI's key map (diffusers has no HunyuanVideo
    # 1.5 LoRA loader)
    pipeline=ReferencePipeline("HunyuanVideo15Pipeline"),
    save_format="comfy",
    musubi_trains=True,
    dora_refused=(
        "ComfyUI's model keeps each stream's q, k and v in one linear, img_attn.qkv / txt_attn.qkv, and maps "
        "no adapter name onto a part of it; a column-wise DoRA of q, k or v alone has no fused form"
    ),
    spatial_step=16,
    frame_multiple=4,
    frame_remainder=1,
    model_fps=24.0,
    supports_video=True,
    latent_patch=(1, 1, 1),
)


RECORDS = (
    HUNYUAN_VIDEO15,
    # HunyuanVideo 1.5 I2V: the same network (other weights) given the first frame as condition
    # latents and SigLIP image tokens
    replace(
        HUNYUAN_VIDEO15,
        name="hunyuan_video15_i2v",
        pipeline=None,  # not checked against its pipeline yet
        pipeline_refused=(
            "its predict runs the samples given their first frame and those not given it as two batches; "
            "not cut into stages yet"
        ),
        variants=("480p_i2v", "720p_i2v"),
        checkpoints=(
            "Variants: `480p_i2v`, `720p_i2v` (the T2V network's shapes, other weights). `transformer`: "
            "Tencent's `transformer/480p_i2v/...` (separate q/k/v) or Comfy-Org's "
            "`hunyuanvideo1.5_{480p,720p}_i2v_*.safetensors` (fused `*_attn_qkv`) or the diffusers folder "
            "(`hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v`); a file named `t2v` is refused "
            "naming `hunyuan_video15`. `image_encoder`: SigLIP so400m-patch14-384 (ComfyUI's "
            "`sigclip_vision_patch14_384.safetensors`, `vision_model.*`, or the diffusers `image_encoder/` + "
            "`feature_extractor/`; configs in `configs/hunyuan_video15/siglip/`); VAE and text encoders as "
            "`hunyuan_video15`. Latent entries hold `latents`, `image_latents` (the clip's first frame "
            "encoded alone) and `image_embeds` (SigLIP's `last_hidden_state`, 729 tokens), keyed by "
            "`model.vae` and `model.image_encoder`; the model is given the frame's latent in latent frame 0 "
            "of the condition channels with a mask channel, as `HunyuanVideo15ImageToVideoPipeline`. Video "
            "datasets only"
        ),
        title="HunyuanVideo 1.5 image-to-video (8.3B, 480p / 720p I2V; first frame + SigLIP)",
        family="HunyuanVideo15I2VModel",
        fixture="I2V_FIXTURE",
        first_frame=1.0,  # without it: the text-to-video pipeline's zero condition and image tokens
        hub_repos=tuple(
            (r, f"hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{r}_i2v") for r in ("480p", "720p")
        ),
        comfy_files=(
            (
                "720p",
                comfy(
                    _HV15_COMFY,
                    transformer="diffusion_models/hunyuanvideo1.5_720p_i2v_fp16.safetensors",
                    **_HV15_PARTS,
                )
                + (
                    (
                        "image_encoder",
                        "Comfy-Org/sigclip_vision_384/sigclip_vision_patch14_384.safetensors",
                    ),
                ),
            ),
        ),  # fmt: skip
        supports_images=False,
        frame_images=1,
        latent_encoders=("vae", "image_encoder"),
    ),
)
