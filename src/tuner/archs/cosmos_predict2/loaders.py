"""Cosmos-Predict2 text-to-image (2B, 14B): loading its models and turning captions into model inputs.

NVIDIA's Cosmos-Predict2 is a DiT (`CosmosTransformer3DModel`, blocks `transformer_blocks`) over the
latents of the **Wan 2.1 VAE** (`tuner.archs.wan.loaders.load_vae` / `encode_video`; the pipeline scales the
normalized latents by `sigma_data` = 1.0, so they are exactly Wan's) with **T5-11B** text embeddings
(google-t5/t5-11b: d_model 1024, ReLU FFN; ComfyUI calls it `oldt5_xxl`). Loaders take either layout:

* transformer: a diffusers folder (`nvidia/Cosmos-Predict2-2B-Text2Image`'s `transformer/`, or the
  pipeline root), or the release's single file (`net.blocks.0.self_attn.q_proj.weight`, ...; NVIDIA's
  `model.pt` converted to safetensors, or ComfyUI's `cosmos_predict2_2B_t2i.safetensors`; with or without
  `net.` / `model.diffusion_model.`; scaled-fp8 files are dequantized). 2B and 14B are told apart by
  shapes, and so is Video2World (`Cosmos-Predict2-*-Video2World`, ComfyUI's
  `cosmos_predict2_2B_video2world_480p_16fps.safetensors`: one more input channel, the condition mask),
  which architecture `cosmos_predict2_v2w` trains; each architecture refuses the other's files, Cosmos 1.0
  files name `cosmos1_t2w` / `cosmos1_v2w` (`loaders_cosmos1`), and Predict2.5 files are refused.
  Video2World's 480p and 720p (and 10 / 16 fps) files hold the same network with the same RoPE scale
  (NVIDIA's `config_video2world.py` sets one `rope_*_extrapolation_ratio` per model size, whatever the
  resolution; diffusers' converter and ComfyUI agree): 2B (1, 3, 3), 14B (20/24, 2, 2);
* T5-11B: a diffusers folder (`text_encoder/`) or a single file in transformers' T5 layout.

**The padding mask.** Every released config sets `concat_padding_mask=True`: the patch embedding takes
one more input channel, a mask of padded pixels resized to the latent grid. Both diffusers pipelines pass
an all-zero mask (`latents.new_zeros(1, 1, height, width)`), and so does training on unpadded images.
diffusers resizes the mask with torchvision, which cannot be imported beside this torch, so the model is
built with the mask channel as an ordinary input channel (`in_channels + 1`, `concat_padding_mask=False`;
the weights and their names are unchanged) and `model_inputs` appends the zero channel itself.

**The parameterization.** Cosmos2TextToImagePipeline runs an EDM-style loop on σ ∈ [0.002, 80] and
calls the transformer on `c_in · x_σ` at timestep `t = σ / (1 + σ)` with `c_in = 1 − t`, then takes
`x̂0 = c_skip · x_σ + c_out · F` with `c_skip = 1 − t`, `c_out = −t`. With `x_σ = x0 + σ ε` that input is
`(1 − t) x0 + t ε`, exactly tuner's `x_t`, and `x̂0 = x_t − t F`: the network output F *is* the
flow-matching velocity ε − x0. So the model is called on `x_t` at `timestep = t` (in [0, 1], not ×1000)
and its output returned as is; `tests/test_cosmos_predict2_models.py` pins this against the pipeline's
own step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.cosmos_predict2.keys import COSMOS_PREDICT2_LAYOUT, RELEASE_PREFIX, is_release_only
from tuner.archs.flux import loaders as flux
from tuner.errors import CheckpointError
from tuner.models.component import diffusers_keys
from tuner.models.encoders import load_encoder
from tuner.models.identify import Variant, check_keys, pick_variant, variant_table, wrong_architecture
from tuner.models.loading import (
    cast_like_from_pretrained_,
    load_tensors,
    load_tensors_of,
    load_tokenizer,
    normalize_shapes,
    normalize_state_dict,
    read_folder_config,
    read_tensor_shapes,
    resolve_folder,
)
from tuner.networks.layouts import CheckpointLayout

if TYPE_CHECKING:
    from diffusers import CosmosTransformer3DModel
    from transformers import PreTrainedTokenizerBase, T5EncoderModel

CONFIGS = Path(__file__).parent / "configs"
SIGMA_DATA = 1.0  # Cosmos2TextToImagePipeline.sigma_data: normalized latents are multiplied by it

# ---------------------------------------------------------------------------------------------------
# Known variants (release names without `net.`; `None`: the tensor must be absent)
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("x_embedder.proj.1.weight", "blocks.0.cross_attn.k_proj.weight", "blocks.{}.mlp.layer1.weight"),
    {
        # nvidia/Cosmos-Predict2-2B-Text2Image: 16 heads of 128, 28 blocks, 16 + 1 input channels
        "2B-t2i": ((2048, 68), (2048, 1024), (28, (8192, 2048))),
        # nvidia/Cosmos-Predict2-14B-Text2Image: 40 heads of 128, 36 blocks
        "14B-t2i": ((5120, 68), (5120, 1024), (36, (20480, 5120))),
        # nvidia/Cosmos-Predict2-2B-Video2World (480p and 720p): 16 + 1 condition mask + 1 padding mask
        "2B-v2w": ((2048, 72), (2048, 1024), (28, (8192, 2048))),
        # nvidia/Cosmos-Predict2-14B-Video2World (480p and 720p)
        "14B-v2w": ((5120, 72), (5120, 1024), (36, (20480, 5120))),
        # the Video2World test fixture (tuner.fixtures.cosmos_predict2_v2w)
        "tiny-v2w": ((64, 72), (64, 64), (2, (256, 64))),
        # the test fixture (tuner.archs.cosmos_predict2.fixture): 2 heads of 32, 2 blocks, text dim 64
        "tiny": ((64, 68), (64, 64), (2, (256, 64))),
    },
)  # fmt: skip

# latent input channels of the released configs (`in_channels`): Video2World adds the condition mask
_T2I_CHANNELS, _V2W_CHANNELS = 16, 17

T5_VARIANTS = variant_table(
    CONFIGS / "text_encoder",
    ("shared.weight", "encoder.block.{}.layer.1.DenseReluDense.wi.weight"),
    {
        # google-t5/t5-11b's encoder (Cosmos-Predict2's text_encoder/; ComfyUI's oldt5_xxl_*.safetensors)
        "t5-11b": ((32128, 1024), (24, (65536, 1024))),
        "tiny": ((512, 64), (2, (128, 64))),
    },
)  # fmt: skip
# FLUX.1's T5 spec (the embedding tied to `shared`: single files may store either or both) with T5 v1.0's
# ReLU feed-forward (`wi`) as marker; T5 v1.1 / UMT5 (FLUX.1, Wan) have the gated `wi_0` / `wi_1`
_T5_MARKERS = ("shared.weight", "encoder.block.0.layer.1.DenseReluDense.wi.weight")
T5_SPEC = replace(
    flux.T5_SPEC, what="T5-11B text encoder", variants=T5_VARIANTS, original_markers=_T5_MARKERS
)


# ---------------------------------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    """What tells one Cosmos generation's transformer files apart and reads them: Predict2's (`PREDICT2`)
    and Cosmos 1.0's (`loaders_cosmos1.COSMOS1`) share the class and the release's `net.` prefix, not the
    names."""

    what: str
    """"Cosmos-Predict2 transformer", ..."""
    variants: tuple[Variant, ...]
    original_markers: tuple[str, ...]
    """Keys (without `net.`) of a file in the release's names."""
    diffusers_markers: tuple[str, ...]
    """Keys of a file in diffusers' names."""
    layout: CheckpointLayout
    is_release_only: Callable[[str], bool]
    """Release-file tensors that hold no network weight."""
    relatives: tuple[tuple[str, str], ...]
    """(marker key without `net.`, what such a file is and what to do): files a user may give by mistake."""
    architectures: tuple[str, str]
    """The architectures training its (text-to-image/world, Video2World) files."""
    models: tuple[str, str]
    """Their names in messages."""

    def release_keys(self, names) -> dict[str, str]:
        """Each network key of a release file (or ComfyUI's) -> the stored key: `net.` stripped, tensors
        that hold no weight left out."""
        return {k: s for k, s in strip_release_prefix(names).items() if not self.is_release_only(k)}

    def identify(self, path: str | Path) -> Variant:
        """The variant of a single transformer file, from its header; a relative's file is refused naming
        what it is."""
        stored = normalize_shapes(read_tensor_shapes(path))
        shapes = {k: stored[s] for k, s in self.release_keys(stored).items()}
        for marker, what in self.relatives:
            if marker in shapes:
                raise CheckpointError(f"{path}: this is {what}.")
        if all(k in shapes for k in self.diffusers_markers):
            shapes = {self._original_or_keep(k): v for k, v in shapes.items()}
        elif not all(k in shapes for k in self.original_markers):
            raise wrong_architecture(path, shapes, self.what, self.original_markers)
        variant = pick_variant(shapes, self.variants, path, self.what)
        expected = diffusers_keys("CosmosTransformer3DModel", self.layout.key_to_original)(variant)
        check_keys(expected, shapes, path, f"{self.what} {variant.name}")
        return variant

    def _original_or_keep(self, key: str) -> str:
        try:
            return self.layout.key_to_original(key)
        except KeyError:  # left as is, so that check_keys reports it as unexpected
            return key

    def check_model(self, path, in_channels: int, video2world: bool) -> None:
        """Refuse a Video2World file (`in_channels` 17) for the other model, and the other way round."""
        found = in_channels == _V2W_CHANNELS
        if found != video2world:
            raise CheckpointError(
                f"{path}: this is a {self.what.replace('transformer', self.models[found])} transformer; "
                f'train it with architecture = "{self.architectures[found]}" '
                f'("{self.architectures[video2world]}" takes {self.models[video2world]} checkpoints).'
            )

    def load_file(self, path: str | Path, dtype: torch.dtype, video2world: bool) -> CosmosTransformer3DModel:
        """The transformer of a single file in the release's names or diffusers'."""
        variant = self.identify(path)
        config = read_folder_config(variant.config_dir)
        self.check_model(path, config["in_channels"], video2world)
        stored = normalize_state_dict(load_tensors(path), dtype)
        tensors = {k: stored[s] for k, s in self.release_keys(stored).items()}
        if all(k in tensors for k in self.original_markers):
            tensors = self.layout.to_diffusers(tensors)
        return build_transformer(config, tensors, dtype, Path(path))


