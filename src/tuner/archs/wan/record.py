"""The wan family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from dataclasses import replace

from tuner.archs.record import (
    LOADS_EVERY_LAYOUT,
    Architecture,
    ReferencePipeline,
    SamplingDefaults,
    comfy,
    hub_tokenizers,
)

_WAN21_COMFY, _WAN22_COMFY = "Comfy-Org/Wan_2.1_ComfyUI_repackaged", "Comfy-Org/Wan_2.2_ComfyUI_Repackaged"

_UMT5 = "text_encoders/umt5_xxl_fp16.safetensors"

_WAN21_VAE = "vae/wan_2.1_vae.safetensors"


def _wan21_i2v(variant: str) -> tuple[tuple[str, str], ...]:
    """Wan 2.1 I2V / FLF2V 14B's repackaged files ("i2v_480p", "i2v_720p", "flf2v_720p")."""
    return comfy(_WAN21_COMFY, transformer=f"diffusion_models/wan2.1_{variant}_14B_fp16.safetensors",
                  vae=_WAN21_VAE, text_encoder=_UMT5, image_encoder="clip_vision/clip_vision_h.safetensors")  # fmt: skip


def _wan21_sizes(task: str) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """Wan 2.1's repackaged 1.3B and 14B files of `task` ("t2v" or "vace") with its VAE and UMT5."""
    return tuple(
        (v, comfy(_WAN21_COMFY, transformer=f"diffusion_models/wan2.1_{task}_{v}_fp16.safetensors",
                  vae=_WAN21_VAE, text_encoder=_UMT5))
        for v in ("1.3B", "14B")
    )  # fmt: skip


def _wan22_experts(task: str) -> tuple[tuple[str, str], ...]:
    """Wan 2.2 A14B's repackaged experts (task "t2v" or "i2v") with Wan 2.1's VAE."""
    return comfy(_WAN22_COMFY, transformer=f"diffusion_models/wan2.2_{task}_high_noise_14B_fp16.safetensors",
                  transformer_2=f"diffusion_models/wan2.2_{task}_low_noise_14B_fp16.safetensors", vae=_WAN21_VAE,
                  text_encoder=_UMT5)  # fmt: skip


