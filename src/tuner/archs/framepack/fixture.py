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

from diffusers import HunyuanVideoFramepackPipeline, HunyuanVideoFramepackTransformer3DModel
from transformers import SiglipImageProcessorPil, SiglipVisionModel

from tuner.archs.framepack.keys import FRAMEPACK_LAYOUT
from tuner.archs.hunyuan_video.fixture import (
    CLIP_FILE,
    LLAMA_FILE,
    VAE_FILE,
    build_hunyuan_video_components,
    single_files,
)
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import vision_tower_file
from tuner.fixtures.weights import tiny_config, tiny_model
from tuner.io import save_safetensors

RELEASE_FILE = "FramePackI2V_HY_tiny.safetensors"
HUNYUAN_NAMES_FILE = "framepack_i2v_tiny_hunyuan.safetensors"
SIGLIP_FILE = "sigclip_vision_tiny.safetensors"


def build_framepack_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments of
    `HunyuanVideoFramepackPipeline`, plus `hunyuan_video_transformer` (HunyuanVideo's tiny network)."""
    parts = build_hunyuan_video_components(seed)
    siglip = tiny_config("framepack", "siglip")
    return {
        **parts,
        "hunyuan_video_transformer": parts["transformer"],
        "transformer": tiny_model(
            HunyuanVideoFramepackTransformer3DModel, tiny_config("framepack", "transformer"), seed + 4
        ),
        "image_encoder": tiny_model(SiglipVisionModel, siglip, seed + 5),
        "feature_extractor": SiglipImageProcessorPil.from_pretrained(siglip),
    }


def write_framepack_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny FramePack model under `out_dir`; returns the paths.

    Keys: root, diffusers, transformer_file (HunyuanVideo names: the layout adapters are exported in),
    release_file (diffusers names, as FramePackI2V_HY_bf16.safetensors), hunyuan_video_file,
    image_encoder_file, vae_file, text_encoder_file, text_encoder_2_file, tokenizer, tokenizer_2.
    """
    parts = build_framepack_components(seed)
    hunyuan_video = single_files({**parts, "transformer": parts.pop("hunyuan_video_transformer")}, seed)
    vision = vision_tower_file(
        parts["image_encoder"]
    )  # the releases hold SigLIP under transformers 4's names

    def diffusers(folder: Path) -> None:
        HunyuanVideoFramepackPipeline(**parts).save_pretrained(folder, safe_serialization=True)
        save_safetensors(vision, folder / "image_encoder" / "model.safetensors")

    state = parts["transformer"].state_dict()
    single = {
        **hunyuan_video,
        "hunyuan_video_file": hunyuan_video["transformer_file"],
        "transformer_file": (HUNYUAN_NAMES_FILE, FRAMEPACK_LAYOUT.to_original(state)),
        "release_file": (RELEASE_FILE, state),
        "image_encoder_file": (SIGLIP_FILE, vision),
    }
    return write_layouts(out_dir, "framepack", diffusers, single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_framepack_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=model_section(
        "framepack",
        transformer=RELEASE_FILE,
        image_encoder=SIGLIP_FILE,
        vae=VAE_FILE,
        text_encoder=LLAMA_FILE,
        text_encoder_2=CLIP_FILE,
    ),
)

ONE_FRAME_FIXTURE = Fixture(
    write=write_framepack_fixture,
    model_section=FIXTURE.model_section.replace('"framepack"', '"framepack_1f"', 1),
)

F1_FIXTURE = Fixture(
    write=write_framepack_fixture,
    model_section=FIXTURE.model_section.replace('"framepack"', '"framepack_f1"', 1),
)
