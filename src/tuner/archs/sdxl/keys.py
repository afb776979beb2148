"""Key names of SDXL in diffusers' layout and in the original (Stability's `sgm`) layout, both directions.

The original UNet numbers its blocks flatly where diffusers nests them. Facts of the original layout
(Stability's `sgm/modules/diffusionmodules/openaimodel.py`, matched against diffusers' single-file
converter and real checkpoints' key lists):

* `input_blocks.0.0` is `conv_in`; then each resolution level holds `layers_per_block` (2) entries of
  `[resnet, attention?]` and, except the last level, one downsampler entry `input_blocks.N.0.op`;
* `middle_block` is `[resnet, attention, resnet]`;
* `output_blocks` walk the levels bottom-up, `layers_per_block + 1` (3) entries each of `[resnet,
  attention?, upsampler?]`, the upsampler being the last module of a level's last entry;
* a resnet names its layers `in_layers.0` (norm1), `in_layers.2` (conv1), `emb_layers.1`
  (time_emb_proj), `out_layers.0` (norm2), `out_layers.3` (conv2), `skip_connection` (conv_shortcut);
* an attention module (`SpatialTransformer`) has diffusers' own inner names (`proj_in`,
  `transformer_blocks.N.attn1.to_q`, `ff.net.0.proj`, ...);
* the embeddings are `time_embed.0/2` and `label_emb.0.0/2` (diffusers' `add_embedding`), the output
  head `out.0` (norm) and `out.2` (conv).

The rules below are *generated* from that block structure (SDXL's three levels, attention on the
last two), so each one is a plain (diffusers, original) pair read in both directions. Every linear layer
an adapter can train is listed by its full name, so kohya's stems (`lora_unet_input_blocks_4_1_
transformer_blocks_0_attn1_to_q`, dots turned into underscores) read back. The tiny test fixture has the
same block structure with narrower layers and one transformer block per attention.

The VAE is the LDM autoencoder (`first_stage_model.*` in a bundled checkpoint), converted by FLUX.1's
`vae_to_original` / `vae_to_diffusers` (same layout, 4 levels). OpenCLIP ViT-bigG (the second text
encoder, `conditioner.embedders.1.model.*`) is converted to transformers' CLIP layout here: its
attention keeps q, k, v in one `in_proj_weight` and its projection is stored transposed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

# ---------------------------------------------------------------------------------------------------
# UNet
# ---------------------------------------------------------------------------------------------------

LAYERS_PER_BLOCK = 2
DOWN_ATTENTION = (False, True, True)  # per level, top (full resolution) to bottom
UP_ATTENTION = (True, True, False)  # per diffusers up block, bottom to top

RESNET_LAYERS: tuple[tuple[str, str], ...] = (
    ("norm1", "in_layers.0"),
    ("conv1", "in_layers.2"),
    ("time_emb_proj", "emb_layers.1"),
    ("norm2", "out_layers.0"),
    ("conv2", "out_layers.3"),
    ("conv_shortcut", "skip_connection"),
)
# the linear layers of an attention module (`{i}`: its transformer block), named alike in both layouts
ATTENTION_LINEARS: tuple[str, ...] = (
    "proj_in",
    "proj_out",
    *(
        f"transformer_blocks.{{i}}.{attn}.{layer}"
        for attn in ("attn1", "attn2")
        for layer in ("to_q", "to_k", "to_v", "to_out.0")
    ),  # fmt: skip
    "transformer_blocks.{i}.ff.net.0.proj",
    "transformer_blocks.{i}.ff.net.2",
)
EMBEDDINGS: tuple[tuple[str, str], ...] = (
    ("conv_in", "input_blocks.0.0"),
    ("time_embedding.linear_1", "time_embed.0"),
    ("time_embedding.linear_2", "time_embed.2"),
    ("add_embedding.linear_1", "label_emb.0.0"),
    ("add_embedding.linear_2", "label_emb.0.2"),
    ("conv_norm_out", "out.0"),
    ("conv_out", "out.2"),
)


def _resnet(diffusers: str, original: str) -> list[tuple[str, str]]:
    return [(f"{diffusers}.{d}", f"{original}.{o}") for d, o in RESNET_LAYERS]


def _attention(diffusers: str, original: str) -> list[tuple[str, str]]:
    # the linears by full name (kohya stems), then the module itself for its norms
    return [(f"{diffusers}.{name}", f"{original}.{name}") for name in ATTENTION_LINEARS] + [
        (diffusers, original)
    ]


def unet_rules() -> tuple[tuple[str, str], ...]:
    """(diffusers, original) module pairs of the whole SDXL UNet (see the module docstring)."""
    rules: list[tuple[str, str]] = list(EMBEDDINGS)
    levels = len(DOWN_ATTENTION)
    for level, attention in enumerate(DOWN_ATTENTION):
        for j in range(LAYERS_PER_BLOCK):
            entry = 1 + level * (LAYERS_PER_BLOCK + 1) + j
            rules += _resnet(f"down_blocks.{level}.resnets.{j}", f"input_blocks.{entry}.0")
            if attention:
                rules += _attention(f"down_blocks.{level}.attentions.{j}", f"input_blocks.{entry}.1")
        if level < levels - 1:
            entry = (level + 1) * (LAYERS_PER_BLOCK + 1)
            rules.append((f"down_blocks.{level}.downsamplers.0.conv", f"input_blocks.{entry}.0.op"))
    rules += _resnet("mid_block.resnets.0", "middle_block.0")
    rules += _attention("mid_block.attentions.0", "middle_block.1")
    rules += _resnet("mid_block.resnets.1", "middle_block.2")
    for block, attention in enumerate(UP_ATTENTION):
        for j in range(LAYERS_PER_BLOCK + 1):
            entry = block * (LAYERS_PER_BLOCK + 1) + j
            rules += _resnet(f"up_blocks.{block}.resnets.{j}", f"output_blocks.{entry}.0")
            if attention:
                rules += _attention(f"up_blocks.{block}.attentions.{j}", f"output_blocks.{entry}.1")
        if block < levels - 1:
            entry = block * (LAYERS_PER_BLOCK + 1) + LAYERS_PER_BLOCK
            rules.append(
                (
                    f"up_blocks.{block}.upsamplers.0.conv",
                    f"output_blocks.{entry}.{2 if attention else 1}.conv",
                )
            )
    return tuple(rules)


# Text-encoder adapters (`network.train_text_encoder`) are named `te1.<name>` (CLIP-L) and `te2.<name>`
# (bigG), `<name>` in transformers' names (`text_model.encoder.layers.0.self_attn.q_proj`). Their file
# stems are kohya's (`lora_te1_text_model_encoder_layers_0_self_attn_q_proj`), which kohya, A1111, Forge,
# ComfyUI and diffusers read, in the comfy layout too; diffusers' own layout says `text_encoder.` /
# `text_encoder_2.`, and `unet.` for the UNet's modules.
TEXT_ENCODER_STEMS = {"te1.": ("lora_te1_", "text_encoder."), "te2.": ("lora_te2_", "text_encoder_2.")}
BUNDLED_CLIP_L, BUNDLED_CLIP_G = "conditioner.embedders.0.transformer.", "conditioner.embedders.1.model."
UNET_DIFFUSERS_PREFIX = "unet."
# the linear layers of a CLIP text model an adapter may train (kohya's set)
CLIP_LINEARS = tuple(
    f"text_model.encoder.layers.{{i}}.{layer}"
    for layer in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1",
                  "mlp.fc2")
)  # fmt: skip
_CLIP_KOHYA = ArchitectureKeys("SDXL text encoder", tuple((n, n) for n in CLIP_LINEARS))


@dataclass(frozen=True)
class SDXLKeys(ArchitectureKeys):
    """The UNet's table, whose name map also names the stems of the text encoders' adapters and diffusers'
    `unet.` prefix itself (`stem`, and back: `name_of_stem`; see `tuner.networks.keys.NameMap`)."""

    def stem(self, name: str, layout: str) -> str | None:
        for part, (kohya, diffusers) in TEXT_ENCODER_STEMS.items():
            if name.startswith(part):
                inner = name[len(part) :]
                return diffusers + inner if layout == "diffusers" else kohya + inner.replace(".", "_")
        return UNET_DIFFUSERS_PREFIX + name if layout == "diffusers" else None

    def name_of_stem(self, stem: str) -> str | None:
        for part, (kohya, diffusers) in TEXT_ENCODER_STEMS.items():
            if stem.startswith(diffusers):
                return part + stem[len(diffusers) :]
            if stem.startswith(kohya):
                return part + _CLIP_KOHYA.from_kohya(stem[len(kohya) :])
        return stem[len(UNET_DIFFUSERS_PREFIX) :] if stem.startswith(UNET_DIFFUSERS_PREFIX) else None

    def checkpoint_weight(self, name: str) -> tuple[str, int, int] | None:
        """Where a text encoder's module sits in the bundled checkpoint (`tuner lora merge`): (stored key,
        part, parts): CLIP-L under `conditioner.embedders.0.transformer.` in transformers' names; bigG
        under `conditioner.embedders.1.model.` in OpenCLIP's, q / k / v being the thirds of `in_proj_weight`.
        None for the UNet's modules."""
        if name.startswith("te1."):
            return f"{BUNDLED_CLIP_L}{name[4:]}.weight", 0, 1
        if not name.startswith("te2."):
            return None
        inner = name[4:].removeprefix(TEXT_MODEL)
        if m := _QKV.fullmatch(f"{inner}.weight"):
            return f"{BUNDLED_CLIP_G}transformer.resblocks.{m[1]}.attn.in_proj_weight", "qkv".index(m[2]), 3
        return f"{BUNDLED_CLIP_G}{_OPEN_CLIP(inner)}.weight", 0, 1


