"""Stable Diffusion 3.5: loading every layout, key conversion and model inputs, checked against diffusers
on the tiny fixture (an SD 3.5 Medium: attn2 in block 0, q/k norms, the last block pre-only)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline
from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from project import assert_equal_weights
from test_fp8 import write_comfy_fp8_state
from tuner import fp8
from tuner.archs.flux import loaders as flux_models
from tuner.archs.flux.keys import vae_to_original
from tuner.archs.sd3 import loaders as sd3
from tuner.archs.sd3.fixture import build_sd3_components, write_bundled_file
from tuner.archs.sd3.keys import SD3_KEYS, SD3_LAYOUT, transformer_to_diffusers, transformer_to_original
from tuner.archs.sd3.trainer import SD3Model
from tuner.errors import CheckpointError
from tuner.fixtures import write_fixture
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors
from tuner.models.identify import check_keys, pick_variant
from tuner.models.loading import load_tensors
from tuner.networks import FullNetwork, LoRANetwork, TargetSpec
from tuner.networks.targets import find_targets
from tuner.registry import ARCHITECTURES, resolve_save_format

PROMPT = "a red circle on a black background"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("sd3", tmp_path_factory.mktemp("sd3_model"))


@pytest.fixture(scope="module")
def pipe(paths):
    pipe = StableDiffusion3Pipeline.from_pretrained(paths["diffusers"], local_files_only=True)
    for part in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        part.eval()
    return pipe


def _same_encoders(a: sd3.TextEncoders, b: sd3.TextEncoders) -> None:
    for x, y in zip(a, b):
        if isinstance(x, torch.nn.Module):
            assert_equal_weights(x, y)
        elif x is not None:
            assert x(PROMPT).input_ids == y(PROMPT).input_ids and x.pad_token == y.pad_token


def _single_encoders(paths, t5: bool = True) -> sd3.TextEncoders:
    files = (
        paths["text_encoder_file"],
        paths["text_encoder_2_file"],
        paths["text_encoder_3_file"] if t5 else None,
    )
    return sd3.load_text_encoders(
        files, (paths["tokenizer"], paths["tokenizer_2"], paths["tokenizer_3"]), torch.float32
    )


def _header_only_file(path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A safetensors file whose header lists `shapes` and holds no data: enough for shape checks, which
    read headers only (a real SD 3.0 file is gigabytes)."""
    header = {k: {"dtype": "F16", "shape": list(v), "data_offsets": [0, 0]} for k, v in shapes.items()}
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)


# ---------------------------------------------------------------------------------------------------
# Loading every layout
# ---------------------------------------------------------------------------------------------------


def test_single_files_load_like_the_diffusers_folder(paths):
    root = paths["diffusers"]
    assert_equal_weights(sd3.load_transformer(paths["transformer_file"], torch.bfloat16),
                  sd3.load_transformer(root, torch.bfloat16))  # fmt: skip
    folder = sd3.load_text_encoders(
        (root, None, root), (None, None, None), torch.float32
    )  # bigG beside CLIP-L
    _same_encoders(_single_encoders(paths), folder)
    assert folder.tokenizer_2.pad_token == "!"  # bigG's padding, kept apart from CLIP-L's


def test_the_release_file_bundling_every_component_loads(paths, tmp_path):
    """The release's all-in-one form: transformer, VAE (`first_stage_model.`) and the three encoders
    (`text_encoders.*`) from one file, bigG found in CLIP-L's file; with and without ComfyUI's prefix."""
    parts, root = build_sd3_components(), paths["diffusers"]
    bundled = tmp_path / "sd3.5_medium_incl_clips_t5xxl.safetensors"
    write_bundled_file(parts, bundled)
    plain = tmp_path / "sd3.5_medium.safetensors"  # the release's own file has no `model.` prefix here
    save_safetensors(
        {k.removeprefix("model.diffusion_model."): v for k, v in load_tensors(bundled).items()}, plain
    )
    for path in (bundled, plain):
        assert_equal_weights(
            sd3.load_transformer(path, torch.float32), sd3.load_transformer(root, torch.float32)
        )
        assert_equal_weights(sd3.load_vae(path, torch.float32), sd3.load_vae(root, torch.float32))
    tokenizers = (paths["tokenizer"], paths["tokenizer_2"], paths["tokenizer_3"])
    from_bundle = sd3.load_text_encoders((bundled, None, bundled), tokenizers, torch.float32)
    _same_encoders(from_bundle, sd3.load_text_encoders((root, None, root), (None, None, None), torch.float32))


