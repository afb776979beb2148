"""HunyuanVideo (text to video): loading its four models and turning captions and videos into model inputs.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder (`hunyuanvideo-community/HunyuanVideo`), or Tencent's single file
  (`hunyuan_video_720_cfgdistill_bf16.safetensors`, ComfyUI's `hunyuan_video_t2v_720p_bf16.safetensors`:
  `double_blocks.0.img_attn_qkv.weight`, ...; with or without `model.diffusion_model.`; fp8 files are
  dequantized), converted by `tuner.archs.hunyuan_video.keys` at any hidden size. A HunyuanVideo 1.5
  file (another network: `byt5_in`, `vision_in`, separate q/k/v, no single blocks) is refused naming
  `hunyuan_video15`;
* VAE: a diffusers folder, or ComfyUI's `hunyuan_video_vae_bf16.safetensors`, which already uses the
  diffusers `AutoencoderKLHunyuanVideo` names (`decoder.up_blocks.0.resnets.0.conv1.conv.weight`);
* LLaVA-LLaMA-3-8B's language model (`text_encoder`): a diffusers folder (`LlamaModel`), or ComfyUI's
  `llava_llama3_fp16.safetensors` / `llava_llama3_fp8_scaled.safetensors`, whose transformers
  `LlamaForCausalLM` names (`model.layers.0...`) lose their `model.` prefix; its `lm_head` (and the
  vision tower of a whole LLaVA file) are not used;
* CLIP-L (`text_encoder_2`): as FLUX.1's (`tuner.archs.flux.loaders`), ComfyUI's `clip_l.safetensors`.
A single text-encoder file carries no tokenizer: pass the tokenizer folders.

Model inputs are what HunyuanVideoPipeline computes: the prompt inside the video prompt template
(`PROMPT_TEMPLATE`), tokenized to `CROP_START` + `max_length` tokens, the Llama hidden states of the
third-to-last layer (`hidden_states[-3]`) with the template's first `CROP_START` tokens cropped off, and
the attention mask cropped alike; CLIP's pooled output over 77 tokens; latents z · 0.476986 (no shift)
in the VAE's 4× temporal, 8× spatial compression; timestep and embedded guidance × 1000.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from tuner.archs.flux.loaders import CLIP_SPEC
from tuner.archs.hunyuan_image.loaders import refuse_hunyuan_image
from tuner.archs.hunyuan_video.keys import transformer_key_to_original, transformer_to_diffusers
from tuner.errors import CheckpointError
from tuner.models.component import component_spec, diffusers_keys, load_component
from tuner.models.encoders import (
    DECODER_COLUMNS,
    clip_text_entries,
    load_clip_encoder,
    load_encoder,
    model_keys,
)
from tuner.models.identify import SingleFileSpec, variant_table
from tuner.models.loading import load_tokenizer, read_folder_config, resolve_folder, second_text_encoder

if TYPE_CHECKING:
    from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoTransformer3DModel
    from transformers import CLIPTextModel, LlamaModel, PreTrainedTokenizerBase

CONFIGS = Path(__file__).parent / "configs"
T = TypeVar("T")

# HunyuanVideoPipeline's DEFAULT_PROMPT_TEMPLATE (the official `dit-llm-encode-video` template). Its
# `crop_start` is the number of tokens before the prompt, <|begin_of_text|> included, with the real
# tokenizer; tuner's tiny tokenizer gives the same count (tests/test_hunyuan_video.py).
PROMPT_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: "
    "1. The main content and theme of the video."
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
    "4. background environment, light, style and atmosphere."
    "5. camera angles, movements, and transitions used in the video:<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
)
CROP_START = 95
HIDDEN_LAYERS_TO_SKIP = 2  # the pipeline's `num_hidden_layers_to_skip`: hidden_states[-3]
MAX_LENGTH = 256  # the pipeline's `max_sequence_length`: prompt tokens after the crop

# ---------------------------------------------------------------------------------------------------
# Known variants. Signatures use Tencent's names; `None` means the tensor must be absent.
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("img_in.proj.weight", "txt_in.input_embedder.weight", "vector_in.in_layer.weight",
     "guidance_in.mlp.0.weight", "double_blocks.{}.img_mod.linear.weight",
     "single_blocks.{}.linear2.weight"),
    {
        # HunyuanVideo T2V 720p (cfg-distilled; its 540p use is the same network)
        "720p": ((3072, 16, 1, 2, 2), (3072, 4096), (3072, 768), (3072, 256), (20, (18432, 3072)), (40, (3072, 15360))),
        # the test fixture (tuner.archs.hunyuan_video.fixture): 2 heads of 32, one block of each kind
        "tiny": ((64, 16, 1, 2, 2), (64, 64), (64, 32), (64, 256), (1, (384, 64)), (1, (64, 320))),
    },
)  # fmt: skip

VAE_VARIANTS = variant_table(
    CONFIGS / "vae",
    ("encoder.conv_in.conv.weight", "encoder.conv_out.conv.weight", "decoder.conv_in.conv.weight"),
    {
        "hunyuan_video": ((128, 3, 3, 3, 3), (32, 512, 3, 3, 3), (512, 16, 3, 3, 3)),
        "tiny": ((32, 3, 3, 3, 3), (32, 64, 3, 3, 3), (64, 16, 3, 3, 3)),
    },
)  # fmt: skip

LLAMA_VARIANTS = variant_table(
    CONFIGS / "llama",
    DECODER_COLUMNS,
    {
        "llava-llama-3-8b": ((128320, 4096), (32, (14336, 4096))),
        "tiny": ((1088, 64), (3, (128, 64))),
    },
)  # fmt: skip

_ORIGINAL_MARKERS = ("double_blocks.0.img_attn_qkv.weight", "img_in.proj.weight")
# HunyuanVideo 1.5, in Tencent's and in diffusers' names: its image and ByT5 glyph embedders
_HUNYUAN_VIDEO_15_MARKERS = ("vision_in.proj.0.weight", "cond_type_embedding.weight", "byt5_in.fc1.weight",
                             "image_embedder.linear_1.weight", "cond_type_embed.weight")  # fmt: skip


_vae_keys = diffusers_keys("AutoencoderKLHunyuanVideo")


def _framepack(path: str | Path) -> CheckpointError:
    """The error for a FramePack transformer (HunyuanVideo plus a history embedder) given to `hunyuan_video`."""
    return CheckpointError(
        f"{path}: a FramePack transformer (it has the history embedder clean_x_embedder), an image-to-video "
        'model trained on sections. Set model.architecture = "framepack" to train it.'
    )


def _hunyuan_video_15(path: str | Path) -> CheckpointError:
    """The error for a HunyuanVideo 1.5 transformer given to `hunyuan_video`."""
    return CheckpointError(
        f"{path}: a HunyuanVideo 1.5 transformer (it has the 1.5 image / glyph embedders and no single-stream "
        'blocks), another network than HunyuanVideo\'s. Set model.architecture = "hunyuan_video15" to train '
        "it, or point model.transformer at a HunyuanVideo (hunyuan_video_t2v_720p) checkpoint."
    )


def _refuse_other_networks(shapes: Mapping[str, tuple[int, ...]], path: Path) -> None:
    """HunyuanImage 2.1, HunyuanVideo 1.5 and FramePack files share block names with HunyuanVideo's."""
    refuse_hunyuan_image(shapes, path)
    if any(name in _HUNYUAN_VIDEO_15_MARKERS for name in shapes):
        raise _hunyuan_video_15(path)
    if any(name.startswith("clean_x_embedder.") for name in shapes):
        raise _framepack(path)


