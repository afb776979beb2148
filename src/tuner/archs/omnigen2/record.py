"""The omnigen2 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import Architecture, SamplingDefaults, comfy

OMNIGEN2 = Architecture(
    name="omnigen2",
    sampling=SamplingDefaults(
        steps=28,
        guidance=4.0,
        shift=3.2,
        source="OmniGen2Pipeline's defaults (28 steps, `text_guidance_scale` 4.0, empty negative prompt); shift: "
        "its scheduler's dynamic time shift m = √(latent pixels) / 40 (τ' = τ / (m − m·τ + τ), the flow shift "
        "s = m in tuner's time) at 1024×1024, where m = 3.2 (it grows with the image; tuner samples every size "
        "at 3.2)",
    ),
    variants=("omnigen2",),
    checkpoints=(
        "Variants: `omnigen2` (OmniGen2, 4B; text-to-image: reference images are not trained). `transformer`: "
        "ComfyUI's `omnigen2_fp16.safetensors` (the release's keys; `model.diffusion_model.` optional, fp8 too) "
        "or the release's folder (`OmniGen2/OmniGen2`, `transformer/`); `vae`: the FLUX.1 VAE (`ae.safetensors` "
        "or `vae/`); `text_encoder`: Qwen2.5-VL-3B (ComfyUI's `qwen_2.5_vl_fp16.safetensors` + `tokenizer`, or "
        "the release's `mllm/` with `processor/`, given as the pipeline folder). Adapters: `auto` = `comfy` "
        "(ComfyUI's generic "
        "`diffusion_model.` names); diffusers has no OmniGen2 pipeline"
    ),
    save_format_loads="ComfyUI; diffusers has no OmniGen2 pipeline",
    title="OmniGen2 text-to-image (Qwen2.5-VL-3B text encoder)",
    family="OmniGen2Model",
    block_lists=("context_refiner", "noise_refiner", "ref_image_refiner", "layers"),
    # attention and SwiGLU MLP of the blocks text-to-image runs (refiners included); the reference-image
    # refiner, modulations, norms, embedders and the output layer are left alone
    default_targets=(
        r"(noise_refiner|context_refiner|layers)\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0)",
        r"(noise_refiner|context_refiner|layers)\.\d+\.feed_forward\.linear_[123]",
    ),
    tokenizers=(("tokenizer", "OmniGen2/OmniGen2:processor"),),  # Qwen2.5-VL's, in the release's processor/
    hub_repos=(("", "OmniGen2/OmniGen2"),),
    hub_folders=(("text_encoder", "mllm"),),  # its tokenizer is then found in the sibling processor/
    comfy_files=(
        (
            "",
            comfy(
                "Comfy-Org/Omnigen2_ComfyUI_repackaged",
                transformer="diffusion_models/omnigen2_fp16.safetensors",
                text_encoder="text_encoders/qwen_2.5_vl_fp16.safetensors",
            )
            + comfy("Comfy-Org/Lumina_Image_2.0_Repackaged", vae="vae/ae.safetensors"),
        ),
    ),  # fmt: skip
    save_format="comfy",  # the release's names are the model's; ComfyUI reads diffusion_model.<name>
    latent_patch=(2, 2),
)


RECORDS = (OMNIGEN2,)