def test_comfyui_variants_of_the_single_files_load(paths, tmp_path):
    """No `model.diffusion_model.` prefix; CLIP-L's own projection and logit scale ignored (SD3 pools
    CLIP-L unprojected); T5 with `encoder.embed_tokens` instead of `shared`; an LDM VAE file alone."""
    state = load_tensors(paths["transformer_file"])
    save_safetensors(
        {k.removeprefix("model.diffusion_model."): v for k, v in state.items()}, tmp_path / "t.safetensors"
    )
    assert_equal_weights(sd3.load_transformer(tmp_path / "t.safetensors", torch.float32),
                  sd3.load_transformer(paths["diffusers"], torch.float32))  # fmt: skip
    clip = load_tensors(paths["text_encoder_file"])
    clip.update({"text_projection.weight": torch.randn(32, 32), "logit_scale": torch.tensor(4.6)})
    save_safetensors(clip, tmp_path / "clip_l.safetensors")
    t5 = load_tensors(paths["text_encoder_3_file"])
    t5["encoder.embed_tokens.weight"] = t5.pop("shared.weight")
    save_safetensors(t5, tmp_path / "t5.safetensors")
    tokenizers = (paths["tokenizer"], paths["tokenizer_2"], paths["tokenizer_3"])
    files = (tmp_path / "clip_l.safetensors", paths["text_encoder_2_file"], tmp_path / "t5.safetensors")
    _same_encoders(sd3.load_text_encoders(files, tokenizers, torch.float32), _single_encoders(paths))
    vae = sd3.load_vae(paths["diffusers"], torch.float32)
    save_safetensors(vae_to_original(vae.state_dict()), tmp_path / "vae.safetensors")
    assert_equal_weights(sd3.load_vae(tmp_path / "vae.safetensors", torch.float32), vae)
    theirs = AutoencoderKL.from_single_file(str(tmp_path / "vae.safetensors"), local_files_only=True,
                                            config=str(sd3.VAE_VARIANTS[1].config_dir))  # fmt: skip
    assert_equal_weights(theirs, vae)  # diffusers' LDM VAE converter reads it alike
    assert vae.config.scaling_factor == 1.5305 and vae.config.shift_factor == 0.0609


def test_diffusers_layout_single_file_loads(paths, tmp_path):
    expected = sd3.load_transformer(paths["diffusers"], torch.float32)
    save_safetensors(expected.state_dict(), tmp_path / "transformer.safetensors")
    assert_equal_weights(sd3.load_transformer(tmp_path / "transformer.safetensors", torch.float32), expected)


