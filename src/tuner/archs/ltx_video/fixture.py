"""A tiny random-weight LTX-Video 0.9 in both layouts users have.

Built from the `tiny` configs in `tuner/archs/ltx_video/configs/` (transformer: 2 blocks, 2 heads of
16, 128 input channels as the release; VAE with the real 32×/8× compression and 128 channels) and
FLUX.1's tiny T5 (2 layers of width 64) with the offline T5 tokenizer.

    out_dir/
      diffusers/   what `LTXPipeline.from_pretrained(out_dir/"diffusers")` loads
      single/ltx-video-tiny.safetensors   the transformer in the release's layout (`model.diffusion_model.*`)
"""

from __future__ import annotations

from pathlib import Path

from tuner.archs.ltx_video.keys import LTX_VIDEO_LAYOUT
from tuner.fixtures import Fixture, model_section, write_layouts
from tuner.fixtures.encoders import prefixed
from tuner.fixtures.tokenizers import build_t5_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "ltx-video-tiny.safetensors"


# The release's diffusers scheduler config (Lightricks' LTX-Video `ltx_video/utils/diffusers_config_mapping.py`)
SCHEDULER_CONFIG = {"base_image_seq_len": 1024, "base_shift": 0.95, "max_image_seq_len": 4096, "max_shift": 2.05,
                    "shift_terminal": 0.1, "use_dynamic_shifting": True}  # fmt: skip


def build_ltx_video_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32): the arguments of `LTXPipeline`."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel
    from transformers import T5EncoderModel

    return {
        "transformer": tiny_model(LTXVideoTransformer3DModel, tiny_config("ltx_video", "transformer"), seed),
        "vae": tiny_model(AutoencoderKLLTXVideo, tiny_config("ltx_video", "vae"), seed + 1),
        "text_encoder": tiny_model(T5EncoderModel, tiny_config("flux", "t5"), seed + 2),
        "tokenizer": build_t5_tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
    }


def write_ltx_video_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny LTX-Video under `out_dir` in both layouts; returns {root, diffusers, transformer_file}."""
    from diffusers import LTXPipeline

    parts = build_ltx_video_components(seed)
    state = LTX_VIDEO_LAYOUT.to_original(parts["transformer"].state_dict())
    single = {"transformer_file": (TRANSFORMER_FILE, prefixed("model.diffusion_model.", state))}
    return write_layouts(out_dir, "ltx_video", LTXPipeline(**parts), single)


FIXTURE = Fixture(
    write=write_ltx_video_fixture,
    model_section=model_section(
        "ltx_video", transformer=TRANSFORMER_FILE, vae="diffusers", text_encoder="diffusers"
    ),
)
