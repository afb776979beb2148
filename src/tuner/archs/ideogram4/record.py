"""The ideogram4 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import Architecture, comfy, hub_tokenizers

IDEOGRAM4 = Architecture(
    name="ideogram4",
    variants=("v4",),
    checkpoints=(
        "Variants: `v4` (the conditional transformer; the unconditional one, the same shape, is refused by its "
        "metadata `model_type` or name). `transformer`: ComfyUI's `ideogram4_fp8_scaled.safetensors` (the "
        "release's keys: fused `layers.0.attention.qkv`, `attention.o`; dequantized), a bf16 file, or a diffusers folder; `vae`: FLUX.2's (`flux2-vae.safetensors` or `vae/`); "
        "`text_encoder`: Qwen3-VL-8B (`qwen3vl_8b_fp8_scaled.safetensors` + `tokenizer`, or `text_encoder/`), "
        "13 stacked layers"
    ),
    save_format_loads="ComfyUI; diffusers (its Ideogram 4 converter reads the release's names and `.alpha`)",
    title="Ideogram 4 text-to-image (single-stream DiT, Qwen3-VL-8B, FLUX.2 VAE)",
    family="Ideogram4Model",
    block_lists=("layers",),
    # musubi-tuner's targets: each block's attention (qkv and o) and SwiGLU MLP; the modulation, embedders
    # and output head are left alone
    default_targets=(
        r"layers\.\d+\.attention\.(to_q|to_k|to_v|to_out\.0)",
        r"layers\.\d+\.feed_forward\.(w1|w2|w3)",
    ),
    tokenizers=hub_tokenizers("ideogram-ai/ideogram-v4", "tokenizer"),  # Qwen3-VL's
    hub_repos=(("v4", "ideogram-ai/ideogram-v4"),),
    comfy_files=(
        (
            "v4",
            comfy(
                "Comfy-Org/Ideogram-4",
                transformer="diffusion_models/ideogram4_fp8_scaled.safetensors",
                vae="vae/flux2-vae.safetensors",
                text_encoder="text_encoders/qwen3vl_8b_fp8_scaled.safetensors",
            ),
        ),
    ),
    save_format="comfy",
    diffusers_loader="Ideogram4LoraLoaderMixin",
    musubi_trains=True,
    timestep_mode="ideogram4_shift",
    sample_shift=1.0,
    flow_schedule="trainer:logit_normal_sigmas",
    latent_patch=(1, 1),
)


RECORDS = (IDEOGRAM4,)
