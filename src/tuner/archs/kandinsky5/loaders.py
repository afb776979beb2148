"""Kandinsky 5.0 Video Lite (text to video): loading its transformer and text encoders, and model inputs.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder (`ai-forever/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers`, ...) or the
  release's single file (`kandinsky5lite_t2v_sft_5s.safetensors`, the same file ComfyUI loads; with or
  without `model.diffusion_model.`; fp8 files are dequantized). **The release is already
  diffusers-named** (`visual_transformer_blocks.0.self_attention.to_query.weight`: diffusers ported the
  original modules one to one, and the RoPE tables are not stored), so the single file is the diffusers
  state dict and the layout renames nothing;
* VAE: HunyuanVideo's (`tuner.archs.hunyuan_video.loaders.load_vae`, either layout). Latents are scaled by the
  VAE config's `scaling_factor`, as Kandinsky5T2VPipeline does: the diffusers folder's own value, or
  HunyuanVideo's shipped config (0.476986) for a single file;
* Qwen2.5-VL-7B-Instruct (`text_encoder`): as Qwen-Image's (`tuner.archs.qwen_image.text`), ComfyUI's
  `qwen_2.5_vl_7b.safetensors` + `tokenizer`, or the diffusers `text_encoder/` + `tokenizer/`;
* CLIP ViT-L/14 (`text_encoder_2`): as FLUX.1's, `clip_l.safetensors` + `tokenizer_2`, or the diffusers
  `text_encoder_2/` + `tokenizer_2/`.

The Lite T2V releases (pretrain, sft, nocfg, distilled16steps; 5 s and 10 s each) are one network of
identical shapes (2 text + 32 visual blocks of width 1792, `visual_cond`). What tells them apart is the
name of the file or folder (`release_name`): the 10 s models were trained with NABLA sparse attention
(the `lite-10s` config records it), and generation's defaults differ (`RELEASES`). tuner runs every
model with dense attention, which NABLA approximates (it keeps the blocks holding 90 % of the attention
mass): diffusers builds NABLA's block mask only for its `flex` attention backend, which has no backward
pass on CPU and is not one of tuner's backends. The Lite image model (another width and the
FLUX VAE), the I2V model and the 19B Pro models are not trained by this architecture.

Model inputs are what Kandinsky5T2VPipeline computes: the cleaned prompt inside the video template
(`PROMPT_TEMPLATE`), Qwen's last hidden states with the template's first `CROP_START` token rows
cropped (no attention mask: one caption at a time, its true length), CLIP's pooled output over 77
tokens; latents channel-last with zeros for the visual condition (T2V); timestep t · 1000 in the
model's dtype; RoPE positions and the pipeline's resolution-dependent RoPE scale.

RoPE in fp32: diffusers' (and the original code's) attention rounds the rotated queries and keys to
bf16 whatever the model's dtype (`apply_rotary` ends in `.to(torch.bfloat16)`). In bf16 that is the
model's own dtype; in fp32 it makes the output jump where an input change flips a rounding (two
adapters at half strength did not add up to one within 1e-5). tuner's loaders therefore rotate inside
the q/k norms' outputs, in fp32, rounded to the compute dtype first (`rotate_in_compute_dtype`): the same
numbers as upstream in bf16 (a test), exact fp32 rotation in fp32.

bf16: the model computes its sinusoidal time embedding in fp32 and feeds it to `time_embeddings`;
`Kandinsky5Transformer3DModel._keep_in_fp32_modules` (time embedding and modulations) must therefore
stay fp32 when the rest is bf16 — what `from_pretrained` and tuner's loaders do. A model cast whole
with `.to(torch.bfloat16)` fails with a dtype mismatch unless run under autocast (the original code
runs under autocast).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from tuner.archs.flux.loaders import load_clip
from tuner.archs.qwen_image.text import QwenTextEncoder
from tuner.archs.qwen_image.text import load_text_encoder as load_qwen
from tuner.errors import CheckpointError, ConfigError
from tuner.models.component import component_spec, load_component
from tuner.models.identify import Variant, variant_table
from tuner.models.loading import load_tokenizer, resolve_folder, second_text_encoder, sibling
from tuner.networks.architectures import COMFY_BARE_FORMS, ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

if TYPE_CHECKING:
    from diffusers import Kandinsky5Transformer3DModel
    from transformers import CLIPTextModel, PreTrainedTokenizerBase

CONFIGS = Path(__file__).parent / "configs"

# Kandinsky5T2VPipeline's `prompt_template` and `prompt_template_encode_start_idx` (tests compare them
# with the pipeline's own).
PROMPT_TEMPLATE = "\n".join(
    [
        "<|im_start|>system\nYou are a prompt engineer. Describe the video in detail.",
        "Describe how the camera moves or shakes, describe the zoom and view angle, whether it follows the objects.",
        "Describe the location of the video, main characters or objects and their action.",
        "Describe the dynamism of the video and presented actions.",
        "Name the visual style of the video: whether it is a professional footage, user generated content, some kind of animation, video game or scren content.",
        "Describe the visual effects, postprocessing and transitions if they are presented in the video.",
        "Pay attention to the order of key actions shown in the scene.<|im_end|>",
        "<|im_start|>user\n{}<|im_end|>",
    ]
)
CROP_START = 128
CLIP_LENGTH = 77
MAX_LENGTH = 512  # the pipeline's `max_sequence_length`: prompt tokens after the crop

# ---------------------------------------------------------------------------------------------------
# Known variants (release names = diffusers names). `None`: the tensor must be absent.
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("visual_embeddings.in_layer.weight", "text_embeddings.in_layer.weight",
     "pooled_text_embeddings.in_layer.weight",
     "visual_transformer_blocks.{}.visual_modulation.out_layer.weight",
     "text_transformer_blocks.{}.text_modulation.out_layer.weight"),
    {
        # every Lite T2V release; a `10s` name picks the sparse-attention config (`transformer_config`)
        "lite-5s": ((1792, 132), (1792, 3584), (512, 768), (32, (16128, 512)), (2, (10752, 512))),
        # the test fixture (tuner.archs.kandinsky5.fixture): 2 heads of 32, 1 text and 2 visual blocks
        "tiny": ((64, 132), (64, 64), (64, 32), (2, (576, 64)), (1, (384, 64))),
    },
)  # fmt: skip

# The Lite T2V releases as their file / folder names spell them, with the release's sampling defaults
# (steps, guidance; flow shift 10 for all): sft and pretrain 50 steps with CFG 5; nocfg is CFG-distilled
# (guidance 1); distilled16steps is step-distilled (16 steps, guidance 1).
RELEASES = {"sft": (50, 5.0), "pretrain": (50, 5.0), "nocfg": (50, 1.0), "distilled16steps": (16, 1.0)}
SAMPLE_SHIFT = 10.0
_RELEASE = re.compile(r"(sft|pretrain|nocfg|distilled16steps)[-_](5s|10s)", re.IGNORECASE)


def release_name(path: str | Path) -> tuple[str, str] | None:
    """(release, duration) from a Lite T2V file or folder name (`kandinsky5lite_t2v_nocfg_10s.safetensors`,
    `Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers`), e.g. ("nocfg", "10s"); None when the name does not say.
    Shapes cannot tell the releases apart."""
    found = _RELEASE.search(str(path))
    return (found.group(1).lower(), found.group(2).lower()) if found else None


KANDINSKY5_KEYS = ArchitectureKeys(
    "kandinsky5",
    tuple(
        (name, name)
        for name in (
            *(f"text_transformer_blocks.{{i}}.{m}" for m in (
                "text_modulation.out_layer", "self_attention.to_query", "self_attention.to_key",
                "self_attention.to_value", "self_attention.out_layer", "feed_forward.in_layer",
                "feed_forward.out_layer")),
            *(f"visual_transformer_blocks.{{i}}.{m}" for m in (
                "visual_modulation.out_layer", *(f"{a}.{p}" for a in ("self_attention", "cross_attention")
                for p in ("to_query", "to_key", "to_value", "out_layer")), "feed_forward.in_layer",
                "feed_forward.out_layer")),
            "time_embeddings.in_layer", "time_embeddings.out_layer", "text_embeddings.in_layer",
            "pooled_text_embeddings.in_layer", "visual_embeddings.in_layer", "out_layer.modulation.out_layer",
            "out_layer.out_layer",
        )
    ),
    same_names=True,
    comfy_forms=COMFY_BARE_FORMS,
)  # fmt: skip
"""The key table of Kandinsky 5: the release's names are diffusers' (linear layers listed so kohya
stems read back)."""
KANDINSKY5_LAYOUT = CheckpointLayout(KANDINSKY5_KEYS)

_MARKERS = (
    "visual_embeddings.in_layer.weight",
    "visual_transformer_blocks.0.visual_modulation.out_layer.weight",
)
TRANSFORMER_SPEC = component_spec(
    "Kandinsky 5 Lite transformer", "Kandinsky5Transformer3DModel", TRANSFORMER_VARIANTS, _MARKERS
)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def _refuse_i2v(path: str | Path) -> None:
    # a file's own name; a folder's name and its parent's (`...-I2V-...-Diffusers/transformer`)
    path = Path(path)
    names = path.name if path.is_file() else "/".join(path.parts[-2:])
    if re.search(r"i2v", names, re.IGNORECASE):
        raise CheckpointError(
            f"{path}: a Kandinsky 5 image-to-video model; tuner trains the text-to-video Lite models "
            "(kandinsky5lite_t2v_*). Point model.transformer at a T2V file or folder."
        )


def transformer_config(path: str | Path) -> Path:
    """The shipped config for a Lite single file: `lite-10s` (NABLA sparse attention) when its name says
    10s, else `lite-5s`."""
    release = release_name(path)
    return CONFIGS / "transformer" / ("lite-10s" if release and release[1] == "10s" else "lite-5s")


def load_transformer(path: str | Path, dtype: torch.dtype) -> Kandinsky5Transformer3DModel:
    """The Kandinsky 5 transformer from a diffusers folder or a single file, in eval mode, with its
    time embedding and modulations in fp32 (see the module docstring)."""
    _refuse_i2v(path)

    def config(variant: Variant) -> Path:  # a Lite release's duration is in its name only
        return transformer_config(path) if variant.name == "lite-5s" else variant.config_dir

    cls = "Kandinsky5Transformer3DModel"
    return rotate_in_compute_dtype(
        load_component(path, dtype, cls, "transformer", TRANSFORMER_SPEC, None, config)
    )


@functools.cache
def _rope_stashing_processor() -> type:
    """Kandinsky5AttnProcessor that hands the rotary table to the q/k norm hooks (`rotate_in_compute_dtype`)
    instead of rotating itself; everything else (backends, sparse attention) is upstream's."""
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5AttnProcessor

    class RopeInNormsProcessor(Kandinsky5AttnProcessor):
        def __call__(
            self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None
        ):
            device = hidden_states.device.type
            dtype = (
                torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden_states.dtype
            )
            for norm in (attn.query_norm, attn.key_norm):  # on the norms: a deep copy keeps its own
                norm._tuner_rope, norm._tuner_dtype = rotary_emb, dtype
            try:
                return super().__call__(attn, hidden_states, encoder_hidden_states, None, sparse_params)
            finally:
                attn.query_norm._tuner_rope = attn.key_norm._tuner_rope = None

    return RopeInNormsProcessor


