"""The lumina2 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import DIFFUSERS_ONLY, RELEASE_SIZES, Architecture, SamplingDefaults, hub_tokenizers

LUMINA2 = Architecture(
    name="lumina2",
    sampling=SamplingDefaults(
        steps=30,
        guidance=4.0,
        shift=6.0,
        source="diffusers Lumina2Pipeline's defaults (30 steps, guidance 4.0, CFG renormalised); shift: the "
        "Lumina-Image-2.0 scheduler config's 6",
    ),
    variants=("lumina2",),
    checkpoints=(
        "Variants: `lumina2` (Lumina-Image-2.0, 2.6B; ). `transformer`: Alpha-VLLM's single file "
        "(`consolidated.00-of-01.pth` or its safetensors conversion: `layers.N.attention.qkv`, "
        "`feed_forward.w1/w2/w3`, `adaLN_modulation.1`; its unused `norm_final.weight` is dropped), "
        "ComfyUI's `lumina_2_model_bf16.safetensors` (fp8 too), the transformer part "
        "(`model.diffusion_model.*`) of ComfyUI's all-in-one `lumina_2.safetensors`, or the diffusers "
        "folder (`Alpha-VLLM/Lumina-Image-2.0`); `vae`: the FLUX.1 VAE (`ae.safetensors` or the diffusers "
        "`vae/`); `text_encoder`: Gemma 2 2B (ComfyUI's `gemma_2_2b_fp16.safetensors`, `model.*` keys, or "
        "the diffusers `text_encoder/`) + `tokenizer` (`configs/lumina2/text_encoder/`). Adapters: `auto` "
        '= `comfy` (ComfyUI); diffusers\' Lumina 2 loader reads `save.format = "diffusers"` only'
    ),
    save_format_loads='ComfyUI; diffusers needs `save.format = "diffusers"` (its converter fixes the 2.6B sizes)',
    title="Lumina Image 2.0 text-to-image (Gemma 2 text encoder)",
    family="Lumina2Model",
    block_lists=("noise_refiner", "context_refiner", "layers"),
    # attention (q/k/v, which the release fuses into `qkv`, and the output) and the SwiGLU MLP of every
    # block, refiners included; modulations, norms, embedders and the output layer are left alone
    default_targets=(
        r"(noise_refiner|context_refiner|layers)\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0)",
        r"(noise_refiner|context_refiner|layers)\.\d+\.feed_forward\.linear_[123]",
    ),
    tokenizers=hub_tokenizers("Alpha-VLLM/Lumina-Image-2.0", "tokenizer"),  # Gemma 2
    hub_repos=(("", "Alpha-VLLM/Lumina-Image-2.0"),),
    save_format="comfy",  # Alpha-VLLM's names with the fused qkv: ComfyUI's key map
    diffusers_loader="Lumina2LoraLoaderMixin",
    diffusers_reads={**DIFFUSERS_ONLY, "comfy": RELEASE_SIZES, "comfy_folded": RELEASE_SIZES},
    dora_refused=(
        "ComfyUI's Lumina 2 model keeps q, k and v in one linear (layers.N.attention.qkv) and maps diffusers' "
        "names onto its rows only as Z-Image spells them (attention.to_q, in equal thirds), not Lumina 2's "
        "attn.to_q with its smaller k and v; a column-wise DoRA of q, k or v alone has no fused form and is "
        "written under that name, which it would not load"
    ),
    latent_patch=(2, 2),
)


RECORDS = (LUMINA2,)
