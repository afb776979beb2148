"""The hidream family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import CONVERTS_FOLDED, Architecture, SamplingDefaults, hub_tokenizers

HIDREAM = Architecture(
    name="hidream",
    sampling=(
        SamplingDefaults(
            steps=50,
            guidance=5.0,
            shift=3.0,
            source="HiDream-I1's inference settings (the release's inference.py: Full 50 steps, guidance 5, "
            "shift 3; Dev 28 / 1 / 6; Fast 16 / 1 / 3); only the file name tells them apart",
        )
        .named(r"i1[-_]dev", steps=28, guidance=1.0, shift=6.0)
        .named(r"i1[-_]fast", steps=16, guidance=1.0)
    ),
    variants=("i1",),
    checkpoints=(
        "Variants: `i1` (Full, Dev and Fast: one network, 16 double- + 32 single-stream MoE blocks; told "
        "apart by file / folder name only, which sets generate's default shift: Dev 6, else 3). "
        "`transformer`: ComfyUI's `hidream_i1_{full,dev,fast}_*.safetensors` (the release is already "
        "diffusers-named; `model.diffusion_model.` optional, fp8 too) or the diffusers folder "
        "(`HiDream-ai/HiDream-I1-Full`); `vae`: FLUX.1's (`ae.safetensors` or `vae/`); `text_encoder` / "
        "`text_encoder_2`: CLIP-L / CLIP-G with projection (`clip_l_hidream.safetensors`, "
        "`clip_g_hidream.safetensors`, 248 positions, or `text_encoder/`, `text_encoder_2/`); "
        "`text_encoder_3`: T5-XXL as `flux`; `text_encoder_4`: Llama 3.1 8B Instruct (the "
        "`meta-llama/Llama-3.1-8B-Instruct` folder with its tokenizer, or ComfyUI's "
        "`llama_3.1_8b_instruct_*.safetensors` + `tokenizer_4`); every Llama layer's hidden states are "
        "cached ([32, L, 4096] per caption: use `cache.text_max_length = 128` and "
        '`cache.text_encoder_dtype = "nf4"`)'
    ),
    save_format_loads="ComfyUI (`transformer.<name>`); diffusers (`load_lora_weights`)",
    title="HiDream-I1 Full / Dev / Fast text-to-image (MoE DiT, four text encoders)",
    family="HiDreamModel",
    layout="loaders:HIDREAM_LAYOUT",
    block_lists=("double_stream_blocks", "single_stream_blocks"),
    # attention of both streams (q, k, v, out; `_t`: the text stream of the double blocks) and every
    # SwiGLU of the feed-forwards: the MoE's shared expert and its routed experts (each token's 2 of 4)
    # and the double blocks' text MLP. Modulations (adaLN), the router, embedders, caption projections
    # and the output layer are left alone.
    default_targets=(
        r"(double|single)_stream_blocks\.\d+\.block\.attn1\.(to_q|to_k|to_v|to_out)(_t)?",
        r"(double|single)_stream_blocks\.\d+\.block\.ff_i\.(shared_experts|experts\.\d+)\.(w1|w2|w3)",
        r"double_stream_blocks\.\d+\.block\.ff_t\.(w1|w2|w3)",
    ),
    tokenizers=hub_tokenizers(
        "HiDream-ai/HiDream-I1-Full", "tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4"
    ),
    hub_repos=tuple((v.lower(), f"HiDream-ai/HiDream-I1-{v}") for v in ("Full", "Dev", "Fast")),
    # `transformer.<name>` with alpha folded in: diffusers' HiDream loader refuses files with `.alpha`
    # keys (the comfy layout), and ComfyUI's HiDream key map takes `transformer.<name>` (SimpleTuner's
    # format); the release's names are diffusers' own
    save_format="diffusers",
    diffusers_loader="HiDreamImageLoraLoaderMixin",
    diffusers_reads=CONVERTS_FOLDED,
    latent_patch=(2, 2),
)


RECORDS = (HIDREAM,)