# ComfyUI's `unet_to_diffusers`: kohya's diffusers-named stems, and diffusers' attention under `.processor.`
SDXL_KEYS = SDXLKeys("sdxl", unet_rules(), comfy_forms=("lora_unet_{d_}", "unet.{dp}", "{dp}"))
"""The adapter name map (diffusers module name -> original); no fused layers."""


@dataclass(frozen=True)
class SDXLLayout(CheckpointLayout):
    """The UNet checkpoint layout; its name map names the text encoders' stems too (`SDXLKeys.stem`)."""

    def stem(self, name: str, layout: str) -> str | None:
        return self.keys.stem(name, layout)


def is_text_encoder_module(name: str) -> bool:
    """Whether an adapter's module name is one of the text encoders' (`te1.` / `te2.`)."""
    return name.startswith(tuple(TEXT_ENCODER_STEMS))


def is_text_encoder_stem(stem: str) -> bool:
    """Whether an adapter file's stem names a text encoder's module, in any layout."""
    return stem.startswith(tuple(p for pair in TEXT_ENCODER_STEMS.values() for p in pair))


SDXL_LAYOUT = SDXLLayout(SDXL_KEYS)
"""The whole UNet checkpoint, both directions; `SDXL_LAYOUT.inverse` is the loaders' original -> diffusers
map."""