_DIFFUSERS_MARKERS = ("transformer_blocks.0.attn.to_q.weight", "x_embedder.proj.weight")
TRANSFORMER_SPEC = component_spec(
    "HunyuanVideo transformer", "HunyuanVideoTransformer3DModel", TRANSFORMER_VARIANTS,
    _ORIGINAL_MARKERS, _DIFFUSERS_MARKERS, transformer_key_to_original,
    refuse=_refuse_other_networks)  # fmt: skip
VAE_SPEC = SingleFileSpec(
    what="HunyuanVideo VAE",
    variants=VAE_VARIANTS,
    expected_keys=_vae_keys,
    original_markers=("encoder.conv_in.conv.weight", "decoder.up_blocks.0.resnets.0.conv1.conv.weight"),
)

# ComfyUI's Llama files are LlamaForCausalLM state dicts: the language model under `model.`, plus parts
# the encoder does not use.
_LLAMA_PREFIX = "model."
_LLAMA_UNUSED = ("lm_head.", "vision_tower.", "multi_modal_projector.", "image_newline")
LLAMA_SPEC = SingleFileSpec(
    "Llama text encoder",
    LLAMA_VARIANTS,
    model_keys("LlamaModel"),
    original_markers=("embed_tokens.weight", "layers.0.self_attn.q_proj.weight"),
)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype) -> HunyuanVideoTransformer3DModel:
    """The HunyuanVideo transformer from a diffusers folder or a single file (either layout), in eval mode."""
    folder = resolve_folder(path, "transformer")
    if folder is not None:
        class_name = read_folder_config(folder).get("_class_name")
        if class_name == "HunyuanVideo15Transformer3DModel":
            raise _hunyuan_video_15(folder)
        if class_name == "HunyuanVideoFramepackTransformer3DModel":
            raise _framepack(folder)
    return load_component(
        path, dtype, "HunyuanVideoTransformer3DModel", "transformer", TRANSFORMER_SPEC,
        lambda state_dict, _: transformer_to_diffusers(state_dict),
    )  # fmt: skip


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKLHunyuanVideo:
    """The causal 3D VAE from a diffusers folder or a single file (diffusers' names), in eval mode."""
    return load_component(path, dtype, "AutoencoderKLHunyuanVideo", "vae", VAE_SPEC)


