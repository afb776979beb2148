"""OmniGen2's diffusion transformer, written from the release's description (diffusers 0.42 has no class
for it; its `OmniGenTransformer2DModel` is OmniGen v1, a different network).

OmniGen2 (VectorSpaceLab, 2025) pairs Qwen2.5-VL-3B with a 4B Lumina-Image-2.0-style transformer. Facts
used here, all from the release's `omnigen2/models/transformers/transformer_omnigen2.py` and ComfyUI's
re-implementation (`comfy/ldm/omnigen/omnigen2.py`), which name every module the same way (so a
ComfyUI single file, `omnigen2_fp16.safetensors`, holds exactly the release's keys):

* every block is a Lumina 2 block (`OmniGen2TransformerBlock`): grouped-query self-attention with
  RMSNorm'd q and k, rotary positions applied to (q, k) as adjacent pairs, SDPA at the default scale
  1/√d; a SwiGLU MLP whose width is 4·dim rounded up to `multiple_of`; sandwich RMSNorms (`norm1` before,
  `norm2` after attention, `ffn_norm1` / `ffn_norm2` around the MLP); in the modulated blocks `norm1`
  is `LuminaRMSNormZero` (scale of the attention input, tanh gates of both residuals, scale of the MLP
  input from SiLU(temb)). That is diffusers' `Lumina2TransformerBlock` line for line (same modules,
  names and wiring, checked against a plain-torch computation in `tests/test_omnigen2_models.py`), so
  this file builds on it rather than writing a second copy;
* four block lists: `context_refiner` (text alone, unmodulated), `noise_refiner` (the noisy image
  alone, modulated), `ref_image_refiner` (each reference image alone, modulated) and `layers` (the joint
  sequence [text, reference images, image]);
* the time embedding is Lumina 2's (sinusoids of 256 channels, cos first, then a 2-layer MLP to
  min(dim, 1024)), taken of `timestep_scale` · τ (1000 in the release); the text goes through RMSNorm +
  linear (`time_caption_embed.caption_embedder`);
* Omni-RoPE: three axes (40 + 40 + 40 of the 120-dim heads); text token i sits at (i, i, i); the image
  token at row r, column c at (L, r, c) with L the text's true length (reference images take (L + shift,
  r, c), each shifting the first axis on by its larger side). Lumina 2 puts text at (i, 0, 0), so the
  rotary table here is this file's own (`OmniGen2RotaryPosEmbed`);
* the output is `LuminaLayerNormContinuous` (LayerNorm without affine, scaled by 1 + linear(SiLU(temb)))
  and a linear to the 2×2×16 patch values; time runs from noise (τ = 0) to image (τ = 1) and the model
  predicts dx/dτ = image − noise (ComfyUI calls it at 1 − t and negates the result, as tuner does).

What the description left open, and how tuner decides it:

* reference images (editing, in-context generation) are not implemented: diffusion-pipe, the tool that
  trains OmniGen2, trains text-to-image only. Their weights (`ref_image_patch_embedder`,
  `ref_image_refiner`, `image_index_embedding`) are part of the checkpoint, so they load and save
  (strict key checks hold), and no default adapter target touches them; the text-to-image forward never
  runs them (in the release, text-to-image runs them on empty sequences, which changes nothing);
* the joint attention mask: the release masks the padding of a batch of unequal captions; so does this
  forward (the padding is at the end of each row), and passes no mask where every row is full.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import LuminaLayerNormContinuous
from diffusers.models.transformers.transformer_lumina2 import (
    Lumina2CombinedTimestepCaptionEmbedding,
    Lumina2TransformerBlock,
)
from torch import nn

MAX_REFERENCE_IMAGES = 5  # rows of `image_index_embedding`


class OmniGen2RotaryPosEmbed(nn.Module):
    """Omni-RoPE without reference images: text token i at (i, i, i), image token (r, c) at (L, r, c), L
    the caption's true length. (Lumina 2's own table puts text at (i, 0, 0): OmniGen2 differs there.)

    Each axis a of d_a dims has the table e^{i·p·θ_j}, θ_j = 10000^(−2j / d_a), for positions p below
    its `axes_lens` entry; a token's rotation is its three rows concatenated (complex, [head_dim / 2])."""

    def __init__(self, axes_dim: tuple[int, ...], axes_lens: tuple[int, ...]) -> None:
        super().__init__()
        self.tables = [
            get_1d_rotary_pos_embed(d, length, theta=10000, freqs_dtype=torch.float64)
            for d, length in zip(axes_dim, axes_lens)
        ]

    def rotations(self, positions: torch.Tensor) -> torch.Tensor:
        """[..., 3] integer positions -> [..., head_dim / 2] complex rotations."""
        return torch.cat(
            [table.to(positions.device)[positions[..., a]] for a, table in enumerate(self.tables)], dim=-1
        )

    def forward(self, text_lengths: list[int], text_len: int, rows: int, cols: int, device: torch.device):
        """Rotations of the text [B, text_len, ·] (padding rows too: they are masked or dropped), of the
        image [B, rows·cols, ·] and of each row's joint sequence [B, max(L) + rows·cols, ·] (its true-length
        text, the image, then zeros for padding)."""
        text = self.rotations(torch.arange(text_len, device=device)[:, None].expand(text_len, 3))
        grid = torch.cartesian_prod(torch.arange(rows, device=device), torch.arange(cols, device=device))
        images, joints = [], []
        for length in text_lengths:
            images.append(self.rotations(torch.cat([torch.full_like(grid[:, :1], length), grid], dim=1)))
            joints.append(torch.cat([text[:length], images[-1]]))
        joint = torch.zeros(
            len(joints), max(map(len, joints)), text.shape[-1], dtype=text.dtype, device=device
        )
        for i, row in enumerate(joints):
            joint[i, : len(row)] = row
        return text.expand(len(text_lengths), -1, -1), torch.stack(images), joint


