"""The chroma family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from dataclasses import replace

from tuner.archs.flux.record import FLUX
from tuner.archs.record import SamplingDefaults

RECORDS = (
    # Chroma: FLUX.1-schnell with T5 only and a guidance approximator in place of the modulation
    # linears; the release keeps FLUX.1's names, fused layers and adapter targets
    replace(
        FLUX,
        name="chroma",
        sampling=SamplingDefaults(
            steps=35,
            guidance=5.0,
            shift="flux_shift",
            source="diffusers ChromaPipeline's defaults (35 steps, real CFG 5.0; no guidance embedding)",
        ),
        musubi_trains=False,  # musubi-tuner has no Chroma network
        variants=("chroma1",),
        checkpoints=(
            "Variants: `chroma1` (`chroma-unlocked-v*`, Chroma1-Base, Chroma1-HD: one network). "
            "`transformer`: the release's / ComfyUI single file (FLUX.1's BFL names with fused `qkv` / "
            "`linear1`, plus `distilled_guidance_layer.*`; fp8 too) or the diffusers folder "
            "(`ChromaTransformer2DModel`); `vae`: the FLUX.1 VAE (`ae.safetensors` or `vae/`); "
            "`text_encoder`: T5-XXL (ComfyUI's `t5xxl_*.safetensors` + `tokenizer`, or the diffusers root's "
            "`text_encoder/` and `tokenizer/`); no CLIP"
        ),
        save_format_loads="ComfyUI; diffusers (its FLUX.1 converter, at the real width)",
        title="Chroma text-to-image (FLUX.1-schnell based, T5 only)",
        family="ChromaModel",
        tokenizers=(("tokenizer", "black-forest-labs/FLUX.1-schnell:tokenizer_2"),),  # T5-XXL only
        hub_repos=(("HD", "lodestones/Chroma1-HD"),),
    ),
)