def strip_release_prefix(names) -> dict[str, str]:
    """Each key without NVIDIA's `net.` prefix (where the file uses it) -> the stored key."""
    normalized = {k: k for k in names}
    if any(k.startswith(RELEASE_PREFIX) for k in normalized):
        normalized = {k.removeprefix(RELEASE_PREFIX): k for k in normalized if k.startswith(RELEASE_PREFIX)}
    return normalized


_COSMOS1 = (
    'a Cosmos 1.0 Diffusion transformer; train it with architecture = "cosmos1_t2w" (Text2World) or '
    '"cosmos1_v2w" (Video2World)'
)
PREDICT2 = Generation(
    what="Cosmos-Predict2 transformer",
    variants=TRANSFORMER_VARIANTS,
    original_markers=("x_embedder.proj.1.weight", "blocks.0.self_attn.q_proj.weight"),
    diffusers_markers=("patch_embed.proj.weight", "transformer_blocks.0.attn1.to_q.weight"),
    layout=COSMOS_PREDICT2_LAYOUT,
    is_release_only=is_release_only,
    relatives=(
        ("blocks.block1.blocks.0.block.attn.to_q.0.weight", _COSMOS1),
        ("learnable_pos_embed.pos_emb_t", _COSMOS1),  # Cosmos 1.0 in diffusers' names
        ("crossattn_proj.0.weight", "a Cosmos-Predict2.5 transformer, which tuner does not train (yet)"),
        (
            "llm_adapter.embed.weight",
            'an Anima transformer (its LLM adapter); train it with architecture = "anima"',
        ),
    ),
    architectures=("cosmos_predict2", "cosmos_predict2_v2w"),
    models=("Text2Image", "Video2World"),
)
identify_transformer = PREDICT2.identify


