"""The qwen_image family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from dataclasses import replace

from tuner.archs.record import (
    DUAL_STREAM_ATTENTION,
    LOADS_EVERY_LAYOUT,
    Architecture,
    ReferencePipeline,
    SamplingDefaults,
    comfy,
    hub_tokenizers,
)

QWEN_IMAGE = Architecture(
    name="qwen_image",
    sampling=SamplingDefaults(
        steps=50,
        guidance=4.0,
        shift="qwen_shift",
        shift_terminal=0.02,
        negative_prompt=" ",
        source="diffusers QwenImagePipeline's defaults (50 steps, `true_cfg_scale` 4.0), its scheduler config's "
        '`shift_terminal` 0.02 and the model card\'s negative prompt " " (the pipeline runs no CFG without a '
        "negative prompt)",
    ),
    variants=("qwen-image",),
    checkpoints=(
        "`transformer`: ComfyUI's `qwen_image_bf16.safetensors` (the release's names are diffusers'; "
        "`model.diffusion_model.` optional, fp8 too) or the diffusers folder (`Qwen/Qwen-Image`); `vae`: "
        "ComfyUI's `qwen_image_vae.safetensors` (the Wan 2.1 VAE's key layout) or `vae/`; `text_encoder`: "
        "Qwen2.5-VL-7B (ComfyUI's `qwen_2.5_vl_7b*.safetensors` + `tokenizer`, or `text_encoder/`)"
    ),
    save_format_loads="ComfyUI; diffusers (`load_lora_weights`)",
    title="Qwen-Image text-to-image",
    family="QwenImageModel",
    layout="loaders:QWEN_IMAGE_LAYOUT",
    block_lists=("transformer_blocks",),
    # the attention projections of both streams and both MLPs of every block; the modulation layers
    # (img_mod / txt_mod), the embedders and the output head are left alone
    default_targets=(
        DUAL_STREAM_ATTENTION,
        r"transformer_blocks\.\d+\.(img_mlp|txt_mlp)\.net\.(0\.proj|2)",
    ),
    tokenizers=hub_tokenizers("Qwen/Qwen-Image", "tokenizer"),
    hub_repos=(("", "Qwen/Qwen-Image"),),
    comfy_files=(
        (
            "",
            comfy(
                "Comfy-Org/Qwen-Image_ComfyUI",
                transformer="diffusion_models/qwen_image_bf16.safetensors",
                vae="vae/qwen_image_vae.safetensors",
                text_encoder="text_encoders/qwen_2.5_vl_7b.safetensors",
            ),
        ),
    ),  # fmt: skip
    save_format="comfy",  # the release uses diffusers' module names; both loaders read the comfy layout
    pipeline=ReferencePipeline("QwenImagePipeline"),
    diffusers_loader="QwenImageLoraLoaderMixin",
    diffusers_reads=LOADS_EVERY_LAYOUT,
    musubi_trains=True,
    timestep_mode="qwen_shift",
)


RECORDS = (
    QWEN_IMAGE,
    # Qwen-Image-Edit 2509 / 2511: the same network given one to three control images
    replace(
        QWEN_IMAGE,
        name="qwen_image_edit",
        pipeline=None,  # not checked against its pipeline yet
        sampling=SamplingDefaults(
            steps=40,
            guidance=4.0,
            shift="qwen_shift",
            negative_prompt=" ",
            source='the Qwen-Image-Edit-2509 model card (40 steps, `true_cfg_scale` 4.0, negative prompt " ")',
        ),
        variants=("qwen-image", "qwen-image-edit-2511"),
        checkpoints=(
            "as `qwen_image`, with the Edit transformer (`qwen_image_edit_2509_bf16.safetensors`, ...; "
            "ComfyUI's `__index_timestep_zero__` marker picks the 2511 config). Image datasets with 1-3 "
            "control images per item; the text encoder sees them too"
        ),
        hub_repos=(("2509", "Qwen/Qwen-Image-Edit-2509"), ("2511", "Qwen/Qwen-Image-Edit-2511")),
        comfy_files=(),
        title="Qwen-Image-Edit 2509 / 2511 image editing (1-3 control images)",
        family="QwenImageEditModel",
        fixture="EDIT_FIXTURE",
        control_images=(1, 3),
        text_uses_controls=True,
    ),
    # Qwen-Image 2.1: a new network (single-stream, block-causal), VAE (64 channels, 16x) and text encoder
    # (Qwen3-VL); the family's tooling and the record's shape are what it shares
    replace(
        QWEN_IMAGE,
        name="qwen_image_21",
        dora_refused=(
            "Qwen-Image 2.1 keeps each block's SwiGLU gate and up projections in one linear (img_mlp.gate_up) "
            "and no ComfyUI key map for it is known; a column-wise DoRA of the gate or up part alone has no "
            "fused form and would be written under its diffusers name, which ComfyUI would not be shown to load"
        ),
        pipeline=None,  # QwenImage21Pipeline: tests/test_qwen_image21_models.py checks generate against it
        pipeline_refused="its transformer has not been cut into stages yet",
        sampling=SamplingDefaults(
            steps=40,
            guidance=1.0,
            shift="flux_shift",
            source="diffusers QwenImage21Pipeline's defaults (40 steps, `true_cfg_scale` 1.0: \"meant to be sampled "
            'without guidance"; σ from 1 to 1/steps shifted by μ on its fallback line 256 → 0.5, 4096 → 1.15, '
            "FLUX.1's; the release's scheduler config and `sample_sigmas` could not be read offline)",
        ),
        variants=("qwen-image-2.1",),
        checkpoints=(
            "`transformer`: the release's single file (diffusers' names with each block's SwiGLU gate and up "
            "fused as `img_mlp.gate_up`, `model.diffusion_model.` optional; diffusers' names load too) or the "
            "diffusers folder (`Qwen/Qwen-Image-2.1`); `vae`: `vae/` or its diffusers keys as one file "
            "(64 channels, 16x); `text_encoder`: Qwen3-VL-8B's language model (`text_encoder/`, or the "
            "Hugging Face file + the `processor/` folder as `tokenizer`). Text-to-image; pixel sides "
            "multiples of 32"
        ),
        title="Qwen-Image 2.1 text-to-image (single-stream block-causal DiT, Qwen3-VL)",
        family="QwenImage21Model",
        layout="qwen21:QWEN_IMAGE_21_LAYOUT",
        fixture="FIXTURE_21",
        configs="configs_21",
        # each block's attention projections and its SwiGLU MLP; the shared modulation, the embedders and
        # the output head are left alone
        default_targets=(
            r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0)",
            r"transformer_blocks\.\d+\.img_mlp\.(gate_layer|proj|out)",
        ),
        tokenizers=(("tokenizer", "Qwen/Qwen-Image-2.1:processor"),),
        hub_repos=(("", "Qwen/Qwen-Image-2.1"),),
        comfy_files=(),
        spatial_step=32,
        latent_patch=(1, 1, 1),
        timestep_mode="flux_shift",
        musubi_trains=False,
    ),
)
