"""FLUX.1 loading, key conversion and model inputs, checked against diffusers on the tiny fixture."""

from types import SimpleNamespace

import pytest
import torch
from diffusers import AutoencoderKL, FluxKontextPipeline, FluxPipeline, FluxTransformer2DModel
from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from project import assert_equal_weights
from tuner.archs.flux import loaders as flux
from tuner.archs.flux.keys import (
    FLUX_KEYS,
    FLUX_LAYOUT,
    transformer_to_diffusers,
    transformer_to_original,
    vae_to_diffusers,
    vae_to_original,
)
from tuner.archs.flux.trainer import FluxKontextModel, FluxModel
from tuner.errors import CheckpointError, ConfigError
from tuner.fixtures import write_fixture
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors
from tuner.models.identify import check_keys, pick_variant
from tuner.models.loading import load_tensors
from tuner.networks import FullNetwork
from tuner.networks.targets import TargetSpec, find_targets
from tuner.registry import ARCHITECTURES


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("flux", tmp_path_factory.mktemp("flux_model"))


# ---------------------------------------------------------------------------------------------------
# Loading both layouts
# ---------------------------------------------------------------------------------------------------


def test_single_files_load_like_the_diffusers_folder(paths):
    root = paths["diffusers"]
    assert_equal_weights(flux.load_transformer(paths["transformer_file"], torch.bfloat16),
                  flux.load_transformer(root, torch.bfloat16))  # fmt: skip
    assert_equal_weights(flux.load_vae(paths["vae_file"], torch.float32), flux.load_vae(root, torch.float32))
    single = flux.load_text_encoders(paths["text_encoder_file"], paths["text_encoder_2_file"],
                                     paths["tokenizer"], paths["tokenizer_2"], torch.float32)  # fmt: skip
    folder = flux.load_text_encoders(root, None, None, None, torch.float32)  # T5 found beside CLIP
    assert_equal_weights(single.clip, folder.clip)
    assert_equal_weights(single.t5, folder.t5)
    assert single.clip_tokenizer("a red circle").input_ids == folder.clip_tokenizer("a red circle").input_ids
    assert single.t5_tokenizer("a red circle").input_ids == folder.t5_tokenizer("a red circle").input_ids


def test_comfyui_variants_of_the_single_files_load(paths, tmp_path):
    """A `model.diffusion_model.` prefix, CLIP's projection/logit scale, T5 with embed_tokens only."""
    transformer = {
        f"model.diffusion_model.{k}": v for k, v in load_tensors(paths["transformer_file"]).items()
    }
    save_safetensors(transformer, tmp_path / "flux.safetensors")
    assert_equal_weights(flux.load_transformer(tmp_path / "flux.safetensors", torch.float32),
                  flux.load_transformer(paths["transformer_file"], torch.float32))  # fmt: skip
    clip = load_tensors(paths["text_encoder_file"])
    clip.update({"text_projection.weight": torch.eye(32), "logit_scale": torch.tensor(4.6)})
    save_safetensors(clip, tmp_path / "clip_l.safetensors")
    t5 = load_tensors(paths["text_encoder_2_file"])
    t5["encoder.embed_tokens.weight"] = t5.pop("shared.weight")
    save_safetensors(t5, tmp_path / "t5.safetensors")
    a = flux.load_text_encoders(tmp_path / "clip_l.safetensors", tmp_path / "t5.safetensors",
                                paths["tokenizer"], paths["tokenizer_2"], torch.float32)  # fmt: skip
    b = flux.load_text_encoders(paths["diffusers"], None, None, None, torch.float32)
    assert_equal_weights(a.clip, b.clip)
    assert_equal_weights(a.t5, b.t5)


def test_diffusers_layout_single_files_load(paths, tmp_path):
    for load, component in ((flux.load_transformer, "transformer"), (flux.load_vae, "vae")):
        expected = load(paths["diffusers"], torch.float32)
        save_safetensors(expected.state_dict(), tmp_path / f"{component}.safetensors")
        assert_equal_weights(load(tmp_path / f"{component}.safetensors", torch.float32), expected)