class TextEncoders(NamedTuple):
    """HunyuanVideo's two text encoders and their tokenizers, in eval mode."""

    llama: LlamaModel
    llama_tokenizer: PreTrainedTokenizerBase
    clip: CLIPTextModel
    clip_tokenizer: PreTrainedTokenizerBase


def load_text_encoders(
    llama_path: str | Path,
    clip_path: str | Path | None,
    llama_tokenizer: str | Path | None,
    clip_tokenizer: str | Path | None,
    dtype: torch.dtype,
) -> TextEncoders:
    """LLaVA-LLaMA-3's language model and CLIP-L with their tokenizers.

    `clip_path` may be None when `llama_path` is a diffusers pipeline root or its `text_encoder/` (the
    sibling `text_encoder_2/` is used); tokenizer paths may be None for diffusers folders.
    """
    if clip_path is None:
        clip_path = second_text_encoder(llama_path, "HunyuanVideo", "CLIP-L", "clip_l.safetensors")
    llama, found = _load_llama(llama_path, dtype)
    clip, found_2 = _load_clip(clip_path, dtype)
    return TextEncoders(
        llama,
        load_tokenizer(
            llama_tokenizer or found, llama_path, "Llama 3 (the tokenizer/ folder of HunyuanVideo)"
        ),
        clip,
        load_tokenizer(
            clip_tokenizer or found_2, clip_path, "CLIP (the tokenizer_2/ folder of HunyuanVideo)"
        ),
    )


def _load_clip(path: str | Path, dtype: torch.dtype) -> tuple[CLIPTextModel, Path | None]:
    """FLUX.1's CLIP-L, in HunyuanVideo's folders (`text_encoder_2/`, `tokenizer_2/`)."""
    from transformers import CLIPTextModel

    folders = ("text_encoder_2", "tokenizer_2")
    return load_clip_encoder(path, dtype, CLIPTextModel, folders, CLIP_SPEC, clip_text_entries)


def _load_llama(path: str | Path, dtype: torch.dtype) -> tuple[LlamaModel, Path | None]:
    """The Llama language model, and the tokenizer folder beside it in a diffusers layout (else None)."""
    from transformers import LlamaModel

    folders = ("text_encoder", "tokenizer")
    return load_encoder(path, dtype, LlamaModel, "llama", folders, LLAMA_SPEC, entries=_llama_names)


