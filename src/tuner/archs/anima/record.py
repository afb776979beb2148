"""The anima family's architecture record (`tuner.archs.record`): Anima, Cosmos-Predict2-2B's DiT with a
Qwen3-0.6B text encoder bridged by an LLM adapter."""

from __future__ import annotations

from tuner.archs.record import FEED_FORWARD, SELF_AND_CROSS_ATTENTION, Architecture, SamplingDefaults, comfy

ANIMA = Architecture(
    name="anima",
    sampling=SamplingDefaults(
        steps=30,
        guidance=4.0,
        shift=3.0,
        source="Anima's model card (30-50 steps, CFG 4-5) and ComfyUI's supported_models.Anima (constant shift 3)",
    ),
    variants=("2B",),
    checkpoints=(
        "`transformer`: the release's single file (circlestone-labs/Anima `anima-preview.safetensors` and its "
        "later files: NVIDIA's Cosmos-Predict2 names plus the LLM adapter `llm_adapter.*`; with or without "
        "`net.` / `model.diffusion_model.`, fp8-scaled too); a Cosmos-Predict2 file is refused naming "
        "`cosmos_predict2`. `vae`: the Qwen-Image VAE (`qwen_image_vae.safetensors` or a diffusers `vae/`); "
        "`text_encoder`: Qwen3-0.6B-Base (`qwen_3_06b_base.safetensors` + `tokenizer`, or a transformers folder); "
        "`tokenizer_2`: the T5 tokenizer of the adapter's ids (the `tokenizer/` of "
        "nvidia/Cosmos-Predict2-2B-Text2Image). Image datasets only"
    ),
    save_format_loads="ComfyUI; diffusers has no Anima pipeline",
    title="Anima text-to-image (2B; Cosmos-Predict2 DiT, Qwen3-0.6B through an LLM adapter)",
    family="AnimaModel",
    block_lists=("transformer_blocks",),
    # the DiT blocks' attention and MLP, and every linear layer of the LLM adapter's blocks (diffusion-pipe's
    # LoRA targets its `LLMAdapterTransformerBlock`s too); modulation, embedders and heads are left alone
    default_targets=(
        SELF_AND_CROSS_ATTENTION,
        FEED_FORWARD,
        r"llm_adapter\.blocks\.\d+\.(self_attn|cross_attn)\.(q_proj|k_proj|v_proj|o_proj)",
        r"llm_adapter\.blocks\.\d+\.mlp\.(0|2)",
    ),
    tokenizers=(
        # Qwen3's tokenizer is one for every size; Z-Image's folder holds it (Qwen3-0.6B-Base has it at its root)
        ("tokenizer", "Tongyi-MAI/Z-Image-Turbo:tokenizer"),
        ("tokenizer_2", "nvidia/Cosmos-Predict2-2B-Text2Image:tokenizer"),  # T5-11B's
    ),
    comfy_files=(
        (
            "2B",
            comfy(
                "circlestone-labs/Anima",
                transformer="diffusion_models/anima-preview.safetensors",
                vae="vae/qwen_image_vae.safetensors",
                text_encoder="text_encoders/qwen_3_06b_base.safetensors",
            ),
        ),
    ),
    # the release's names under `diffusion_model.` (`diffusion_model.llm_adapter.blocks.0.self_attn.q_proj`),
    # as diffusion-pipe saves Anima adapters and ComfyUI's key map reads them
    save_format="comfy",
    timestep_mode="logit_normal",
)

RECORDS = (ANIMA,)
