"""A tiny random-weight FramePack model, written in the layouts users have.

The transformer is built from the `tiny` config shipped with `tuner.archs.framepack.loaders` (HunyuanVideo's tiny
sizes plus the history embedder and a SigLIP projection of width 32); the VAE, Llama, CLIP and their
tokenizers are HunyuanVideo's tiny ones (`tuner.archs.hunyuan_video.fixture`); SigLIP is 2 layers of width 32
on 32×32 images.

    out_dir/
      diffusers/                      what `HunyuanVideoFramepackPipeline.from_pretrained` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  text_encoder_2/  tokenizer_2/
        image_encoder/  feature_extractor/  scheduler/
      single/
        FramePackI2V_HY_tiny.safetensors          the release's layout (lllyasviel's class: diffusers names)
        framepack_i2v_tiny_hunyuan.safetensors    the same weights in HunyuanVideo's Tencent names
        sigclip_vision_tiny.safetensors           ComfyUI's SigLIP layout (vision_model.*)
        hunyuan_video_t2v_tiny.safetensors        a HunyuanVideo transformer (to check it is refused)
        hunyuan_video_vae_tiny.safetensors  llava_llama3_tiny.safetensors  clip_l.safetensors
        tokenizer/  tokenizer_2/
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import HunyuanVideoFramepackPipeline, HunyuanVideoFramepackTransformer3DModel
from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

from tuner.archs.framepack.keys import FRAMEPACK_LAYOUT
from tuner.archs.framepack.loaders import SIGLIP_VARIANTS, TRANSFORMER_VARIANTS
from tuner.archs.hunyuan_video.fixture import (
    CLIP_FILE,
    LLAMA_FILE,
    VAE_FILE,
    build_hunyuan_video_components,
    write_single_files,
)
from tuner.archs.hunyuan_video.fixture import (
    TRANSFORMER_FILE as HUNYUAN_VIDEO_FILE,
)
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors

RELEASE_FILE = "FramePackI2V_HY_tiny.safetensors"
HUNYUAN_NAMES_FILE = "framepack_i2v_tiny_hunyuan.safetensors"
SIGLIP_FILE = "sigclip_vision_tiny.safetensors"


def _tiny(variants) -> Path:
    return next(v.config_dir for v in variants if v.name == "tiny")


def build_framepack_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments of
    `HunyuanVideoFramepackPipeline`, plus `hunyuan_video_transformer` (HunyuanVideo's tiny network)."""
    parts = build_hunyuan_video_components(seed)
    with torch.random.fork_rng(devices=[]):  # constructors draw from the global generator
        transformer = HunyuanVideoFramepackTransformer3DModel.from_config(
            HunyuanVideoFramepackTransformer3DModel.load_config(_tiny(TRANSFORMER_VARIANTS))
        )
        siglip = SiglipVisionModel(SiglipVisionConfig.from_pretrained(_tiny(SIGLIP_VARIANTS)))
    return {
        **parts,
        "hunyuan_video_transformer": parts["transformer"],
        "transformer": fill_random_(transformer, seed + 4).eval(),
        "image_encoder": fill_random_(siglip, seed + 5).eval(),
        "feature_extractor": SiglipImageProcessorPil.from_pretrained(_tiny(SIGLIP_VARIANTS)),
    }


def write_framepack_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny FramePack model under `out_dir`; returns the paths.

    Keys: root, diffusers, transformer_file (HunyuanVideo names: the layout adapters are exported in),
    release_file (diffusers names, as FramePackI2V_HY_bf16.safetensors), hunyuan_video_file,
    image_encoder_file, vae_file, text_encoder_file, text_encoder_2_file, tokenizer, tokenizer_2.
    """
    out = Path(out_dir)
    parts = build_framepack_components(seed)
    hunyuan_video = parts.pop("hunyuan_video_transformer")

    def write(staging: Path) -> None:
        HunyuanVideoFramepackPipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        single = staging / "single"
        write_single_files(single, {**parts, "transformer": hunyuan_video}, seed)
        state = parts["transformer"].state_dict()
        save_safetensors(state, single / RELEASE_FILE)
        save_safetensors(FRAMEPACK_LAYOUT.to_original(state), single / HUNYUAN_NAMES_FILE)
        # the releases hold SigLIP under transformers 4's names (`vision_model.*`)
        vision = {
            f"vision_model.{k.removeprefix('vision_model.')}": v
            for k, v in parts["image_encoder"].state_dict().items()
        }
        save_safetensors(vision, staging / "diffusers" / "image_encoder" / "model.safetensors")
        save_safetensors(vision, single / SIGLIP_FILE)

    publish_layouts(out, "framepack", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "transformer_file": single / HUNYUAN_NAMES_FILE,
        "release_file": single / RELEASE_FILE,
        "hunyuan_video_file": single / HUNYUAN_VIDEO_FILE,
        "image_encoder_file": single / SIGLIP_FILE,
        "vae_file": single / VAE_FILE,
        "text_encoder_file": single / LLAMA_FILE,
        "text_encoder_2_file": single / CLIP_FILE,
        "tokenizer": single / "tokenizer",
        "tokenizer_2": single / "tokenizer_2",
    }


FIXTURE = Fixture(
    write=write_framepack_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=f"""\
architecture = "framepack"
transformer = "{{root}}/single/{RELEASE_FILE}"
image_encoder = "{{root}}/single/{SIGLIP_FILE}"
vae = "{{root}}/single/{VAE_FILE}"
text_encoder = "{{root}}/single/{LLAMA_FILE}"
tokenizer = "{{root}}/single/tokenizer"
text_encoder_2 = "{{root}}/single/{CLIP_FILE}"
tokenizer_2 = "{{root}}/single/tokenizer_2"
""",
)

ONE_FRAME_FIXTURE = Fixture(
    write=write_framepack_fixture,
    model_section=FIXTURE.model_section.replace('"framepack"', '"framepack_1f"', 1),
)
