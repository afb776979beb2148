"""The cosmos_predict2 family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from dataclasses import replace

from tuner.archs.record import Architecture

COSMOS_PREDICT2 = Architecture(
    name="cosmos_predict2",
    title="Cosmos-Predict2 text-to-image (2B, 14B)",
    family="tuner.archs.cosmos_predict2.trainer:CosmosPredict2Model",
    layout="tuner.archs.cosmos_predict2.keys:COSMOS_PREDICT2_LAYOUT",
    fixture="tuner.archs.cosmos_predict2.fixture:FIXTURE",
    model_class="CosmosTransformer3DModel",
    block_lists=("transformer_blocks",),
    # the self- and cross-attention projections and the MLP of every block; the AdaLN-LoRA modulation
    # linears, embedders and output head are left alone
    default_targets=(
        r"transformer_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)",
        r"transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)",
    ),
    configs="cosmos_predict2",
    tokenizers=(("tokenizer", "nvidia/Cosmos-Predict2-2B-Text2Image:tokenizer"),),  # T5-11B
    hub_repos=tuple((v, f"nvidia/Cosmos-Predict2-{v}-Text2Image") for v in ("2B", "14B")),
    # release names (`diffusion_model.blocks.0.self_attn.q_proj`): ComfyUI's key map; diffusers has no
    # LoRA loader for the Predict2 pipelines
    save_format="comfy",
    spatial_step=16,
    timestep_mode="logit_normal",
)


RECORDS = (
    COSMOS_PREDICT2,
    # Cosmos-Predict2 Video2World: the same network and names with a condition-mask input channel
    replace(
        COSMOS_PREDICT2,
        name="cosmos_predict2_v2w",
        title="Cosmos-Predict2 Video2World 2B, 14B (480p, 720p; video from its first frames)",
        family="tuner.archs.cosmos_predict2.trainer_v2w:CosmosPredict2V2WModel",
        fixture="tuner.archs.cosmos_predict2.fixture:V2W_FIXTURE",
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