def _llama_names(tensors: Mapping[str, T]) -> dict[str, T]:
    """A Llama file's entries under LlamaModel's names: `model.` dropped, unused parts left out."""
    named = {k.removeprefix(_LLAMA_PREFIX): v for k, v in tensors.items()}
    return {k: v for k, v in named.items() if not k.startswith(_LLAMA_UNUSED)}


# ---------------------------------------------------------------------------------------------------
# Inputs for the transformer
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_prompts(
    encoders: TextEncoders, captions: list[str], max_length: int = MAX_LENGTH
) -> list[dict[str, torch.Tensor]]:
    """Per caption {"text": [n, D_llama], "pooled": [D_clip]}, as HunyuanVideoPipeline.encode_prompt.

    Llama: the templated prompt padded to CROP_START + `max_length` tokens, hidden_states[-3] with the
    first CROP_START rows cropped; only the n rows the attention mask keeps are stored (the model never
    attends to the others: `collate` pads and masks them again). CLIP: the pooled output over 77 tokens.
    """
    llama, llama_tokenizer, clip, clip_tokenizer = encoders
    tokens = llama_tokenizer(
        [PROMPT_TEMPLATE.format(c) for c in captions], max_length=CROP_START + max_length,
        padding="max_length", truncation=True, return_tensors="pt",
    )  # fmt: skip
    mask = tokens.attention_mask.to(llama.device)
    hidden = llama(
        input_ids=tokens.input_ids.to(llama.device), attention_mask=mask, output_hidden_states=True
    ).hidden_states[-(HIDDEN_LAYERS_TO_SKIP + 1)]
    hidden, mask = hidden[:, CROP_START:], mask[:, CROP_START:].bool()
    clip_ids = clip_tokenizer(
        captions, padding="max_length", max_length=clip_tokenizer.model_max_length, truncation=True,
        return_tensors="pt",
    ).input_ids  # fmt: skip
    pooled = clip(clip_ids.to(clip.device), output_hidden_states=False).pooler_output
    return [{"text": h[m], "pooled": p} for h, m, p in zip(hidden, mask, pooled)]


