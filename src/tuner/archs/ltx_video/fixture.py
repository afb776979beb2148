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

import torch

from tuner.archs.ltx_video.keys import LTX_VIDEO_LAYOUT
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_t5_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors

TRANSFORMER_FILE = "ltx-video-tiny.safetensors"


def build_ltx_video_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32): the arguments of `LTXPipeline`."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    from tuner.archs.flux.loaders import T5_VARIANTS

    tiny = Path(__file__).parent / "configs"
    with torch.random.fork_rng(devices=[]):  # constructors draw from the global generator
        transformer = LTXVideoTransformer3DModel.from_config(
            LTXVideoTransformer3DModel.load_config(tiny / "transformer" / "tiny")
        )
        vae = AutoencoderKLLTXVideo.from_config(AutoencoderKLLTXVideo.load_config(tiny / "vae" / "tiny"))
        t5 = T5EncoderModel(
            T5Config.from_pretrained(next(v.config_dir for v in T5_VARIANTS if v.name == "tiny"))
        )
    return {
        "transformer": fill_random_(transformer, seed).eval(),
        "vae": fill_random_(vae, seed + 1).eval(),
        "text_encoder": fill_random_(t5, seed + 2).eval(),
        "tokenizer": build_t5_tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
    }


def write_ltx_video_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny LTX-Video under `out_dir` in both layouts; returns {root, diffusers, transformer_file}."""
    from diffusers import LTXPipeline

    out = Path(out_dir)
    parts = build_ltx_video_components(seed)

    def write(staging: Path) -> None:
        LTXPipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        (staging / "single").mkdir()
        state = LTX_VIDEO_LAYOUT.to_original(parts["transformer"].state_dict())
        save_safetensors(
            {f"model.diffusion_model.{k}": v for k, v in state.items()}, staging / "single" / TRANSFORMER_FILE
        )

    publish_layouts(out, "ltx_video", write)
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "transformer_file": out / "single" / TRANSFORMER_FILE,
    }


FIXTURE = Fixture(
    write=write_ltx_video_fixture,
    model_section=f"""\
architecture = "ltx_video"
transformer = "{{root}}/single/{TRANSFORMER_FILE}"
vae = "{{root}}/diffusers"
text_encoder = "{{root}}/diffusers"
""",
)
