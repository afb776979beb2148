"""HunyuanVideo 1.5 (text to video): loading its four models and turning captions and videos into model inputs.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder (`hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v`, ...), or
  a single file in Tencent's names, of either layout (`tuner.archs.hunyuan_video15.keys`, told apart by
  its keys): Tencent's release (`transformer/480p_t2v/diffusion_pytorch_model.safetensors`, separate
  `double_blocks.0.img_attn_q.weight`, ...) or Comfy-Org's repackaged file
  (`hunyuanvideo1.5_720p_t2v_fp16.safetensors`, fused `double_blocks.0.img_attn_qkv.weight`); with or
  without `model.diffusion_model.`, fp16 / bf16 / scaled fp8 (dequantized; with `memory.fp8_base` a fused
  fp8 layer is split keeping its stored rows and scale).
  The 480p and 720p, T2V and I2V networks all have the same shapes (8.3B: 54 double blocks of 2048);
  their configs differ only in `target_size` (the pipeline's default resolution) and `task_type`, so the
  config is picked from the file or folder name (`720p` / `i2v` in it; 480p T2V otherwise), and a file
  named for the other task is refused naming the architecture that trains it. A HunyuanVideo 1.0 file
  is refused naming `hunyuan_video`;
* VAE (`AutoencoderKLHunyuanVideo15`, 32 channels, 16× spatial and 4× temporal compression): a diffusers
  folder, or a single file in Tencent's names (`encoder.down.0.block.0.conv1.conv.weight`, ComfyUI's
  `hunyuanvideo15_vae_fp16.safetensors`) or in diffusers' names;
* Qwen2.5-VL-7B (`text_encoder`): the diffusers folder's `Qwen2_5_VLTextModel`, or ComfyUI's
  `qwen_2.5_vl_7b*.safetensors` as Qwen-Image loads it (`tuner.archs.qwen_image.text`), of which only
  the language model is used;
* the ByT5 glyph encoder (`text_encoder_2`, Glyph-SDXL-v2's ByT5-small, a `T5EncoderModel`): a diffusers
  folder or a transformers-layout single file (ComfyUI's `byt5_small_glyphxl_fp16.safetensors`).
A single text-encoder file carries no tokenizer: pass the tokenizer folders (ByT5's is byte-level).

Model inputs are what HunyuanVideo15Pipeline computes: the prompt as the user turn of a chat with the
video system message (Qwen2.5-VL's chat template, generation prompt added), tokenized to `CROP_START` +
`max_length` tokens, the hidden states of the third-to-last layer (`hidden_states[-3]`) with the first
`CROP_START` rows cropped; the quoted text of the prompt (`"..."` or `“...”`), as `Text "a". Text "b". `,
through ByT5 (256 tokens; none quoted: no glyph tokens); latents z · 1.03682 (no shift); the timestep
× 1000 as a float. The transformer's input is the latents, the first-frame condition latents and a
one-channel mask stacked on channels (zeros for text to video), and 729 SigLIP image tokens (zeros for
text to video, which the model then masks out).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from tuner.archs.flux.loaders import t5_keys
from tuner.archs.hunyuan_image.loaders import refuse_hunyuan_image
from tuner.archs.hunyuan_video15.keys import (
    TENCENT_LAYOUT,
    transformer_key_to_original,
    transformer_to_diffusers,
)
from tuner.errors import CheckpointError
from tuner.models.component import diffusers_keys, load_component
from tuner.models.identify import (
    SingleFileSpec,
    Variant,
    identify_shapes,
)
from tuner.models.loading import (
    load_tensors,
    load_tokenizer,
    load_transformers_folder,
    normalize_shapes,
    normalize_state_dict,
    read_folder_config,
    read_tensor_shapes,
    resolve_folder,
    second_text_encoder,
    sibling,
)

if TYPE_CHECKING:
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel
    from transformers import PreTrainedTokenizerBase, Qwen2_5_VLTextModel, T5EncoderModel

CONFIGS = Path(__file__).parent / "configs"

# HunyuanVideo15Pipeline's prompt settings (its `system_message`, `prompt_template_encode_start_idx`,
# `tokenizer_max_length`, `tokenizer_2_max_length`, `vision_num_semantic_tokens`). The system message
# keeps the runs of spaces the pipeline's line continuations put in it.
SYSTEM_MESSAGE = (
    "You are a helpful assistant. Describe the video by detailing the following aspects:         "
    "1. The main content and theme of the video.         "
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.         "
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects.         "
    "4. background environment, light, style and atmosphere.         "
    "5. camera angles, movements, and transitions used in the video."
)
CROP_START = 108  # tokens before the prompt (with the real tokenizer), cropped off
HIDDEN_LAYERS_TO_SKIP = 2  # hidden_states[-3]
MAX_LENGTH = 1000  # prompt tokens after the crop
GLYPH_MAX_LENGTH = 256  # ByT5 tokens of the quoted text
IMAGE_TOKENS = 729  # SigLIP tokens of the first frame (27 × 27 patches)
# Qwen2.5-VL's chat template for messages whose content is a string (the pipeline's only use)
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_QUOTED = re.compile(r"\"(.*?)\"|“(.*?)”")

# ---------------------------------------------------------------------------------------------------
# Known variants. Signatures use Tencent's names; `None` means the tensor must be absent.
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = (
    Variant(  # 480p / 720p, T2V / I2V (and their step-distilled releases): one network shape
        "8.3B",
        CONFIGS / "transformer" / "480p_t2v",
        {
            "img_in.proj.weight": (2048, 65, 1, 1, 1),
            "txt_in.input_embedder.weight": (2048, 3584),
            "byt5_in.fc1.weight": (2048, 1472),
            "vision_in.proj.1.weight": (1152, 1152),
            "double_blocks.53.img_mod.linear.weight": (12288, 2048),
            "double_blocks.54.img_mod.linear.weight": None,
        },
    ),
    Variant(  # the test fixture (tuner.archs.hunyuan_video15.fixture): 2 heads of 32, one block
        "tiny",
        CONFIGS / "transformer" / "tiny",
        {
            "img_in.proj.weight": (64, 65, 1, 1, 1),
            "txt_in.input_embedder.weight": (64, 64),
            "byt5_in.fc1.weight": (2048, 64),
            "vision_in.proj.1.weight": (32, 32),
            "double_blocks.0.img_mod.linear.weight": (384, 64),
            "double_blocks.1.img_mod.linear.weight": None,
        },
    ),
)

VAE_VARIANTS = (
    Variant(
        "hunyuan_video15",
        CONFIGS / "vae" / "hunyuan_video15",
        {
            "encoder.conv_in.conv.weight": (128, 3, 3, 3, 3),
            "decoder.conv_in.conv.weight": (1024, 32, 3, 3, 3),
        },
    ),
    Variant(
        "tiny",
        CONFIGS / "vae" / "tiny",
        {"encoder.conv_in.conv.weight": (32, 3, 3, 3, 3), "decoder.conv_in.conv.weight": (64, 32, 3, 3, 3)},
    ),
)

BYT5_VARIANTS = (
    Variant(  # Glyph-SDXL-v2's ByT5-small (its vocabulary is taken from the file)
        "byt5-small-glyph",
        CONFIGS / "byt5" / "byt5-small-glyph",
        {
            "encoder.block.11.layer.1.DenseReluDense.wi_0.weight": (3584, 1472),
            "encoder.block.12.layer.1.DenseReluDense.wi_0.weight": None,
        },
    ),
    Variant(
        "tiny",
        CONFIGS / "byt5" / "tiny",
        {
            "encoder.block.0.layer.1.DenseReluDense.wi_0.weight": (128, 64),
            "encoder.block.1.layer.1.DenseReluDense.wi_0.weight": None,
        },
    ),
)

# HunyuanVideo 1.0 has single-stream blocks (1.5 has none); its double blocks fuse q/k/v as ComfyUI's 1.5 files do
_HUNYUAN_VIDEO_1_MARKERS = ("single_blocks.0.linear1.weight", "single_transformer_blocks.0.proj_mlp.weight")
_TENCENT_MARKER = "double_blocks.0.img_attn_q.weight"  # separate q/k/v: Tencent's release
_DIFFUSERS_MARKERS = ("transformer_blocks.0.attn.to_q.weight", "context_embedder_2.linear_1.weight")

TRANSFORMER_SPEC = SingleFileSpec(
    what="HunyuanVideo 1.5 transformer (ComfyUI's layout)",
    variants=TRANSFORMER_VARIANTS,
    expected_keys=diffusers_keys("HunyuanVideo15Transformer3DModel", transformer_key_to_original),
    original_markers=("double_blocks.0.img_attn_qkv.weight", "byt5_in.fc1.weight"),
    diffusers_markers=_DIFFUSERS_MARKERS,
    to_original=transformer_key_to_original,
)
"""Comfy-Org's files (fused q/k/v), and files saved in diffusers' names."""

TENCENT_TRANSFORMER_SPEC = replace(
    TRANSFORMER_SPEC,
    what="HunyuanVideo 1.5 transformer (Tencent's layout)",
    expected_keys=diffusers_keys("HunyuanVideo15Transformer3DModel", TENCENT_LAYOUT.key_to_original),
    original_markers=(_TENCENT_MARKER, "byt5_in.fc1.weight"),
    to_original=TENCENT_LAYOUT.key_to_original,
)
"""Tencent's release (separate q/k/v)."""

