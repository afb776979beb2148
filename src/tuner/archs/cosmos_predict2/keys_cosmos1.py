"""Key names of Cosmos 1.0 Diffusion (Text2World, Video2World) in diffusers' and NVIDIA's release layout.

NVIDIA's checkpoints (`model.pt` of nvidia/Cosmos-1.0-Diffusion-*, and safetensors made from it) store the
network (`GeneralDIT`) under `net.`, each block as three sub-blocks:
`net.blocks.block0.blocks.0.block.attn.to_q.0` (self-attention, its q then its q-norm as `to_q.1`), `blocks.1` the cross-attention, `blocks.2.block.layer1`
the MLP, each with its `adaLN_modulation.1/.2`. ComfyUI's files hold the same names (its `comfy/ldm/cosmos`
model is the release's), and ComfyUI names weights without `net.`, so that is the "original" layout here
(adapters are saved as `diffusion_model.blocks.block0.blocks.0.block.attn.to_q.0`). The renames are those of
diffusers' `convert_cosmos_transformer_checkpoint_to_diffusers` (`TRANSFORMER_KEYS_RENAME_DICT_COSMOS_1_0`,
`loaders/single_file_utils.py`). Release files also carry the training loss's uncertainty network
(`logvar.*`) and a RoPE table (`pos_embedder.seq`), which no diffusers tensor corresponds to (`RELEASE_ONLY`).
"""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

_B = "blocks.block{i}.blocks"  # the release's block {i}: sub-blocks 0 (self-attn), 1 (cross-attn), 2 (MLP)

# (diffusers module, release module); `{i}` is a block index
TRANSFORMER_RULES: tuple[tuple[str, str], ...] = (
    # nn.Linear modules of the blocks (what adapters target)
    ("transformer_blocks.{i}.attn1.to_q", f"{_B}.0.block.attn.to_q.0"),
    ("transformer_blocks.{i}.attn1.to_k", f"{_B}.0.block.attn.to_k.0"),
    ("transformer_blocks.{i}.attn1.to_v", f"{_B}.0.block.attn.to_v.0"),
    ("transformer_blocks.{i}.attn1.to_out.0", f"{_B}.0.block.attn.to_out.0"),
    ("transformer_blocks.{i}.attn2.to_q", f"{_B}.1.block.attn.to_q.0"),
    ("transformer_blocks.{i}.attn2.to_k", f"{_B}.1.block.attn.to_k.0"),
    ("transformer_blocks.{i}.attn2.to_v", f"{_B}.1.block.attn.to_v.0"),
    ("transformer_blocks.{i}.attn2.to_out.0", f"{_B}.1.block.attn.to_out.0"),
    ("transformer_blocks.{i}.ff.net.0.proj", f"{_B}.2.block.layer1"),
    ("transformer_blocks.{i}.ff.net.2", f"{_B}.2.block.layer2"),
    # the AdaLN-LoRA modulation of each sub-block and of the output head
    ("transformer_blocks.{i}.norm1.linear_1", f"{_B}.0.adaLN_modulation.1"),
    ("transformer_blocks.{i}.norm1.linear_2", f"{_B}.0.adaLN_modulation.2"),
    ("transformer_blocks.{i}.norm2.linear_1", f"{_B}.1.adaLN_modulation.1"),
    ("transformer_blocks.{i}.norm2.linear_2", f"{_B}.1.adaLN_modulation.2"),
    ("transformer_blocks.{i}.norm3.linear_1", f"{_B}.2.adaLN_modulation.1"),
    ("transformer_blocks.{i}.norm3.linear_2", f"{_B}.2.adaLN_modulation.2"),
    ("norm_out.linear_1", "final_layer.adaLN_modulation.1"),
    ("norm_out.linear_2", "final_layer.adaLN_modulation.2"),
    ("proj_out", "final_layer.linear"),
    ("patch_embed.proj", "x_embedder.proj.1"),  # proj.0 is the patchifying rearrange (no weights)
    ("time_embed.t_embedder.linear_1", "t_embedder.1.linear_1"),
    ("time_embed.t_embedder.linear_2", "t_embedder.1.linear_2"),
    # everything else in the state dict: q/k RMSNorms, the timestep norm, the learnable position embedding
    ("transformer_blocks.{i}.attn1.norm_q", f"{_B}.0.block.attn.to_q.1"),
    ("transformer_blocks.{i}.attn1.norm_k", f"{_B}.0.block.attn.to_k.1"),
    ("transformer_blocks.{i}.attn2.norm_q", f"{_B}.1.block.attn.to_q.1"),
    ("transformer_blocks.{i}.attn2.norm_k", f"{_B}.1.block.attn.to_k.1"),
    ("time_embed.norm", "affline_norm"),  # sic: the release's spelling
    ("learnable_pos_embed", "extra_pos_embedder"),
)

COSMOS1_KEYS = ArchitectureKeys("cosmos1", TRANSFORMER_RULES)
COSMOS1_LAYOUT = CheckpointLayout(COSMOS1_KEYS)

# Release-file tensors that hold no network weight (matched against the key without `net.`): the loss's
# uncertainty network and the RoPE table rebuilt at construction
RELEASE_ONLY_PREFIXES = ("logvar.", "pos_embedder.")


def is_release_only(key: str) -> bool:
    """True for a release-file tensor that holds no network weight (see `RELEASE_ONLY_PREFIXES`)."""
    return key.startswith(RELEASE_ONLY_PREFIXES) or key.endswith("_extra_state")


transformer_to_original = COSMOS1_LAYOUT.to_original
transformer_to_diffusers = COSMOS1_LAYOUT.to_diffusers
transformer_key_to_original = COSMOS1_LAYOUT.key_to_original