# Wan 2.1 I2V 14B (480p and 720p share the network): trained image-to-video (`wan_i2v`) and one-frame (`wan_1f`)
_WAN21_I2V_HUB = (
    ("480p", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"),
    ("720p", "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers"),
)
_WAN21_I2V_COMFY = (("480p", _wan21_i2v("i2v_480p")), ("720p", _wan21_i2v("i2v_720p")))

# Wan 2.1 I2V / FLF2V cross-attend to CLIP tokens of the given frame(s) in every block, and no pipeline runs
# them without: diffusers' WanImageToVideoPipeline and the release require an image; ComfyUI, given no CLIP
# output, hands the image attention the text tokens. Zeros or a blank image's tokens would be inputs the
# model never saw, so these train with their frames only.
_WAN_CLIP_REQUIRED = (
    "its CLIP image cross-attention needs the frame's tokens; no pipeline runs it without them"
)


WAN = Architecture(
    name="wan",
    sampling=SamplingDefaults(
        steps=50,
        guidance=5.0,
        shift=3.0,
        source="diffusers WanPipeline's defaults; shift: the Wan2.1 diffusers repos' scheduler `flow_shift` (480p)",
    ),
    variants=("t2v-1.3B", "t2v-14B"),
    checkpoints=(
        "`transformer`: Wan 2.1 T2V single file (official / ComfyUI, fp8 too) or diffusers folder; `vae`: "
        "Wan 2.1 VAE; `text_encoder`: UMT5-XXL (+ `tokenizer`)"
    ),
    save_format_loads="ComfyUI; diffusers (`load_lora_weights`)",
    title="Wan 2.1 text-to-video (1.3B, 14B)",
    family="WanModel",
    block_lists=("blocks",),
    # every linear layer of the attention and FFN inside the blocks (the condition embedders, time
    # projection and output head are left alone)
    default_targets=(
        r"blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)",
        r"blocks\.\d+\.ffn\.net\.(0\.proj|2)",
    ),
    save_format="comfy",  # original names: ComfyUI's key map, and diffusers' Wan loader reads them too
    pipeline=ReferencePipeline(
        "WanPipeline",
        differs=(
            ("euler", "tuner samples flow models with Euler (as ComfyUI); the pipeline defaults to UniPC"),
            (
                "sigmas",
                "diffusers' Euler spaces its steps from 1 to the scheduler's σ_min, tuner evenly to 1/steps",
            ),
        ),
    ),
    diffusers_loader="WanLoraLoaderMixin",
    diffusers_reads=LOADS_EVERY_LAYOUT,
    musubi_trains=True,
    tokenizers=hub_tokenizers("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "tokenizer"),  # UMT5, the same for 2.2
    hub_repos=(("1.3B", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"), ("14B", "Wan-AI/Wan2.1-T2V-14B-Diffusers")),
    comfy_files=_wan21_sizes("t2v"),
    frame_multiple=4,
    frame_remainder=1,
    supports_video=True,
)


RECORDS = (
    WAN,
    # Wan 2.2 T2V A14B: two Wan 2.1 14B-shaped experts, switched at t = 0.875 (the release's boundary)
    replace(
        WAN,
        name="wan22_t2v",
        sampling=SamplingDefaults(
            steps=40,
            guidance=4.0,
            shift=12.0,
            source="the Wan 2.2 release's wan/configs/wan_t2v_A14B.py (40 steps, shift 12, guidance 4 on the "
            "high-noise expert, 3 on the low-noise one: tuner guides both at one scale)",
        ),
        variants=("t2v-14B",),
        checkpoints=(
            "Variants: `t2v-14B` (each expert has the Wan 2.1 14B network). `transformer`: the high-noise "
            "expert (`wan2.2_t2v_high_noise_14B_*.safetensors`, `high_noise_model/`, or the diffusers root's "
            "`transformer/`); `transformer_2`: the low-noise expert (`transformer_2/`); VAE and text encoder "
            "as `wan`"
        ),
        hub_repos=(("A14B", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"),),
        comfy_files=(("A14B", _wan22_experts("t2v")),),
        title="Wan 2.2 text-to-video A14B (high- and low-noise 14B experts)",
        family="trainer_wan22:Wan22T2VModel",
        fixture="fixture_wan22:T2V_FIXTURE",
        boundary=0.875,
    ),
    # Wan 2.2 I2V A14B: two experts taking Wan 2.1 I2V's 36-channel input without its CLIP image
    # layers, switched at t = 0.9 (the release's boundary)
    replace(
        WAN,
        name="wan22_i2v",
        pipeline=None,  # not checked against its pipeline yet
        sampling=SamplingDefaults(
            steps=40,
            guidance=3.5,
            shift=5.0,
            source="the Wan 2.2 release's wan/configs/wan_i2v_A14B.py (40 steps, shift 5, guidance 3.5)",
        ),
        variants=("i2v-A14B",),
        checkpoints=(
            "Variants: `i2v-A14B` (36 input channels, no CLIP layers; 480p and 720p). `transformer`: the "
            "high-noise expert (`wan2.2_i2v_high_noise_14B_*.safetensors`, `high_noise_model/`, or the "
            "diffusers root's `transformer/`); `transformer_2`: the low-noise expert (`transformer_2/`); VAE "
            "and text encoder as `wan`; no `image_encoder`. Video datasets only"
        ),
        hub_repos=(("A14B", "Wan-AI/Wan2.2-I2V-A14B-Diffusers"),),
        comfy_files=(("A14B", _wan22_experts("i2v")),),
        title="Wan 2.2 image-to-video A14B (high- and low-noise 14B experts; first frame, no CLIP)",
        family="trainer_wan22:Wan22I2VModel",
        fixture="fixture_wan22:I2V_FIXTURE",
        boundary=0.9,
        first_frame=1.0,  # without it: zero condition latents and mask (`WanFrameConditionedModel`)
        supports_images=False,
        frame_images=1,
    ),
    # Wan 2.2 TI2V-5B: one 5B Wan network on the Wan 2.2 VAE's 48 channels, text- and image-to-video
    replace(
        WAN,
        name="wan22_ti2v",
        sampling=SamplingDefaults(
            steps=50,
            guidance=5.0,
            shift=5.0,
            source="the Wan 2.2 release's wan/configs/wan_ti2v_5B.py (50 steps, shift 5, guidance 5)",
        ),
        variants=("ti2v-5B",),
        checkpoints=(
            "`transformer`: `wan2.2_ti2v_5B_*.safetensors` (official / ComfyUI, fp8 too) or the diffusers "
            "folder (`Wan-AI/Wan2.2-TI2V-5B-Diffusers`); `vae`: **the Wan 2.2 VAE** (`Wan2.2_VAE.pth`, "
            "ComfyUI's `wan2.2_vae.safetensors`, or the diffusers `vae/`; 48 channels, "
            "`configs/wan/vae/wan2.2`); `text_encoder`: UMT5-XXL as `wan`"
        ),
        hub_repos=(("5B", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"),),
        comfy_files=(
            (
                "5B",
                comfy(
                    _WAN22_COMFY,
                    transformer="diffusion_models/wan2.2_ti2v_5B_fp16.safetensors",
                    vae="vae/wan2.2_vae.safetensors",
                    text_encoder=_UMT5,
                ),
            ),
        ),  # fmt: skip
        title="Wan 2.2 TI2V-5B text/image-to-video (48-channel Wan 2.2 VAE)",
        family="trainer_ti2v:Wan22TI2VModel",
        fixture="fixture_ti2v:FIXTURE",
        first_frame=0.5,  # one model for both tasks: half the video samples train text-to-video
        spatial_step=32,
        model_fps=24.0,
        first_frame_image=True,
    ),
    # Wan 2.1 I2V / FLF2V 14B: the 14B network with 36 input channels and CLIP image cross-attention;
    # the default targets already hold its image projections (add_k_proj / add_v_proj = k_img / v_img)
    replace(
        WAN,
        name="wan_i2v",
        pipeline=None,  # not checked against its pipeline yet
        sampling=SamplingDefaults(
            steps=40,
            guidance=5.0,
            shift=5.0,
            source="the Wan 2.1 release's generate.py / wan/configs/wan_i2v_14B.py (40 steps, shift 5, guidance 5)",
        ),
        variants=("i2v-14B",),
        checkpoints=(
            "Variants: `i2v-14B` (480p and 720p share it). `transformer`: Wan 2.1 I2V single file "
            "(`wan2.1_i2v_480p_14B_*.safetensors`, `..._720p_...`) or diffusers folder; `image_encoder`: CLIP "
            "ViT-H/14, ComfyUI's `clip_vision_h.safetensors` (`vision_model.*`, its `visual_projection` "
            "unused) or the diffusers folder's `image_encoder/` (+ `image_processor/`; configs in "
            "`configs/clip_vision/`); VAE and text encoder as `wan`. Video datasets only"
        ),
        hub_repos=_WAN21_I2V_HUB,
        comfy_files=_WAN21_I2V_COMFY,
        title="Wan 2.1 image-to-video 14B (480p, 720p; first frame + CLIP ViT-H)",
        family="trainer_i2v:WanI2VModel",
        fixture="fixture_i2v:I2V_FIXTURE",
        first_frame=1.0,
        first_frame_required=_WAN_CLIP_REQUIRED,
        supports_images=False,
        frame_images=1,
        latent_encoders=("vae", "image_encoder"),
    ),
    # one-frame Wan 2.1 (musubi-tuner's "one frame" training): the I2V 14B model making one target frame from
    # a reference image placed at chosen RoPE time indices
    replace(
        WAN,
        name="wan_1f",
        pipeline=None,  # not checked against its pipeline yet
        sampling=SamplingDefaults(
            steps=40,
            guidance=5.0,
            shift=5.0,
            source="Wan 2.1 I2V 14B's (the release's wan/configs/wan_i2v_14B.py), as musubi-tuner's one-frame "
            "inference starts from them",
        ),
        variants=("i2v-14B",),
        checkpoints=(
            "the files of `wan_i2v` (the I2V 14B transformer, CLIP ViT-H, VAE, UMT5). Image datasets with one "
            "control image (the reference) per item, placed with the target on the time axis by the "
            "`[one_frame]` section (musubi-tuner's `target_index` / `control_index`, default 1 and [0]; `no_post` and `latent_window` do not apply); "
            "`tuner generate --control REF --frames 1`. musubi's intermediate-frame mode (two references, "
            "the FLF2V model) is not supported"
        ),
        hub_repos=_WAN21_I2V_HUB,
        comfy_files=_WAN21_I2V_COMFY,
        title="Wan 2.1 one-frame image editing (I2V 14B; one target frame from a reference image)",
        family="trainer_1f:WanOneFrameModel",
        fixture="fixture_i2v:ONE_FRAME_FIXTURE",
        supports_video=False,
        control_images=(1, 1),
        one_frame="frames",
        latent_encoders=("vae", "image_encoder"),
    ),
    replace(
        WAN,
        name="wan_flf2v",
        pipeline=None,  # not checked against its pipeline yet
        sampling=SamplingDefaults(
            steps=50,
            guidance=5.0,
            shift=16.0,
            source="the Wan 2.1 release's wan/configs/wan_flf2v_14B.py / generate.py (50 steps, shift 16, guidance 5)",
        ),
        variants=("flf2v-14B",),
        checkpoints=(
            "Variants: `flf2v-14B` (720p). as `wan_i2v` with the FLF2V transformer (`img_emb.emb_pos`); clips "
            "of 5 frames or more"
        ),
        hub_repos=(("720p", "Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers"),),
        comfy_files=(("720p", _wan21_i2v("flf2v_720p")),),
        title="Wan 2.1 first-last-frame-to-video 14B (720p; first and last frame + CLIP ViT-H)",
        family="trainer_i2v:WanFLF2VModel",
        fixture="fixture_i2v:FLF2V_FIXTURE",
        first_frame=1.0,
        first_frame_required=_WAN_CLIP_REQUIRED,
        supports_images=False,
        min_frames=2,
        frame_images=2,
        latent_encoders=("vae", "image_encoder"),
    ),
    # Wan 2.1 VACE: the T2V network plus a control branch reading a control video (depth, pose, edges...)
    replace(
        WAN,
        name="wan_vace",
        pipeline=None,  # WanVACEPipeline takes control videos: tests/test_wan_vace_models.py checks generate against it
        pipeline_refused="its VACE blocks run beside the main blocks on the control video's tokens; not cut into stages yet",
        sampling=SamplingDefaults(
            steps=50,
            guidance=5.0,
            shift=3.0,
            source="diffusers WanVACEPipeline's defaults (50 steps, guidance 5); shift: the Wan2.1-VACE "
            "diffusers repos' scheduler `flow_shift` (not confirmed offline)",
        ),
        variants=("vace-1.3B", "vace-14B"),
        checkpoints=(
            "Variants: `vace-1.3B`, `vace-14B` (told by shapes). `transformer`: the Wan 2.1 VACE single file "
            "(`wan2.1_vace_*_fp16.safetensors`, official `vace_blocks.*` / `vace_patch_embedding` keys, with or "
            "without ComfyUI's prefix), the release folder (`Wan-AI/Wan2.1-VACE-*`) or the diffusers folder; "
            "VAE and text encoder as `wan`. Per item a control video with the item's frames (`control_directory`; an "
            "image item: a control image), followed whole, or with a mask video (`name_0`: the control, `name_1`: "
            "the mask, white where to generate) for inpainting; `tuner generate --control VIDEO [--control "
            "MASK]`. Reference images are not supported"
        ),
        hub_repos=(
            ("1.3B", "Wan-AI/Wan2.1-VACE-1.3B-diffusers"),
            ("14B", "Wan-AI/Wan2.1-VACE-14B-diffusers"),
        ),
        comfy_files=_wan21_sizes("vace"),
        title="Wan 2.1 VACE 1.3B / 14B (text-to-video following a control video)",
        family="trainer_vace:WanVACEModel",
        control_encoder="trainer_vace:encode_controls",
        fixture="fixture_vace:FIXTURE",
        default_targets=(
            *WAN.default_targets,
            # the control branch's blocks, their attention, FFN and output projections
            r"vace_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)",
            r"vace_blocks\.\d+\.ffn\.net\.(0\.proj|2)",
            r"vace_blocks\.\d+\.proj_(in|out)",
        ),
        musubi_trains=False,
        control_images=(1, 2),
    ),
)
