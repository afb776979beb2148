"""The kandinsky5 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import Architecture

KANDINSKY5 = Architecture(
    name="kandinsky5",
    title="Kandinsky 5.0 Video Lite text-to-video (2B; sft, pretrain, nocfg, distilled, 5 s / 10 s)",
    family="tuner.archs.kandinsky5.trainer:Kandinsky5Model",
    layout="tuner.archs.kandinsky5.loaders:KANDINSKY5_LAYOUT",
    fixture="tuner.archs.kandinsky5.fixture:FIXTURE",
    model_class="Kandinsky5Transformer3DModel",
    block_lists=("text_transformer_blocks", "visual_transformer_blocks"),
    # attention (self- and cross-) and feed-forward linears of the visual blocks and the text blocks;
    # modulations (kept in fp32), embeddings and the output layer are left alone
    default_targets=(
        r"(text|visual)_transformer_blocks\.\d+\.self_attention\.(to_query|to_key|to_value|out_layer)",
        r"visual_transformer_blocks\.\d+\.cross_attention\.(to_query|to_key|to_value|out_layer)",
        r"(text|visual)_transformer_blocks\.\d+\.feed_forward\.(in_layer|out_layer)",
    ),
    configs="kandinsky5",
    # the release's names are diffusers' own: `diffusion_model.<name>` is ComfyUI's key map;
    # diffusers' Kandinsky loader reads `save.format = "diffusers"` (`transformer.<name>`)
    tokenizers=(  # Qwen2.5-VL and CLIP-L
        ("tokenizer", "ai-forever/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers:tokenizer"),
        ("tokenizer_2", "ai-forever/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers:tokenizer_2"),
    ),
    hub_repos=tuple(
        (f"lite-{d}", f"ai-forever/Kandinsky-5.0-T2V-Lite-sft-{d}-Diffusers") for d in ("5s", "10s")
    ),
    save_format="comfy",
    spatial_step=16,
    frame_multiple=4,
    frame_remainder=1,
    model_fps=24.0,
    supports_video=True,
    sample_shift=10.0,
)


RECORDS = (KANDINSKY5,)