def collate(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batch cached text entries: `text` zero-padded on the right to the longest, its `mask` (1 = a
    prompt token; the model counts a row's valid tokens from the left), and `pooled` stacked."""
    length = max(e["text"].shape[0] for e in entries)
    first = entries[0]["text"]
    text = first.new_zeros(len(entries), length, first.shape[-1])
    mask = torch.zeros(len(entries), length, dtype=torch.long, device=first.device)
    for i, entry in enumerate(entries):
        n = entry["text"].shape[0]
        text[i, :n], mask[i, :n] = entry["text"], 1
    return {"text": text, "mask": mask, "pooled": torch.stack([e["pooled"] for e in entries])}


@torch.no_grad()
def encode_video(vae: AutoencoderKLHunyuanVideo, pixels: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, 16, 1 + (F-1)/4, H/8, W/8] of videos [B, 3, F, H, W] in [-1, 1]: the
    distribution's mode (deterministic caching) times the VAE's scaling factor, which the pipeline
    divides by before decoding."""
    frames, height, width = pixels.shape[2:]
    if (frames - 1) % 4 or height % 8 or width % 8:
        raise ValueError(
            f"the HunyuanVideo VAE needs 1 + 4k frames and sides divisible by 8, got {tuple(pixels.shape)}"
        )
    param = next(vae.parameters())
    latents = vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode()
    return latents * vae.config.scaling_factor


@torch.no_grad()
def decode_latents(vae: AutoencoderKLHunyuanVideo, latents: torch.Tensor) -> torch.Tensor:
    """Videos [B, 3, F, H, W] in about [-1, 1] from normalized latents (the inverse of `encode_video`)."""
    param = next(vae.parameters())
    return vae.decode(latents.to(param.device, param.dtype) / vae.config.scaling_factor).sample


def model_inputs(model: HunyuanVideoTransformer3DModel, noisy: torch.Tensor, t: torch.Tensor,
                 cond: Mapping[str, torch.Tensor], guidance: float) -> dict[str, torch.Tensor]:  # fmt: skip
    """The transformer's keyword arguments for latents `noisy` [B, 16, F, H, W] at t ∈ [0, 1], given
    collated text (`collate`). `guidance` feeds the embedded guidance of the cfg-distilled model, × 1000 as
    the pipeline scales it (and the timestep)."""
    b = noisy.shape[0]
    embedded_guidance = None
    if model.config.guidance_embeds:
        embedded_guidance = torch.full((b,), guidance * 1000.0, device=noisy.device, dtype=noisy.dtype)
    return {
        "hidden_states": noisy,
        # fp32, as the pipeline's (its latents stay fp32); the model embeds it in fp32
        "timestep": t.float() * 1000,
        "encoder_hidden_states": cond["text"].to(noisy.dtype),
        "encoder_attention_mask": cond["mask"],
        "pooled_projections": cond["pooled"].to(noisy.dtype),
        "guidance": embedded_guidance,
    }


def predict_velocity(model: HunyuanVideoTransformer3DModel, noisy: torch.Tensor, t: torch.Tensor,
                     cond: Mapping[str, torch.Tensor], guidance: float) -> torch.Tensor:  # fmt: skip
    """The model's velocity (shape of `noisy`) on `model_inputs`."""
    return model(**model_inputs(model, noisy, t, cond, guidance), return_dict=False)[0]


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# HunyuanVideoTransformer3DModel.forward; the contract suite checks the parts against the whole forward.


def embed(model: HunyuanVideoTransformer3DModel, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block: (video tokens, text tokens, conditioning embedding, the joint
    attention mask [B, 1, 1, N] (the text's padding masked), rotary cos, rotary sin, the first frame's
    token-replace embedding or empty, the first frame's token count)."""
    from tuner.archs.stages import optional

    latents, text_mask = inputs["hidden_states"], inputs["encoder_attention_mask"]
    cos, sin = model.rope(latents)
    temb, replace = model.time_text_embed(
        inputs["timestep"], inputs["pooled_projections"], inputs["guidance"]
    )
    hidden = model.x_embedder(latents)
    text = model.context_embedder(inputs["encoder_hidden_states"], inputs["timestep"], text_mask)
    # the joint sequence is video then text tokens; a sample's text padding is at the end of its sequence
    length = hidden.shape[1] + text.shape[1]
    kept = hidden.shape[1] + text_mask.sum(dim=1, dtype=torch.int)
    mask = (torch.arange(length, device=hidden.device)[None] < kept[:, None])[:, None, None]
    p = model.config.patch_size
    first_frame = torch.tensor((latents.shape[-2] // p) * (latents.shape[-1] // p), device=hidden.device)
    return hidden, text, temb, mask, cos, sin, optional(replace, hidden), first_frame


def run_block(model: HunyuanVideoTransformer3DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    """One dual- or single-stream block (both take and return the two streams)."""
    from tuner.archs.stages import call_block, given

    hidden, text, temb, mask, cos, sin, replace, first_frame = carried
    hidden, text = call_block(
        model, block, hidden, text, temb, mask, (cos, sin), given(replace), int(first_frame)
    )
    return hidden, text, temb, mask, cos, sin, replace, first_frame


def project_out(model: HunyuanVideoTransformer3DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last block: output norm, projection, unpatchify to `noisy`'s shape."""
    hidden, temb = carried[0], carried[2]
    tokens = model.proj_out(model.norm_out(hidden, temb))
    return unpatchify(tokens, noisy, model.config.patch_size_t, model.config.patch_size)


def unpatchify(tokens: torch.Tensor, noisy: torch.Tensor, p_t: int, p: int) -> torch.Tensor:
    """Output tokens [B, N, C·p_t·p·p] (frame, row, column order; each token's values channel, then frame,
    row and column within its patch) → latents of `noisy`'s frames and sides."""
    b, _, frames, height, width = noisy.shape
    grid = tokens.reshape(b, frames // p_t, height // p, width // p, -1, p_t, p, p)
    return grid.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)
