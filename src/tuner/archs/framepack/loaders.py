"""FramePack (lllyasviel's `FramePackI2V_HY`): loading its transformer and SigLIP, and building a section's inputs.

FramePack is HunyuanVideo's 13B network turned into an image-to-video model that generates a video one
*section* of latent frames at a time. Besides the noisy section it is fed, as tokens before it:

* `latents_clean`: the given image's latent frame (the prefix) and one clean history frame, patchified
  like the section (1×);
* `latents_history_2x`: two history frames through `proj_2x` (2×4×4 patches: 2× fewer tokens in time, 4×
  in space than 1×);
* `latents_history_4x`: sixteen history frames through `proj_4x` (4×8×8 patches);

each with the frame indices its RoPE uses (`indices_*`, 1-D: one set per batch), and the SigLIP image
embedding of the given image (`image_embeds`, last hidden state, before the text tokens). The release's
sampler (the pipeline's `inverted_anti_drifting`) generates the video from its end backwards, so the
"history" of a section is the frames *after* it. The indices of one section are the pipeline's:
`[prefix | padding | section | 1x | 2x | 4x]` numbered 0, 1, ... in that order, the prefix and the 1×
frame both going to `latents_clean`. A clip trained as one section (the one the sampler makes last, next
to the image: padding 0) is `section_indices`. FramePack-F1 samples forwards instead, its history the frames
*before* a section (`forward_section_indices`); the one-frame mode's indices are `one_frame_indices`.

Loaders take either layout:

* transformer: the diffusers folder (`lllyasviel/FramePackI2V_HY`), the release's single file
  (`FramePackI2V_HY_bf16.safetensors`, `..._fp8_e4m3fn`: lllyasviel's class, diffusers' names; with or
  without `model.diffusion_model.`), or the same weights in HunyuanVideo's Tencent names
  (`tuner.archs.framepack.keys`). A HunyuanVideo file (no history embedder) is refused naming
  `hunyuan_video`;
* SigLIP (`image_encoder`): the `image_encoder/` folder (+ `feature_extractor/`) of
  `lllyasviel/flux_redux_bfl` / the diffusers pipeline, or ComfyUI's `sigclip_vision_patch14_384.safetensors`
  (`vision_model.*`), with the shipped processor config;
* VAE, LLaVA-LLaMA-3 and CLIP-L: HunyuanVideo's (`tuner.archs.hunyuan_video.loaders`), and so is text encoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from tuner.archs.framepack.keys import FRAMEPACK_LAYOUT
from tuner.errors import CheckpointError
from tuner.models import encoders
from tuner.models.component import component_spec, load_component
from tuner.models.encoders import model_keys
from tuner.models.identify import SingleFileSpec, variant_table
from tuner.models.loading import read_folder_config, resolve_folder

if TYPE_CHECKING:
    from diffusers import HunyuanVideoFramepackTransformer3DModel
    from transformers import SiglipVisionModel

CONFIGS = Path(__file__).parent / "configs"
T = TypeVar("T")
CLASS_NAME = "HunyuanVideoFramepackTransformer3DModel"
HISTORY_SIZES = (1, 2, 16)  # clean history frames at 1×, 2× and 4× compression (the release's)
LATENT_WINDOW = 9  # the release's `latent_window_size`: latent frames per section

# ---------------------------------------------------------------------------------------------------
# Known variants. Signatures use HunyuanVideo's Tencent names (the layout's "original").
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("img_in.proj.weight", "clean_x_embedder.proj_4x.weight", "image_projection.up.weight",
     "double_blocks.{}.img_mod.linear.weight", "single_blocks.{}.linear2.weight"),
    {
        # FramePackI2V_HY and FramePack_F1_I2V_HY_20250503: one network, sampled differently
        "i2v": ((3072, 16, 1, 2, 2), (3072, 16, 4, 8, 8), (9216, 1152), (20, (18432, 3072)), (40, (3072, 15360))),
        # the test fixture (tuner.archs.framepack.fixture): 2 heads of 32, one block of each kind
        "tiny": ((64, 16, 1, 2, 2), (64, 16, 4, 8, 8), (192, 32), (1, (384, 64)), (1, (64, 320))),
    },
)  # fmt: skip

SIGLIP_VARIANTS = variant_table(
    CONFIGS / "siglip",
    ("vision_model.embeddings.patch_embedding.weight", "vision_model.encoder.layers.{}.layer_norm1.weight"),
    {
        # google/siglip-so400m-patch14-384, as lllyasviel/flux_redux_bfl's image_encoder holds it
        "so400m-patch14-384": ((1152, 3, 14, 14), (27, (1152,))),
        # the test fixture: 32×32 images in 8×8 patches (16 tokens), width 32, 2 layers
        "tiny": ((32, 3, 8, 8), (2, (32,))),
    },
)  # fmt: skip

_HISTORY_EMBEDDER = "clean_x_embedder."
_SIGLIP_PREFIX = "vision_model."
SIGLIP_SPEC = SingleFileSpec(
    "SigLIP vision encoder",
    SIGLIP_VARIANTS,
    model_keys("SiglipVisionModel", prefix=_SIGLIP_PREFIX),
    (_SIGLIP_PREFIX + "embeddings.patch_embedding.weight",),
)


def _hunyuan_video(path: str | Path) -> CheckpointError:
    """The error for a HunyuanVideo transformer given to `framepack`."""
    return CheckpointError(
        f"{path}: a HunyuanVideo transformer without FramePack's history embedder (clean_x_embedder), "
        'another model than FramePack. Set model.architecture = "hunyuan_video" to train it, or point '
        "model.transformer at a FramePack checkpoint (FramePackI2V_HY)."
    )


def _refuse_hunyuan_video(shapes: Mapping[str, tuple[int, ...]], path: Path) -> None:
    """A HunyuanVideo file (either layout) has no history embedder."""
    hunyuan = ("double_blocks.0.img_attn_qkv.weight", "transformer_blocks.0.attn.to_q.weight")
    if any(k in shapes for k in hunyuan) and not any(k.startswith(_HISTORY_EMBEDDER) for k in shapes):
        raise _hunyuan_video(path)


_ORIGINAL_MARKERS = ("double_blocks.0.img_attn_qkv.weight", "img_in.proj.weight")
_DIFFUSERS_MARKERS = ("transformer_blocks.0.attn.to_q.weight", "x_embedder.proj.weight")
TRANSFORMER_SPEC = component_spec(
    "FramePack transformer", "HunyuanVideoFramepackTransformer3DModel", TRANSFORMER_VARIANTS,
    _ORIGINAL_MARKERS, _DIFFUSERS_MARKERS, FRAMEPACK_LAYOUT.key_to_original,
    refuse=_refuse_hunyuan_video)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype) -> HunyuanVideoFramepackTransformer3DModel:
    """The FramePack transformer from a diffusers folder or a single file (either layout), in eval mode."""
    folder = resolve_folder(path, "transformer")
    if (
        folder is not None
        and read_folder_config(folder).get("_class_name") == "HunyuanVideoTransformer3DModel"
    ):
        raise _hunyuan_video(folder)
    return load_component(path, dtype, CLASS_NAME, "transformer", TRANSFORMER_SPEC,
                          lambda sd, _: FRAMEPACK_LAYOUT.to_diffusers(sd))  # fmt: skip


class ImageEncoder(NamedTuple):
    """SigLIP's vision tower and the processor that prepares its input (the pipeline's `feature_extractor`)."""

    model: SiglipVisionModel
    processor: object

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """`image_embeds` [B, tokens, width] of images [B, 3, H, W] in [-1, 1]: the last hidden state of the
        processed image, as HunyuanVideoFramepackPipeline.encode_image computes it."""
        param = next(self.model.parameters())
        pixels = self.processor(images=(images.float().cpu() + 1) / 2, return_tensors="pt", do_rescale=False)
        return self.model(pixel_values=pixels.pixel_values.to(param.device, param.dtype)).last_hidden_state


def load_image_encoder(path: str | Path, dtype: torch.dtype) -> ImageEncoder:
    """SigLIP from a diffusers folder (`image_encoder/`, `feature_extractor/` beside it) or a single file."""
    from transformers import SiglipImageProcessorPil, SiglipVisionModel

    folders = ("image_encoder", "feature_extractor")
    model, processor_dir = encoders.load_image_encoder(
        path, dtype, SiglipVisionModel, folders, SIGLIP_SPEC, _siglip_entries
    )
    return ImageEncoder(model, SiglipImageProcessorPil.from_pretrained(processor_dir, local_files_only=True))


def _siglip_entries(tensors: dict[str, T]) -> dict[str, T]:
    """SigLIP's entries under the releases' names (`vision_model.*`, as transformers 4 saved them; 5 drops
    the prefix)."""
    return {_SIGLIP_PREFIX + k.removeprefix(_SIGLIP_PREFIX): v for k, v in tensors.items()}


# ---------------------------------------------------------------------------------------------------
# A section's inputs
# ---------------------------------------------------------------------------------------------------


class SectionIndices(NamedTuple):
    """The 1-D RoPE frame indices of one section's inputs (the pipeline's `indices_*`)."""

    latents: torch.Tensor
    clean: torch.Tensor
    history_2x: torch.Tensor
    history_4x: torch.Tensor


def section_indices(window: int, padding: int = 0) -> SectionIndices:
    """Indices of a `window`-frame section `padding` frames after the prefix (inverted anti-drifting)."""
    prefix, _, latents, one, two, four = torch.arange(1 + padding + window + sum(HISTORY_SIZES)).split(
        [1, padding, window, *HISTORY_SIZES]
    )
    return SectionIndices(latents, torch.cat([prefix, one]), two, four)


def forward_section_indices(window: int) -> SectionIndices:
    """Indices of a `window`-frame section in F1's forward (vanilla) order, as FramePack-F1 trains and
    samples it (diffusers' `FramepackSamplingType.VANILLA`, musubi-tuner's `fpack_cache_latents.py --f1`):
    `[prefix | 4x | 2x | 1x | section]`, the history being the 19 frames *before* the section, oldest first."""
    two, four = HISTORY_SIZES[1:]
    prefix, history_4x, history_2x, one, latents = torch.arange(1 + sum(HISTORY_SIZES) + window).split(
        [1, four, two, 1, window]
    )
    return SectionIndices(latents, torch.cat([prefix, one]), history_2x, history_4x)


def section_paddings(sections: int, window: int = LATENT_WINDOW) -> list[int]:
    """The padding (frames between the image and the section) of each section in generation order, from
    the video's end to its start, as the release's sampler sets them: every section's own start, except
    that beyond 4 sections the far ones are placed at most 3 windows away (3, 2, ..., 2, 1, 0)."""
    if sections > 4:
        return [w * window for w in [3] + [2] * (sections - 3) + [1, 0]]
    return [k * window for k in reversed(range(sections))]


def one_frame_indices(
    window: int = LATENT_WINDOW,
    clean: tuple[int, ...] = (0,),
    target: int | None = None,
    no_post: bool = False,
) -> SectionIndices:
    """The one-frame mode's indices, as musubi-tuner's `fp_1f_*` dataset keys set them (its
    `fpack_cache_latents.py` one-frame cache, docs/framepack_1f.md): the target frame alone at `target`
    (default `window`), the reference images at `clean`, followed (unless `no_post`) by the zero "post" latent
    at 1 + `window`; the 2× and 4× history (zeros) at the indices after it. The defaults are its defaults."""
    target = window if target is None else target
    post = () if no_post else (1 + window,)
    start = 2 + window
    return SectionIndices(
        torch.tensor([target]),
        torch.tensor([*clean, *post]),
        torch.arange(start, start + HISTORY_SIZES[1]),
        torch.arange(start + HISTORY_SIZES[1], start + HISTORY_SIZES[1] + HISTORY_SIZES[2]),
    )


def split_history(
    history: torch.Tensor, forward: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """History latents [B, C, 19, H, W] (the frames after a section, nearest first) as 1×, 2×, 4× parts; a
    history of 18 frames has no 1× part (the one-frame mode without its post latent). `forward` (F1): the
    19 frames *before* a section in time order, 4× (oldest 16), 2×, then 1× (the latest)."""
    two, four = HISTORY_SIZES[1:]
    if forward:
        four, two, one = history.split([four, two, 1], dim=2)
        return one, two, four
    one, two, four = history.split([history.shape[2] - two - four, two, four], dim=2)
    return one, two, four


def section_inputs(
    model: HunyuanVideoFramepackTransformer3DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    cond: Mapping[str, torch.Tensor],
    guidance: float,
    indices: SectionIndices | None = None,
    forward: bool = False,
) -> dict:
    """The transformer's keyword arguments for a noisy section [B, 16, F, H, W] at t ∈ [0, 1], given collated text
    (`hunyuan_video.collate`), the image's latent frame `first_frame` [B, 16, 1, H, W] (the one-frame
    mode: its reference images' frames), the clean
    `history` [B, 16, 19, H, W] and `image_embeds`; called as the pipeline calls it (timestep and embedded
    guidance × 1000). `indices` default to the section `cond["padding"]` frames after the image (0 when
    absent: the section trained on a clip; generation sets it per section). `forward`: F1's history, the
    frames before the section oldest first (`split_history`)."""
    b, dtype = noisy.shape[0], noisy.dtype
    indices = indices if indices is not None else section_indices(noisy.shape[2], cond.get("padding", 0))
    one, two, four = split_history(cond["history"].to(dtype), forward)
    return {
        "hidden_states": noisy,
        "timestep": t.float() * 1000,
        "encoder_hidden_states": cond["text"].to(dtype),
        "encoder_attention_mask": cond["mask"],
        "pooled_projections": cond["pooled"].to(dtype),
        "image_embeds": cond["image_embeds"].to(dtype),
        "indices_latents": indices.latents,
        "guidance": torch.full((b,), guidance * 1000.0, device=noisy.device, dtype=dtype),
        "latents_clean": torch.cat([cond["first_frame"].to(dtype), one], dim=2),
        "indices_latents_clean": indices.clean,
        "latents_history_2x": two,
        "indices_latents_history_2x": indices.history_2x,
        "latents_history_4x": four,
        "indices_latents_history_4x": indices.history_4x,
    }


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# HunyuanVideoFramepackTransformer3DModel.forward on `section_inputs` (the history packed by the model's
# own `_pack_history_states`); the contract suite checks the parts against the whole forward.


def embed(model: HunyuanVideoFramepackTransformer3DModel, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block: (the history's then the section's tokens, the image's then the
    text's context tokens, conditioning embedding, the joint attention mask or empty (a batch of one keeps
    only its caption's rows instead), rotary cos and sin)."""
    from tuner.archs.stages import optional

    noisy, mask = inputs["hidden_states"], inputs["encoder_attention_mask"]
    b, _, _, height, width = noisy.shape
    p = model.config.patch_size

    def rope(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return model.rope(frame_indices=indices, height=height, width=width, device=noisy.device)

    hidden = model.x_embedder(noisy)
    clean, two, four = model.clean_x_embedder(inputs["latents_clean"], inputs["latents_history_2x"],
                                              inputs["latents_history_4x"])  # fmt: skip
    hidden, (cos, sin) = model._pack_history_states(
        hidden, clean, two, four, rope(inputs["indices_latents"]), rope(inputs["indices_latents_clean"]),
        rope(inputs["indices_latents_history_2x"]), rope(inputs["indices_latents_history_4x"]), height // p, width // p,
    )  # fmt: skip
    timestep = inputs["timestep"]
    temb, _ = model.time_text_embed(timestep, inputs["pooled_projections"], inputs["guidance"])
    image = model.image_projection(inputs["image_embeds"])
    text = torch.cat([image, model.context_embedder(inputs["encoder_hidden_states"], timestep, mask)], dim=1)
    kept = image.shape[1] + mask.sum(dim=1, dtype=torch.int)
    if b == 1:
        return hidden, text[:, : int(kept[0])], temb, optional(None, hidden), cos, sin
    joint = (
        torch.arange(hidden.shape[1] + text.shape[1], device=hidden.device)[None]
        < (hidden.shape[1] + kept)[:, None]
    )
    return hidden, text, temb, joint[:, None, None], cos, sin


def run_block(
    model: HunyuanVideoFramepackTransformer3DModel, block: torch.nn.Module, carried: tuple
) -> tuple:
    """One dual- or single-stream block (both take and return the two streams)."""
    from tuner.archs.stages import call_block, given

    hidden, text, temb, mask, cos, sin = carried
    hidden, text = call_block(model, block, hidden, text, temb, given(mask), (cos, sin))
    return hidden, text, temb, mask, cos, sin


def project_out(
    model: HunyuanVideoFramepackTransformer3DModel, carried: tuple, noisy: torch.Tensor
) -> torch.Tensor:
    """The forward after its last block: the section's tokens (the last ones) through the output norm and
    projection, unpatchified as HunyuanVideo's."""
    from tuner.archs.hunyuan_video.loaders import unpatchify

    hidden, temb = carried[0], carried[2]
    p, p_t = model.config.patch_size, model.config.patch_size_t
    frames, height, width = noisy.shape[2:]
    hidden = hidden[:, -(frames // p_t) * (height // p) * (width // p) :]
    return unpatchify(model.proj_out(model.norm_out(hidden, temb)), noisy, p_t, p)