def load_transformer(
    path: str | Path, dtype: torch.dtype, video2world: bool = False
) -> CosmosTransformer3DModel:
    """The Cosmos-Predict2 Text2Image (or, with `video2world`, Video2World) transformer from a diffusers
    folder or a single file, in eval mode, with its padding-mask channel taken as an ordinary input
    channel (see the module docstring). A checkpoint of the other model is refused naming its architecture."""
    folder = resolve_folder(path, "transformer")
    if folder is not None:
        config = read_folder_config(folder)
        if config.get("_class_name") != "CosmosTransformer3DModel":
            raise CheckpointError(
                f"{folder}: config.json describes a {config.get('_class_name')!r}, not a CosmosTransformer3DModel."
            )
        if (
            config.get("in_channels") not in (_T2I_CHANNELS, _V2W_CHANNELS)
            or config.get("img_context_dim_in")
            or config.get("use_crossattn_projection")
        ):
            raise CheckpointError(
                f"{folder}: not a Cosmos-Predict2 transformer (in_channels {config.get('in_channels')}; "
                "Predict2.5 is not supported yet)."
            )
        if config.get("extra_pos_embed_type") == "learnable":
            raise CheckpointError(
                f'{folder}: a Cosmos 1.0 Diffusion transformer; train it with architecture = "cosmos1_t2w" '
                '(Text2World) or "cosmos1_v2w" (Video2World).'
            )
        PREDICT2.check_model(folder, config["in_channels"], video2world)
        return build_transformer(config, load_folder_tensors(folder), dtype, folder)
    return PREDICT2.load_file(path, dtype, video2world)


