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
    save_format="comfy",  # the release uses diffusers' module names; both loaders read the comfy layout
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
    # kohya's `lora_unet_input_blocks_4_1_...` names: A1111, Forge, ComfyUI and diffusers all load them
    save_format="kohya",
)

ARCHITECTURES: dict[str, Architecture] = {
    record.name: record
    for record in (
        _WAN,
        # Wan 2.2 T2V A14B: two Wan 2.1 14B-shaped experts, switched at t = 0.875 (the release's boundary)
        replace(
            _WAN,
            name="wan22_t2v",
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
            title="Wan 2.2 image-to-video A14B (high- and low-noise 14B experts; first frame, no CLIP)",
            trainer="tuner.trainers.wan22:Wan22I2VTrainer",
            fixture="tuner.fixtures.wan22:I2V_FIXTURE",
            boundary=0.9,
        ),
        # Wan 2.2 TI2V-5B: one 5B Wan network on the Wan 2.2 VAE's 48 channels, text- and image-to-video
        replace(
            _WAN,
            name="wan22_ti2v",
            title="Wan 2.2 TI2V-5B text/image-to-video (48-channel Wan 2.2 VAE)",
            trainer="tuner.trainers.wan22_ti2v:Wan22TI2VTrainer",
            fixture="tuner.fixtures.wan22_ti2v:FIXTURE",
        ),
        # Wan 2.1 I2V / FLF2V 14B: the 14B network with 36 input channels and CLIP image cross-attention;
        # the default targets already hold its image projections (add_k_proj / add_v_proj = k_img / v_img)
        replace(
            _WAN,
            name="wan_i2v",
            title="Wan 2.1 image-to-video 14B (480p, 720p; first frame + CLIP ViT-H)",
            trainer="tuner.trainers.wan_i2v:WanI2VTrainer",
            fixture="tuner.fixtures.wan_i2v:I2V_FIXTURE",
        ),
        replace(
            _WAN,
            name="wan_flf2v",
            title="Wan 2.1 first-last-frame-to-video 14B (720p; first and last frame + CLIP ViT-H)",
            trainer="tuner.trainers.wan_i2v:WanFLF2VTrainer",
            fixture="tuner.fixtures.wan_i2v:FLF2V_FIXTURE",
        ),
        _FLUX,
        # FLUX.1 Kontext: the dev network given a reference image; same module names
        replace(
            _FLUX,
            name="flux_kontext",
            title="FLUX.1 Kontext dev image editing (one reference image)",
            trainer="tuner.trainers.flux:FluxKontextTrainer",
            fixture="tuner.fixtures.flux:KONTEXT_FIXTURE",
        ),
        _QWEN_IMAGE,
        # Qwen-Image-Edit 2509 / 2511: the same network given one to three control images
        replace(
            _QWEN_IMAGE,
            name="qwen_image_edit",
            title="Qwen-Image-Edit 2509 / 2511 image editing (1-3 control images)",
            trainer="tuner.trainers.qwen_image:QwenImageEditTrainer",
            fixture="tuner.fixtures.qwen_image:EDIT_FIXTURE",
        ),
        _SDXL,
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
