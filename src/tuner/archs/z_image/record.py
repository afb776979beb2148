"""The z_image family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import (
    ALPHA_LEFT_OVER,
    LOADS_EVERY_LAYOUT,
    Architecture,
    SamplingDefaults,
    comfy,
    hub_tokenizers,
)

Z_IMAGE = Architecture(
    name="z_image",
    sampling=(
        SamplingDefaults(
            steps=50,
            guidance=5.0,
            cfg_form="cond_plus",
            shift=3.0,
            source="diffusers ZImagePipeline's defaults (50 steps, guidance 5 as cond + g·(cond − uncond)); "
            "Turbo: its example's 8 steps without guidance (0); shift: Turbo's scheduler config's 3",
        ).named(r"turbo", steps=8, guidance=0.0)
    ),
    variants=("turbo", "base"),
    checkpoints=(
        "Variants: `turbo`, `base` (one network: a 6B header matches the `z-image` signature, and `turbo` "
        "in the file or folder name picks Turbo's config). `transformer`: ComfyUI's "
        "`z_image_turbo_bf16.safetensors` / `z_image_bf16.safetensors` (the release's keys: fused "
        "`attention.qkv`, `attention.out`, `q_norm` / `k_norm`, `x_embedder`, `final_layer`; fp8 too; a "
        "stray `norm_final.weight` is ignored), the same network saved in diffusers' keys, or the "
        "diffusers folder (`Tongyi-MAI/Z-Image-Turbo`); `vae`: FLUX.1's (`ae.safetensors` or the "
        "diffusers `vae/`); `text_encoder`: Qwen3-4B (`qwen_3_4b.safetensors` + `tokenizer`, or the "
        "diffusers folder), second-to-last hidden states. Adapters save as `kohya` (ComfyUI maps it; "
        "diffusers' Z-Image converter splits the fused qkv). Turbo is step-distilled: training it without "
        "`model.merge_adapters` (a de-distillation adapter merged in memory first) warns once"
    ),
    save_format_loads="ComfyUI; diffusers (its Z-Image converter splits the fused qkv); musubi-tuner needs `musubi`",
    title="Z-Image text-to-image (Turbo, Base; 6B single-stream DiT)",
    family="ZImageModel",
    training_warning="trainer:turbo_warning",
    layout="loaders:Z_IMAGE_LAYOUT",
    block_lists=("noise_refiner", "context_refiner", "layers"),
    # q/k/v (the release's fused `attention.qkv`), the output projection and the SwiGLU MLP of every
    # block, refiners included; the modulations, embedders and final layer are left alone
    default_targets=(
        r"(noise_refiner|context_refiner|layers)\.\d+\.attention\.(to_q|to_k|to_v|to_out\.0)",
        r"(noise_refiner|context_refiner|layers)\.\d+\.feed_forward\.(w1|w2|w3)",
    ),
    tokenizers=hub_tokenizers("Tongyi-MAI/Z-Image-Turbo", "tokenizer"),  # Qwen3
    hub_repos=(("turbo", "Tongyi-MAI/Z-Image-Turbo"),),
    comfy_files=(
        (
            "turbo",
            comfy(
                "Comfy-Org/z_image_turbo",
                transformer="diffusion_models/z_image_turbo_bf16.safetensors",
                vae="vae/ae.safetensors",
                text_encoder="text_encoders/qwen_3_4b.safetensors",
            ),
        ),
    ),  # fmt: skip
    # the release's names (fused `attention.qkv`, `attention.out`) in kohya's spelling: ComfyUI maps
    # them, and diffusers' Z-Image converter splits the fused qkv again (it leaves a comfy file's
    # `attention.out.alpha` unread and refuses it)
    save_format="kohya",
    diffusers_loader="ZImageLoraLoaderMixin",
    diffusers_reads={**LOADS_EVERY_LAYOUT, "comfy": ALPHA_LEFT_OVER},
    # its Z-Image converter takes the feed-forwards of a `diffusion_model.` file, not the fused
    # `attention.qkv`
    diffusers_drops=(("comfy_folded", ".attention."),),
    musubi_trains=True,
    dora_refused=(
        "a column-wise DoRA of q, k or v alone has no fused form (attention.qkv) and the kohya file writes it "
        "under lora_transformer_<diffusers name>, which ComfyUI's Z-Image key map lacks (it maps diffusers' "
        "names under transformer. and diffusion_model. onto the fused rows)"
    ),
    latent_patch=(2, 2),
)


RECORDS = (Z_IMAGE,)
