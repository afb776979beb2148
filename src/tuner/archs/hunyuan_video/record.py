"""The hunyuan_video family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import (
    ALPHA_CHUNKED,
    DUAL_STREAM_ATTENTION,
    DUAL_STREAM_FEED_FORWARD,
    RELEASE_SIZES,
    SINGLE_STREAM,
    Architecture,
    SamplingDefaults,
    comfy,
    hub_tokenizers,
)

# cfg-distilled: `model.guidance` feeds the embedded guidance × 1000 while training, as the release's own
# sampler and diffusion-pipe do (musubi-tuner's training passes it raw); why: the trainer's docstring.
HUNYUAN_VIDEO = Architecture(
    name="hunyuan_video",
    sampling=SamplingDefaults(
        steps=50,
        guidance=1.0,
        embedded_guidance=6.0,
        shift=7.0,
        source="diffusers HunyuanVideoPipeline's defaults (50 steps, embedded guidance 6.0, `true_cfg_scale` "
        "1); shift: the release's `flow_shift` 7 (its scheduler config)",
    ),
    variants=("720p",),
    checkpoints=(
        "Variants: `720p` (the 13B cfg-distilled T2V network; ). `transformer`: Tencent's / ComfyUI's "
        "single file (`hunyuan_video_720_cfgdistill_bf16.safetensors`, "
        "`hunyuan_video_t2v_720p_bf16.safetensors`; fused `img_attn_qkv` / `txt_attn_qkv` / `linear1` / "
        "refiner `self_attn_qkv`, fp8 too) or the diffusers folder "
        "(`hunyuanvideo-community/HunyuanVideo`); `vae`: ComfyUI's `hunyuan_video_vae_bf16.safetensors` "
        "(diffusers names) or `vae/`; `text_encoder`: LLaVA-LLaMA-3-8B's language model, ComfyUI's "
        "`llava_llama3_fp16` / `_fp8_scaled.safetensors` (`model.*`, `lm_head` unused) or `text_encoder/` "
        "(+ `tokenizer`); `text_encoder_2`: CLIP-L as FLUX.1's (+ `tokenizer_2`). A HunyuanVideo 1.5 file "
        "is refused naming `hunyuan_video15`. Adapters save as comfy (ComfyUI); diffusers' loader needs "
        '`save.format = "diffusers"` (its converter cannot read `.alpha` keys of fused layers)'
    ),
    save_format_loads=(
        'ComfyUI; diffusers needs `save.format = "diffusers"` (its converter cannot read the fused '
        "layers' `.alpha`); musubi-tuner needs `save.format = \"musubi\"` (the release's `img_mlp_fc1`)"
    ),
    title="HunyuanVideo text-to-video (13B, cfg-distilled 720p T2V)",
    family="HunyuanVideoModel",
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # as FLUX.1: the attention and MLP linears of both streams in the double blocks, and q/k/v, MLP
    # input and output of the single blocks, so the export can fuse `img_attn_qkv`, `txt_attn_qkv` and
    # `linear1`. Modulations, norms, the text token refiner and the embedders are left alone.
    default_targets=(DUAL_STREAM_ATTENTION, DUAL_STREAM_FEED_FORWARD, SINGLE_STREAM),
    # LLaVA-Llama-3 and CLIP-L
    tokenizers=hub_tokenizers("hunyuanvideo-community/HunyuanVideo", "tokenizer", "tokenizer_2"),
    hub_repos=(("", "hunyuanvideo-community/HunyuanVideo"),),
    comfy_files=(
        (
            "",
            comfy(
                "Comfy-Org/HunyuanVideo_repackaged",
                transformer="diffusion_models/hunyuan_video_t2v_720p_bf16.safetensors",
                vae="vae/hunyuan_video_vae_bf16.safetensors",
                text_encoder="text_encoders/llava_llama3_fp16.safetensors",
                text_encoder_2="text_encoders/clip_l.safetensors",
            ),
        ),
    ),  # fmt: skip
    # Tencent names (fused qkv / linear1) under `diffusion_model.`: ComfyUI's key map, and diffusers'
    # HunyuanVideo loader converts them
    save_format="comfy",
    diffusers_loader="HunyuanVideoLoraLoaderMixin",
    diffusers_reads={
        "comfy": ALPHA_CHUNKED,
        "comfy_folded": RELEASE_SIZES,
        "kohya": ALPHA_CHUNKED,
        "musubi": ALPHA_CHUNKED,
        "diffusers": "loads",
    },
    musubi_trains=True,
    # ComfyUI's `HunyuanVideo` key map (FramePack's too) names Tencent's modules only (comfy/lora.py)
    dora_refused=(
        "ComfyUI's HunyuanVideo model keeps q, k and v in one linear (img_attn.qkv / txt_attn.qkv, the single "
        "blocks' linear1, the refiner's self_attn_qkv) and maps adapter names onto it in Tencent's spelling "
        "only; a column-wise DoRA of q, k or v alone has no fused form and is written under its diffusers "
        "name (transformer.transformer_blocks.N.attn.to_q), which it would not load"
    ),
    frame_multiple=4,
    frame_remainder=1,
    model_fps=24.0,
    supports_video=True,
)


RECORDS = (HUNYUAN_VIDEO,)