def test_vae_layout_agrees_with_diffusers_converter(paths):
    """diffusers' LDM VAE converter (size-independent) reads our ae.safetensors as we do."""
    theirs = AutoencoderKL.from_single_file(str(paths["vae_file"]), config=str(flux.VAE_VARIANTS[1].config_dir),
                                            local_files_only=True)  # fmt: skip
    assert_equal_weights(theirs, flux.load_vae(paths["vae_file"], torch.float32))


def test_wrong_files_raise_checkpoint_errors_naming_the_file(paths):
    cases = [
        (flux.load_transformer, paths["vae_file"]),
        (flux.load_vae, paths["transformer_file"]),
        (lambda p, d: flux.load_text_encoders(p, paths["text_encoder_2_file"], paths["tokenizer"],
                                              paths["tokenizer_2"], d), paths["text_encoder_2_file"]),
        (lambda p, d: flux.load_text_encoders(paths["text_encoder_file"], p, paths["tokenizer"],
                                              paths["tokenizer_2"], d), paths["text_encoder_file"]),
    ]  # fmt: skip
    for load, path in cases:
        with pytest.raises(CheckpointError, match=str(path.name)):
            load(path, torch.float32)
    with pytest.raises(CheckpointError, match="FLUX"):  # the error says what the file looks like
        flux.load_vae(paths["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="text_encoder_2"):  # a CLIP file alone is not enough
        flux.load_text_encoders(paths["text_encoder_file"], None, paths["tokenizer"], None, torch.float32)


def test_truncated_transformer_is_refused(paths, tmp_path):
    state = load_tensors(paths["transformer_file"])
    del state["single_blocks.0.linear1.bias"]
    save_safetensors(state, tmp_path / "partial.safetensors")
    with pytest.raises(CheckpointError, match="partial.safetensors.*missing"):
        flux.load_transformer(tmp_path / "partial.safetensors", torch.float32)


# ---------------------------------------------------------------------------------------------------
# Key conversion
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        dict(num_attention_heads=3, attention_head_dim=32, axes_dims_rope=(8, 12, 12), num_layers=2,
             num_single_layers=3, joint_attention_dim=96, pooled_projection_dim=64, guidance_embeds=True),
        dict(num_attention_heads=2, attention_head_dim=64, axes_dims_rope=(16, 24, 24), num_layers=1,
             num_single_layers=1, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False),
    ],
)  # fmt: skip
def test_transformer_round_trip_at_other_sizes(config):
    model = fill_random_(FluxTransformer2DModel(**config), seed=3)
    state = model.state_dict()
    original = transformer_to_original(state)
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    assert original["double_blocks.0.img_attn.qkv.weight"].shape == (3 * hidden, hidden)
    assert original["single_blocks.0.linear1.weight"].shape == (7 * hidden, hidden)
    back = transformer_to_diffusers(original)
    assert back.keys() == state.keys()
    for key in state:
        assert torch.equal(back[key], state[key]), key


