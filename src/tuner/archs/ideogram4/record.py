"""The ideogram4 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import CONVERTS_FOLDED, Architecture, SamplingDefaults, comfy, hub_tokenizers

IDEOGRAM4 = Architecture(
    name="ideogram4",
    sampling=SamplingDefaults(
        steps=48,
        guidance=7.0,
        shift=1.0,
        source="diffusers Ideogram4Pipeline's defaults (48 steps; its guidance schedule is 7.0 for 45 steps "
        "then 3.0 for 3: tuner guides at one scale)",
    ),
    variants=("v4",),
    checkpoints=(
        "Variants: `v4` (the conditional transformer; the unconditional one, "
        "`ideogram4_unconditional_fp8_scaled.safetensors`, the same shape, is refused by its metadata "
        "`model_type` or name, and not loaded: guided samples run the trained transformer for the "
        "unconditional pass too). `transformer`: ComfyUI's `ideogram4_fp8_scaled.safetensors` (the "
        "release's keys: fused `layers.0.attention.qkv`, `attention.o`; dequantized), a bf16 file, the same "
        "network in diffusers' keys, or a diffusers folder; `vae`: FLUX.2's (`flux2-vae.safetensors` or "
        "`vae/`); `text_encoder`: Qwen3-VL-8B (`qwen3vl_8b_fp8_scaled.safetensors` + `tokenizer`, or "
        "`text_encoder/`), 13 stacked layers"
    ),
    save_format_loads=(
        "ComfyUI; diffusers (its Ideogram 4 converter reads the release's names and folds `.alpha`); "
        'musubi-tuner needs `save.format = "kohya"`'
    ),
    title="Ideogram 4 text-to-image (single-stream DiT, Qwen3-VL-8B, FLUX.2 VAE)",
    family="Ideogram4Model",
    block_lists=("layers",),
    # musubi-tuner's targets: each block's attention (qkv and o) and SwiGLU MLP; the modulation, embedders
    # and output head are left alone
    default_targets=(
        r"layers\.\d+\.attention\.(to_q|to_k|to_v|to_out\.0)",
        r"layers\.\d+\.feed_forward\.(w1|w2|w3)",
    ),
    # the release's diffusers repository (FP8 weights, gated); its tokenizer is Qwen3-VL's
    tokenizers=hub_tokenizers("ideogram-ai/ideogram-4-fp8", "tokenizer"),
    hub_repos=(("v4", "ideogram-ai/ideogram-4-fp8"),),
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
    # the release's names under `diffusion_model.` with `.alpha`: ComfyUI and diffusers both load it
    save_format="comfy",
    diffusers_loader="Ideogram4LoraLoaderMixin",
    # its converter reads the release's names under `diffusion_model.` (splitting qkv, folding `.alpha`) and
    # diffusers' own; kohya's `lora_unet_` names it does not know
    diffusers_reads={**CONVERTS_FOLDED, "comfy": "loads"},
    musubi_trains=True,
    # ComfyUI's key map for Ideogram 4 is taken as its generic rule (the release's names under
    # `diffusion_model.`): nothing maps a diffusers name onto a row slice of the fused qkv
    dora_refused=(
        "Ideogram 4 keeps q, k and v in one linear (layers.N.attention.qkv) and ComfyUI maps adapter names "
        "onto it in the release's spelling only; a column-wise DoRA of q, k or v alone has no fused form and "
        "would be written under its diffusers name, which ComfyUI would not load"
    ),
    timestep_mode="ideogram4_shift",
    flow_schedule="trainer:logit_normal_sigmas",
    latent_patch=(1, 1),
)


RECORDS = (IDEOGRAM4,)
