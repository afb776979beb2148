"""The minimax_h3 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import LOADS_EVERY_LAYOUT, Architecture, SamplingDefaults, hub_tokenizers

MINIMAX_H3 = Architecture(
    pipeline_refused=(
        "its loss covers two streams, video and sound (tuner.archs.parts.audio), where pipeline stages "
        "compute the loss of one prediction"
    ),
    name="minimax_h3",
    sampling=SamplingDefaults(
        steps=50,
        guidance=1.0,
        shift=12.0,
        source=(
            "diffusers MiniMaxH3ModularPipeline: guidance-distilled (no guidance: one pass per step), video "
            "shift 12 and audio shift 3 over one grid (MiniMaxH3SetTimestepsStep), 50 steps (the "
            "modular `num_inference_steps` template's default)"
        ),
    ),
    variants=("h3",),
    checkpoints=(
        "Variants: `h3` (MiniMax H3, 33B: 50 blocks of width 5376; config from diffusers' class defaults), "
        "`tiny`. `transformer`: the release's diffusers folder (`MiniMaxAI/MiniMax-H3`, `transformer/`) or "
        "a single file in the reference code's names (ComfyUI's `Comfy-Org/MiniMax-H3`: `blocks.N.attn."
        "qkv_proj` with q, k, v stacked, `mlp.fc1` gate first, `final_layer.*`; `diffusion_model.` prefix "
        "optional; fp8 too; the `*_pruned_*` files, whose `adaln_t_table` replaces the timestep MLP, are "
        "refused by shape); `vae`: the diffusers folder (`vae/`, with `audio_vae/` beside it); "
        "`text_encoder`: Qwen3-VL-32B (`text_encoder/` + `tokenizer/`, or a Hugging Face Qwen3-VL file "
        "+ `tokenizer`), `hidden_states[50]`. t2va only (no keyframe or reference conditions). Adapters: "
        "`comfy` (the release's names under `diffusion_model.`); `mlp.fc1` is not targeted (its halves "
        "are swapped relative to diffusers')"
    ),
    save_format_loads="ComfyUI; diffusers (`MiniMaxH3LoraLoaderMixin` converts the release's names)",
    title="MiniMax H3 text-to-video with sound (33B; text, video and audio rows in one sequence)",
    family="MiniMaxH3Model",
    block_lists=("transformer_blocks",),
    # q/k/v/out of the blocks' attention (the release's fused qkv_proj) and the feed-forward's output;
    # the refiner, the embedders, the modulation and the heads are left alone
    default_targets=(
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0)",
        r"transformer_blocks\.\d+\.ff\.net\.2",
    ),
    save_format="comfy",
    diffusers_loader="MiniMaxH3LoraLoaderMixin",
    diffusers_reads=LOADS_EVERY_LAYOUT,
    tokenizers=hub_tokenizers("MiniMaxAI/MiniMax-H3", "tokenizer"),  # Qwen3-VL's
    hub_repos=(("h3", "MiniMaxAI/MiniMax-H3"),),
    spatial_step=32,
    frame_multiple=17,
    frame_remainder=5,
    min_frames=5,
    model_fps=24.0,
    supports_video=True,
    supports_images=False,
    latent_patch=(1, 2, 2),
    audio_format=(32000, 2),
    sound_stream="sound:MiniMaxH3Sound",
    dora_refused=(
        "MiniMax H3 keeps q, k and v in one linear (blocks.N.attn.qkv_proj) and ComfyUI maps adapter names "
        "onto it in the release's spelling only; a column-wise DoRA of q, k or v alone has no fused form and "
        "would be written under its diffusers name, which ComfyUI would not load"
    ),
)


RECORDS = (MINIMAX_H3,)