unet_key_to_original = SDXL_LAYOUT.key_to_original
unet_to_original = SDXL_LAYOUT.to_original
unet_to_diffusers = SDXL_LAYOUT.to_diffusers


# ---------------------------------------------------------------------------------------------------
# OpenCLIP ViT-bigG text tower <-> transformers' CLIPTextModelWithProjection
# ---------------------------------------------------------------------------------------------------

# (transformers, OpenCLIP) module renames; `{i}` is a layer index
OPEN_CLIP_RULES: tuple[tuple[str, str], ...] = (
    ("embeddings.token_embedding", "token_embedding"),
    ("encoder.layers.{i}.self_attn.out_proj", "transformer.resblocks.{i}.attn.out_proj"),
    ("encoder.layers.{i}.layer_norm1", "transformer.resblocks.{i}.ln_1"),
    ("encoder.layers.{i}.layer_norm2", "transformer.resblocks.{i}.ln_2"),
    ("encoder.layers.{i}.mlp.fc1", "transformer.resblocks.{i}.mlp.c_fc"),
    ("encoder.layers.{i}.mlp.fc2", "transformer.resblocks.{i}.mlp.c_proj"),
    ("final_layer_norm", "ln_final"),
)
_OPEN_CLIP = ArchitectureKeys("OpenCLIP bigG", OPEN_CLIP_RULES)
POSITIONS = ("embeddings.position_embedding.weight", "positional_embedding")
PROJECTION = ("text_projection.weight", "text_projection")  # OpenCLIP stores the transpose
_IN_PROJ = re.compile(r"transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)")
_QKV = re.compile(r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)")
OPEN_CLIP_IGNORED = ("logit_scale",)  # the contrastive temperature: no part of the text tower


TEXT_MODEL = "text_model."  # CLIPTextModelWithProjection's prefix of everything but the projection


def clip_g_to_original(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CLIPTextModelWithProjection state dict in OpenCLIP's layout (q, k, v fused into `in_proj`)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        key = key.removeprefix(TEXT_MODEL)
        if m := _QKV.fullmatch(key):
            qkv.setdefault((m[1], m[3]), {})[m[2]] = value
        elif key == POSITIONS[0]:
            out[POSITIONS[1]] = value
        elif key == PROJECTION[0]:
            out[PROJECTION[1]] = value.T.contiguous()
        else:
            out[_OPEN_CLIP(key)] = value
    for (layer, leaf), parts in qkv.items():
        out[f"transformer.resblocks.{layer}.attn.in_proj_{leaf}"] = torch.cat([parts[p] for p in "qkv"])
    return out


def clip_g_to_diffusers(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `clip_g_to_original` (`logit_scale` is left out)."""
    return {k if k == PROJECTION[0] else TEXT_MODEL + k: v for k, v in _open_clip_to_hf(state_dict).items()}


def _open_clip_to_hf(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in OPEN_CLIP_IGNORED:
            continue
        if m := _IN_PROJ.fullmatch(key):
            for part, chunk in zip("qkv", value.chunk(3), strict=True):
                out[f"encoder.layers.{m[1]}.self_attn.{part}_proj.{m[2]}"] = chunk.clone()
        elif key == POSITIONS[1]:
            out[POSITIONS[0]] = value
        elif key == PROJECTION[1]:
            out[PROJECTION[0]] = value.T.contiguous()
        else:
            out[_OPEN_CLIP.to_diffusers(key)] = value
    return out
