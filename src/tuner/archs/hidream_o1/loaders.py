"""HiDream-O1-Image (full, dev): loading the network and its tokenizer, tokenizing prompts, calling it.

The network (`tuner.archs.hidream_o1.model.HiDreamO1Transformer`, Qwen3-VL-8B plus three small pixel
modules) loads from either layout users have, with every tensor of the file used and none missing:

* ComfyUI's single file (`hidream_o1_image_bf16.safetensors`, `hidream_o1_image_dev_bf16.safetensors`):
  the module names bare (`language_model.layers.0.self_attn.q_proj.weight`, `visual.blocks.0...`,
  `t_embedder1.mlp.0.weight`, `x_embedder.proj1.weight`, `final_layer2.linear.weight`), optionally behind
  `model.diffusion_model.` / `diffusion_model.`, fp8 too; it leaves out the LM head and Qwen3-VL's
  DeepStack mergers (musubi-tuner's `normalize_single_checkpoint_state_dict` says so).
* The release's folder (`HiDream-ai/HiDream-O1-Image`, a `Qwen3VLForConditionalGeneration` save) or one of
  its shards' sets: the same names behind `model.`, plus `lm_head.weight` and the DeepStack mergers, which
  image generation does not use (`UNUSED`); its tokenizer sits in the folder.

full and dev have one shape (dev is distilled to 28 steps without guidance): `dev` in the file or folder
name says dev, as musubi-tuner's `--model_type dev` does (`is_dev`). The tokenizer is Qwen3-VL's with
HiDream's added `<|boi_token|>` (begin of image) and `<|tms_token|>` (the timestep token).

A prompt is the Qwen3-VL chat template of one user turn, then `<|boi_token|><|tms_token|>` (musubi-tuner's
`build_t2i_text_sample`, with one timestep token). Its token ids are what the cache holds: the network's
own embedding table turns them into vectors at every step, so no text encoder runs while caching.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.model import padded_rows
from tuner.errors import CheckpointError
from tuner.models.encoders import load_encoder_file_on_meta
from tuner.models.identify import SingleFileSpec, variant_table
from tuner.models.loading import load_tokenizer
from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

if TYPE_CHECKING:  # the model subclasses transformers' Qwen3VLModel: imported only to build it
    from tuner.archs.hidream_o1.model import HiDreamO1Transformer

CONFIGS = Path(__file__).parent / "configs"

TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("x_embedder.proj1.weight", "final_layer2.linear.weight", "language_model.layers.{}.mlp.gate_proj.weight"),
    {
        # HiDream-O1-Image and -Dev: Qwen3-VL-8B (36 layers of width 4096) with 32x32 RGB patches
        "full": ((1024, 3072), (3072, 4096), (36, (12288, 4096))),
        # the test fixture (tuner.archs.hidream_o1.fixture): 2 layers of width 64, a one-block vision tower
        "tiny": ((16, 3072), (3072, 64), (2, (128, 64))),
    },
)  # fmt: skip

UNUSED = ("lm_head.", "visual.deepstack_merger_list.")
"""What the release's folder holds beyond the network image generation runs: the language model's head
(text generation) and Qwen3-VL's DeepStack mergers (ComfyUI's files drop both)."""

PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<|boi_token|><|tms_token|>"
"""A prompt as the network reads it: Qwen3-VL's chat template of one user turn and the two HiDream tokens."""
SPECIAL_TOKENS = ("<|boi_token|>", "<|tms_token|>")


def _expected_keys(variant) -> list[str]:
    from transformers import Qwen3VLConfig

    from tuner.archs.hidream_o1.model import HiDreamO1Transformer

    with torch.device("meta"):
        model = HiDreamO1Transformer(Qwen3VLConfig.from_pretrained(variant.config_dir))
    return list(model.state_dict())


TRANSFORMER_SPEC = SingleFileSpec(
    what="HiDream-O1 transformer",
    variants=TRANSFORMER_VARIANTS,
    expected_keys=_expected_keys,
    original_markers=("x_embedder.proj1.weight", "t_embedder1.mlp.0.weight", "final_layer2.linear.weight"),
)


BUNDLED = ("vae.", "text_encoders.")
"""What a ComfyUI checkpoint may bundle beside the network (musubi-tuner's loader skips them too)."""


def network_entries(entries: dict) -> dict:
    """A file's entries under the network's names: the release's `model.` dropped, `UNUSED` and what a
    ComfyUI checkpoint bundles (`BUNDLED`) left out."""
    named = {k.removeprefix("model."): v for k, v in entries.items() if not k.startswith(BUNDLED)}
    return {k: v for k, v in named.items() if not k.startswith(UNUSED)}