# The VAE in Tencent's names -> diffusers' (regex, replacement), applied in order.
_VAE_TO_DIFFUSERS = (
    (r"\.down\.(\d+)\.block\.(\d+)\.", r".down_blocks.\1.resnets.\2."),
    (r"\.down\.(\d+)\.downsample\.", r".down_blocks.\1.downsamplers.0."),
    (r"\.up\.(\d+)\.block\.(\d+)\.", r".up_blocks.\1.resnets.\2."),
    (r"\.up\.(\d+)\.upsample\.", r".up_blocks.\1.upsamplers.0."),
    (r"\.mid\.block_1\.", ".mid_block.resnets.0."),
    (r"\.mid\.block_2\.", ".mid_block.resnets.1."),
    (r"\.mid\.attn_1\.([qkv])\.", r".mid_block.attentions.0.to_\1."),
    (r"\.mid\.attn_1\.", ".mid_block.attentions.0."),
)
_VAE_TO_ORIGINAL = (
    (r"\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r".down.\1.block.\2."),
    (r"\.down_blocks\.(\d+)\.downsamplers\.0\.", r".down.\1.downsample."),
    (r"\.up_blocks\.(\d+)\.resnets\.(\d+)\.", r".up.\1.block.\2."),
    (r"\.up_blocks\.(\d+)\.upsamplers\.0\.", r".up.\1.upsample."),
    (r"\.mid_block\.resnets\.0\.", ".mid.block_1."),
    (r"\.mid_block\.resnets\.1\.", ".mid.block_2."),
    (r"\.mid_block\.attentions\.0\.to_([qkv])\.", r".mid.attn_1.\1."),
    (r"\.mid_block\.attentions\.0\.", ".mid.attn_1."),
)


def _rename(key: str, rules: tuple[tuple[str, str], ...]) -> str:
    for pattern, replacement in rules:
        key = re.sub(pattern, replacement, key)
    return key


def vae_key_to_original(key: str) -> str:
    """A diffusers `AutoencoderKLHunyuanVideo15` key in Tencent's names."""
    return _rename(key, _VAE_TO_ORIGINAL)


_vae_keys = diffusers_keys("AutoencoderKLHunyuanVideo15", vae_key_to_original)


VAE_SPEC = SingleFileSpec(
    what="HunyuanVideo 1.5 VAE",
    variants=VAE_VARIANTS,
    expected_keys=_vae_keys,
    original_markers=("encoder.down.0.block.0.conv1.conv.weight", "decoder.conv_in.conv.weight"),
    diffusers_markers=("encoder.down_blocks.0.resnets.0.conv1.conv.weight", "decoder.conv_in.conv.weight"),
    to_original=vae_key_to_original,
)


def _byt5_keys(variant: Variant) -> list[str]:
    return t5_keys(variant)


BYT5_SPEC = SingleFileSpec(
    what="ByT5 glyph text encoder",
    variants=BYT5_VARIANTS,
    expected_keys=_byt5_keys,
    original_markers=("shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight"),
    aliases={"encoder.embed_tokens.weight": "shared.weight"},
)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def _other_version(path: str | Path) -> CheckpointError:
    return CheckpointError(
        f"{path}: a HunyuanVideo 1.0 transformer (it has single-stream blocks), another network "
        'than HunyuanVideo 1.5\'s. Set model.architecture = "hunyuan_video" to train it, or point '
        "model.transformer at a HunyuanVideo 1.5 checkpoint (hunyuanvideo1.5_480p_t2v_*.safetensors)."
    )


def _check_task(path: str | Path, task: str) -> None:
    """Refuse a file or folder named for the other task (T2V and I2V networks have the same shapes)."""
    name = "/".join(Path(path).parts[-3:]).lower()
    other = {"t2v": "i2v", "i2v": "t2v"}[task]
    if other in name and task not in name:
        arch = {"t2v": "hunyuan_video15", "i2v": "hunyuan_video15_i2v"}[other]
        raise CheckpointError(
            f"{path}: named a HunyuanVideo 1.5 {other.upper()} checkpoint (same shapes as {task.upper()}, other "
            f'weights). Set model.architecture = "{arch}" to train it, or point model.transformer at a '
            f"{task.upper()} checkpoint."
        )


def transformer_config(path: str | Path, variant: Variant, task: str) -> Path:
    """The shipped config for a file of `variant` trained as `task`: the real ones differ only in the
    pipeline's default size (480p / 720p, from the name) and `task_type`."""
    if variant.name == "tiny":
        return CONFIGS / "transformer" / ("tiny_i2v" if task == "i2v" else "tiny")
    resolution = "720p" if "720" in "/".join(Path(path).parts[-3:]) else "480p"
    return CONFIGS / "transformer" / f"{resolution}_{task}"


def load_transformer(
    path: str | Path, dtype: torch.dtype, task: str = "t2v"
) -> HunyuanVideo15Transformer3DModel:
    """The HunyuanVideo 1.5 transformer from a diffusers folder or a single file, in eval mode."""
    _check_task(path, task)
    folder = resolve_folder(path, "transformer")
    spec = TRANSFORMER_SPEC
    if folder is not None:
        other = read_folder_config(folder).get("_class_name") == "HunyuanVideoTransformer3DModel"
    else:
        keys = normalize_shapes(read_tensor_shapes(path))
        refuse_hunyuan_image(keys, path)
        other = any(k in _HUNYUAN_VIDEO_1_MARKERS for k in keys)
        spec = TENCENT_TRANSFORMER_SPEC if _TENCENT_MARKER in keys else TRANSFORMER_SPEC
    if other:
        raise _other_version(folder or path)
    return load_component(
        path,
        dtype,
        "HunyuanVideo15Transformer3DModel",
        "transformer",
        spec,
        lambda sd, _: transformer_to_diffusers(sd),
        lambda variant: transformer_config(path, variant, task),
    )


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKLHunyuanVideo15:
    """The VAE from a diffusers folder or a single file (Tencent's or diffusers' names), in eval mode."""
    return load_component(path, dtype, "AutoencoderKLHunyuanVideo15", "vae", VAE_SPEC, _vae_to_diffusers)


def _vae_to_diffusers(state_dict: dict[str, torch.Tensor], _: Variant) -> dict[str, torch.Tensor]:
    return {_rename(k, _VAE_TO_DIFFUSERS): v for k, v in state_dict.items()}


class TextEncoders(NamedTuple):
    """HunyuanVideo 1.5's two text encoders and their tokenizers, in eval mode."""

    qwen: Qwen2_5_VLTextModel
    qwen_tokenizer: PreTrainedTokenizerBase
    byt5: T5EncoderModel
    byt5_tokenizer: PreTrainedTokenizerBase


def load_text_encoders(
    qwen_path: str | Path,
    byt5_path: str | Path | None,
    qwen_tokenizer: str | Path | None,
    byt5_tokenizer: str | Path | None,
    dtype: torch.dtype,
    model: str = "HunyuanVideo 1.5",
) -> TextEncoders:
    """Qwen2.5-VL's language model and the ByT5 glyph encoder with their tokenizers (`model`'s, for
    messages: HunyuanImage 2.1 loads its text encoders here too).

    `byt5_path` may be None when `qwen_path` is a diffusers pipeline root or its `text_encoder/` (the
    sibling `text_encoder_2/` is used); tokenizer paths may be None for diffusers folders.
    """
    qwen, found = load_qwen(qwen_path, dtype)
    if byt5_path is None:
        byt5_path = second_text_encoder(
            qwen_path, model, "the ByT5 glyph encoder", "byt5_small_glyphxl_fp16.safetensors"
        )
    byt5, found_2 = load_byt5(byt5_path, dtype)
    tokenizer = load_tokenizer(qwen_tokenizer or found, qwen_path, "Qwen2.5-VL tokenizer (tokenizer/)")
    if tokenizer.chat_template is None:
        tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return TextEncoders(
        qwen,
        tokenizer,
        byt5,
        load_tokenizer(byt5_tokenizer or found_2, byt5_path, "ByT5 tokenizer (tokenizer_2/)"),
    )


def load_qwen(path: str | Path, dtype: torch.dtype) -> tuple[Qwen2_5_VLTextModel, Path | None]:
    """Qwen2.5-VL's language model (HunyuanImage 2.1 loads it here too), and the tokenizer folder beside a
    diffusers folder (else None)."""
    from transformers import Qwen2_5_VLTextModel

    from tuner.archs.qwen_image import text as qwen_image_text

    folder = resolve_folder(path, "text_encoder")
    if folder is not None and read_folder_config(folder).get("model_type") == "qwen2_5_vl_text":
        return load_transformers_folder(Qwen2_5_VLTextModel, folder, dtype, "qwen2_5_vl_text"), sibling(
            folder, "tokenizer"
        )
    if folder is not None:  # a whole Qwen2.5-VL folder
        encoder = qwen_image_text.load_text_encoder(folder, sibling(folder, "tokenizer") or folder, dtype)
        return encoder.model.language_model, sibling(folder, "tokenizer")
    return qwen_image_text.load_single_file(Path(path), dtype).language_model.eval(), None


def load_byt5(path: str | Path, dtype: torch.dtype) -> tuple[T5EncoderModel, Path | None]:
    """The ByT5 glyph encoder (HunyuanImage 2.1's too), and the tokenizer folder beside a diffusers folder
    (else None)."""
    from transformers import T5Config, T5EncoderModel

    path = Path(path)
    if (path / "text_encoder_2" / "config.json").is_file():
        path = path / "text_encoder_2"
    folder = resolve_folder(path, "text_encoder_2")
    if folder is not None:
        return load_transformers_folder(T5EncoderModel, folder, dtype, "t5"), sibling(folder, "tokenizer_2")
    shapes = normalize_shapes(read_tensor_shapes(path))
    variant = identify_shapes(shapes, BYT5_SPEC, path)
    state_dict = normalize_state_dict(load_tensors(path), dtype)
    state_dict.pop("encoder.embed_tokens.weight", None)
    config = T5Config.from_pretrained(variant.config_dir)
    config.vocab_size = state_dict["shared.weight"].shape[0]  # Glyph-SDXL adds color / font tokens
    model = T5EncoderModel.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype)
    return model.eval(), None