def _rotate_output(norm: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
    """Forward hook of a q/k norm: RoPE as upstream applies it (the norm's output in the query's dtype,
    as fp32 pairs times the 2×2 table), without the rounding to bf16 after it."""
    rope = norm._tuner_rope
    if rope is None:
        return None
    x = output.to(norm._tuner_dtype).float()
    return (rope * x.reshape(*x.shape[:-1], -1, 1, 2)).sum(dim=-1).reshape(x.shape)


def rotate_in_compute_dtype(model: Kandinsky5Transformer3DModel) -> Kandinsky5Transformer3DModel:
    """Apply RoPE at the q/k norms' outputs without upstream's rounding to bf16 (module docstring).
    State-dict keys are unchanged."""
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Attention

    for attn in model.modules():
        if isinstance(attn, Kandinsky5Attention) and not isinstance(
            attn.processor, _rope_stashing_processor()
        ):
            attn.set_processor(_rope_stashing_processor()())
            for norm in (attn.query_norm, attn.key_norm):
                norm._tuner_rope = None
                norm.register_forward_hook(_rotate_output)
    return model


class TextEncoders(NamedTuple):
    """Kandinsky 5's two text encoders and their tokenizers, in eval mode."""

    qwen: QwenTextEncoder
    clip: CLIPTextModel
    clip_tokenizer: PreTrainedTokenizerBase


def load_text_encoders(
    qwen_path: str | Path,
    clip_path: str | Path | None,
    qwen_tokenizer: str | Path | None,
    clip_tokenizer: str | Path | None,
    dtype: torch.dtype,
) -> TextEncoders:
    """Qwen2.5-VL and CLIP-L with their tokenizers. `clip_path` may be None when `qwen_path` is a
    diffusers pipeline root or its `text_encoder/` (the sibling `text_encoder_2/` is used)."""
    folder = resolve_folder(qwen_path, "text_encoder")
    if clip_path is None:
        clip_path = second_text_encoder(qwen_path, "Kandinsky 5", "CLIP-L", "clip_l.safetensors")
    qwen = load_qwen(folder or qwen_path, qwen_tokenizer, dtype)
    clip_path = Path(clip_path)
    if (clip_path / "text_encoder_2" / "config.json").is_file():
        clip_path = clip_path / "text_encoder_2"
    clip, _ = load_clip(clip_path, dtype)
    found = sibling(clip_path, "tokenizer_2") if clip_path.is_dir() else None
    tokenizer = load_tokenizer(
        clip_tokenizer or found, clip_path, "CLIP (the tokenizer_2/ folder of Kandinsky 5)"
    )
    return TextEncoders(qwen, clip, tokenizer)


# ---------------------------------------------------------------------------------------------------
# Inputs for the transformer
# ---------------------------------------------------------------------------------------------------


def _templated(tokenizer: PreTrainedTokenizerBase, caption: str, max_length: int) -> str:
    """The caption in the template, shortened as the pipeline shortens it when its tokens run past
    CROP_START + max_length (it cuts the decoded overflow's length of characters off the text's end)."""
    text = PROMPT_TEMPLATE.format(caption)
    ids = tokenizer(text=text).input_ids
    if len(ids) > CROP_START + max_length:
        removed = tokenizer.decode(ids[CROP_START:-2][max_length - 2 :])
        if removed:
            text = text[: -len(removed)]
    return text


@torch.no_grad()
def encode_prompts(
    encoders: TextEncoders, captions: list[str], max_length: int = MAX_LENGTH
) -> list[dict[str, torch.Tensor]]:
    """Per caption {"text": [n, D_qwen], "pooled": [D_clip]}, as Kandinsky5T2VPipeline.encode_prompt.

    Each caption is cleaned as the pipeline cleans it and encoded alone, so its rows are the pipeline's
    for that prompt (the pipeline runs Qwen without an attention mask; a batch of unequal prompts would
    add padding rows the original model never attends to)."""
    from diffusers.pipelines.kandinsky5.pipeline_kandinsky import prompt_clean

    qwen = encoders.qwen
    captions = [prompt_clean(c) for c in captions]
    device = qwen.model.device
    texts = []
    for caption in captions:
        text = _templated(qwen.tokenizer, caption, max_length)
        ids = qwen.tokenizer(
            text=text, max_length=CROP_START + max_length, truncation=True, return_tensors="pt"
        )
        hidden = qwen.model(input_ids=ids.input_ids.to(device), output_hidden_states=True).hidden_states[-1]
        texts.append(hidden[0, CROP_START:])
    return [{"text": t, "pooled": p} for t, p in zip(texts, clip_pooled(encoders, captions))]


@torch.no_grad()
def clip_pooled(encoders: TextEncoders, captions: list[str]) -> torch.Tensor:
    """CLIP-L's pooled output [B, D] over 77 tokens, as the Kandinsky 5 and 6 pipelines compute it."""
    tokens = encoders.clip_tokenizer(
        captions, max_length=CLIP_LENGTH, truncation=True, padding="max_length", return_tensors="pt"
    ).to(encoders.clip.device)
    return encoders.clip(**tokens).pooler_output


def collate(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batch cached text entries: `text` zero-padded on the right to the longest, each row's `length`,
    and `pooled` stacked."""
    length = max(e["text"].shape[0] for e in entries)
    first = entries[0]["text"]
    text = first.new_zeros(len(entries), length, first.shape[-1])
    for i, entry in enumerate(entries):
        text[i, : entry["text"].shape[0]] = entry["text"]
    lengths = torch.tensor([e["text"].shape[0] for e in entries])
    return {"text": text, "length": lengths, "pooled": torch.stack([e["pooled"] for e in entries])}


def rope_scale(latents: torch.Tensor) -> tuple[float, float, float]:
    """The pipeline's RoPE scale for channel-last latents [B, F, H, W, C], by diffusers' own method
    (called unbound: it reads nothing else): (1, 2, 2) when both pixel sides are in 480..854, else
    (1, 3.16, 3.16)."""
    from diffusers import Kandinsky5T2VPipeline

    return Kandinsky5T2VPipeline._get_scale_factor(None, latents.shape[2] * 8, latents.shape[3] * 8)


def predict_velocity(
    model: Kandinsky5Transformer3DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    cond: Mapping[str, torch.Tensor],
) -> torch.Tensor:
    """The model's velocity [B, 16, F, H, W] for latents `noisy` [B, 16, F, H, W] at t ∈ [0, 1], given
    collated text (`collate`). Captions of unequal length run one sample at a time, each at its own
    length, as the original model's variable-length attention sees them."""
    lengths = cond["length"].tolist()
    groups = (
        [slice(0, len(lengths))] if len(set(lengths)) == 1 else [slice(i, i + 1) for i in range(len(lengths))]
    )
    out = [model(**model_inputs(model, noisy[s], t[s], {k: v[s] for k, v in cond.items()}), return_dict=False)
           for s in groups]  # fmt: skip
    return torch.cat(out).permute(0, 4, 1, 2, 3)


def model_inputs(model: Kandinsky5Transformer3DModel, noisy: torch.Tensor, t: torch.Tensor,
                 cond: Mapping[str, torch.Tensor]) -> dict:  # fmt: skip
    """The transformer's keyword arguments for samples whose captions are of one length (channels last;
    its output [B, F, H, W, 16])."""
    dtype = noisy.dtype
    x = noisy.permute(0, 2, 3, 4, 1)
    if model.config.visual_cond:  # text to video: no conditioning frames, zero mask
        x = torch.cat([x, torch.zeros_like(x), x.new_zeros(*x.shape[:-1], 1)], dim=-1)
    frames, height, width = x.shape[1:4]
    n = int(cond["length"][0])
    return {
        "hidden_states": x,
        "encoder_hidden_states": cond["text"][:, :n].to(dtype),
        "timestep": (t.float() * 1000).to(dtype),
        "pooled_projections": cond["pooled"].to(dtype),
        "visual_rope_pos": [torch.arange(n, device=x.device) for n in (frames, height // 2, width // 2)],
        "text_rope_pos": torch.arange(n, device=x.device),
        "scale_factor": rope_scale(x),
        "sparse_params": None,  # dense attention, also for the 10 s models (module docstring)
    }


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# Kandinsky5Transformer3DModel.forward with dense attention: the text blocks run in the prologue (their
# adapters are outside the stages' blocks), the visual blocks are the blocks. The contract suite checks the
# parts against the whole forward.


def embed(model: Kandinsky5Transformer3DModel, noisy: torch.Tensor, t: torch.Tensor,
          cond: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`predict_velocity`'s forward up to its first visual block, for a micro-batch whose captions are of
    one length: (visual tokens, text tokens after the text blocks, time embedding, visual rotary table)."""
    from tuner.archs.stages import call_block

    if len(set(cond["length"].tolist())) > 1:  # predict runs such samples one by one; one stage input cannot
        raise ConfigError(
            "key 'distributed.pipeline_microbatches': kandinsky5's pipeline stages take micro-batches of captions "
            "of one length; set it to the batch size (one sample each)."
        )
    inputs = model_inputs(model, noisy, t, cond)
    text = model.text_embeddings(inputs["encoder_hidden_states"])
    time = model.time_embeddings(inputs["timestep"]) + model.pooled_text_embeddings(
        inputs["pooled_projections"]
    )
    visual = model.visual_embeddings(inputs["hidden_states"])
    text_rope = model.text_rope_embeddings(inputs["text_rope_pos"]).unsqueeze(0)
    for block in model.text_transformer_blocks:
        text = call_block(model, block, text, time, text_rope)
    rope = model.visual_rope_embeddings(visual.shape[:-1], inputs["visual_rope_pos"], inputs["scale_factor"])
    return visual.flatten(1, 3), text, time, rope.flatten(1, 3)


def run_block(model: Kandinsky5Transformer3DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    from tuner.archs.stages import call_block

    visual, text, time, rope = carried
    return call_block(model, block, visual, text, time, rope, None), text, time, rope


def project_out(model: Kandinsky5Transformer3DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last visual block: tokens back to their grid, the output layer, channels first."""
    visual, text, time = carried[:3]
    p_t, p_h, p_w = model.config.patch_size
    b, _, frames, height, width = noisy.shape
    grid = visual.reshape(b, frames // p_t, height // p_h, width // p_w, -1)
    return model.out_layer(grid, text, time).permute(0, 4, 1, 2, 3)