def test_wrong_files_are_refused_naming_what_they_are(paths, tmp_path):
    sd30 = tmp_path / "sd3_medium.safetensors"  # SD 3.0 Medium: no q/k norms, a 192² position table
    _header_only_file(sd30, {"joint_blocks.0.x_block.attn.qkv.weight": (4608, 1536),
                             "x_embedder.proj.weight": (1536, 16, 2, 2), "pos_embed": (1, 192**2, 1536)})  # fmt: skip
    with pytest.raises(CheckpointError, match="Stable Diffusion 3.0 Medium"):
        sd3.load_transformer(sd30, torch.float32)
    flux = tmp_path / "flux1-dev.safetensors"
    _header_only_file(flux, {"model.diffusion_model.double_blocks.0.img_attn.qkv.weight": (9216, 3072)})
    sdxl = tmp_path / "sd_xl_base_1.0.safetensors"
    _header_only_file(sdxl, {"model.diffusion_model.input_blocks.0.0.weight": (320, 4, 3, 3)})
    for path, what in (
        (flux, "FLUX"),
        (sdxl, "SDXL"),
        (paths["text_encoder_file"], "not a SD 3.5 transformer"),
    ):
        with pytest.raises(CheckpointError, match=what):
            sd3.load_transformer(path, torch.float32)
    with pytest.raises(CheckpointError, match="looks like Stable Diffusion 3"):  # and the other way round
        flux_models.load_transformer(paths["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="SD3 VAE"):
        sd3.load_vae(paths["transformer_file"], torch.float32)
    tokenizers = (paths["tokenizer"], paths["tokenizer_2"], None)
    with pytest.raises(CheckpointError, match="OpenCLIP bigG"):  # CLIP-L's file given as bigG
        sd3.load_text_encoders((paths["text_encoder_file"],) * 2 + (None,), tokenizers, torch.float32)
    with pytest.raises(CheckpointError, match="text_encoder_2"):  # CLIP-L alone is not enough
        sd3.load_text_encoders((paths["text_encoder_file"], None, None), tokenizers, torch.float32)
    other = (
        tmp_path / "flux_named_as_sd3.safetensors"
    )  # an SD3 file of another size: which variant is closest
    state = load_tensors(paths["transformer_file"])
    del state["model.diffusion_model.joint_blocks.0.x_block.attn.ln_q.weight"]
    save_safetensors(state, other)
    with pytest.raises(CheckpointError, match="variant tuner does not know"):
        sd3.load_transformer(other, torch.float32)


# ---------------------------------------------------------------------------------------------------
# Key conversion
# ---------------------------------------------------------------------------------------------------

LARGE_LIKE = dict(
    num_layers=3,
    attention_head_dim=32,
    num_attention_heads=3,
    caption_projection_dim=96,
    joint_attention_dim=64,
    pooled_projection_dim=32,
    pos_embed_max_size=8,
    qk_norm="rms_norm",
)
SD30_LIKE = dict(
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    caption_projection_dim=64,
    joint_attention_dim=64,
    pooled_projection_dim=32,
    pos_embed_max_size=8,
)
MEDIUM_LIKE = dict(SD30_LIKE, num_layers=3, qk_norm="rms_norm", dual_attention_layers=(0, 1))  # fmt: skip


@pytest.mark.parametrize("config", [LARGE_LIKE, SD30_LIKE, MEDIUM_LIKE], ids=["large", "sd30", "medium"])
def test_conversion_agrees_with_diffusers_converter_both_ways(config):
    """diffusers' SD3 converter (size-independent) turns our release-layout state dict into exactly the
    model's tensors, including the swapped halves of the final and the last block's text modulation."""
    model = fill_random_(SD3Transformer2DModel(**config), seed=3)
    state = model.state_dict()
    original = transformer_to_original(state)
    dim = config["caption_projection_dim"]
    assert original["joint_blocks.0.x_block.attn.qkv.weight"].shape == (3 * dim, dim)
    last = config["num_layers"] - 1
    assert original[f"joint_blocks.{last}.context_block.adaLN_modulation.1.weight"].shape == (2 * dim, dim)
    theirs = convert_sd3_transformer_checkpoint_to_diffusers(dict(original))
    assert theirs.keys() == state.keys()
    back = transformer_to_diffusers(original)
    for key in state:
        assert torch.equal(theirs[key], state[key]) and torch.equal(back[key], state[key]), key


def test_a_lone_fp8_weight_converts_by_its_shape():
    """ComfyUI fp8 layers convert one tensor at a time: the last block's text modulation (2·dim rows) is
    swapped, the others (6·dim) are not; a bias alone cannot tell, so it is refused."""
    weight = torch.arange(8.0).reshape(8, 1).expand(8, 4).contiguous()
    swapped = SD3_LAYOUT.tensor_to_diffusers("joint_blocks.5.context_block.adaLN_modulation.1.weight", weight)
    assert torch.equal(swapped["transformer_blocks.5.norm1_context.linear.weight"], weight.roll(4, 0))
    plain = torch.zeros(24, 4)
    assert (
        SD3_LAYOUT.tensor_to_diffusers("joint_blocks.5.context_block.adaLN_modulation.1.weight", plain)[
            "transformer_blocks.5.norm1_context.linear.weight"
        ]
        is plain
    )
    with pytest.raises(KeyError, match="only with its weight"):
        SD3_LAYOUT.tensor_to_diffusers("joint_blocks.5.context_block.adaLN_modulation.1.bias", torch.zeros(8))


def test_shipped_signatures_fit_the_shipped_configs():
    """Each shipped config, built on the meta device and written in the release's layout, is recognised
    as that variant with exactly the expected keys (so real files will be too)."""
    for variant in sd3.TRANSFORMER_VARIANTS:
        with torch.device("meta"):
            model = SD3Transformer2DModel.from_config(SD3Transformer2DModel.load_config(variant.config_dir))
        shapes = {k: tuple(v.shape) for k, v in SD3_LAYOUT.to_original(model.state_dict()).items()}
        assert pick_variant(shapes, sd3.TRANSFORMER_VARIANTS, "x", "sd3") is variant
        check_keys(sd3.TRANSFORMER_SPEC.expected_keys(variant), shapes, "x", "sd3")
    for variants in (sd3.CLIP_L_VARIANTS, sd3.CLIP_G_VARIANTS):
        for variant in variants:
            with torch.device("meta"):
                model = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(variant.config_dir))
            shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            assert pick_variant(shapes, variants, "x", "clip") is variant


def test_adapter_names_cover_the_default_targets(paths):
    """Every default target is renamed one to one or is a part of a fused qkv of the release's file."""
    model = sd3.load_transformer(paths["transformer_file"], torch.float32)
    original = {k.removeprefix("model.diffusion_model.") for k in load_tensors(paths["transformer_file"])}
    names = list(find_targets(model, TargetSpec(ARCHITECTURES["sd3"].default_targets)))
    assert (
        len(names) == 16 + 9
    )  # block 0: 8 attention, 4 attn2, 4 MLP; block 1 (pre-only): no to_add_out, ff_context
    for name in names:
        fused = [layer for layer in SD3_KEYS.fused if layer.part_of(name)]
        stem = fused[0].part_of(name)[0] if fused else SD3_KEYS(name)
        assert f"{stem}.weight" in original, name
    with pytest.raises(KeyError):  # a modulation's adapter would need its rows swapped: refused
        SD3_KEYS("transformer_blocks.1.norm1_context.linear")


def test_full_model_save_gives_back_the_release_file_exactly(paths, tmp_path):
    model = sd3.load_transformer(paths["transformer_file"], torch.float32)
    FullNetwork(model).save(tmp_path / "full.safetensors", SD3_LAYOUT)
    saved = load_tensors(tmp_path / "full.safetensors")
    fixture = {
        k.removeprefix("model.diffusion_model."): v
        for k, v in load_tensors(paths["transformer_file"]).items()
    }
    assert saved.keys() == fixture.keys()
    assert all(torch.equal(saved[k], v) for k, v in fixture.items())
    # continuing from it converts the whole file at once (`layouts.diffusers_state_dict`): the last
    # block's modulation bias is swapped by what its weight's shape says
    fresh = fill_random_(sd3.load_transformer(paths["transformer_file"], torch.float32), seed=9)
    FullNetwork(fresh).load_weights(tmp_path / "full.safetensors", SD3_LAYOUT.inverse)
    assert_equal_weights(fresh, model)


# ---------------------------------------------------------------------------------------------------
# Model inputs: ours against the pipeline's
# ---------------------------------------------------------------------------------------------------


def _trainer(text_length: int, t5: bool = True) -> SD3Model:
    return SD3Model(SimpleNamespace(model=SimpleNamespace(text_encoder_3="t5" if t5 else ""),
                                      cache=SimpleNamespace(text_max_length=text_length, text_encoder_blocks_to_swap=0)))  # fmt: skip


def _encoders(pipe, t5: bool = True) -> sd3.TextEncoders:
    return sd3.TextEncoders(pipe.text_encoder, pipe.tokenizer, pipe.text_encoder_2, pipe.tokenizer_2,
                            pipe.text_encoder_3 if t5 else None, pipe.tokenizer_3 if t5 else None)  # fmt: skip


@torch.no_grad()
@pytest.mark.parametrize("t5", [True, False], ids=["t5", "without_t5"])
def test_text_encoding_matches_encode_prompt(pipe, t5):
    """Our cached entries, collated and assembled as `predict` does, are the pipeline's prompt_embeds
    (CLIP features padded to T5's width, then T5's or zeros) and pooled_prompt_embeds."""
    trainer = _trainer(24, t5)
    cond = trainer.collate_text(trainer.encode_text(_encoders(pipe, t5), [PROMPT, "a blue square"]))
    assert ("t5" in cond) == t5
    text_encoder_3, pipe.text_encoder_3 = pipe.text_encoder_3, pipe.text_encoder_3 if t5 else None
    try:
        embeds, _, pooled, _ = pipe.encode_prompt(
            [PROMPT, "a blue square"], None, None, do_classifier_free_guidance=False, max_sequence_length=24
        )
    finally:
        pipe.text_encoder_3 = text_encoder_3
    torch.testing.assert_close(cond["pooled"], pooled, rtol=0, atol=0)
    clip = torch.nn.functional.pad(cond["clip"], (0, 128 - cond["clip"].shape[-1]))
    t5_part = cond["t5"] if t5 else torch.zeros(2, 24, 128)
    torch.testing.assert_close(torch.cat([clip, t5_part], 1), embeds, rtol=0, atol=0)


def test_training_without_t5_says_so_once(paths, caplog):
    trainer = SD3Model(SimpleNamespace(path="x.toml", model=SimpleNamespace(
        text_encoder=str(paths["text_encoder_file"]), text_encoder_2=str(paths["text_encoder_2_file"]),
        text_encoder_3="", tokenizer=str(paths["tokenizer"]), tokenizer_2=str(paths["tokenizer_2"]), tokenizer_3=""),
        cache=SimpleNamespace(text_encoder_blocks_to_swap=0)))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="tuner.archs.sd3.trainer"):
        encoders = trainer.load_text_encoder(torch.device("cpu"), "float32")
    assert encoders.t5 is None
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "text_encoder_3 is not set" in caplog.records[0].getMessage()