def load_folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a diffusers transformer folder's `diffusion_pytorch_model*.safetensors`."""
    files = sorted(folder.glob("diffusion_pytorch_model*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no diffusion_pytorch_model*.safetensors in it.")
    return load_tensors_of(files)


def build_transformer(
    config: dict, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, path: Path
) -> CosmosTransformer3DModel:
    """A CosmosTransformer3DModel of `config` holding exactly `state_dict` (diffusers keys), its padding
    mask an input channel, cast the way `from_pretrained` casts."""
    from accelerate import init_empty_weights
    from diffusers import CosmosTransformer3DModel

    config = mask_as_input_channel(config)
    with init_empty_weights():
        model = CosmosTransformer3DModel.from_config(config)
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: cannot be loaded as a CosmosTransformer3DModel: {e}") from None
    cast_like_from_pretrained_(model, dtype)
    return model.eval()


def mask_as_input_channel(config: dict) -> dict:
    """A released config with its padding-mask channel as one more ordinary input channel (same weight
    shapes and names; no torchvision resize in the forward pass)."""
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    if config.get("concat_padding_mask", True):
        config.update(in_channels=config.get("in_channels", 16) + 1, concat_padding_mask=False)
    return config


def model_inputs(model: CosmosTransformer3DModel, noisy: torch.Tensor, t: torch.Tensor,
                 context: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    """The network's keyword arguments at `x_t` = `noisy` [B, 16, F, H, W], t ∈ [0, 1] [B], given T5 rows
    [B, L, 1024] zero-padded as the pipeline pads them (see the module docstring); its output is the
    velocity ε − x0."""
    b, c, f, h, w = noisy.shape
    mask_channels = model.config.in_channels - c  # the all-zero padding mask the pipelines pass
    return {
        "hidden_states": torch.cat([noisy, noisy.new_zeros(b, mask_channels, f, h, w)], dim=1),
        "timestep": t.to(noisy.dtype),
        "encoder_hidden_states": context.to(noisy.dtype),
    }


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# CosmosTransformer3DModel.forward as tuner calls it: the masks are in `hidden_states`' channels already
# (no condition_mask, padding_mask or attention_mask), no ControlNet residuals, text context only. The
# contract suite checks the parts against the whole forward.


def embed(model: CosmosTransformer3DModel, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block: (video tokens, text context, the embedded timestep and the
    timestep embedding (per token for a timestep per frame [B, 1, F, 1, 1]), rotary cos and sin, the
    learnable position embedding or empty)."""
    from tuner.archs.stages import optional

    latents, timestep = inputs["hidden_states"], inputs["timestep"]
    b, _, frames, height, width = latents.shape
    cos, sin = model.rope(latents, fps=inputs.get("fps"))
    extra = model.learnable_pos_embed(latents) if model.config.extra_pos_embed_type else None
    hidden = model.patch_embed(latents).flatten(1, 3)
    temb, embedded = model.time_embed(hidden, timestep.flatten())
    if timestep.ndim == 5:  # one per latent frame: spread over that frame's tokens
        p_t, p_h, p_w = model.config.patch_size
        grid = (frames // p_t, height // p_h, width // p_w)
        temb, embedded = (x.view(b, grid[0], 1, 1, -1).expand(-1, -1, *grid[1:], -1).flatten(1, 3)
                          for x in (temb, embedded))  # fmt: skip
    text = inputs["encoder_hidden_states"]
    if model.config.use_crossattn_projection:
        text = model.crossattn_proj(text)
    return hidden, text, embedded, temb, cos, sin, optional(extra, hidden)


def run_block(model: CosmosTransformer3DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    from tuner.archs.stages import call_block, given

    hidden, text, embedded, temb, cos, sin, extra = carried
    hidden = call_block(model, block, hidden, text, embedded, temb, (cos, sin), given(extra), None, None)
    return hidden, text, embedded, temb, cos, sin, extra


def project_out(model: CosmosTransformer3DModel, carried: tuple, latents: torch.Tensor) -> torch.Tensor:
    """The forward after its last block: output norm, projection, unpatchify to `latents`' frames and
    sides (each token's values are row, column, frame within its patch, then channel)."""
    hidden, _, embedded, temb = carried[:4]
    tokens = model.proj_out(model.norm_out(hidden, embedded, temb))
    p_t, p_h, p_w = model.config.patch_size
    frames, height, width = latents.shape[2:]
    grid = tokens.unflatten(2, (p_h, p_w, p_t, -1)).unflatten(1, (frames // p_t, height // p_h, width // p_w))
    return grid.permute(0, 7, 1, 6, 2, 4, 3, 5).flatten(6, 7).flatten(4, 5).flatten(2, 3)


# ---------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------


def load_text_encoder(
    path: str | Path, tokenizer_path: str | Path | None, dtype: torch.dtype
) -> tuple[T5EncoderModel, PreTrainedTokenizerBase]:
    """T5-11B and its tokenizer (`tokenizer_path`, else the pipeline's `tokenizer/` beside a diffusers
    `text_encoder/`), in eval mode."""
    from transformers import T5EncoderModel

    model, found = load_encoder(path, dtype, T5EncoderModel, "t5", ("text_encoder", "tokenizer"), T5_SPEC)
    what = "T5 tokenizer (the tokenizer/ folder of a Cosmos-Predict2 diffusers release, or google-t5/t5-11b)"
    return model, load_tokenizer(tokenizer_path or found, path, what)


@torch.no_grad()
def encode_prompts(
    text_encoder: T5EncoderModel,
    tokenizer: PreTrainedTokenizerBase,
    captions: list[str],
    max_length: int = 512,
) -> list[torch.Tensor]:
    """T5 embeddings of each caption at its true token length (with `</s>`): one [n, 1024] tensor each.

    As Cosmos2TextToImagePipeline: padded to `max_length` tokens and encoded with the attention mask;
    the pipeline then zeroes the rows past the prompt and gives the transformer all `max_length` rows
    without a mask, so whoever batches these must zero-pad them to `max_length` (`collate`).
    """
    device = text_encoder.device
    tokens = tokenizer(
        captions, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    )
    mask = tokens.attention_mask.bool().to(
        device
    )  # boolean, as the pipeline passes it (same rows, bit for bit)
    hidden = text_encoder(tokens.input_ids.to(device), attention_mask=mask).last_hidden_state
    return [h[:n].clone() for h, n in zip(hidden, mask.sum(dim=1).tolist())]


def collate(contexts: list[torch.Tensor], max_length: int = 512) -> torch.Tensor:
    """[B, max_length, D]: each caption's rows followed by zero rows, as the pipeline feeds them."""
    out = contexts[0].new_zeros(len(contexts), max_length, contexts[0].shape[-1])
    for i, ctx in enumerate(contexts):
        ctx = ctx[:max_length]
        out[i, : ctx.shape[0]] = ctx
    return out
