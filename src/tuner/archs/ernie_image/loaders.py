"""ERNIE-Image (base, Turbo): loading the transformer, and calling it as ErnieImagePipeline does.

The transformer (diffusers' `ErnieImageTransformer2DModel`, 8B: 36 single-stream blocks of width 4096
sharing one AdaLN modulation) attends over [image tokens, text tokens]. The release's names are
diffusers' (`layers.0.self_attention.to_q.weight`, `adaLN_modulation.1`, `final_linear`, ...): diffusers'
single-file converter (`convert_ernie_image_transformer_checkpoint_to_diffusers` in
`diffusers/loaders/single_file_utils.py`) only strips ComfyUI's `model.diffusion_model.` prefix, and
ComfyUI's `comfy/ldm/ernie/model.py` (`ErnieImageModel`) uses the same module names. So the transformer
loads from

* a diffusers folder (`transformer/` of `baidu/ERNIE-Image`, or the pipeline root);
* the single file (Comfy-Org's `ernie-image.safetensors` / `ernie-image-turbo.safetensors`, with or
  without `model.diffusion_model.`, fp8 files dequantized), read by diffusers' own converter.

The base model (about 50 steps, guidance 4) and Turbo (distilled to 8 steps, guidance 1) have the same
tensors: `turbo` in the file or folder name says which (`is_turbo`), which changes only the training warning.

Calling the model (`predict_velocity`): the normalized, 2x2-patchified FLUX.2 VAE latents [B, 128, H, W]
as they are (the transformer patchifies 1x1 itself), the timestep t · 1000 (the pipeline passes the
scheduler's timesteps), the text rows zero-padded to the batch's longest with each caption's length
(`text_lens`: the model masks the padded rows as keys and starts the image's rotary positions after the
text). It predicts the velocity noise − x0.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.models.component import component_spec, load_component
from tuner.models.identify import variant_table
from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

if TYPE_CHECKING:
    from diffusers import ErnieImageTransformer2DModel

CONFIGS = Path(__file__).parent / "configs"

TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("x_embedder.proj.weight", "text_proj.weight", "layers.{}.mlp.gate_proj.weight"),
    {
        # ERNIE-Image and ERNIE-Image-Turbo (8B): 36 blocks of width 4096, Ministral 3 3B's 3072-wide text
        "ernie-image": ((4096, 128, 1, 1), (4096, 3072), (36, (12288, 4096))),
        # the test fixture (tuner.archs.ernie_image.fixture): 2 heads of 32, 2 blocks, text width 32
        "tiny": ((64, 128, 1, 1), (64, 32), (2, (128, 64))),
    },
)  # fmt: skip

# The transformer's linear layers ({i}: block index), under the release's names, which are diffusers'
LINEAR_MODULES = (
    *(
        f"layers.{{i}}.{name}"
        for name in (
            "self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
            "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2",
        )
    ),
    "text_proj", "time_embedding.linear_1", "time_embedding.linear_2", "adaLN_modulation.1",
    "final_norm.linear", "final_linear",
)  # fmt: skip
ERNIE_IMAGE_KEYS = ArchitectureKeys(
    "ernie_image", tuple((name, name) for name in LINEAR_MODULES), same_names=True
)
"""The adapter name map: the release's names are diffusers' (ComfyUI's too)."""
ERNIE_IMAGE_LAYOUT = CheckpointLayout(ERNIE_IMAGE_KEYS)

TRANSFORMER_SPEC = component_spec(
    "ERNIE-Image transformer",
    "ErnieImageTransformer2DModel",
    TRANSFORMER_VARIANTS,
    ("x_embedder.proj.weight", "adaLN_modulation.1.weight", "layers.0.adaLN_sa_ln.weight"),
)


def is_turbo(path: str | Path) -> bool:
    """Whether a transformer file or folder is ERNIE-Image-Turbo, by its name (its shapes equal the base
    model's): the file's, or a diffusers folder's and its parent's (`ERNIE-Image-Turbo/transformer`)."""
    path = Path(path)
    names = [path.name] if path.is_file() else [path.name, path.parent.name]
    return any("turbo" in name.lower() for name in names)


def load_transformer(path: str | Path, dtype: torch.dtype) -> ErnieImageTransformer2DModel:
    """Load the ERNIE-Image transformer from a diffusers folder or a single file, in eval mode."""
    return load_component(
        path, dtype, "ErnieImageTransformer2DModel", "transformer", TRANSFORMER_SPEC, diffusers_converter=True
    )


def predict_velocity(
    model: ErnieImageTransformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_mask: torch.Tensor,
) -> torch.Tensor:
    """The velocity (noise − x0) for latents `noisy` [B, 128, H, W] at t ∈ [0, 1], given the text rows
    zero-padded to [B, L, D] with `prompt_mask` [B, L] marking each caption's real rows."""
    return model(
        hidden_states=noisy,
        timestep=(t * 1000).to(noisy.dtype),
        text_bth=prompt_embeds.to(noisy.dtype),
        text_lens=prompt_mask.to(noisy.device).sum(dim=1),
        return_dict=False,
    )[0]


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# ErnieImageTransformer2DModel.forward (sequence-first: tokens are [S, B, D], image tokens then text);
# the contract suite checks the parts against the whole forward.


def embed(model: ErnieImageTransformer2DModel, noisy: torch.Tensor, t: torch.Tensor, prompt_embeds: torch.Tensor,
          prompt_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`predict_velocity`'s forward up to its first layer: (image then text tokens [S, B, D], rotary table,
    the attention mask [B, 1, 1, S] (each caption's padding masked), the layers' modulation [B, 6D], the
    timestep embedding the final norm takes). Image tokens sit at (caption length, row, column), text
    token i at (i, 0, 0)."""
    b, _, height, width = noisy.shape
    p, device = model.patch_size, noisy.device
    rows, cols = height // p, width // p
    text, lengths = prompt_embeds.to(noisy.dtype), prompt_mask.to(device).sum(dim=1)
    image = model.x_embedder(noisy).transpose(0, 1)
    if model.text_proj is not None and text.numel() > 0:
        text = model.text_proj(text)
    length = text.shape[1]
    tokens = torch.cat([image, text.transpose(0, 1)], dim=0).contiguous()
    text_ids = torch.zeros(b, length, 3, device=device)
    text_ids[..., 0] = torch.arange(length, device=device, dtype=torch.float32)
    grid = torch.stack(torch.meshgrid(torch.arange(rows, device=device, dtype=torch.float32),
                                      torch.arange(cols, device=device, dtype=torch.float32), indexing="ij"), -1)  # fmt: skip
    image_ids = torch.cat([lengths.float().view(b, 1, 1).expand(-1, rows * cols, -1),
                           grid.reshape(1, -1, 2).expand(b, -1, -1)], dim=-1)  # fmt: skip
    rope = model.pos_embed(torch.cat([image_ids, text_ids], dim=1))
    kept = torch.arange(length, device=device)[None] < lengths[:, None]
    mask = torch.cat([kept.new_ones(b, rows * cols), kept], dim=1)[:, None, None]
    c = model.time_embedding(model.time_proj((t * 1000).to(noisy.dtype)).to(noisy.dtype))
    return tokens, rope, mask, model.adaLN_modulation(c), c


def run_block(model: ErnieImageTransformer2DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    """One layer; its six modulations spread over the sequence as the forward spreads them."""
    from tuner.archs.stages import call_block

    tokens, rope, mask, modulation, c = carried
    spread = [
        m.unsqueeze(0).expand(tokens.shape[0], -1, -1).contiguous() for m in modulation.chunk(6, dim=-1)
    ]
    return call_block(model, block, tokens, rope, spread, mask), rope, mask, modulation, c


def project_out(model: ErnieImageTransformer2DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last layer: final norm and linear on the image tokens, unpatchified."""
    from tuner.archs.stages import unpatchify

    tokens, c = carried[0], carried[-1]
    out = model.final_linear(model.final_norm(tokens, c).type_as(tokens))
    image = out[: (noisy.shape[-2] // model.patch_size) * (noisy.shape[-1] // model.patch_size)].transpose(
        0, 1
    )
    return unpatchify(image, *noisy.shape[-2:], model.patch_size)