# ---------------------------------------------------------------------------------------------------
# diffusers' LoRA loader
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def _velocity(transformer) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    noisy, clip, pooled = (
        torch.randn(1, 16, 8, 8, generator=g),
        torch.randn(1, 77, 96, generator=g),
        torch.randn(1, 96, generator=g),
    )
    t5 = torch.randn(1, 8, 128, generator=g)
    return sd3.predict_velocity(transformer, noisy, torch.tensor([0.7]), clip, pooled, t5, 8)


def test_diffusers_sd3_lora_loader(paths, pipe, tmp_path):
    """`StableDiffusion3Pipeline.load_lora_weights` reads only diffusers' names (its SD3 loader has no
    converter of the release layout), so it refuses a comfy file (the release's names, qkv fused, read by
    ComfyUI); the default, save.format = "diffusers" (which ComfyUI maps too), loads there and computes
    our output."""
    ours = sd3.load_transformer(paths["transformer_file"], torch.float32)
    network = LoRANetwork.apply_to(
        ours, TargetSpec(ARCHITECTURES["sd3"].default_targets), 4, 2.0, name_map=SD3_LAYOUT
    )
    g = torch.Generator().manual_seed(0)
    for p in network.parameters():
        p.data.add_(torch.randn(p.shape, generator=g) * 0.05)
    expected = _velocity(ours)
    assert resolve_save_format("sd3", "auto") == "diffusers"
    network.save(tmp_path / "comfy.safetensors", format="comfy")
    assert "diffusion_model.joint_blocks.0.x_block.attn.qkv.lora_A.weight" in load_tensors(
        tmp_path / "comfy.safetensors"
    )
    with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):  # its `.alpha` keys, release names
        pipe.load_lora_weights(tmp_path / "comfy.safetensors")
    network.save(tmp_path / "diffusers.safetensors", format="diffusers")
    pipe.load_lora_weights(tmp_path / "diffusers.safetensors", adapter_name="ours")
    try:
        injected = {k.split(".lora_A.")[0] for k in pipe.transformer.state_dict() if ".lora_A." in k}
        assert injected == set(network.names())
        torch.testing.assert_close(_velocity(pipe.transformer), expected, rtol=1e-5, atol=1e-5)
    finally:
        pipe.delete_adapters("ours")


