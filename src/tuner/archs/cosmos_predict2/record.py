"""The cosmos_predict2 family's architecture records (`tuner.archs.record`): Cosmos-Predict2 Text2Image and
Video2World, and Cosmos 1.0 Diffusion Text2World, the same diffusers network under another config."""

from __future__ import annotations

from dataclasses import replace

from tuner.archs.record import (
    FEED_FORWARD,
    SELF_AND_CROSS_ATTENTION,
    Architecture,
    SamplingDefaults,
    hub_tokenizers,
)

COSMOS_NEGATIVE_PROMPT = (
    "The video captures a series of frames showing ugly scenes, static with no motion, motion blur, "
    "over-saturation, shaky footage, low resolution, grainy texture, pixelated images, poorly lit areas, "
    "underexposed and overexposed scenes, poor color balance, washed out colors, choppy sequences, "
    "jerky movements, low frame rate, artifacting, color banding, unnatural transitions, outdated special effects, "
    "fake elements, unconvincing visuals, poorly edited content, jump cuts, visual noise, and flickering. "
    "Overall, the video is of poor quality."
)
"""The Cosmos-Predict2 pipelines' `DEFAULT_NEGATIVE_PROMPT` (diffusers 0.42.1, pipelines/cosmos/)."""

COSMOS_PREDICT2 = Architecture(
    name="cosmos_predict2",
    sampling=SamplingDefaults(
        steps=35,
        guidance=7.0,
        cfg_form="cond_plus",
        negative_prompt=COSMOS_NEGATIVE_PROMPT,
        source="diffusers Cosmos2TextToImagePipeline's defaults (35 steps, guidance 7 as cond + "
        "g·(cond − uncond), its DEFAULT_NEGATIVE_PROMPT)",
    ),
    variants=("2B-t2i", "14B-t2i"),
    checkpoints=(
        "`transformer`: NVIDIA's Cosmos-Predict2 Text2Image single file (`model.pt` as safetensors: "
        "`net.blocks.0.self_attn.q_proj.weight`, ...; its RoPE buffers and counters are dropped) or "
        "ComfyUI's `cosmos_predict2_*_t2i.safetensors` (fp8 too), or the diffusers folder "
        "(`nvidia/Cosmos-Predict2-2B-Text2Image`); `vae`: the Wan 2.1 VAE as `wan`; `text_encoder`: "
        "T5-11B (`configs/cosmos_predict2/text_encoder/t5-11b`; the diffusers `text_encoder/` + "
        "`tokenizer/`, or a transformers-layout single file such as ComfyUI's `oldt5_xxl_*.safetensors` + "
        "`tokenizer`). Image datasets only; Video2World files are refused naming `cosmos_predict2_v2w`, "
        "Cosmos 1.0 and Predict2.5 files by name"
    ),
    save_format_loads="ComfyUI; diffusers has no LoRA loader for the Predict2 pipelines",
    title="Cosmos-Predict2 text-to-image (2B, 14B)",
    family="CosmosPredict2Model",
    block_lists=("transformer_blocks",),
    # the self- and cross-attention projections and the MLP of every block; the AdaLN-LoRA modulation
    # linears, embedders and output head are left alone
    default_targets=(SELF_AND_CROSS_ATTENTION, FEED_FORWARD),
    tokenizers=hub_tokenizers("nvidia/Cosmos-Predict2-2B-Text2Image", "tokenizer"),  # T5-11B
    hub_repos=tuple((v, f"nvidia/Cosmos-Predict2-{v}-Text2Image") for v in ("2B", "14B")),
    # release names (`diffusion_model.blocks.0.self_attn.q_proj`): ComfyUI's key map; diffusers has no
    # LoRA loader for the Predict2 pipelines
    save_format="comfy",
    timestep_mode="logit_normal",
)


PREDICT2_RECORDS = (
    COSMOS_PREDICT2,
    # Cosmos-Predict2 Video2World: the same network and names with a condition-mask input channel
    replace(
        COSMOS_PREDICT2,
        name="cosmos_predict2_v2w",
        sampling=SamplingDefaults(
            steps=35,
            guidance=7.0,
            cfg_form="cond_plus",
            negative_prompt=COSMOS_NEGATIVE_PROMPT,
            source="diffusers Cosmos2VideoToWorldPipeline's defaults (35 steps, guidance 7 as cond + "
            "g·(cond − uncond), its DEFAULT_NEGATIVE_PROMPT)",
        ),
        variants=("2B-v2w", "14B-v2w"),
        checkpoints=(
            "Variants: `2B-v2w`, `14B-v2w` (`in_channels` 17: the condition mask). `transformer`: NVIDIA's "
            "Cosmos-Predict2 Video2World single file (`model-480p-16fps.pt`, `model-720p-16fps.pt`, ... as "
            "safetensors) or ComfyUI's `cosmos_predict2_2B_video2world_480p_16fps.safetensors` (fp8 too), or "
            "the diffusers folder (`nvidia/Cosmos-Predict2-2B-Video2World`); Text2Image files are refused "
            "naming `cosmos_predict2`. 480p and 720p (10 and 16 fps) files are the same network with the same "
            "RoPE scale (NVIDIA's `config_video2world.py`: 2B (1, 3, 3), 14B (20/24, 2, 2) for every "
            "resolution; diffusers' converter and ComfyUI agree), so nothing is chosen by file name. `vae`, "
            "`text_encoder` as `cosmos_predict2`. Video datasets only (4N+1 frames, ≥ 5)"
        ),
        title="Cosmos-Predict2 Video2World 2B, 14B (480p, 720p; video from its first frames)",
        family="trainer_v2w:CosmosPredict2V2WModel",
        fixture="V2W_FIXTURE",
        first_frame=1.0,  # without it: no given latent frame, a zero condition mask (its own "none given")
        hub_repos=tuple((v, f"nvidia/Cosmos-Predict2-{v}-Video2World") for v in ("2B", "14B")),
        frame_multiple=4,
        frame_remainder=1,
        supports_video=True,
        supports_images=False,
        min_frames=5,
        frame_images=1,
    ),
)

