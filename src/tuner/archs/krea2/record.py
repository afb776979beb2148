"""The krea2 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

import math

from tuner.archs.record import (
    ALPHA_LEFT_OVER,
    CONVERTS_FOLDED,
    Architecture,
    SamplingDefaults,
    comfy,
    hub_tokenizers,
)

_BLOCKS = r"(transformer_blocks|text_fusion\.layerwise_blocks|text_fusion\.refiner_blocks)\.\d+"

KREA2 = Architecture(
    name="krea2",
    sampling=(
        SamplingDefaults(
            steps=28,
            guidance=4.5,
            cfg_form="cond_plus",
            shift="krea2_shift",
            source="diffusers Krea2Pipeline's defaults (28 steps, guidance 4.5 as cond + g·(cond − uncond)); Turbo: its example's 8 steps "
            "without guidance and the fixed μ = 1.15 of `is_distilled`",
        ).named(r"turbo", steps=8, guidance=0.0, shift=math.exp(1.15))
    ),
    variants=("raw", "turbo"),
    checkpoints=(
        "Variants: `raw`, `turbo` (one network: a 12B header is Krea 2, and `turbo` in the file or folder "
        "name picks Turbo's sampling defaults). `transformer`: ComfyUI's `krea2_raw_bf16.safetensors` / "
        "`krea2_turbo_bf16.safetensors` (the release's keys: `blocks.0.attn.wq`, `txtfusion.*`, `first`, "
        "`last`; `*_fp8_scaled` too), the same network in diffusers' keys, or a diffusers folder; `vae`: "
        "Qwen-Image's (`qwen_image_vae.safetensors` or `vae/`); `text_encoder`: Qwen3-VL-4B "
        "(`qwen3vl_4b_bf16.safetensors` + `tokenizer`, or `text_encoder/`), 12 tapped layers. Train RAW; "
        "training Turbo warns"
    ),
    save_format_loads=(
        "ComfyUI; diffusers (its Krea 2 converter reads the release's names, refusing `.alpha` keys); "
        'musubi-tuner needs `save.format = "kohya"`'
    ),
    title="Krea 2 text-to-image (RAW, Turbo; 12B single-stream DiT, Qwen3-VL-4B)",
    family="Krea2Model",
    training_warning="trainer:turbo_warning",
    block_lists=("transformer_blocks",),
    # every linear layer of the blocks (attention q/k/v/out/gate and the SwiGLU MLP), the text-fusion
    # blocks' too; the embedders, the shared modulation projection and the output head are left alone
    default_targets=(
        _BLOCKS + r"\.attn\.(to_q|to_k|to_v|to_out\.0|to_gate)",
        _BLOCKS + r"\.ff\.(gate|up|down)",
    ),
    # Qwen3-VL's; diffusers' single-file loader takes its configs from this repository's folders
    tokenizers=hub_tokenizers("krea/Krea-2-Raw", "tokenizer"),
    hub_repos=(("raw", "krea/Krea-2-Raw"), ("turbo", "krea/Krea-2-Turbo")),
    comfy_files=tuple(
        (
            variant,
            comfy(
                "Comfy-Org/Krea-2",
                transformer=f"diffusion_models/krea2_{variant}_bf16.safetensors",
                vae="vae/qwen_image_vae.safetensors",
                text_encoder="text_encoders/qwen3vl_4b_bf16.safetensors",
            ),
        )
        for variant in ("raw", "turbo")
    ),
    # the release's names under `diffusion_model.`, as ComfyUI and Krea's trainer write, no `.alpha` keys:
    # ComfyUI and diffusers load it
    save_format="comfy_folded",
    diffusers_loader="Krea2LoraLoaderMixin",
    diffusers_reads={**CONVERTS_FOLDED, "comfy": ALPHA_LEFT_OVER},
    musubi_trains=True,
    timestep_mode="krea2_shift",
)


RECORDS = (KREA2,)