def test_transformer_conversion_agrees_with_diffusers_converter():
    """diffusers' converter only runs at hidden size 3072 (it splits linear1 at fixed sizes): give it an
    original state dict whose linear1 has the 12B model's row count and small everything else."""
    model = fill_random_(FluxTransformer2DModel(num_attention_heads=2, attention_head_dim=32, num_layers=1,
                                                num_single_layers=1, joint_attention_dim=64,
                                                pooled_projection_dim=32, guidance_embeds=True,
                                                axes_dims_rope=(8, 12, 12)), seed=5)  # fmt: skip
    original = transformer_to_original(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    original["single_blocks.0.linear1.weight"] = torch.randn(7 * 3072, 4, generator=gen)
    original["single_blocks.0.linear1.bias"] = torch.randn(7 * 3072, generator=gen)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(original))
    ours = transformer_to_diffusers(original)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_vae_round_trip():
    vae = fill_random_(
        AutoencoderKL.from_config(AutoencoderKL.load_config(flux.VAE_VARIANTS[1].config_dir)), 1
    )
    state = vae.state_dict()
    back = vae_to_diffusers(vae_to_original(state))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_shipped_signatures_fit_the_shipped_configs():
    """Each real variant's config, built on the meta device and written in the original layout, is
    recognised as that variant with exactly the expected keys (so real files will be too)."""
    for spec in (flux.TRANSFORMER_SPEC, flux.VAE_SPEC):
        for variant in spec.variants:
            cls = FluxTransformer2DModel if spec is flux.TRANSFORMER_SPEC else AutoencoderKL
            with torch.device("meta"):
                model = cls.from_config(cls.load_config(variant.config_dir))
            state = model.state_dict()
            if cls is FluxTransformer2DModel:
                original = transformer_to_original(state)
            else:
                original = vae_to_original(state, len(model.config.block_out_channels))
            shapes = {k: tuple(v.shape) for k, v in original.items()}
            assert pick_variant(shapes, spec.variants, "x", spec.what) is variant
            check_keys(spec.expected_keys(variant), shapes, "x", spec.what)
    for variants, config_cls, model_cls in ((flux.CLIP_VARIANTS, CLIPTextConfig, CLIPTextModel),
                                            (flux.T5_VARIANTS, T5Config, T5EncoderModel)):  # fmt: skip
        for variant in variants:
            with torch.device("meta"):
                model = model_cls(config_cls.from_pretrained(variant.config_dir))
            shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            assert pick_variant(shapes, variants, "x", "text encoder") is variant


def test_adapter_names_cover_the_default_targets(paths):
    """Every default target is either renamed one to one or a part of a fused layer."""
    model = flux.load_transformer(paths["transformer_file"], torch.float32)
    original = set(load_tensors(paths["transformer_file"]))
    names = list(find_targets(model, TargetSpec(ARCHITECTURES["flux"].default_targets)))
    assert len(names) == 17  # 12 linears in the double block, 5 in the single block
    for name in names:
        fused = [layer for layer in FLUX_KEYS.fused if layer.part_of(name)]
        stem = fused[0].part_of(name)[0] if fused else FLUX_KEYS(name)
        assert f"{stem}.weight" in original, name
        if not fused:
            assert FLUX_KEYS.to_diffusers(stem) == name


# ---------------------------------------------------------------------------------------------------
# A full fine-tune saved in BFL's layout (issue #21)
# ---------------------------------------------------------------------------------------------------


def test_full_model_save_gives_back_the_bfl_file_exactly(paths, tmp_path):
    """BFL single file -> diffusers model -> full-model save (default format): the same tensors, bit for
    bit, under the same keys (q/k/v fused again, norms named `scale`, the final modulation swapped back)."""
    model = flux.load_transformer(paths["transformer_file"], torch.float32)
    path = tmp_path / "full.safetensors"
    FullNetwork(model).save(path, FLUX_LAYOUT)
    saved, fixture = load_tensors(path), load_tensors(paths["transformer_file"])
    assert saved.keys() == fixture.keys()
    for key, value in fixture.items():
        assert value.dtype == saved[key].dtype and torch.equal(value, saved[key]), key


def test_full_model_layout_is_what_diffusers_single_file_conversion_reads_at_full_size():
    """`FluxTransformer2DModel.from_single_file` cannot load the tiny fixture (its converter hard-codes
    hidden size 3072), so the check runs at FLUX.1-dev's real size on the meta device: diffusers' own
    converter turns our BFL-layout state dict into exactly the model's keys and shapes. (Values agree with
    it in `test_transformer_conversion_agrees_with_diffusers_converter`.)"""
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(
            FluxTransformer2DModel.load_config(flux.TRANSFORMER_VARIANTS[0].config_dir)
        )
    state = model.state_dict()
    theirs = convert_flux_transformer_checkpoint_to_diffusers(FLUX_LAYOUT.to_original(state))
    assert theirs.keys() == state.keys()
    assert all(theirs[k].shape == state[k].shape for k in state)


