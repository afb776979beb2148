"""The architecture records: everything shared code needs to know about an architecture, in one place.

An architecture is one `Architecture` record in `ARCHITECTURES`. The training loop, the cache commands,
generation, the adapter file tools (`tuner lora ...`), memory settings, fixtures, the demo and the
contract test suite all read it from here; nothing else keeps a per-architecture table. Adding an
architecture means writing its pieces (see `docs/architectures.md`) and registering one record;
`tests/test_registry.py` fails while any piece is missing, and the contract suite then runs every user
path on its fixture.

The record is plain data. Code it points to (the trainer class, the key table, the fixture) is named as
`"module:attribute"` and imported only when asked for, so reading a config or printing `--help` loads no
model code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tuner.errors import ConfigError

CONFIGS = Path(__file__).parent / "models" / "configs"
SAVE_LAYOUTS = ("comfy", "diffusers", "kohya")
SAVE_FORMATS = ("auto", *SAVE_LAYOUTS)
"""What `save.format` (and the file tools' `--to` / `--format`) accept: a layout, or "auto"."""


@dataclass(frozen=True)
class Architecture:
    """One architecture (a config's `model.architecture`)."""

    name: str
    """The config name, e.g. `wan`."""
    title: str
    """What it trains, in a few words (shown by `tuner --help` and `tuner fixtures --help`)."""
    trainer: str
    """`module:Class` of its `NetworkTrainer` subclass."""
    layout: str
    """`module:attribute` of its `CheckpointLayout`: the release's single-file layout relative to
    diffusers'. Its `keys` (`ArchitectureKeys`: module renames and fused layers) name adapters in saved
    files. Architectures with the same network point to the same layout."""
    fixture: str
    """`module:attribute` of its tiny random-weight `Fixture` (written in the release's layouts)."""
    model_class: str
    """The diffusers class of its transformer."""
    block_lists: tuple[str, ...]
    """The transformer's `nn.ModuleList`s of blocks, in execution order (block swap, checkpointing,
    fp8 storage)."""
    default_targets: tuple[str, ...]
    """Regexes over diffusers module names of the linear layers an adapter trains by default."""
    configs: str
    """Folder under `tuner/models/configs` with the diffusers configs of every shipped variant (a
    `transformer/` folder holding a `tiny` variant and at least one real one)."""
    save_format: str
    """The layout `save.format = "auto"` writes: one that ComfyUI and diffusers both load."""
    boundary: float | None = None
    """Two-expert models (Wan 2.2 A14B): the release's t in [0, 1] where denoising switches from the
    high-noise expert (`model.transformer`) to the low-noise one (`model.transformer_2`); None for models
    with one transformer."""
    tokenizers: tuple[tuple[str, str], ...] = ()
    """(config field, hub folder) of the tokenizer of each text encoder, e.g. ("tokenizer",
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers:tokenizer"): used when the config gives none and the encoder is a
    single file, which carries none (see `tuner.hub`). Every record names one per text encoder."""
    hub_repos: tuple[tuple[str, str], ...] = ()
    """(variant, repository) of the official diffusers pipelines, the first the default: what
    `tuner download ARCH [VARIANT]` fetches the components from."""
    comfy_files: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    """(variant, ((config field, hub file), ...)) of the single files ComfyUI users have, from Comfy-Org's
    repackaged repositories (`repo/split_files/...`): what `tuner download ARCH [VARIANT] --comfy` fetches;
    empty where there are none. Variants are `hub_repos`' names."""
    first_frame: float | None = None
    """Models given a video's first frame (image-to-video): the share of training samples given it when
    `train.first_frame_conditioning_p` is unset (1.0, as the releases train; 0.5 where one model does both
    text- and image-to-video). None for models without a first-frame condition (they refuse the key)."""
    first_frame_required: str = ""
    """Why such a model cannot train without its frame, where it cannot (its image condition has no absent
    form in any of its pipelines): it then accepts only p = 1. What the others are fed without the frame is
    their trainer's `draw_conditions` / `predict`."""

    def trainer_class(self) -> type:
        return _resolve(self.trainer)

    def checkpoint_layout(self) -> Any:
        """The `CheckpointLayout` of this architecture: a name map (diffusers module -> release's, with the
        fused layers), `.inverse` for the way back, and whole-checkpoint conversion."""
        return _resolve(self.layout)

    def key_table(self) -> Any:
        """The `ArchitectureKeys` of this architecture (what adapter files are named by)."""
        return self.checkpoint_layout().keys

    def load_fixture(self) -> Any:
        """The `Fixture` of this architecture."""
        return _resolve(self.fixture)

    @property
    def variant_dir(self) -> Path:
        return CONFIGS / self.configs


def _resolve(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


# ---------------------------------------------------------------------------------------------------
# The records
# ---------------------------------------------------------------------------------------------------


def _comfy(repo: str, **files: str) -> tuple[tuple[str, str], ...]:
    """`comfy_files` entries: config field -> a file under `repo`'s `split_files/` folder."""
    return tuple((field, f"{repo}/split_files/{path}") for field, path in files.items())


_WAN21_COMFY, _WAN22_COMFY = "Comfy-Org/Wan_2.1_ComfyUI_repackaged", "Comfy-Org/Wan_2.2_ComfyUI_Repackaged"
_UMT5 = "text_encoders/umt5_xxl_fp16.safetensors"
_WAN21_VAE = "vae/wan_2.1_vae.safetensors"
_HV15_COMFY = "Comfy-Org/HunyuanVideo_1.5_repackaged"
_HV15_PARTS = {"vae": "vae/hunyuanvideo15_vae_fp16.safetensors",
               "text_encoder": "text_encoders/qwen_2.5_vl_7b.safetensors",
               "text_encoder_2": "text_encoders/byt5_small_glyphxl_fp16.safetensors"}  # fmt: skip


def _wan21_i2v(variant: str) -> tuple[tuple[str, str], ...]:
    """Wan 2.1 I2V / FLF2V 14B's repackaged files ("i2v_480p", "i2v_720p", "flf2v_720p")."""
    return _comfy(_WAN21_COMFY, transformer=f"diffusion_models/wan2.1_{variant}_14B_fp16.safetensors",
                  vae=_WAN21_VAE, text_encoder=_UMT5, image_encoder="clip_vision/clip_vision_h.safetensors")  # fmt: skip


def _wan22_experts(task: str) -> tuple[tuple[str, str], ...]:
    """Wan 2.2 A14B's repackaged experts (task "t2v" or "i2v") with Wan 2.1's VAE."""
    return _comfy(_WAN22_COMFY, transformer=f"diffusion_models/wan2.2_{task}_high_noise_14B_fp16.safetensors",
                  transformer_2=f"diffusion_models/wan2.2_{task}_low_noise_14B_fp16.safetensors", vae=_WAN21_VAE,
                  text_encoder=_UMT5)  # fmt: skip


_WAN = Architecture(
    name="wan",
    title="Wan 2.1 text-to-video (1.3B, 14B)",
    trainer="tuner.trainers.wan:WanTrainer",
    layout="tuner.models.wan_keys:WAN_LAYOUT",
    fixture="tuner.fixtures.wan:FIXTURE",
    model_class="WanTransformer3DModel",
    block_lists=("blocks",),
    # every linear layer of the attention and FFN inside the blocks (the condition embedders, time
    # projection and output head are left alone)
    default_targets=(
        r"blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)",
        r"blocks\.\d+\.ffn\.net\.(0\.proj|2)",
    ),
    configs="wan",
    save_format="comfy",  # original names: ComfyUI's key map, and diffusers' Wan loader reads them too
    tokenizers=(("tokenizer", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers:tokenizer"),),  # UMT5, the same for 2.2
    hub_repos=(("1.3B", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"), ("14B", "Wan-AI/Wan2.1-T2V-14B-Diffusers")),
    comfy_files=tuple(
        (
            v,
            _comfy(
                _WAN21_COMFY,
                transformer=f"diffusion_models/wan2.1_t2v_{v}_fp16.safetensors",
                vae=_WAN21_VAE,
                text_encoder=_UMT5,
            ),
        )
        for v in ("1.3B", "14B")
    ),  # fmt: skip
)

_FLUX = Architecture(
    name="flux",
    title="FLUX.1 dev text-to-image",
    trainer="tuner.trainers.flux:FluxTrainer",
    layout="tuner.models.flux_keys:FLUX_LAYOUT",
    fixture="tuner.fixtures.flux:FIXTURE",
    model_class="FluxTransformer2DModel",
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # the attention and MLP linears of both streams in the double blocks, and q/k/v, MLP input and
    # output of the single blocks: together the original fused `qkv` and `linear1` layers, so the export
    # can fuse them. Modulations, norms and embedders are left alone.
    default_targets=(
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
        r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)",
        r"single_transformer_blocks\.\d+\.(attn\.to_q|attn\.to_k|attn\.to_v|proj_mlp|proj_out)",
    ),
    configs="flux",
    # FLUX.1-schnell's (the same CLIP-L and T5-XXL tokenizers as dev's, in a repository that is not gated)
    tokenizers=(
        ("tokenizer", "black-forest-labs/FLUX.1-schnell:tokenizer"),
        ("tokenizer_2", "black-forest-labs/FLUX.1-schnell:tokenizer_2"),
    ),
    hub_repos=(("dev", "black-forest-labs/FLUX.1-dev"),),
    # BFL names in kohya's spelling: ComfyUI maps them, and diffusers converts them (its loader ignores
    # the comfy layout's `diffusion_model.` FLUX names with only a warning)
    save_format="kohya",
)

_QWEN_IMAGE = Architecture(
    name="qwen_image",
    title="Qwen-Image text-to-image",
    trainer="tuner.trainers.qwen_image:QwenImageTrainer",
    layout="tuner.models.qwen_image:QWEN_IMAGE_LAYOUT",
    fixture="tuner.fixtures.qwen_image:FIXTURE",
    model_class="QwenImageTransformer2DModel",
    block_lists=("transformer_blocks",),
    # the attention projections of both streams and both MLPs of every block; the modulation layers
    # (img_mod / txt_mod), the embedders and the output head are left alone
    default_targets=(
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
        r"transformer_blocks\.\d+\.(img_mlp|txt_mlp)\.net\.(0\.proj|2)",
    ),
    configs="qwen_image",
    tokenizers=(("tokenizer", "Qwen/Qwen-Image:tokenizer"),),
    hub_repos=(("", "Qwen/Qwen-Image"),),
    comfy_files=(
        (
            "",
            _comfy(
                "Comfy-Org/Qwen-Image_ComfyUI",
                transformer="diffusion_models/qwen_image_bf16.safetensors",
                vae="vae/qwen_image_vae.safetensors",
                text_encoder="text_encoders/qwen_2.5_vl_7b.safetensors",
            ),
        ),
    ),  # fmt: skip
    save_format="comfy",  # the release uses diffusers' module names; both loaders read the comfy layout
)

_HUNYUAN_VIDEO = Architecture(
    name="hunyuan_video",
    title="HunyuanVideo text-to-video (13B, cfg-distilled 720p T2V)",
    trainer="tuner.trainers.hunyuan_video:HunyuanVideoTrainer",
    layout="tuner.models.hunyuan_video_keys:HUNYUAN_VIDEO_LAYOUT",
    fixture="tuner.fixtures.hunyuan_video:FIXTURE",
    model_class="HunyuanVideoTransformer3DModel",
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # as FLUX.1: the attention and MLP linears of both streams in the double blocks, and q/k/v, MLP
    # input and output of the single blocks, so the export can fuse `img_attn_qkv`, `txt_attn_qkv` and
    # `linear1`. Modulations, norms, the text token refiner and the embedders are left alone.
    default_targets=(
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
        r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)",
        r"single_transformer_blocks\.\d+\.(attn\.to_q|attn\.to_k|attn\.to_v|proj_mlp|proj_out)",
    ),
    configs="hunyuan_video",
    tokenizers=(  # LLaVA-Llama-3 and CLIP-L
        ("tokenizer", "hunyuanvideo-community/HunyuanVideo:tokenizer"),
        ("tokenizer_2", "hunyuanvideo-community/HunyuanVideo:tokenizer_2"),
    ),
    hub_repos=(("", "hunyuanvideo-community/HunyuanVideo"),),
    comfy_files=(
        (
            "",
            _comfy(
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
)

_HUNYUAN_VIDEO15 = Architecture(
    name="hunyuan_video15",
    title="HunyuanVideo 1.5 text-to-video (8.3B, 480p / 720p T2V)",
    trainer="tuner.trainers.hunyuan_video15:HunyuanVideo15Trainer",
    layout="tuner.models.hunyuan_video15_keys:HUNYUAN_VIDEO15_LAYOUT",
    fixture="tuner.fixtures.hunyuan_video15:FIXTURE",
    model_class="HunyuanVideo15Transformer3DModel",
    block_lists=("transformer_blocks",),
    # the attention and MLP linears of both streams of every double block (Tencent's img_attn_q ...
    # txt_mlp.fc2, all unfused). Modulations, norms, the text refiner and the text / glyph / image
    # embedders are left alone.
    default_targets=(
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
        r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)",
    ),
    configs="hunyuan_video15",
    # Tencent names under `diffusion_model.`: ComfyUI's key map (diffusers has no HunyuanVideo 1.5 LoRA loader)
    tokenizers=(  # Qwen2.5-VL and the ByT5 glyph encoder
        ("tokenizer", "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v:tokenizer"),
        ("tokenizer_2", "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v:tokenizer_2"),
    ),
    hub_repos=tuple(
        (r, f"hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{r}_t2v") for r in ("480p", "720p")
    ),
    comfy_files=(
        (
            "720p",
            _comfy(
                _HV15_COMFY,
                transformer="diffusion_models/hunyuanvideo1.5_720p_t2v_fp16.safetensors",
                **_HV15_PARTS,
            ),
        ),
    ),  # fmt: skip
    save_format="comfy",
)

# FramePack: HunyuanVideo's network plus the history embedder and SigLIP projection, trained on sections;
# adapters on the same modules as HunyuanVideo's, exported in its Tencent names
_FRAMEPACK = replace(
    _HUNYUAN_VIDEO,
    name="framepack",
    title="FramePack image-to-video (HunyuanVideo-based, next-section prediction, SigLIP)",
    trainer="tuner.trainers.framepack:FramePackTrainer",
    layout="tuner.models.framepack_keys:FRAMEPACK_LAYOUT",
    fixture="tuner.fixtures.framepack:FIXTURE",
    model_class="HunyuanVideoFramepackTransformer3DModel",
    configs="framepack",
    # the transformer; VAE, text and image encoders are HunyuanVideo's (`hunyuanvideo-community/HunyuanVideo`)
    # and SigLIP (`lllyasviel/flux_redux_bfl`), as diffusers' FramePack example loads them
    hub_repos=(("i2v", "lllyasviel/FramePackI2V_HY"),),
    comfy_files=(),
    first_frame=1.0,
    # every section is anchored on the image: its latent is the clean prefix and its SigLIP tokens the image
    # context, and the release's sampler (and diffusers') cannot run without one
    first_frame_required="every section's clean prefix and SigLIP tokens are the image's; its sampler needs one",
)

_HIDREAM = Architecture(
    name="hidream",
    title="HiDream-I1 Full / Dev / Fast text-to-image (MoE DiT, four text encoders)",
    trainer="tuner.trainers.hidream:HiDreamTrainer",
    layout="tuner.models.hidream:HIDREAM_LAYOUT",
    fixture="tuner.fixtures.hidream:FIXTURE",
    model_class="HiDreamImageTransformer2DModel",
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
    configs="hidream",
    tokenizers=tuple(
        (f"tokenizer{n}", f"HiDream-ai/HiDream-I1-Full:tokenizer{n}") for n in ("", "_2", "_3", "_4")
    ),
    hub_repos=tuple((v.lower(), f"HiDream-ai/HiDream-I1-{v}") for v in ("Full", "Dev", "Fast")),
    # `transformer.<name>` with alpha folded in: diffusers' HiDream loader refuses files with `.alpha`
    # keys (the comfy layout), and ComfyUI's HiDream key map takes `transformer.<name>` (SimpleTuner's
    # format); the release's names are diffusers' own
    save_format="diffusers",
)

_SD3 = Architecture(
    name="sd3",
    title="Stable Diffusion 3.5 text-to-image (Medium, Large, Large Turbo)",
    trainer="tuner.trainers.sd3:SD3Trainer",
    layout="tuner.models.sd3_keys:SD3_LAYOUT",
    fixture="tuner.fixtures.sd3:FIXTURE",
    model_class="SD3Transformer2DModel",
    block_lists=("transformer_blocks",),
    # the attention and MLP linears of both streams (Medium's attn2 too): together the release's fused
    # `qkv` layers, so the export can fuse them. Modulations, embedders and the output head are left alone.
    default_targets=(
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
        r"transformer_blocks\.\d+\.attn2\.(to_q|to_k|to_v|to_out\.0)",
        r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)",
    ),
    configs="sd3",
    tokenizers=(  # CLIP-L, OpenCLIP bigG, T5-XXL
        ("tokenizer", "stabilityai/stable-diffusion-3.5-medium:tokenizer"),
        ("tokenizer_2", "stabilityai/stable-diffusion-3.5-medium:tokenizer_2"),
        ("tokenizer_3", "stabilityai/stable-diffusion-3.5-medium:tokenizer_3"),
    ),
    hub_repos=tuple((v, f"stabilityai/stable-diffusion-3.5-{v}") for v in ("medium", "large", "large-turbo")),
    # the release's names, qkv fused exactly: ComfyUI's key map, and full fine-tunes in the release's file
    # layout. diffusers' SD3 loader reads only its own names (it has no converter): save.format =
    # "diffusers" (or `tuner lora convert --to diffusers`) writes those, which ComfyUI maps as well
    save_format="comfy",
)

_FLUX2 = Architecture(
    name="flux2",
    title="FLUX.2 dev text-to-image and multi-reference editing (Mistral-Small text encoder)",
    trainer="tuner.trainers.flux2:Flux2Trainer",
    layout="tuner.models.flux2_keys:FLUX2_LAYOUT",
    fixture="tuner.fixtures.flux2:FIXTURE",
    model_class="Flux2Transformer2DModel",
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # attention and MLP linears of both streams in the double blocks (q/k/v together are the original
    # fused `qkv`, so the export can fuse them) and the fused input / output linears of the single
    # blocks (`linear1` / `linear2`, fused in diffusers too). The shared modulations, embedders and the
    # output head are left alone.
    default_targets=(
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
        r"transformer_blocks\.\d+\.(ff|ff_context)\.(linear_in|linear_out)",
        r"single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)",
    ),
    configs="flux2",
    tokenizers=(("tokenizer", "black-forest-labs/FLUX.2-dev:tokenizer"),),  # Mistral-Small 3
    hub_repos=(("dev", "black-forest-labs/FLUX.2-dev"),),
    # BFL names in kohya's spelling, with alphas: ComfyUI maps them and diffusers' FLUX.2 loader converts
    # them (its loader for the comfy layout refuses `.alpha` keys)
    save_format="kohya",
)

_Z_IMAGE = Architecture(
    name="z_image",
    title="Z-Image text-to-image (Turbo, Base; 6B single-stream DiT)",
    trainer="tuner.trainers.z_image:ZImageTrainer",
    layout="tuner.models.z_image:Z_IMAGE_LAYOUT",
    fixture="tuner.fixtures.z_image:FIXTURE",
    model_class="ZImageTransformer2DModel",
    block_lists=("noise_refiner", "context_refiner", "layers"),
    # q/k/v (the release's fused `attention.qkv`), the output projection and the SwiGLU MLP of every
    # block, refiners included; the modulations, embedders and final layer are left alone
    default_targets=(
        r"(noise_refiner|context_refiner|layers)\.\d+\.attention\.(to_q|to_k|to_v|to_out\.0)",
        r"(noise_refiner|context_refiner|layers)\.\d+\.feed_forward\.(w1|w2|w3)",
    ),
    configs="z_image",
    tokenizers=(("tokenizer", "Tongyi-MAI/Z-Image-Turbo:tokenizer"),),  # Qwen3
    hub_repos=(("turbo", "Tongyi-MAI/Z-Image-Turbo"),),
    comfy_files=(
        (
            "turbo",
            _comfy(
                "Comfy-Org/z_image_turbo",
                transformer="diffusion_models/z_image_turbo_bf16.safetensors",
                vae="vae/ae.safetensors",
                text_encoder="text_encoders/qwen_3_4b.safetensors",
            ),
        ),
    ),  # fmt: skip
    # the release's names (fused `attention.qkv`, `attention.out`) in kohya's spelling: ComfyUI maps
    # them, and diffusers' Z-Image converter splits the fused qkv again (it leaves a comfy file's
    # `attention.out.alpha` unread and refuses it)
    save_format="kohya",
)

_LUMINA2 = Architecture(
    name="lumina2",
    title="Lumina Image 2.0 text-to-image (Gemma 2 text encoder)",
    trainer="tuner.trainers.lumina2:Lumina2Trainer",
    layout="tuner.models.lumina2_keys:LUMINA2_LAYOUT",
    fixture="tuner.fixtures.lumina2:FIXTURE",
    model_class="Lumina2Transformer2DModel",
    block_lists=("noise_refiner", "context_refiner", "layers"),
    # attention (q/k/v, which the release fuses into `qkv`, and the output) and the SwiGLU MLP of every
    # block, refiners included; modulations, norms, embedders and the output layer are left alone
    default_targets=(
        r"(noise_refiner|context_refiner|layers)\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0)",
        r"(noise_refiner|context_refiner|layers)\.\d+\.feed_forward\.linear_[123]",
    ),
    configs="lumina2",
    tokenizers=(("tokenizer", "Alpha-VLLM/Lumina-Image-2.0:tokenizer"),),  # Gemma 2
    hub_repos=(("", "Alpha-VLLM/Lumina-Image-2.0"),),
    save_format="comfy",  # Alpha-VLLM's names with the fused qkv: ComfyUI's key map
)

_COSMOS_PREDICT2 = Architecture(
    name="cosmos_predict2",
    title="Cosmos-Predict2 text-to-image (2B, 14B)",
    trainer="tuner.trainers.cosmos_predict2:CosmosPredict2Trainer",
    layout="tuner.models.cosmos_predict2_keys:COSMOS_PREDICT2_LAYOUT",
    fixture="tuner.fixtures.cosmos_predict2:FIXTURE",
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
)

_SDXL = Architecture(
    name="sdxl",
    title="SDXL text-to-image (base 1.0 and fine-tunes: Pony, Illustrious, NoobAI; epsilon or v-pred)",
    trainer="tuner.trainers.sdxl:SDXLTrainer",
    layout="tuner.models.sdxl_keys:SDXL_LAYOUT",
    fixture="tuner.fixtures.sdxl:FIXTURE",
    model_class="UNet2DConditionModel",
    # the UNet's levels (the mid block is one module, not a list, and stays resident)
    block_lists=("down_blocks", "up_blocks"),
    # every linear layer of the attention modules: their projections in and out, self- and
    # cross-attention and the feed-forward (kohya's default set for SDXL); resnets and embeddings left alone
    default_targets=(
        r".*attentions\.\d+\.(proj_in|proj_out)",
        r".*attentions\.\d+\.transformer_blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)",
        r".*attentions\.\d+\.transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)",
    ),
    configs="sdxl",
    tokenizers=(
        ("tokenizer", "stabilityai/stable-diffusion-xl-base-1.0:tokenizer"),
        ("tokenizer_2", "stabilityai/stable-diffusion-xl-base-1.0:tokenizer_2"),
    ),
    hub_repos=(("base", "stabilityai/stable-diffusion-xl-base-1.0"),),
    # kohya's `lora_unet_input_blocks_4_1_...` names: A1111, Forge, ComfyUI and diffusers all load them
    save_format="kohya",
)

_KANDINSKY5 = Architecture(
    name="kandinsky5",
    title="Kandinsky 5.0 Video Lite text-to-video (2B; sft, pretrain, nocfg, distilled, 5 s / 10 s)",
    trainer="tuner.trainers.kandinsky5:Kandinsky5Trainer",
    layout="tuner.models.kandinsky5:KANDINSKY5_LAYOUT",
    fixture="tuner.fixtures.kandinsky5:FIXTURE",
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
)

_LTX2 = Architecture(
    name="ltx2",
    title="LTX-2 text-to-video with sound (19B; video and audio streams trained together)",
    trainer="tuner.trainers.ltx2:LTX2Trainer",
    layout="tuner.models.ltx2_keys:LTX2_LAYOUT",
    fixture="tuner.fixtures.ltx2:FIXTURE",
    model_class="LTX2VideoTransformer3DModel",
    block_lists=("transformer_blocks",),
    # every attention (self, text, and audio<->video of both streams) and both feed-forwards of the
    # blocks; the embedders, modulation and output projections are left alone
    default_targets=(
        r"transformer_blocks\.\d+\.(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn)"
        r"\.(to_q|to_k|to_v|to_out\.0)",
        r"transformer_blocks\.\d+\.(ff|audio_ff)\.net\.(0\.proj|2)",
    ),
    configs="ltx2",
    save_format="comfy",  # the release's names (the blocks' linears are diffusers' names too)
    tokenizers=(("tokenizer", "Lightricks/LTX-2:tokenizer"),),  # Gemma 3
    hub_repos=(("19b", "Lightricks/LTX-2"),),
)

_LTX_VIDEO = Architecture(
    name="ltx_video",
    title="LTX-Video 0.9 text-to-video (2B)",
    trainer="tuner.trainers.ltx_video:LTXVideoTrainer",
    layout="tuner.models.ltx_video_keys:LTX_VIDEO_LAYOUT",
    fixture="tuner.fixtures.ltx_video:FIXTURE",
    model_class="LTXVideoTransformer3DModel",
    block_lists=("transformer_blocks",),
    # the self- and text attention and the feed-forward of every block
    default_targets=(
        r"transformer_blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)",
        r"transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)",
    ),
    configs="ltx_video",
    save_format="comfy",  # the release's names (the blocks' linears are diffusers' names too)
    tokenizers=(("tokenizer", "Lightricks/LTX-Video:tokenizer"),),  # T5-XXL
    hub_repos=(("0.9", "Lightricks/LTX-Video"),),
    first_frame=0.0,  # text-to-video unless asked: what training did before the key (one model, both tasks)
)

# Wan 2.1 I2V / FLF2V cross-attend to CLIP tokens of the given frame(s) in every block, and no pipeline runs
# them without: diffusers' WanImageToVideoPipeline and the release require an image; ComfyUI, given no CLIP
# output, hands the image attention the text tokens. Zeros or a blank image's tokens would be inputs the
# model never saw, so these train with their frames only.
_WAN_CLIP_REQUIRED = (
    "its CLIP image cross-attention needs the frame's tokens; no pipeline runs it without them"
)

ARCHITECTURES: dict[str, Architecture] = {
    record.name: record
    for record in (
        _WAN,
        # Wan 2.2 T2V A14B: two Wan 2.1 14B-shaped experts, switched at t = 0.875 (the release's boundary)
        replace(
            _WAN,
            name="wan22_t2v",
            hub_repos=(("A14B", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"),),
            comfy_files=(("A14B", _wan22_experts("t2v")),),
            title="Wan 2.2 text-to-video A14B (high- and low-noise 14B experts)",
            trainer="tuner.trainers.wan22:Wan22T2VTrainer",
            fixture="tuner.fixtures.wan22:T2V_FIXTURE",
            boundary=0.875,
        ),
        # Wan 2.2 I2V A14B: two experts taking Wan 2.1 I2V's 36-channel input without its CLIP image
        # layers, switched at t = 0.9 (the release's boundary)
        replace(
            _WAN,
            name="wan22_i2v",
            hub_repos=(("A14B", "Wan-AI/Wan2.2-I2V-A14B-Diffusers"),),
            comfy_files=(("A14B", _wan22_experts("i2v")),),
            title="Wan 2.2 image-to-video A14B (high- and low-noise 14B experts; first frame, no CLIP)",
            trainer="tuner.trainers.wan22:Wan22I2VTrainer",
            fixture="tuner.fixtures.wan22:I2V_FIXTURE",
            boundary=0.9,
            first_frame=1.0,  # without it: zero condition latents and mask (`WanFrameConditionedTrainer`)
        ),
        # Wan 2.2 TI2V-5B: one 5B Wan network on the Wan 2.2 VAE's 48 channels, text- and image-to-video
        replace(
            _WAN,
            name="wan22_ti2v",
            hub_repos=(("5B", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"),),
            comfy_files=(
                (
                    "5B",
                    _comfy(
                        _WAN22_COMFY,
                        transformer="diffusion_models/wan2.2_ti2v_5B_fp16.safetensors",
                        vae="vae/wan2.2_vae.safetensors",
                        text_encoder=_UMT5,
                    ),
                ),
            ),  # fmt: skip
            title="Wan 2.2 TI2V-5B text/image-to-video (48-channel Wan 2.2 VAE)",
            trainer="tuner.trainers.wan22_ti2v:Wan22TI2VTrainer",
            fixture="tuner.fixtures.wan22_ti2v:FIXTURE",
            first_frame=0.5,  # one model for both tasks: half the video samples train text-to-video
        ),
        # Wan 2.1 I2V / FLF2V 14B: the 14B network with 36 input channels and CLIP image cross-attention;
        # the default targets already hold its image projections (add_k_proj / add_v_proj = k_img / v_img)
        replace(
            _WAN,
            name="wan_i2v",
            hub_repos=(
                ("480p", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"),
                ("720p", "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers"),
            ),
            comfy_files=(("480p", _wan21_i2v("i2v_480p")), ("720p", _wan21_i2v("i2v_720p"))),
            title="Wan 2.1 image-to-video 14B (480p, 720p; first frame + CLIP ViT-H)",
            trainer="tuner.trainers.wan_i2v:WanI2VTrainer",
            fixture="tuner.fixtures.wan_i2v:I2V_FIXTURE",
            first_frame=1.0,
            first_frame_required=_WAN_CLIP_REQUIRED,
        ),
        replace(
            _WAN,
            name="wan_flf2v",
            hub_repos=(("720p", "Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers"),),
            comfy_files=(("720p", _wan21_i2v("flf2v_720p")),),
            title="Wan 2.1 first-last-frame-to-video 14B (720p; first and last frame + CLIP ViT-H)",
            trainer="tuner.trainers.wan_i2v:WanFLF2VTrainer",
            fixture="tuner.fixtures.wan_i2v:FLF2V_FIXTURE",
            first_frame=1.0,
            first_frame_required=_WAN_CLIP_REQUIRED,
        ),
        _FLUX,
        # FLUX.1 Kontext: the dev network given a reference image; same module names
        replace(
            _FLUX,
            name="flux_kontext",
            hub_repos=(("dev", "black-forest-labs/FLUX.1-Kontext-dev"),),
            title="FLUX.1 Kontext dev image editing (one reference image)",
            trainer="tuner.trainers.flux:FluxKontextTrainer",
            fixture="tuner.fixtures.flux:KONTEXT_FIXTURE",
        ),
        # Chroma: FLUX.1-schnell with T5 only and a guidance approximator in place of the modulation
        # linears; the release keeps FLUX.1's names, fused layers and adapter targets
        replace(
            _FLUX,
            name="chroma",
            title="Chroma text-to-image (FLUX.1-schnell based, T5 only)",
            trainer="tuner.trainers.chroma:ChromaTrainer",
            layout="tuner.models.chroma_keys:CHROMA_LAYOUT",
            fixture="tuner.fixtures.chroma:FIXTURE",
            model_class="ChromaTransformer2DModel",
            configs="chroma",
            tokenizers=(("tokenizer", "black-forest-labs/FLUX.1-schnell:tokenizer_2"),),  # T5-XXL only
            hub_repos=(("HD", "lodestones/Chroma1-HD"),),
        ),
        _QWEN_IMAGE,
        # Qwen-Image-Edit 2509 / 2511: the same network given one to three control images
        replace(
            _QWEN_IMAGE,
            name="qwen_image_edit",
            hub_repos=(("2509", "Qwen/Qwen-Image-Edit-2509"), ("2511", "Qwen/Qwen-Image-Edit-2511")),
            comfy_files=(),
            title="Qwen-Image-Edit 2509 / 2511 image editing (1-3 control images)",
            trainer="tuner.trainers.qwen_image:QwenImageEditTrainer",
            fixture="tuner.fixtures.qwen_image:EDIT_FIXTURE",
        ),
        _HUNYUAN_VIDEO,
        _HUNYUAN_VIDEO15,
        # HunyuanVideo 1.5 I2V: the same network (other weights) given the first frame as condition
        # latents and SigLIP image tokens
        replace(
            _HUNYUAN_VIDEO15,
            name="hunyuan_video15_i2v",
            title="HunyuanVideo 1.5 image-to-video (8.3B, 480p / 720p I2V; first frame + SigLIP)",
            trainer="tuner.trainers.hunyuan_video15:HunyuanVideo15I2VTrainer",
            fixture="tuner.fixtures.hunyuan_video15:I2V_FIXTURE",
            first_frame=1.0,  # without it: the text-to-video pipeline's zero condition and image tokens
            hub_repos=tuple(
                (r, f"hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{r}_i2v") for r in ("480p", "720p")
            ),
            comfy_files=(
                (
                    "720p",
                    _comfy(
                        _HV15_COMFY,
                        transformer="diffusion_models/hunyuanvideo1.5_720p_i2v_fp16.safetensors",
                        **_HV15_PARTS,
                    )
                    + (
                        (
                            "image_encoder",
                            "Comfy-Org/sigclip_vision_384/sigclip_vision_patch14_384.safetensors",
                        ),
                    ),
                ),
            ),  # fmt: skip
        ),
        _FRAMEPACK,
        # FramePack's single-frame mode: one target image from one reference image (image editing)
        replace(
            _FRAMEPACK,
            name="framepack_1f",
            title="FramePack single-frame image editing (one target frame from one reference image)",
            trainer="tuner.trainers.framepack:FramePackOneFrameTrainer",
            fixture="tuner.fixtures.framepack:ONE_FRAME_FIXTURE",
            first_frame_required="the reference image is the edit's input; without it there is nothing to edit",
        ),
        _HIDREAM,
        _SD3,
        _FLUX2,
        # FLUX.2 klein 4B / 9B: the FLUX.2 network, smaller, without the guidance embedding, on Qwen3
        replace(
            _FLUX2,
            name="flux2_klein",
            title="FLUX.2 klein 4B / 9B text-to-image and multi-reference editing (Qwen3 text encoder)",
            trainer="tuner.trainers.flux2:Flux2KleinTrainer",
            fixture="tuner.fixtures.flux2:KLEIN_FIXTURE",
            tokenizers=(("tokenizer", "black-forest-labs/FLUX.2-klein-4B:tokenizer"),),  # Qwen3
            hub_repos=(
                ("4B", "black-forest-labs/FLUX.2-klein-4B"),
                ("9B", "black-forest-labs/FLUX.2-klein-9B"),
            ),
        ),
        _Z_IMAGE,
        _LUMINA2,
        _COSMOS_PREDICT2,
        # Cosmos-Predict2 Video2World: the same network and names with a condition-mask input channel
        replace(
            _COSMOS_PREDICT2,
            name="cosmos_predict2_v2w",
            title="Cosmos-Predict2 Video2World 2B, 14B (480p, 720p; video from its first frames)",
            trainer="tuner.trainers.cosmos_predict2_v2w:CosmosPredict2V2WTrainer",
            fixture="tuner.fixtures.cosmos_predict2:V2W_FIXTURE",
            first_frame=1.0,  # without it: no given latent frame, a zero condition mask (its own "none given")
            hub_repos=tuple((v, f"nvidia/Cosmos-Predict2-{v}-Video2World") for v in ("2B", "14B")),
        ),
        _SDXL,
        _KANDINSKY5,
        _LTX2,
        _LTX_VIDEO,
    )
}


def architecture(name: str) -> Architecture:
    """The record of `name`, or a `ConfigError` listing the known ones."""
    if name not in ARCHITECTURES:
        from tuner.config.fields import did_you_mean

        raise ConfigError(
            f"unknown architecture {name!r}.{did_you_mean(name, ARCHITECTURES)} Known: {', '.join(ARCHITECTURES)}."
        )
    return ARCHITECTURES[name]


def trainer_class(name: str) -> type:
    """Import and return the trainer class of architecture `name`."""
    return architecture(name).trainer_class()


def resolve_save_format(name: str, format: str) -> str:
    """The key layout `format` means for architecture `name`: "auto" is the record's `save_format` (the
    layout ComfyUI and diffusers both load); a layout stands for itself. `ConfigError` for an unknown
    architecture or format."""
    if format not in SAVE_FORMATS:
        raise ConfigError(f"unknown adapter format {format!r}; choose one of {', '.join(SAVE_FORMATS)}")
    return architecture(name).save_format if format == "auto" else format


def describe_architectures() -> str:
    """One line per architecture, for help texts."""
    width = max(map(len, ARCHITECTURES))
    return "\n".join(f"  {name:<{width}}  {record.title}" for name, record in ARCHITECTURES.items())
