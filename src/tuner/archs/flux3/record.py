"""The flux3 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import CONVERTS_FOLDED, Architecture, SamplingDefaults, hub_tokenizers

_REPO = "black-forest-labs/flux-3-image-klein-base"  # diffusers' single-file config repository for FLUX.3
_BLOCKS = r"(mode_blocks\.(image|image_cond)|txt_mode_blocks|single_transformer_blocks)\.\d+"

FLUX3 = Architecture(
    pipeline_refused="its per-mode and joint blocks have not been cut into stages yet",
    name="flux3",
    sampling=SamplingDefaults(
        steps=50,
        guidance=3.5,
        shift=6.93,
        source="diffusers' modular FLUX.3 pipeline (Flux3SetTimestepsStep: 50 steps, the constant shift 6.93 "
        "on linear sigmas; Flux3LoopDenoiser: ClassifierFreeGuidance 3.5, negative prompt '')",
    ),
    variants=("klein-base",),
    checkpoints=(
        "Variants: `klein-base` (a step-distilled flow-map file, with `ref_time_in`, is refused). `transformer`: "
        "BFL's single file (`content_mode_blocks.image.0.q_proj`, `single_blocks.0.mlp_in`, "
        "`early_stream_modulations.image.lin`; `model.diffusion_model.` optional), the same network in "
        "diffusers' keys, or the diffusers folder; `vae`: FLUX.2's (`flux2-vae.safetensors` or `vae/`); "
        "`text_encoder`: Qwen3-VL-4B (a Hugging Face single file with `model.language_model.*` + "
        "`tokenizer`, or `text_encoder/`), hidden states after layers 4, 8, ..., 32 over an 80-token window. Control images (0-10 per item) are reference images"
    ),
    save_format_loads="diffusers (its FLUX.3 converter reads the release's names under `diffusion_model.`)",
    title="FLUX.3 klein text-to-image (per-mode + joint single-stream DiT, Qwen3-VL-4B)",
    family="Flux3Model",
    block_lists=("txt_mode_blocks", "mode_blocks.image", "single_transformer_blocks"),
    # q/k/v/out and the fused SwiGLU MLP of every block (each mode's and the joint ones); the
    # modulations, embedders and the output head are left alone
    default_targets=(
        _BLOCKS + r"\.attn\.(to_q|to_k|to_v|to_out\.0)",
        _BLOCKS + r"\.ff\.(linear_in|linear_out)",
    ),
    tokenizers=hub_tokenizers(_REPO, "tokenizer"),  # Qwen3-VL's
    hub_repos=(("klein-base", _REPO),),
    # the release's names under `diffusion_model.`, no `.alpha` keys: diffusers' Flux3LoraLoaderMixin
    # converts them (no ComfyUI support for FLUX.3 was found)
    save_format="comfy_folded",
    diffusers_loader="Flux3LoraLoaderMixin",
    diffusers_reads=CONVERTS_FOLDED,
    control_images=(0, 10),  # the pipeline's image-conditioned workflow takes at most 10 references
    timestep_mode="shift",
    latent_patch=(1, 1),
)


RECORDS = (FLUX3,)
