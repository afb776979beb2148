"""The hidream_o1 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import Architecture, SamplingDefaults

_RELEASE = "HiDream-ai/HiDream-O1-Image"
_COMFY = "Comfy-Org/HiDream-O1-Image/checkpoints"  # no `split_files/` in this repository
_LAYERS = r"language_model\.layers\.\d+"

HIDREAM_O1 = Architecture(
    name="hidream_o1",
    sampling=(
        SamplingDefaults(
            steps=50,
            guidance=5.0,
            shift=3.0,
            source="the release's inference defaults as musubi-tuner's `select_inference_schedule` holds them "
            "(full: 50 steps, guidance 5, shift 3; dev: 28 steps without guidance, shift 1); tuner samples "
            "both with Euler steps (the release: UniPC / its flash Euler on 28 fixed timesteps)",
        ).named(r"dev", steps=28, guidance=1.0, shift=1.0)
    ),
    variants=("full", "dev"),
    checkpoints=(
        "Variants: `full`, `dev` (one network: Qwen3-VL-8B denoising 32x32 pixel patches; `dev` in the file or "
        "folder name picks dev's noise scale and sampling defaults). `transformer`: ComfyUI's "
        "`hidream_o1_image_bf16.safetensors` / `hidream_o1_image_dev_bf16.safetensors` (bare names: "
        "`language_model.layers.0.self_attn.q_proj`, `visual.*`, `t_embedder1`, `x_embedder`, `final_layer2`; "
        "fp8 too) or the release's folder (`HiDream-ai/HiDream-O1-Image`, the same names behind `model.`); "
        "`text_encoder`: the same checkpoint (the network embeds the prompt's tokens itself); `tokenizer`: "
        "the release's (Qwen3-VL's with `<|boi_token|>`, `<|tms_token|>`); no `vae` (pixel space)"
    ),
    save_format_loads="ComfyUI (its HiDream-O1 model's names are the release's; unconfirmed offline)",
    title="HiDream-O1-Image text-to-image (full, dev; pixel-space Qwen3-VL-8B, no VAE)",
    family="HiDreamO1Model",
    layout="loaders:HIDREAM_O1_LAYOUT",
    block_lists=("language_model.layers",),
    # the decoder's attention and MLP, and the pixel input and output (musubi-tuner's t2i targets); the
    # vision tower, the timestep embedder and the token embedding are left alone
    default_targets=(
        _LAYERS + r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)",
        _LAYERS + r"\.mlp\.(gate_proj|up_proj|down_proj)",
        r"x_embedder\.(proj1|proj2)",
        r"final_layer2\.linear",
    ),
    spatial_step=32,
    latent_patch=(1, 32, 32),
    latent_encoders=(),
    latent_space="pixels",
    tokenizers=(("tokenizer", _RELEASE),),  # Qwen3-VL's with HiDream's two tokens, at the repository's root
    hub_repos=(("full", _RELEASE), ("dev", "HiDream-ai/HiDream-O1-Image-Dev")),
    comfy_files=tuple(
        (variant, (("transformer", f"{_COMFY}/{file}"), ("text_encoder", f"{_COMFY}/{file}")))
        for variant, file in (
            ("full", "hidream_o1_image_bf16.safetensors"),
            ("dev", "hidream_o1_image_dev_bf16.safetensors"),
        )
    ),
    # the release's names under `diffusion_model.`, with `.alpha` keys (ComfyUI's key map)
    save_format="comfy",
    timestep_mode="uniform",
    # the network predicts the clean picture, from noise 8x (dev: 7.5x, clipped at 2.5 std) the unit normal's
    flow_prediction="x0",
    noise_scales=((r"dev", 7.5, 2.5), (r"", 8.0, 0.0)),
)


RECORDS = (HIDREAM_O1,)