def test_a_fused_layer_missing_a_part_is_refused():
    state = {f"transformer_blocks.0.attn.to_{p}.weight": torch.zeros(4, 4) for p in "qk"}
    with pytest.raises(KeyError, match="lacks some of the layers it fuses"):
        FLUX_LAYOUT.to_original(state)


# ---------------------------------------------------------------------------------------------------
# Model inputs: ours against the pipelines'
# ---------------------------------------------------------------------------------------------------


def test_pack_unpack_and_ids_match_the_pipeline():
    latents = torch.randn(2, 16, 6, 10)
    packed = flux.pack_latents(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 6, 10))
    assert torch.equal(flux.unpack_latents(packed, 6, 10), latents)
    assert torch.equal(
        flux.image_ids(6, 10), FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32)
    )


def _trainer(cls, guidance: float, text_length: int):
    cfg = SimpleNamespace(
        model=SimpleNamespace(guidance=guidance), cache=SimpleNamespace(text_max_length=text_length)
    )
    return cls(cfg)


@torch.no_grad()
def test_kontext_two_euler_steps_match_the_pipeline(paths):
    """Our text encoding, collation, guidance, timesteps, packing and Kontext's reference tokens, stepped
    with Euler, give FluxKontextPipeline's latents (FLUX.1 without a reference: test_contract_generate.py)."""
    pipe = FluxKontextPipeline.from_pipe(
        FluxPipeline.from_pretrained(paths["diffusers"], local_files_only=True)
    )
    trainer = _trainer(FluxKontextModel, guidance=3.5, text_length=24)
    encoders = flux.TextEncoders(pipe.text_encoder, pipe.tokenizer, pipe.text_encoder_2, pipe.tokenizer_2)
    cond = trainer.collate_text(trainer.encode_text(encoders, ["a red circle on a black background"]))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 6, 4, generator=gen)  # a 48×32 image
    cond["control_0"] = torch.randn(1, 16, 4, 6, generator=gen)  # a reference of another size
    out = pipe(prompt="a red circle on a black background", height=48, width=32, num_inference_steps=2,
               guidance_scale=3.5, latents=flux.pack_latents(x), output_type="latent",
               max_sequence_length=24, image=cond["control_0"], max_area=48 * 32).images  # fmt: skip
    sigmas = pipe.scheduler.sigmas
    for i in range(2):
        t = sigmas[i].reshape(1)
        x = x + (sigmas[i + 1] - sigmas[i]) * trainer.predict(pipe.transformer, x, t, cond)
    torch.testing.assert_close(flux.pack_latents(x), out, rtol=1e-5, atol=1e-5)


def test_kontext_needs_exactly_one_reference():
    trainer = _trainer(FluxKontextModel, guidance=1.0, text_length=8)
    reference = torch.zeros(1, 16, 4, 4)
    assert trainer.references({"t5": None, "control_0": reference})[0] is reference
    for cond in ({}, {"control_0": reference, "control_1": reference}):
        with pytest.raises(ConfigError, match="exactly one reference"):
            trainer.references(cond)
    assert _trainer(FluxModel, guidance=1.0, text_length=8).references({"control_0": reference}) == ()


def test_a_fused_layer_adapted_in_part_is_refused_before_training(paths):
    """Excluding v of a double block leaves its fused qkv half adapted; that file could not be saved in
    the release's layout, so the network refuses it when it is built, not at the end of the run."""
    from tuner.config.schema import NetworkConfig
    from tuner.networks.factory import build_network

    model = flux.load_transformer(paths["transformer_file"], torch.float32)
    targets = ARCHITECTURES["flux"].default_targets
    cfg = NetworkConfig(exclude=(r"transformer_blocks\.0\.attn\.to_v",))
    with pytest.raises(
        ConfigError, match="kohya layout.*double_blocks.0.img_attn.qkv.*adapt all of them or none"
    ):
        build_network(model, targets, cfg, FLUX_LAYOUT, save_format="kohya")
    build_network(model, targets, cfg, FLUX_LAYOUT, save_format="diffusers").remove()  # split names: fine
