"""The flux2 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from dataclasses import replace

from tuner.archs.record import (
    ALPHA_LEFT_OVER,
    DUAL_STREAM_ATTENTION,
    LOADS_EVERY_LAYOUT,
    Architecture,
    SamplingDefaults,
    hub_tokenizers,
)

FLUX2 = Architecture(
    name="flux2",
    sampling=SamplingDefaults(
        steps=50,
        guidance=1.0,
        embedded_guidance=4.0,
        shift="flux_shift",
        source="diffusers Flux2Pipeline's defaults (50 steps, embedded guidance 4.0); shift: FLUX.1's "
        "resolution-dependent μ (the pipeline's empirical μ also depends on the step count)",
    ),
    variants=("dev",),
    checkpoints=(
        "Variants: `dev` (a klein file is refused naming `flux2_klein`). `transformer`: FLUX.2-dev single "
        "file (BFL `flux2-dev.safetensors`, ComfyUI `flux2_dev_fp8mixed.safetensors`; fused "
        "`img_attn.qkv`, `single_blocks.N.linear1`) or diffusers folder; `vae`: FLUX.2 VAE "
        "(`ae.safetensors` / `flux2-vae.safetensors`, LDM layout + `encoder.quant_conv`, `bn.*`; or "
        "diffusers `vae/`); `text_encoder`: Mistral-Small 3.x 24B (the diffusers folder's "
        "`text_encoder/`, or a single file with the language model as `model.language_model.*`, "
        "`language_model.model.*` or `model.*`; only the language model is loaded) + `tokenizer`. Control "
        "images (0-10 per item) are reference images"
    ),
    save_format_loads="ComfyUI; diffusers (its FLUX.2 converter)",
    title="FLUX.2 dev text-to-image and multi-reference editing (Mistral-Small text encoder)",
    family="Flux2Model",
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # attention and MLP linears of both streams in the double blocks (q/k/v together are the original
    # fused `qkv`, so the export can fuse them) and the fused input / output linears of the single
    # blocks (`linear1` / `linear2`, fused in diffusers too). The shared modulations, embedders and the
    # output head are left alone.
    default_targets=(
        DUAL_STREAM_ATTENTION,
        r"transformer_blocks\.\d+\.(ff|ff_context)\.(linear_in|linear_out)",
        r"single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)",
    ),
    tokenizers=hub_tokenizers("black-forest-labs/FLUX.2-dev", "tokenizer"),  # Mistral-Small 3
    hub_repos=(("dev", "black-forest-labs/FLUX.2-dev"),),
    # BFL names in kohya's spelling, with alphas: ComfyUI maps them and diffusers' FLUX.2 loader converts
    # them (its loader for the comfy layout refuses `.alpha` keys)
    save_format="kohya",
    diffusers_loader="Flux2LoraLoaderMixin",
    diffusers_reads={**LOADS_EVERY_LAYOUT, "comfy": ALPHA_LEFT_OVER},
    musubi_trains=True,
    control_images=(0, 10),
    timestep_mode="flux_shift",
    latent_patch=(1, 1),
)


RECORDS = (
    FLUX2,
    # FLUX.2 klein 4B / 9B: the FLUX.2 network, smaller, without the guidance embedding, on Qwen3
    replace(
        FLUX2,
        name="flux2_klein",
        sampling=SamplingDefaults(
            steps=50,
            guidance=4.0,
            shift="flux_shift",
            source="diffusers Flux2KleinPipeline's defaults (50 steps, real CFG 4.0: the undistilled models)",
        ),
        variants=("klein-4b", "klein-9b"),
        checkpoints=(
            "Variants: `klein-4b`, `klein-9b` (no guidance embedding; a dev file is refused naming `flux2`). "
            "`transformer`: BFL `flux-2-klein-4b.safetensors` / `-9b` (same layout as dev) or diffusers "
            "folder; `vae`: as `flux2`; `text_encoder`: Qwen3-4B (klein 4B) or Qwen3-8B (klein 9B), ComfyUI's "
            "single file (`model.*`, `lm_head` unused) or the diffusers `text_encoder/` + `tokenizer`; hidden "
            "states after layers 9, 18, 27"
        ),
        title="FLUX.2 klein 4B / 9B text-to-image and multi-reference editing (Qwen3 text encoder)",
        family="Flux2KleinModel",
        fixture="KLEIN_FIXTURE",
        tokenizers=hub_tokenizers("black-forest-labs/FLUX.2-klein-4B", "tokenizer"),  # Qwen3
        hub_repos=(
            ("4B", "black-forest-labs/FLUX.2-klein-4B"),
            ("9B", "black-forest-labs/FLUX.2-klein-9B"),
        ),
    ),
)
