"""The flux family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from dataclasses import replace

from tuner.archs.record import (
    DUAL_STREAM_ATTENTION,
    DUAL_STREAM_FEED_FORWARD,
    LOADS_EVERY_LAYOUT,
    SINGLE_STREAM,
    Architecture,
    ReferencePipeline,
    SamplingDefaults,
    hub_tokenizers,
)

FLUX = Architecture(
    name="flux",
    sampling=SamplingDefaults(
        steps=28,
        guidance=1.0,
        embedded_guidance=3.5,
        shift="flux_shift",
        source="diffusers FluxPipeline's defaults (28 steps, `guidance_scale` 3.5 into the guidance embedding, "
        "`true_cfg_scale` 1) and its scheduler's resolution-dependent μ",
    ),
    variants=("dev",),
    checkpoints=(
        "`transformer`: BFL's `flux1-dev.safetensors` or ComfyUI's single files (BFL names: fused "
        "`img_attn.qkv`, `linear1`; `model.diffusion_model.` optional; scaled fp8 too) or the diffusers "
        "folder (`black-forest-labs/FLUX.1-dev`); `vae`: BFL's `ae.safetensors` (LDM layout) or `vae/`; "
        "`text_encoder`: CLIP-L (ComfyUI's `clip_l.safetensors` + `tokenizer`, or `text_encoder/`); "
        "`text_encoder_2`: T5-XXL (ComfyUI's `t5xxl_*.safetensors` + `tokenizer_2`, or `text_encoder_2/`)"
    ),
    save_format_loads="ComfyUI; diffusers (its FLUX.1 converter)",
    title="FLUX.1 dev text-to-image",
    family="FluxModel",
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # the attention and MLP linears of both streams in the double blocks, and q/k/v, MLP input and
    # output of the single blocks: together the original fused `qkv` and `linear1` layers, so the export
    # can fuse them. Modulations, norms and embedders are left alone.
    default_targets=(DUAL_STREAM_ATTENTION, DUAL_STREAM_FEED_FORWARD, SINGLE_STREAM),
    # FLUX.1-schnell's (the same CLIP-L and T5-XXL tokenizers as dev's, in a repository that is not gated)
    tokenizers=hub_tokenizers("black-forest-labs/FLUX.1-schnell", "tokenizer", "tokenizer_2"),
    hub_repos=(("dev", "black-forest-labs/FLUX.1-dev"),),
    # BFL names in kohya's spelling: ComfyUI maps them, and diffusers converts them (its loader ignores
    # the comfy layout's `diffusion_model.` FLUX names with only a warning)
    save_format="kohya",
    pipeline=ReferencePipeline("FluxPipeline"),
    diffusers_loader="FluxLoraLoaderMixin",
    # kohya: its FLUX.1 converter, at the release's width (test_diffusers_interop.py)
    diffusers_reads={**LOADS_EVERY_LAYOUT, "comfy": "ignores", "comfy_folded": "ignores"},
    musubi_trains=True,
    timestep_mode="flux_shift",
    latent_patch=(2, 2),
)


RECORDS = (
    FLUX,
    # FLUX.1 Kontext: the dev network given a reference image; same module names
    replace(
        FLUX,
        name="flux_kontext",
        pipeline=None,  # FLUX.1's is not its pipeline
        sampling=SamplingDefaults(
            steps=28,
            guidance=1.0,
            embedded_guidance=3.5,
            shift="flux_shift",
            source="diffusers FluxKontextPipeline's defaults (28 steps, embedded guidance 3.5, `true_cfg_scale` 1)",
        ),
        variants=("dev",),
        checkpoints=(
            "as `flux`, with the Kontext transformer (`flux1-kontext-dev.safetensors`, the same network: the "
            "config's architecture says which it is). Image datasets with one control image (the reference) "
            "per item"
        ),
        hub_repos=(("dev", "black-forest-labs/FLUX.1-Kontext-dev"),),
        title="FLUX.1 Kontext dev image editing (one reference image)",
        family="FluxKontextModel",
        fixture="KONTEXT_FIXTURE",
        control_images=(1, 1),
    ),
)