def test_fp8_base_skips_the_encoders_bundled_in_an_fp8_release_file(paths, tmp_path):
    """ComfyUI's SD 3.5 fp8 files bundle the text encoders (in fp8 too) beside the
    `model.diffusion_model.` transformer: fp8_base takes the transformer's fp8 layers only, and the
    transformer loads from the same file."""
    path = tmp_path / "sd3.5_medium_fp8_scaled.safetensors"
    original = {
        k.removeprefix("model.diffusion_model."): v
        for k, v in load_tensors(paths["transformer_file"]).items()
    }
    written = write_comfy_fp8_state(
        original, path, "legacy", quantized=lambda key: key.startswith("joint_blocks.")
    )
    bundle = load_tensors(path)
    q = torch.randn(128, 128).to(torch.float8_e4m3fn)
    bundle[f"{sd3.T5_PREFIX}encoder.block.0.layer.0.SelfAttention.q.weight"] = q
    bundle[f"{sd3.T5_PREFIX}encoder.block.0.layer.0.SelfAttention.q.scale_weight"] = torch.ones(1)
    save_safetensors(bundle, path)
    model = sd3.load_transformer(path, torch.float32).requires_grad_(False)
    stored = fp8.load_comfy_fp8_weights(model, path, SD3_LAYOUT.inverse)
    assert len(stored) == 3 * len(written) - 2 * sum(".qkv" not in stem for stem in written)  # qkv: 3 parts
    assert all(name.startswith("transformer_blocks.") for name in stored)
