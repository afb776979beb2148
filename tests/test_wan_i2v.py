"""Wan 2.1 I2V (`wan_i2v`) and FLF2V (`wan_flf2v`): the model inputs against diffusers' pipeline, both
layouts of the transformer and the CLIP encoder, variant detection, the CLIP encoder in the latent cache
key, and what is refused (image datasets, one-frame FLF2V clips, generation without its frames).

The contract suite (test_contract*.py) runs both architectures' user paths on their fixtures.
"""

import re
import shutil

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from project import cfg, make_project, run
from tuner.archs.wan import loaders as wan
from tuner.archs.wan.keys import original_module_name
from tuner.archs.wan.trainer_i2v import LatentEncoders, WanFLF2VModel, frame_mask
from tuner.cache.plan import latent_encoder
from tuner.data.media import to_tensor
from tuner.errors import CheckpointError
from tuner.fixtures import write_fixture
from tuner.models import clip_vision
from tuner.models.identify import diffusers_meta_keys, pick_variant
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec
from tuner.registry import ARCHITECTURES
from tuner.trainers import trainer_class

ARCHS = ("wan_i2v", "wan_flf2v")


@pytest.fixture(scope="module", params=ARCHS)
def project(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    paths = write_fixture(arch, root / "model")
    config = make_project(root / "project", root / "model", architecture=arch)
    return arch, config, paths


def _trainer(config, *overrides):
    c = cfg(config, *overrides)
    return trainer_class(c.model.architecture)(c)


def _frame(seed: int, size=(64, 48)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


# --- the model's inputs are the pipeline's ---------------------------------------------------------


def test_inputs_and_prediction_match_the_diffusers_pipeline(project):
    """Condition latents + mask, CLIP embeddings and the transformer call equal WanImageToVideoPipeline's
    (`prepare_latents`, `encode_image`, its transformer call), for I2V and FLF2V."""
    arch, config, paths = project
    trainer = _trainer(config)
    pipe = WanImageToVideoPipeline.from_pretrained(paths["diffusers"], local_files_only=True)
    for part in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.image_encoder):
        part.eval()
    flf = trainer.record.frame_images == 2
    images = [_frame(1)] + ([_frame(2)] if flf else [])
    pixels = [to_tensor(np.asarray(img))[:, 0].unsqueeze(0) for img in images]  # [1, 3, H, W]
    frames = 9
    with torch.no_grad():
        encoders = LatentEncoders(
            pipe.vae, clip_vision.ImageEncoder(pipe.image_encoder, pipe.image_processor)
        )
        mine = trainer.encode_frame_images(encoders, pixels, frames)
        noise, condition = pipe.prepare_latents(
            pixels[0], 1, 16, 48, 64, frames, torch.float32, "cpu", torch.Generator().manual_seed(0),
            None, pixels[1] if flf else None,
        )  # fmt: skip
        image_embeds = pipe.encode_image(images if flf else images[0], "cpu")
    mask = frame_mask(1, noise.shape[2], noise.shape[3:], last=flf)
    torch.testing.assert_close(torch.cat([mask, mine["cond_latents"]], dim=1), condition, rtol=0, atol=1e-6)
    torch.testing.assert_close(mine["clip"].reshape(image_embeds.shape), image_embeds, rtol=0, atol=1e-6)

    # the text embeddings equal the pipeline's (test_wan_models.py); here: padded to its 512 tokens
    text = trainer.collate_text(trainer.encode_text((pipe.text_encoder, pipe.tokenizer), ["a red circle"]))
    assert text["context"].shape == (1, 512, 64)
    t = torch.tensor([0.7])
    with torch.no_grad():
        got = trainer.predict(pipe.transformer, noise, t, {**text, **mine})
        want = pipe.transformer(
            hidden_states=torch.cat([noise, condition], dim=1), timestep=t * 1000,
            encoder_hidden_states=text["context"], encoder_hidden_states_image=image_embeds, return_dict=False,
        )[0]  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_frame_mask_marks_the_given_frames():
    i2v = frame_mask(1, 3, (1, 1))[0, :, :, 0, 0]  # 9 frames -> 3 latent frames of 4 mask channels
    assert i2v.t().tolist() == [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    flf = frame_mask(1, 3, (1, 1), last=True)[0, :, :, 0, 0]
    assert flf.t().tolist() == [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]]


# --- loading -------------------------------------------------------------------------------------


def test_both_layouts_load_the_same_transformer_and_image_encoder(project):
    """The single files (official transformer, ComfyUI clip_vision) and the diffusers folder load to
    identical weights; FLF2V's `img_emb.emb_pos` is loaded (diffusers' converter has no rule for it)."""
    arch, _, paths = project
    single = wan.load_transformer(paths["transformer_file"], torch.float32, arch).state_dict()
    folder = wan.load_transformer(paths["diffusers"], torch.float32, arch).state_dict()
    assert single.keys() == folder.keys()
    assert all(torch.equal(single[k], folder[k]) for k in single)
    pos = "condition_embedder.image_embedder.pos_embed"
    assert (pos in single) == (arch == "wan_flf2v")
    if pos in single:
        assert single[pos].abs().sum() > 0
    a = clip_vision.load_image_encoder(paths["image_encoder_file"], torch.float32)
    b = clip_vision.load_image_encoder(paths["diffusers"], torch.float32)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.processor.to_dict() == b.processor.to_dict()


def test_diffusers_converter_still_leaves_emb_pos_unconverted():
    """`models/wan.py` renames `img_emb.emb_pos` itself; if diffusers starts converting it, drop that."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    out = convert_wan_transformer_to_diffusers(
        {"img_emb.emb_pos": torch.zeros(1), "img_emb.proj.1.weight": 0}
    )
    assert "img_emb.emb_pos" in out and "condition_embedder.image_embedder.ff.net.0.proj.weight" in out
    passed = convert_wan_transformer_to_diffusers({"condition_embedder.image_embedder.pos_embed": 0})
    assert list(passed) == ["condition_embedder.image_embedder.pos_embed"]


def _meta_shapes(variant: str) -> dict[str, tuple[int, ...]]:
    config = wan.CONFIGS / "transformer" / variant
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(config))
    return {original_module_name(k): tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("variant", ["i2v-14B", "flf2v-14B", "i2v-A14B", "t2v-14B", "tiny-i2v", "tiny-flf2v"])
def test_the_releases_shapes_name_their_variant(variant):
    """The shapes of each shipped config (the real releases' sizes) match exactly its own signature."""
    assert pick_variant(_meta_shapes(variant), wan.TRANSFORMER_VARIANTS, "x", "Wan").name == variant
    assert set(diffusers_meta_keys(WanTransformer3DModel, wan.CONFIGS / "transformer" / variant))


def test_clip_vit_h_config_matches_its_signature():
    variant = next(v for v in clip_vision.VARIANTS if v.name == "vit-h-14")
    keys = clip_vision.SPEC.expected_keys(variant)
    assert "vision_model.encoder.layers.31.layer_norm1.weight" in keys
    assert "vision_model.encoder.layers.32.layer_norm1.weight" not in keys


def test_a_file_of_another_variant_names_the_architecture_to_use(project):
    arch, _, paths = project
    others = [a for a in ("wan", *ARCHS) if a != arch]
    for other in others:
        with pytest.raises(CheckpointError, match=f'test transformer.*use architecture = "{arch}"'):
            wan.load_transformer(paths["transformer_file"], torch.float32, other)


@pytest.mark.parametrize(
    "variant, arch, names",
    [
        ("i2v-14B", "wan", 'Wan 2.1 I2V 14B.*architecture = "wan_i2v"'),
        ("flf2v-14B", "wan_i2v", 'FLF2V.*architecture = "wan_flf2v"'),
        ("i2v-14B", "wan_flf2v", 'Wan 2.1 I2V.*architecture = "wan_i2v"'),
        ("t2v-14B", "wan_i2v", 'T2V 14B.*architecture = "wan"'),
        ("i2v-A14B", "wan_i2v", "Wan 2.2 I2V A14B"),
    ],
)
def test_the_real_variants_name_the_architecture_to_use(variant, arch, names):
    with pytest.raises(CheckpointError, match=names):
        wan.check_variant(variant, arch, "x.safetensors")


def test_a_t2v_file_given_to_i2v_names_wan(wan_model):
    with pytest.raises(CheckpointError, match='use architecture = "wan"'):
        wan.load_transformer(wan_model / "single" / "wan2.1_t2v_tiny.safetensors", torch.float32, "wan_i2v")


def test_a_clip_file_of_the_wrong_kind_is_named(project, tmp_path):
    _, _, paths = project
    with pytest.raises(CheckpointError, match="not a CLIP vision encoder checkpoint.*Wan VAE"):
        clip_vision.load_image_encoder(paths["vae_file"], torch.float32)


# --- caching -------------------------------------------------------------------------------------


def test_the_image_encoder_is_part_of_the_latent_key(project, tmp_path, capsys):
    """Another CLIP file re-encodes every latent entry (text entries are reused); the same file reuses."""
    arch, config, paths = project
    code, log = run(capsys, "cache", "latents", "--config", config)
    assert code == 0, log
    other = tmp_path / "clip_vision_h_other.safetensors"
    tensors = load_file(paths["image_encoder_file"])
    tensors["vision_model.post_layernorm.weight"] = tensors["vision_model.post_layernorm.weight"] + 1
    tensors["vision_model.encoder.layers.0.mlp.fc1.weight"] *= 1.5
    save_file(tensors, other)
    before = latent_encoder(_trainer(config))
    after = latent_encoder(_trainer(config, f"model.image_encoder='{other}'"))
    assert before.weights_fingerprint != after.weights_fingerprint
    code, log = run(capsys, "cache", "latents", "--config", config, "--set", f"model.image_encoder='{other}'")
    assert code == 0, log
    encoded, reused = (int(v) for v in re.search(r"encoded (\d+), reused (\d+)", log).groups())
    assert encoded == 2 and reused == 0, log
    code, log = run(capsys, "cache", "latents", "--config", config)
    assert code == 0 and "encoded 0, reused 2" in log, log


def test_cached_entries_hold_the_conditions(project, capsys):
    arch, config, _ = project
    assert run(capsys, "cache", "latents", "--config", config)[0] == 0
    assert run(capsys, "cache", "text", "--config", config)[0] == 0
    from tuner.cache.plan import open_training_data

    trainer = _trainer(config)
    batch = next(iter(open_training_data(trainer, trainer.cfg, log=lambda s: None).epoch(0)))
    latents, extra = batch["latents"], batch["extra"]
    assert extra["cond_latents"].shape == latents.shape
    tokens = (2, 17, 32) if arch == "wan_flf2v" else (17, 32)
    assert extra["clip"].shape == (latents.shape[0], *tokens)


def _dataset_with(config, text: str):
    dataset = config.parent / "dataset.toml"
    original = dataset.read_text()
    dataset.write_text(original + text)
    return dataset, original


def test_image_datasets_are_refused(project, capsys):
    arch, config, _ = project
    dataset, original = _dataset_with(config, '\n[[datasets]]\nimage_directory = "data/images"\n')
    try:
        code, log = run(capsys, "cache", "latents", "--config", config)
    finally:
        dataset.write_text(original)
    assert code != 0
    assert f"image dataset, but {arch} is an image-to-video model" in log and "video_directory" in log, log


def test_a_one_frame_flf2v_clip_is_refused(project, capsys):
    arch, config, _ = project
    if arch != "wan_flf2v":
        pytest.skip("first-last-frame only")
    dataset = config.parent / "dataset.toml"
    original = dataset.read_text()
    dataset.write_text(original.replace("target_frames = [9]", "target_frames = [1]"))
    try:
        code, log = run(capsys, "cache", "latents", "--config", config)
    finally:
        dataset.write_text(original)
    assert code != 0
    assert "video_000.mp4 gives a clip of 1 frame(s); wan_flf2v needs at least 2" in log, log
    assert "target_frames to 5 or more" in log, log


def test_an_unreadable_first_frame_names_the_file_and_the_fix(project, tmp_path, capsys):
    arch, config, _ = project
    video = config.parent / "data" / "videos" / "video_001.mp4"
    keep = tmp_path / "keep.mp4"
    shutil.copy(video, keep)
    data = keep.read_bytes()
    video.write_bytes(data[: int(len(data) * 0.9)])  # the header survives, the frames do not
    try:
        code, log = run(capsys, "cache", "latents", "--config", config)
    finally:
        shutil.copy(keep, video)
    assert code != 0
    assert "video_001.mp4" in log and ("Re-encode it" in log), log


# --- generation and export -----------------------------------------------------------------------


def test_generate_needs_its_frame_images(project, tmp_path, capsys):
    arch, config, _ = project
    base = ("generate", "--config", config, "--prompt", "x", "--size", "64x48", "--frames", "9", "--steps", "1",
            "--device", "cpu", "--out", tmp_path / "x.mp4")  # fmt: skip
    code, log = run(capsys, *base)
    assert code != 0
    want = "first and last frame (--image FIRST --image LAST)" if arch == "wan_flf2v" else "--image FIRST"
    assert want in log, log
    if arch == "wan_flf2v":
        image = config.parent / "data" / "images" / "image_000.png"
        code, log = run(capsys, *base[:-4], "--frames", "1", "--image", image, "--image", image, *base[-4:])
        assert code != 0 and "needs at least 2" in log, log


def test_exported_keys_are_the_release_image_layers(project, tmp_path):
    """The comfy export names the image cross-attention and image embedder as the release does."""
    arch, config, paths = project
    trainer = _trainer(config)
    model = trainer.load_transformer(torch.float32)
    targets = (*trainer.default_targets, r"condition_embedder\.image_embedder\.ff\.net\.(0\.proj|2)")
    network = LoRANetwork.apply_to(model, TargetSpec(targets), rank=4, alpha=4, name_map=trainer.layout)
    path = tmp_path / "lora.safetensors"
    network.save(path, trainer.layout)
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    for stem in (
        "img_emb.proj.1",
        "img_emb.proj.3",
        "blocks.1.cross_attn.k_img",
        "blocks.0.cross_attn.v_img",
    ):
        assert f"diffusion_model.{stem}.lora_A.weight" in keys, stem
    original = {k for k in load_file(paths["transformer_file"])}
    for key in keys:
        if key.endswith(".lora_A.weight"):
            assert key.removeprefix("diffusion_model.").removesuffix(".lora_A.weight") + ".weight" in original


def test_trainers_are_registered():
    assert issubclass(trainer_class("wan_flf2v"), WanFLF2VModel)
    assert ARCHITECTURES["wan_i2v"].frame_images == 1 and ARCHITECTURES["wan_flf2v"].frame_images == 2