class OmniGen2Transformer2DModel(ModelMixin, ConfigMixin):
    """OmniGen2's transformer (text-to-image forward); the config keys are the release's `config.json`'s."""

    _supports_gradient_checkpointing = True
    _skip_layerwise_casting_patterns = ["x_embedder", "norm"]

    @register_to_config
    def __init__(
        self,
        patch_size: int = 2,
        in_channels: int = 16,
        out_channels: int | None = None,
        hidden_size: int = 2520,
        num_layers: int = 32,
        num_refiner_layers: int = 2,
        num_attention_heads: int = 21,
        num_kv_heads: int = 7,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        axes_dim_rope: tuple[int, int, int] = (40, 40, 40),
        axes_lens: tuple[int, int, int] = (1024, 1664, 1664),
        text_feat_dim: int = 2048,
        timestep_scale: float = 1000.0,
    ) -> None:
        super().__init__()
        if hidden_size // num_attention_heads != sum(axes_dim_rope):
            raise ValueError(
                f"hidden_size // num_attention_heads ({hidden_size // num_attention_heads}) must equal "
                f"sum(axes_dim_rope) ({sum(axes_dim_rope)}): the rotary axes split each head"
            )
        self.out_channels = out_channels or in_channels
        patch_values = patch_size * patch_size * in_channels

        def blocks(count: int, modulation: bool) -> nn.ModuleList:
            return nn.ModuleList(
                Lumina2TransformerBlock(
                    hidden_size,
                    num_attention_heads,
                    num_kv_heads,
                    multiple_of,
                    ffn_dim_multiplier,
                    norm_eps,
                    modulation=modulation,
                )
                for _ in range(count)
            )

        self.rope_embedder = OmniGen2RotaryPosEmbed(axes_dim_rope, axes_lens)
        self.x_embedder = nn.Linear(patch_values, hidden_size)
        self.ref_image_patch_embedder = nn.Linear(patch_values, hidden_size)
        self.time_caption_embed = Lumina2CombinedTimestepCaptionEmbedding(
            hidden_size=hidden_size, cap_feat_dim=text_feat_dim, norm_eps=norm_eps
        )
        self.noise_refiner = blocks(num_refiner_layers, modulation=True)
        self.ref_image_refiner = blocks(num_refiner_layers, modulation=True)
        self.context_refiner = blocks(num_refiner_layers, modulation=False)
        self.layers = blocks(num_layers, modulation=True)
        self.norm_out = LuminaLayerNormContinuous(
            embedding_dim=hidden_size,
            conditioning_embedding_dim=min(hidden_size, 1024),
            elementwise_affine=False,
            eps=1e-6,
            bias=True,
            out_dim=patch_size * patch_size * self.out_channels,
        )
        self.image_index_embedding = nn.Parameter(torch.zeros(MAX_REFERENCE_IMAGES, hidden_size))
        self.gradient_checkpointing = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        return_dict: bool = True,
    ) -> torch.Tensor | Transformer2DModelOutput:
        """The velocity image − noise for latents `hidden_states` [B, C, H, W] at OmniGen2's time τ [B]
        (0 = noise, 1 = image), given Qwen2.5-VL's hidden states [B, L, D] with their mask [B, L]
        (True = a token; padding at the end of each row)."""
        joint, mask, rope, temb = self.embed(
            hidden_states, timestep, encoder_hidden_states, encoder_attention_mask
        )
        for block in self.layers:
            joint = self.run_layer(block, joint, mask, rope, temb)
        text_lengths = encoder_attention_mask.sum(dim=1).tolist()
        output = self.project_out(joint, temb, text_lengths, *hidden_states.shape[-2:])
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def embed(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything before the joint layers: (joint sequence [B, S, dim] (each row its true-length text,
        the image, then padding), its mask [B, S] (True = a token), its rotations, temb)."""
        batch, channels, height, width = hidden_states.shape
        p = self.config.patch_size
        temb, text = self.time_caption_embed(
            hidden_states, timestep * self.config.timestep_scale, encoder_hidden_states
        )
        text_lengths = encoder_attention_mask.sum(dim=1).tolist()
        text_rope, image_rope, joint_rope = self.rope_embedder(
            text_lengths, text.shape[1], height // p, width // p, hidden_states.device
        )
        # 2x2 patches; token (r, c) holds its values in (row in patch, column in patch, channel) order
        patches = hidden_states.view(batch, channels, height // p, p, width // p, p)
        image = self.x_embedder(patches.permute(0, 2, 4, 3, 5, 1).flatten(3).flatten(1, 2))

        for block in self.context_refiner:
            text = block(text, encoder_attention_mask, text_rope)
        for block in self.noise_refiner:
            image = block(image, None, image_rope, temb)

        lengths = [length + image.shape[1] for length in text_lengths]
        joint = image.new_zeros(batch, max(lengths), self.config.hidden_size)
        mask = torch.zeros(batch, max(lengths), dtype=torch.bool, device=image.device)
        for i, (text_length, length) in enumerate(zip(text_lengths, lengths)):
            joint[i, :text_length] = text[i, :text_length]
            joint[i, text_length:length] = image[i]
            mask[i, :length] = True
        return joint, mask, joint_rope, temb

    def run_layer(
        self,
        block: nn.Module,
        joint: torch.Tensor,
        mask: torch.Tensor,
        rope: torch.Tensor,
        temb: torch.Tensor,
    ) -> torch.Tensor:
        """One joint layer (checkpointed when gradient checkpointing is on); no mask where no row is padded."""
        mask = None if bool(mask.all()) else mask
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            return self._gradient_checkpointing_func(block, joint, mask, rope, temb)
        return block(joint, mask, rope, temb)

    def project_out(
        self, joint: torch.Tensor, temb: torch.Tensor, text_lengths: list[int], height: int, width: int
    ) -> torch.Tensor:
        """The output layer on each row's image tokens, back to latents [B, C, height, width]."""
        p = self.config.patch_size
        image_tokens = (height // p) * (width // p)
        out = self.norm_out(joint, temb)
        rows = [
            out[i, length : length + image_tokens]
            .view(height // p, width // p, p, p, self.out_channels)
            .permute(4, 0, 2, 1, 3)
            .reshape(self.out_channels, height, width)
            for i, length in enumerate(text_lengths)
        ]
        return torch.stack(rows)