# Cosmos 1.0 Diffusion: the same diffusers class with NVIDIA's first release's config and names, an EDM model
COSMOS1_T2W = replace(
    COSMOS_PREDICT2,
    name="cosmos1_t2w",
    sampling=SamplingDefaults(
        steps=36,
        guidance=7.0,
        cfg_form="cond_plus",
        shift=None,
        negative_prompt=COSMOS_NEGATIVE_PROMPT,
        source="diffusers CosmosTextToWorldPipeline / CosmosVideoToWorldPipeline defaults (36 steps, guidance 7 "
        "as cond + g·(cond − uncond), the same DEFAULT_NEGATIVE_PROMPT as Predict2's; EDM: no shift)",
    ),
    variants=("7B-text2world", "14B-text2world"),
    checkpoints=(
        "Variants: `7B-text2world`, `14B-text2world` (told apart by shapes). `transformer`: NVIDIA's Cosmos-1.0-Diffusion "
        "Text2World single file (`model.pt` as safetensors: `net.blocks.block0.blocks.0.block.attn.to_q.0.weight`, "
        "...; its `logvar` and RoPE buffers are dropped), ComfyUI's `Cosmos-1_0-Diffusion-7B-Text2World.safetensors` "
        "(mcmonkey/cosmos-1.0: the same names without `net.`), or the diffusers folder (`nvidia/Cosmos-1.0-Diffusion-7B-Text2World`); "
        "Cosmos-Predict2 files are refused naming `cosmos_predict2`. `vae`: the Cosmos tokenizer CV8x8x8 from a "
        "diffusers folder (the pipeline's `vae/`; ComfyUI's `cosmos_cv8x8x8_1.0.safetensors` is not read yet); `text_encoder`: T5-11B as `cosmos_predict2`. Videos of 8N+1 "
        "frames (images as one frame); EDM objective (`tuner.diffusion.edm`)"
    ),
    title="Cosmos 1.0 Diffusion Text2World 7B, 14B (EDM)",
    save_format_loads="ComfyUI; diffusers has no LoRA loader for the Cosmos 1.0 pipelines",
    family="trainer_cosmos1:Cosmos1T2WModel",
    layout="keys_cosmos1:COSMOS1_LAYOUT",
    fixture="fixture_cosmos1:T2W_FIXTURE",
    tokenizers=hub_tokenizers("nvidia/Cosmos-1.0-Diffusion-7B-Text2World", "tokenizer"),  # T5-11B
    hub_repos=tuple((v, f"nvidia/Cosmos-1.0-Diffusion-{v}-Text2World") for v in ("7B", "14B")),
    objective="edm",
    model_fps=24.0,
    frame_multiple=8,
    frame_remainder=1,
    supports_video=True,
)

RECORDS = (
    *PREDICT2_RECORDS,
    COSMOS1_T2W,
    # Cosmos 1.0 Video2World: the same network with a condition-mask input channel
    replace(
        COSMOS1_T2W,
        name="cosmos1_v2w",
        variants=("7B-video2world", "14B-video2world"),
        checkpoints=(
            "Variants: `7B-video2world`, `14B-video2world` (`in_channels` 17: the condition mask). `transformer`: "
            "NVIDIA's Cosmos-1.0-Diffusion Video2World single file, ComfyUI's "
            "`Cosmos-1_0-Diffusion-7B-Video2World.safetensors` (the same names), or the diffusers "
            "folder (`nvidia/Cosmos-1.0-Diffusion-7B-Video2World`); Text2World files are refused naming "
            "`cosmos1_t2w`, Predict2 files naming `cosmos_predict2_v2w`. `vae`, `text_encoder` as `cosmos1_t2w`. "
            "Video datasets only (8N+1 frames, ≥ 9); `tuner generate --image FIRST`"
        ),
        title="Cosmos 1.0 Diffusion Video2World 7B, 14B (EDM; video from its first frames)",
        family="trainer_cosmos1:Cosmos1V2WModel",
        fixture="fixture_cosmos1:V2W_FIXTURE",
        tokenizers=hub_tokenizers("nvidia/Cosmos-1.0-Diffusion-7B-Video2World", "tokenizer"),
        hub_repos=tuple((v, f"nvidia/Cosmos-1.0-Diffusion-{v}-Video2World") for v in ("7B", "14B")),
        first_frame=1.0,  # without it: no given latent frame, a zero condition mask
        supports_images=False,
        min_frames=9,
        frame_images=1,
    ),
)
