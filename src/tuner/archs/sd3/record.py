"""The sd3 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import Architecture

SD3 = Architecture(
    name="sd3",
    title="Stable Diffusion 3.5 text-to-image (Medium, Large, Large Turbo)",
    family="tuner.archs.sd3.trainer:SD3Model",
    layout="tuner.archs.sd3.keys:SD3_LAYOUT",
    fixture="tuner.archs.sd3.fixture:FIXTURE",
    model_class="SD3Transformer2DModel",
    block_lists=("transformer_blocks",),
    # the attention and MLP linears of both streams (Medium's attn2 too): together the release's fused
    # `qkv` layers, so the export can fuse them. Modulations, embedders and the output head are left alone.
    default_targets=(
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
        r"transformer_blocks\.\d+\.attn2\.(to_q|to_k|to_v|to_out\.0)",
        r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)",
    ),
    configs="sd3",
    tokenizers=(  # CLIP-L, OpenCLIP bigG, T5-XXL
        ("tokenizer", "stabilityai/stable-diffusion-3.5-medium:tokenizer"),
        ("tokenizer_2", "stabilityai/stable-diffusion-3.5-medium:tokenizer_2"),
        ("tokenizer_3", "stabilityai/stable-diffusion-3.5-medium:tokenizer_3"),
    ),
    hub_repos=tuple((v, f"stabilityai/stable-diffusion-3.5-{v}") for v in ("medium", "large", "large-turbo")),
    # the release's names, qkv fused exactly: ComfyUI's key map, and full fine-tunes in the release's file
    # layout. diffusers' SD3 loader reads only its own names (it has no converter): save.format =
    # "diffusers" (or `tuner lora convert --to diffusers`) writes those, which ComfyUI maps as well
    save_format="comfy",
    spatial_step=16,
    latent_patch=(2, 2),
)


RECORDS = (SD3,)