# ---------------------------------------------------------------------------------------------------
# Inputs for the transformer
# ---------------------------------------------------------------------------------------------------


def glyph_text(caption: str) -> str | None:
    """The quoted text of a caption as the pipeline gives it to ByT5 (`Text "a". Text "b". `), or None."""
    found = [a or b for a, b in _QUOTED.findall(caption)]
    if len(found) > 1:
        found = list(dict.fromkeys(found))
    return ". ".join(f'Text "{t}"' for t in found) + ". " if found else None


@torch.no_grad()
def encode_prompts(
    encoders: TextEncoders, captions: list[str], max_length: int = MAX_LENGTH
) -> list[dict[str, torch.Tensor]]:
    """Per caption {"text": [n, D_qwen], "glyph": [g, D_byt5]} at their true lengths (g = 0 without
    quoted text), as HunyuanVideo15Pipeline.encode_prompt computes them; `collate` pads and masks."""
    qwen, tokenizer, byt5, byt5_tokenizer = encoders
    chats = [[{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": c or " "}]
             for c in captions]  # fmt: skip
    tokens = tokenizer.apply_chat_template(
        chats, add_generation_prompt=True, tokenize=True, return_dict=True, padding="max_length",
        max_length=CROP_START + max_length, truncation=True, return_tensors="pt",
    )  # fmt: skip
    mask = tokens["attention_mask"].to(qwen.device)
    hidden = qwen(
        input_ids=tokens["input_ids"].to(qwen.device), attention_mask=mask, output_hidden_states=True
    ).hidden_states[-(HIDDEN_LAYERS_TO_SKIP + 1)]
    hidden, mask = hidden[:, CROP_START:], mask[:, CROP_START:].bool()
    return [
        {
            "text": h[m],
            "glyph": glyph_states(byt5, byt5_tokenizer, glyph_text(c), GLYPH_MAX_LENGTH).to(h.dtype),
        }
        for c, h, m in zip(captions, hidden, mask)
    ]


def glyph_states(byt5: T5EncoderModel, tokenizer, text: str | None, max_length: int) -> torch.Tensor:
    """ByT5's last hidden state [g, D] of a caption's glyph text tokenized to `max_length`, at its true
    length; [0, D] for None (no quoted text). HunyuanImage 2.1 encodes its glyph text so too."""
    if text is None:
        return torch.zeros(0, byt5.config.d_model, device=byt5.device)
    ids = tokenizer(text, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    mask = ids.attention_mask.to(byt5.device)
    states = byt5(input_ids=ids.input_ids.to(byt5.device), attention_mask=mask.float())[0]
    return states[0][mask[0].bool()]


def _pad(rows: list[torch.Tensor], least: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [n_i, D] zero-padded on the right to the longest (at least `least`), and their 0/1 mask."""
    length = max([least] + [r.shape[0] for r in rows])
    out = rows[0].new_zeros(len(rows), length, rows[0].shape[-1])
    mask = torch.zeros(len(rows), length, dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]], mask[i, : r.shape[0]] = r, 1
    return out, mask


def collate(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batch cached text entries: `text` / `glyph` padded with their masks (`mask`, `glyph_mask`; a
    batch with no quoted text gets one masked glyph row)."""
    text, mask = _pad([e["text"] for e in entries])
    glyph, glyph_mask = _pad([e["glyph"] for e in entries])
    return {"text": text, "mask": mask, "glyph": glyph, "glyph_mask": glyph_mask}


@torch.no_grad()
def encode_video(vae: AutoencoderKLHunyuanVideo15, pixels: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, 32, 1 + (F-1)/4, H/16, W/16] of videos [B, 3, F, H, W] in [-1, 1]: the
    distribution's mode times the VAE's scaling factor (no shift), as the I2V pipeline encodes."""
    frames, height, width = pixels.shape[2:]
    if (frames - 1) % 4 or height % 16 or width % 16:
        raise ValueError(
            f"the HunyuanVideo 1.5 VAE needs 1 + 4k frames and sides divisible by 16, got {tuple(pixels.shape)}"
        )
    param = next(vae.parameters())
    pixels = pixels.to(param.device, param.dtype)
    # one video at a time: the VAE's mid-block attention builds a [B, L, L] causal mask that SDPA
    # broadcasts against its batch (fails for B > 1 in diffusers 0.42)
    latents = torch.cat([vae.encode(p.unsqueeze(0)).latent_dist.mode() for p in pixels])
    return latents * vae.config.scaling_factor


@torch.no_grad()
def decode_latents(vae: AutoencoderKLHunyuanVideo15, latents: torch.Tensor) -> torch.Tensor:
    """Videos [B, 3, F, H, W] in about [-1, 1] from normalized latents (the inverse of `encode_video`)."""
    param = next(vae.parameters())
    latents = latents.to(param.device, param.dtype) / vae.config.scaling_factor
    return torch.cat([vae.decode(z.unsqueeze(0)).sample for z in latents])  # one at a time, as encoding


def first_frame_condition(image_latents: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """The I2V condition channels [B, C + 1, F, H, W] for latents like `noisy`: the first frame's latent
    [B, C, 1, H, W] in latent frame 0 and zeros after it, then a mask channel that is 1 on frame 0."""
    b, c, f, h, w = noisy.shape
    frame_cond = noisy.new_zeros(b, c + 1, f, h, w)
    frame_cond[:, :c, :1] = image_latents.to(noisy)
    frame_cond[:, c, 0] = 1.0
    return frame_cond


def model_inputs(model: HunyuanVideo15Transformer3DModel, noisy: torch.Tensor, t: torch.Tensor,
                 cond: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # fmt: skip
    """The transformer's keyword arguments for latents `noisy` [B, C, F, H, W] at t ∈ [0, 1], given
    collated text.

    `cond` may hold the first-frame condition `cond_latents` [B, C + 1, F, H, W] (latents and mask) and
    `image_embeds` [B, 729, D] (I2V); text to video passes zeros for both, as the pipeline does.
    """
    b, c, f, h, w = noisy.shape
    dtype = noisy.dtype
    frame_cond = cond.get("cond_latents")
    if frame_cond is None:
        frame_cond = noisy.new_zeros(b, c + 1, f, h, w)
    image_embeds = cond.get("image_embeds")
    if image_embeds is None:
        image_embeds = noisy.new_zeros(b, IMAGE_TOKENS, model.config.image_embed_dim)
    return {
        "hidden_states": torch.cat([noisy, frame_cond.to(dtype)], dim=1),
        "timestep": (t.float() * 1000).to(dtype),  # a float timestep in the latents' dtype, as the pipeline's
        "encoder_hidden_states": cond["text"].to(dtype),
        "encoder_attention_mask": cond["mask"],
        "encoder_hidden_states_2": cond["glyph"].to(dtype),
        "encoder_attention_mask_2": cond["glyph_mask"],
        "image_embeds": image_embeds.to(dtype),
    }


def predict_velocity(model: HunyuanVideo15Transformer3DModel, noisy: torch.Tensor, t: torch.Tensor,
                     cond: Mapping[str, torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """The model's velocity (shape of `noisy`) on `model_inputs`."""
    return model(**model_inputs(model, noisy, t, cond), return_dict=False)[0]


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# HunyuanVideo15Transformer3DModel.forward without a MeanFlow timestep_r (training passes none); the
# contract suite checks the parts against the whole forward.


def embed(model: HunyuanVideo15Transformer3DModel, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block: (video tokens, context tokens, conditioning embedding, context
    mask, rotary cos and sin). The context is each sample's valid image tokens, glyph rows and prompt rows,
    then the invalid ones (the text's zeroed), each kind marked by its `cond_type_embed` row; all-zero image
    embeddings across the batch mean text to video (image tokens zeroed and masked)."""
    latents, timestep, images = inputs["hidden_states"], inputs["timestep"], inputs["image_embeds"]
    cos, sin = model.rope(latents)
    temb = model.time_embed(timestep, timestep_r=None)
    hidden = model.x_embedder(latents)
    mask = inputs["encoder_attention_mask"]
    text = model.context_embedder(inputs["encoder_hidden_states"], timestep, mask)
    glyph = model.context_embedder_2(inputs["encoder_hidden_states_2"])
    image = model.image_embedder(images)
    t2v = bool(torch.all(images == 0))
    if t2v:
        image = image * 0.0
    kinds = [model.cond_type_embed(torch.full_like(x[:, :, 0], k, dtype=torch.long))
             for k, x in enumerate((text, glyph, image))]  # fmt: skip
    text, glyph, image = text + kinds[0], glyph + kinds[1], image + kinds[2]
    image_mask = torch.full(image.shape[:2], not t2v, dtype=torch.bool, device=mask.device)
    mask, glyph_mask = mask.bool(), inputs["encoder_attention_mask_2"].bool()
    context, context_mask = [], []
    for x, m, g, gm, i, im in zip(text, mask, glyph, glyph_mask, image, image_mask, strict=True):
        context.append(
            torch.cat([i[im], g[gm], x[m], i[~im], torch.zeros_like(g[~gm]), torch.zeros_like(x[~m])])
        )
        context_mask.append(torch.cat([im[im], gm[gm], m[m], im[~im], gm[~gm], m[~m]]))
    return hidden, torch.stack(context), temb, torch.stack(context_mask), cos, sin


def run_block(model: HunyuanVideo15Transformer3DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    from tuner.archs.stages import call_block

    hidden, context, temb, mask, cos, sin = carried
    hidden, context = call_block(model, block, hidden, context, temb, mask, (cos, sin))
    return hidden, context, temb, mask, cos, sin


def project_out(model: HunyuanVideo15Transformer3DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last block: output norm, projection, unpatchify as HunyuanVideo's."""
    from tuner.archs.hunyuan_video.loaders import unpatchify

    hidden, _, temb = carried[:3]
    tokens = model.proj_out(model.norm_out(hidden, temb))
    return unpatchify(tokens, noisy, model.config.patch_size_t, model.config.patch_size)
