"""HiDream-O1-Image's network: a Qwen3-VL that denoises pixels.

HiDream-O1 has no VAE and no separate text encoder. One Qwen3-VL (transformers' `Qwen3VLModel`: a vision
tower and a language model) reads one sequence, the prompt's tokens followed by the image's, and predicts
the clean image:

    [ chat-templated prompt ... <|boi_token|> <|tms_token|> ][ patch 0, patch 1, ..., patch N-1 ]
      text tokens: causal attention                  ^ t      image tokens: attend to everything

* Pixels in [-1, 1] are cut into 32×32 patches of 3·32·32 = 3072 values (channel-major, then rows, then
  columns inside a patch) and embedded by a two-layer bottleneck (`x_embedder`: 3072 → width/4 without a
  bias → width).
* The noise level enters as one token: the embedding of the last prompt token (`<|tms_token|>`) is
  replaced by `t_embedder1(t)`, a DiT timestep embedder (256 sinusoidal frequencies of 1000·t, cos before
  sin, max period 10000, then Linear-SiLU-Linear). Here t = 1 − σ: 0 is pure noise, 1 the clean image.
* Attention: the prompt's tokens attend causally (as the language model was trained); the timestep token
  and every image token attend to the whole sequence. Padding of a batch's shorter prompts is masked.
* Positions are Qwen3-VL's multimodal RoPE (t, h, w): the i-th prompt token is (i, i, i); the image patch
  at row r, column c is (4096, 4096 + r, 4096 + c), a fixed origin whatever the prompt's length.
* The decoder's final norm, then `final_layer2` (width → 3072), predicts each patch's clean pixels.

The vision tower reads reference images (image-to-image), which tuner does not train yet: it is loaded
(a checkpoint round-trips whole) and left unused; Qwen3-VL's DeepStack mergers, which the released
ComfyUI files leave out, are not built (`deepstack_visual_indexes` is empty in the shipped configs).

Facts: the module names and shapes, the embedders, the mask and the positions are those of the HiDream-O1
release as musubi-tuner's port holds them (`src/musubi_tuner/hidream_o1/qwen3_vl_transformers.py`,
`Qwen3VLModel._forward_generation`; `hidream_o1/utils.py`, `get_rope_index_fix_point`). Written here from
that description, not copied.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import Qwen3VLModel

PATCH_SIZE = 32
"""Pixels per patch side: sizes are multiples of 32."""
PATCH_VALUES = 3 * PATCH_SIZE * PATCH_SIZE
"""Values per patch token (RGB)."""
IMAGE_ORIGIN = 4096
"""The RoPE position the image grid starts at, on each of the three axes."""
FREQUENCIES = 256
"""Sinusoidal features of the timestep embedder."""


class TimestepEmbedder(nn.Module):
    """t ∈ [0, 1] → a token: sinusoidal features of 1000·t through Linear-SiLU-Linear (DiT's embedder)."""

    def __init__(self, width: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQUENCIES, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = FREQUENCIES // 2
        freqs = torch.exp(
            -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half
        )
        angles = (t.float() * 1000.0)[:, None] * freqs[None]
        features = torch.cat([angles.cos(), angles.sin()], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class PatchEmbedder(nn.Module):
    """A patch's 3072 pixel values → a token, through a narrow linear bottleneck (width / 4)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj1 = nn.Linear(PATCH_VALUES, width // 4, bias=False)
        self.proj2 = nn.Linear(width // 4, width)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj2(self.proj1(patches))


class PixelHead(nn.Module):
    """A token → its patch's 3072 predicted clean pixel values."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, PATCH_VALUES)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden)


class HiDreamO1Transformer(Qwen3VLModel):
    """Qwen3-VL with HiDream-O1's timestep token, patch embedder and pixel head (module names as released:
    `t_embedder1`, `x_embedder`, `final_layer2`)."""

    def __init__(self, config):
        super().__init__(config)
        width = config.text_config.hidden_size
        self.t_embedder1 = TimestepEmbedder(width)
        self.x_embedder = PatchEmbedder(width)
        self.final_layer2 = PixelHead(width)
        self.post_init()

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each decoder layer in backward (the training loop asks under diffusers' name;
        transformers' layers then checkpoint themselves in train mode, non-reentrant)."""
        self.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    def forward(
        self, input_ids: torch.Tensor, text_mask: torch.Tensor, patches: torch.Tensor, timestep: torch.Tensor,
        grid: tuple[int, int],
    ) -> torch.Tensor:  # fmt: skip
        """The clean patches [B, N, 3072] predicted from noisy `patches` [B, N, 3072] (row-major over the
        `grid` (rows, columns)) at `timestep` [B] (1 − σ), given the prompts' token ids [B, L] padded on
        the right, `text_mask` [B, L] marking the real ones (each prompt ends with its timestep token)."""
        hidden, cos, sin, mask = self.embed(input_ids, text_mask, patches, timestep, grid)
        for layer in self.language_model.layers:
            hidden = self.run_layer(layer, hidden, cos, sin, mask)
        return self.pixels(hidden, input_ids.shape[1])

    def embed(
        self, input_ids: torch.Tensor, text_mask: torch.Tensor, patches: torch.Tensor, timestep: torch.Tensor,
        grid: tuple[int, int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """`forward` up to the decoder layers: the sequence [B, L + N, width], its RoPE cos and sin, and the
        attention mask (what each layer takes)."""
        lengths = text_mask.sum(dim=1)
        text = self.language_model.embed_tokens(input_ids).clone()
        rows = torch.arange(text.shape[0], device=text.device)
        text[rows, lengths - 1] = self.t_embedder1(timestep).to(text.dtype)
        image = self.x_embedder(patches.to(text.dtype))
        hidden = torch.cat([text, image], dim=1)
        cos, sin = self.language_model.rotary_emb(hidden, sequence_positions(text_mask, grid))
        return hidden, cos, sin, attention_mask(text_mask, image.shape[1])

    @staticmethod
    def run_layer(layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """One decoder layer of `forward`."""
        return layer(hidden, position_embeddings=(cos, sin), attention_mask=mask)

    def pixels(self, hidden: torch.Tensor, text_length: int) -> torch.Tensor:
        """`forward` after the decoder layers: the image tokens' predicted patches."""
        return self.final_layer2(self.language_model.norm(hidden[:, text_length:]))


def sequence_positions(text_mask: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """The (t, h, w) RoPE positions [3, B, L + N] of padded prompts followed by a `grid` of image patches:
    i for the i-th prompt token on every axis (padding repeats 0, it is masked), and
    (4096, 4096 + row, 4096 + column) for the patches."""
    batch, length = text_mask.shape
    device = text_mask.device
    text = (torch.arange(length, device=device)[None] * text_mask).expand(3, batch, length)
    rows, cols = grid
    r, c = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    image = torch.stack([torch.zeros_like(r), r, c]).flatten(1) + IMAGE_ORIGIN
    return torch.cat([text, image[:, None].expand(3, batch, -1)], dim=2)


def attention_mask(text_mask: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """[B, 1, S, S] (True: may attend) for padded prompts followed by `image_tokens` patches: prompt tokens
    see the real prompt tokens up to themselves; the timestep token (each prompt's last) and the patches
    see every real token."""
    batch, length = text_mask.shape
    device = text_mask.device
    total = length + image_tokens
    valid = torch.cat([text_mask.bool(), torch.ones(batch, image_tokens, dtype=torch.bool, device=device)], 1)
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    sees_all = torch.zeros(batch, total, dtype=torch.bool, device=device)
    sees_all[:, length:] = True
    sees_all[torch.arange(batch, device=device), text_mask.sum(dim=1) - 1] = True
    allowed = (causal[None] | sees_all[:, :, None]) & valid[:, None, :]
    return allowed[:, None]


def patchify(pixels: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] → patch tokens [B, (H/32)·(W/32), 3072], row-major, each patch (C, 32, 32)."""
    b, c, h, w = pixels.shape
    p = PATCH_SIZE
    x = pixels.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def unpatchify(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`patchify`'s inverse: tokens [B, N, 3072] → images [B, 3, height, width]."""
    p = PATCH_SIZE
    b = tokens.shape[0]
    x = tokens.reshape(b, height // p, width // p, 3, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, 3, height, width)
