"""The kandinsky5 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import DIFFUSERS_ONLY, Architecture, SamplingDefaults, hub_tokenizers

KANDINSKY5_NEGATIVE_PROMPT = (
    "Static, 2D cartoon, cartoon, 2d animation, paintings, images, worst quality, low quality, ugly, deformed, "
    "walking backwards"
)
"""Kandinsky5T2VPipeline's negative prompt when given none (diffusers 0.42.1, pipelines/kandinsky5/)."""

KANDINSKY5 = Architecture(
    name="kandinsky5",
    sampling=(
        SamplingDefaults(
            steps=50,
            guidance=5.0,
            shift=10.0,
            negative_prompt=KANDINSKY5_NEGATIVE_PROMPT,
            source="diffusers Kandinsky5T2VPipeline's defaults (50 steps, guidance 5.0, its negative prompt) and "
            "the release's configs (shift 10; nocfg 50 steps / guidance 1; distilled16steps 16 / 1)",
        )
        .named(r"distill", steps=16, guidance=1.0)
        .named(r"nocfg", guidance=1.0)
    ),
    variants=("lite-5s", "lite-10s"),
    checkpoints=(
        "Variants: `lite-5s`, `lite-10s` (Kandinsky 5.0 Video Lite T2V, 2B: pretrain, sft, nocfg and "
        "distilled16steps share shapes; ). `transformer`: the release's single file "
        "(`kandinsky5lite_t2v_sft_5s.safetensors`, ...; already diffusers-named, so the layout renames "
        "nothing; `model.diffusion_model.` optional, fp8 too) or the diffusers folder "
        "(`ai-forever/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers`). Shapes cannot tell the releases apart: a "
        "`10s` file name picks the NABLA sparse-attention config (a folder's config says it); the release "
        "name sets only generation's recommended steps / guidance (sft, pretrain 50 / 5; nocfg 50 / 1; "
        "distilled16steps 16 / 1; shift 10 for all). I2V files are refused by name; the Lite image model "
        "(FLUX VAE) and the 19B Pro models are not supported. `vae`: the HunyuanVideo VAE (as "
        "`hunyuan_video`); `text_encoder`: Qwen2.5-VL-7B (as `qwen_image`: `qwen_2.5_vl_7b.safetensors` + "
        "`tokenizer`, or `text_encoder/`), last hidden states after the template's 128 tokens; "
        "`text_encoder_2`: CLIP-L pooled (`clip_l.safetensors` + `tokenizer_2`, or `text_encoder_2/`). "
        "Loaders keep the time embedding and modulations fp32 (what makes bf16 work without autocast) and "
        "rotate q/k in fp32 (upstream rounds them to bf16 in any dtype). Adapters: `diffusers` by default (ComfyUI's "
        "Kandinsky 5 key map takes `transformer.<name>` too); diffusers' Kandinsky loader refuses `comfy` files "
        "(their `.alpha` keys)"
    ),
    save_format_loads="ComfyUI (`transformer.<name>`); diffusers (`load_lora_weights`)",
    title="Kandinsky 5.0 Video Lite text-to-video (2B; sft, pretrain, nocfg, distilled, 5 s / 10 s)",
    family="Kandinsky5Model",
    layout="loaders:KANDINSKY5_LAYOUT",
    block_lists=("text_transformer_blocks", "visual_transformer_blocks"),
    # attention (self- and cross-) and feed-forward linears of the visual blocks and the text blocks;
    # modulations (kept in fp32), embeddings and the output layer are left alone
    default_targets=(
        r"(text|visual)_transformer_blocks\.\d+\.self_attention\.(to_query|to_key|to_value|out_layer)",
        r"visual_transformer_blocks\.\d+\.cross_attention\.(to_query|to_key|to_value|out_layer)",
        r"(text|visual)_transformer_blocks\.\d+\.feed_forward\.(in_layer|out_layer)",
    ),
    # the release's names are diffusers' own: `diffusion_model.<name>` is ComfyUI's key map;
    # diffusers' Kandinsky loader reads `save.format = "diffusers"` (`transformer.<name>`)
    # Qwen2.5-VL and CLIP-L
    tokenizers=hub_tokenizers(
        "ai-forever/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers", "tokenizer", "tokenizer_2"
    ),
    hub_repos=tuple(
        (f"lite-{d}", f"ai-forever/Kandinsky-5.0-T2V-Lite-sft-{d}-Diffusers") for d in ("5s", "10s")
    ),
    save_format="diffusers",
    diffusers_loader="KandinskyLoraLoaderMixin",
    diffusers_reads=DIFFUSERS_ONLY,
    musubi_trains=True,
    frame_multiple=4,
    frame_remainder=1,
    model_fps=24.0,
    supports_video=True,
)


RECORDS = (KANDINSKY5,)
