"""The ernie_image family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import CONVERTS_FOLDED, Architecture, SamplingDefaults, hub_tokenizers

_COMFY = "Comfy-Org/ERNIE-Image"  # no `split_files/` in this repository

ERNIE_IMAGE = Architecture(
    name="ernie_image",
    sampling=(
        SamplingDefaults(
            steps=50,
            guidance=4.0,
            shift=3.0,
            source="diffusers ErnieImagePipeline's defaults (50 steps, guidance 4.0); shift: ComfyUI's "
            "`ErnieImage` sampling settings (comfy/supported_models.py); Turbo: few steps without guidance",
        ).named(r"turbo", steps=8, guidance=1.0)
    ),
    variants=("ernie-image",),
    checkpoints=(
        "Variants: `ernie-image` (ERNIE-Image and ERNIE-Image-Turbo are one network; `turbo` in the file or "
        "folder name says Turbo, and training it warns). `transformer`: ComfyUI's `ernie-image.safetensors` / "
        "`ernie-image-turbo.safetensors` (the release's names are diffusers': `layers.0.self_attention.to_q`, "
        "`adaLN_modulation.1`; `model.diffusion_model.` optional, fp8 too) or the diffusers folder "
        "(`baidu/ERNIE-Image`); `vae`: FLUX.2's (`flux2-vae.safetensors` or `vae/`); `text_encoder`: "
        "Ministral 3 3B (`ministral-3-3b.safetensors` + `tokenizer`, or `text_encoder/`), second-to-last "
        "hidden states"
    ),
    save_format_loads=(
        "ComfyUI; diffusers (its ERNIE-Image loader reads `diffusion_model.` names without `.alpha` keys)"
    ),
    title="ERNIE-Image text-to-image (base, Turbo; 8B single-stream DiT, Ministral 3 3B)",
    family="ErnieImageModel",
    training_warning="trainer:turbo_warning",
    layout="loaders:ERNIE_IMAGE_LAYOUT",
    block_lists=("layers",),
    # q/k/v/out and the gated MLP of every block; the shared modulation, embedders and output head are
    # left alone
    default_targets=(
        r"layers\.\d+\.self_attention\.(to_q|to_k|to_v|to_out\.0)",
        r"layers\.\d+\.mlp\.(gate_proj|up_proj|linear_fc2)",
    ),
    tokenizers=hub_tokenizers("baidu/ERNIE-Image", "tokenizer"),  # Ministral 3's
    hub_repos=(("base", "baidu/ERNIE-Image"), ("turbo", "baidu/ERNIE-Image-Turbo")),
    comfy_files=tuple(
        (
            variant,
            (
                ("transformer", f"{_COMFY}/diffusion_models/{file}"),
                ("vae", f"{_COMFY}/vae/flux2-vae.safetensors"),
                ("text_encoder", f"{_COMFY}/text_encoders/ministral-3-3b.safetensors"),
            ),
        )
        for variant, file in (("base", "ernie-image.safetensors"), ("turbo", "ernie-image-turbo.safetensors"))
    ),
    # the release's (= diffusers') names under `diffusion_model.`, no `.alpha` keys: ComfyUI maps them, and
    # diffusers' ErnieImageLoraLoaderMixin renames `diffusion_model.` to `transformer.` (it refuses
    # `.alpha` keys: its check wants 'lora' in every key)
    save_format="comfy_folded",
    diffusers_loader="ErnieImageLoraLoaderMixin",
    diffusers_reads=CONVERTS_FOLDED,
    timestep_mode="shift",
    latent_patch=(1, 1),
)


RECORDS = (ERNIE_IMAGE,)