# the linear layers adapters may train, under the release's names (which are the network's)
_LINEAR = (
    *(f"language_model.layers.{{i}}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
    *(f"language_model.layers.{{i}}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
    "x_embedder.proj1", "x_embedder.proj2", "final_layer2.linear", "t_embedder1.mlp.0", "t_embedder1.mlp.2",
)  # fmt: skip
HIDREAM_O1_KEYS = ArchitectureKeys("hidream_o1", tuple((name, name) for name in _LINEAR), same_names=True)
"""The adapter name map: the network's module names are the release's."""
HIDREAM_O1_LAYOUT = CheckpointLayout(HIDREAM_O1_KEYS)


def is_dev(path: str | Path) -> bool:
    """Whether a checkpoint is HiDream-O1-Image-Dev, by its file or folder name (its shapes equal full's)."""
    return "dev" in Path(path).name.lower()


def transformer_files(path: str | Path) -> Path | list[Path]:
    """The single file `path`, or the safetensors shards of the release's folder `path`."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder. Check model.transformer in your config.")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(
            f"{path}: no .safetensors in this folder. Point model.transformer at ComfyUI's "
            "hidream_o1_image_bf16.safetensors or the HiDream-ai/HiDream-O1-Image folder."
        )
    return shards


def load_transformer(path: str | Path, dtype: torch.dtype) -> HiDreamO1Transformer:
    """The network from a ComfyUI single file or the release's folder, in `dtype`, in eval mode."""
    from tuner.archs.hidream_o1.model import HiDreamO1Transformer

    files = transformer_files(path)
    model = load_encoder_file_on_meta(
        files, dtype, HiDreamO1Transformer, TRANSFORMER_SPEC, dict, "a HiDream-O1 transformer",
        entries=network_entries,
    )  # fmt: skip
    return model.eval()


def load_prompt_tokenizer(tokenizer: str | Path | None, transformer: str | Path):
    """The tokenizer: `tokenizer` (a folder), else the one in the release's folder `transformer`. It must
    know HiDream's two added tokens."""
    if tokenizer is None and Path(transformer).is_dir():
        tokenizer = transformer
    loaded = load_tokenizer(
        tokenizer, transformer, "HiDream-O1 tokenizer (the release folder's tokenizer files)"
    )
    unknown = [t for t in SPECIAL_TOKENS if loaded.convert_tokens_to_ids(t) in (None, loaded.unk_token_id)]
    if unknown:
        raise CheckpointError(
            f"{tokenizer}: this tokenizer lacks HiDream-O1's {', '.join(unknown)}; use the tokenizer of "
            "HiDream-ai/HiDream-O1-Image."
        )
    return loaded


def tokenize(tokenizer, captions: list[str], max_length: int) -> list[torch.Tensor]:
    """Each caption's prompt as token ids [L] (`PROMPT`); a caption is cut to `max_length` tokens first."""
    out = []
    for caption in captions:
        ids = tokenizer(caption, add_special_tokens=False, truncation=True, max_length=max_length).input_ids
        caption = tokenizer.decode(ids)
        out.append(torch.tensor(tokenizer(PROMPT.format(caption), add_special_tokens=False).input_ids))
    return out


def padded_ids(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Cached prompts as a batch: `input_ids` [B, L] padded with 0 on the right, `text_mask` [B, L]."""
    ids, mask = padded_rows([e["input_ids"] for e in entries])
    return {"input_ids": ids, "text_mask": mask.long()}


def model_inputs(
    noisy: torch.Tensor, t: torch.Tensor, input_ids: torch.Tensor, text_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]]:
    """The network's arguments for pixels `noisy` [B, 3, 1, H, W] at t ∈ [0, 1] (1 = noise): the prompts,
    the patches, the timestep 1 − t and the patch grid."""
    from tuner.archs.hidream_o1.model import PATCH_SIZE, patchify

    height, width = noisy.shape[-2:]
    grid = (height // PATCH_SIZE, width // PATCH_SIZE)
    return input_ids.long(), text_mask.long(), patchify(noisy[:, :, 0]), (1.0 - t).float(), grid


def as_image(patches: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """Predicted patches [B, N, 3072] as an image shaped like `noisy` [B, 3, 1, H, W]."""
    from tuner.archs.hidream_o1.model import unpatchify

    height, width = noisy.shape[-2:]
    return unpatchify(patches, height, width).unsqueeze(2).to(noisy.dtype)


def predict_clean(
    model: HiDreamO1Transformer, noisy: torch.Tensor, t: torch.Tensor, input_ids: torch.Tensor,
    text_mask: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The clean image the network predicts for pixels `noisy` [B, 3, 1, H, W] at t ∈ [0, 1] (1 = noise)."""
    return as_image(model(*model_inputs(noisy, t, input_ids, text_mask)), noisy)
