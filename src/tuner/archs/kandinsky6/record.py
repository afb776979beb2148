"""The kandinsky6 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.kandinsky5.record import KANDINSKY5_NEGATIVE_PROMPT
from tuner.archs.record import Architecture, SamplingDefaults, hub_tokenizers

SAMPLE_SHIFT = 10.0
"""Kandinsky 5's flow shift: the Kandinsky 6 release's scheduler config could not be read offline."""
NEGATIVE_PROMPT = KANDINSKY5_NEGATIVE_PROMPT
"""Kandinsky6TI2VAPipeline's `_DEFAULT_NEGATIVE_PROMPT` (Kandinsky 5's, word for word; a test compares)."""

KANDINSKY6 = Architecture(
    pipeline_refused=(
        "its loss covers two streams, video and sound (tuner.archs.parts.audio), where pipeline stages "
        "compute the loss of one prediction"
    ),
    name="kandinsky6",
    sampling=SamplingDefaults(
        steps=50,
        guidance=5.0,
        shift=SAMPLE_SHIFT,
        negative_prompt=NEGATIVE_PROMPT,
        source=(
            "diffusers Kandinsky6TI2VAPipeline's defaults (50 steps, guidance 5.0, its negative prompt); shift "
            "10 is Kandinsky 5's (the Kandinsky 6 scheduler config was not readable offline)"
        ),
    ).named(r"distill", steps=16, guidance=1.0),
    variants=("pro",),
    checkpoints=(
        "Variants: `pro` (Kandinsky 6.0 Pro: 60 fused video/audio blocks, video width 4096, audio 2048, 40 "
        "audio channels: the released dimensions ComfyUI's Kandinsky 6 detection names), `tiny`. `transformer`: "
        "the diffusers folder (`transformer/`) or a single file in the release's names (`visual_blocks.N.videoT`"
        " / `audioT`, `feed_forward.in_layer`, `audio_outLayer`; ComfyUI's) or diffusers' "
        "(`diffusion_model.` optional, fp8 too); `vae`: the HunyuanVideo VAE (as `kandinsky5`), with the "
        "diffusers `audio_vae/` (MMAudioVAE) and `vocoder/` (MMAudioVocoder) beside it (the pipeline folder, its "
        "`vae/`, or a VAE file in a folder holding both); `text_encoder` / `text_encoder_2`: Qwen2.5-VL-7B and "
        "CLIP-L as `kandinsky5` (crop 129). Text to video with sound only (no reference image); the distilled "
        "releases' PiflowScheduler is not reproduced (Euler at the release's 16 steps). Adapters: `comfy` (the "
        "release's names under `diffusion_model.`); `diffusers` (`transformer.` + PEFT names) is what "
        "`Kandinsky6Transformer3DModel.load_lora_adapter` reads (the pipeline has no LoRA loader)"
    ),
    save_format_loads='ComfyUI; diffusers needs `save.format = "diffusers"` (`transformer.load_lora_adapter`)',
    title="Kandinsky 6.0 text-to-video with sound (fused video and audio blocks, MMAudio sound)",
    family="Kandinsky6Model",
    block_lists=(
        "video_text_transformer_blocks",
        "audio_text_transformer_blocks",
        "visual_transformer_blocks",
    ),
    # attention and feed-forward linears of both streams' decoder blocks, the cross-modal attention and
    # the text blocks; modulations (fp32), embeddings and heads are left alone
    default_targets=(
        r"(video|audio)_text_transformer_blocks\.\d+\.(attn\.(to_query|to_key|to_value|out_layer)|"
        r"feed_forward\.net\.(0\.proj|2))",
        r"visual_transformer_blocks\.\d+\.(video|audio)_dec_block\.((self|cross)_attention\."
        r"(to_query|to_key|to_value|out_layer)|feed_forward\.net\.(0\.proj|2))",
        r"visual_transformer_blocks\.\d+\.(va|av)_cross_attention\.(to_query|to_key|to_value|out_layer)",
    ),
    save_format="comfy",
    tokenizers=hub_tokenizers(
        "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers", "tokenizer", "tokenizer_2"
    ),
    hub_repos=(("pro", "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers"),),
    frame_multiple=4,
    frame_remainder=1,
    model_fps=24.0,
    supports_video=True,
    supports_images=False,
    audio_format=(44100, 1),
    sound_stream="sound:Kandinsky6Sound",
)


RECORDS = (KANDINSKY6,)
