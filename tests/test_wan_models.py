"""Wan 2.1 loading (both layouts), variant detection, key maps and input encoding, on the tiny fixture."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import diffusers
import pytest
import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
from safetensors.torch import load_file, save_file
from transformers import UMT5Config, UMT5EncoderModel

from tuner.archs.wan import loaders as wan
from tuner.archs.wan.fixture import write_wan_fixture
from tuner.archs.wan.keys import diffusers_module_name, original_module_name, vae_key_to_original
from tuner.errors import CheckpointError
from tuner.models.identify import pick_variant
from tuner.models.loading import read_safetensors_header


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_wan_fixture(tmp_path_factory.mktemp("wan"), seed=0)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


# ---------------------------------------------------------------------------------------------------
# Both layouts load the same weights
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_layouts_are_identical(fx, dtype):
    folder = wan.load_transformer(fx["diffusers"], dtype)
    assert isinstance(folder, WanTransformer3DModel)
    assert_same_weights(folder, wan.load_transformer(fx["diffusers"] / "transformer", dtype))
    assert_same_weights(folder, wan.load_transformer(fx["transformer_file"], dtype))
    if dtype == torch.bfloat16:  # modulation tables stay fp32, as diffusers' from_pretrained keeps them
        assert folder.scale_shift_table.dtype == torch.float32
        assert folder.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("prefix", ["model.diffusion_model.", "diffusion_model."])
def test_transformer_single_file_with_comfyui_prefix(fx, tmp_path, prefix):
    tensors = load_file(fx["transformer_file"])
    path = tmp_path / "prefixed.safetensors"
    save_file({prefix + k: v for k, v in tensors.items()}, path)
    assert_same_weights(
        wan.load_transformer(fx["diffusers"], torch.float32), wan.load_transformer(path, torch.float32)
    )


def test_transformer_single_file_in_diffusers_keys(fx):
    # e.g. a user points at transformer/diffusion_pytorch_model.safetensors itself
    file = fx["diffusers"] / "transformer" / "diffusion_pytorch_model.safetensors"
    assert_same_weights(
        wan.load_transformer(fx["diffusers"], torch.float32), wan.load_transformer(file, torch.float32)
    )


def test_transformer_official_release_folder(fx, tmp_path):
    # Wan-AI/Wan2.1-T2V-14B: config.json of class WanModel beside sharded original-layout safetensors
    tensors = load_file(fx["transformer_file"])
    keys = sorted(tensors)
    for n, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :]), start=1):
        save_file(
            {k: tensors[k] for k in part}, tmp_path / f"diffusion_pytorch_model-0000{n}-of-00002.safetensors"
        )
    (tmp_path / "config.json").write_text('{"_class_name": "WanModel", "dim": 64, "model_type": "t2v"}')
    reference = wan.load_transformer(fx["diffusers"], torch.bfloat16)
    assert_same_weights(reference, wan.load_transformer(tmp_path, torch.bfloat16))


def test_vae_layouts_are_identical(fx):
    folder = wan.load_vae(fx["diffusers"], torch.float32)
    assert isinstance(folder, AutoencoderKLWan)
    assert_same_weights(folder, wan.load_vae(fx["vae_file"], torch.float32))


def test_vae_single_file_as_pth(fx, tmp_path):
    path = tmp_path / "Wan2.1_VAE.pth"  # the official release ships the VAE as a .pth
    torch.save(load_file(fx["vae_file"]), path)
    assert_same_weights(wan.load_vae(fx["diffusers"], torch.float32), wan.load_vae(path, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_text_encoder_layouts_are_identical(fx, dtype):
    folder, folder_tok = wan.load_text_encoder(fx["diffusers"], None, dtype)
    single, single_tok = wan.load_text_encoder(fx["text_encoder_file"], fx["tokenizer"], dtype)
    assert isinstance(single, UMT5EncoderModel) and single.dtype == dtype
    assert_same_weights(folder, single)
    assert single.encoder.embed_tokens.weight is single.shared.weight
    caption = "a dog runs on the beach"
    assert folder_tok(caption).input_ids == single_tok(caption).input_ids


def test_text_encoder_single_file_needs_a_tokenizer(fx):
    with pytest.raises(CheckpointError, match="tokenizer"):
        wan.load_text_encoder(fx["text_encoder_file"], None, torch.float32)


def test_comfyui_scaled_fp8_files_are_dequantized(fx, tmp_path):
    tensors = load_file(fx["transformer_file"])
    quantized = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    for key, value in tensors.items():
        if key.endswith(".weight") and value.ndim == 2:
            scale = value.abs().max() / 448.0
            quantized[key] = (value / scale).to(torch.float8_e4m3fn)
            quantized[key.removesuffix(".weight") + ".scale_weight"] = scale.reshape(1)
        else:
            quantized[key] = value
    path = tmp_path / "wan_fp8_scaled.safetensors"
    save_file(quantized, path)
    reference = wan.load_transformer(fx["diffusers"], torch.float32).state_dict()
    loaded = wan.load_transformer(path, torch.float32).state_dict()
    assert loaded.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(
            loaded[key], reference[key], atol=0.1 * reference[key].abs().max().item(), rtol=0
        )


# ---------------------------------------------------------------------------------------------------
# Variant detection from shapes
# ---------------------------------------------------------------------------------------------------


def meta_original_shapes(config: dict, cls: type = WanTransformer3DModel) -> dict[str, tuple[int, ...]]:
    """Original-layout shapes of a transformer built on the meta device (no memory)."""
    with torch.device("meta"):
        model = cls.from_config(config)
    return {original_module_name(k): tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("variant", wan.TRANSFORMER_VARIANTS, ids=lambda v: v.name)
def test_transformer_variant_picked_from_shapes(variant):
    """Each shipped config's shapes (VACE's on its own class) match exactly its own signature."""
    cls = getattr(diffusers, wan.transformer_class_name(variant))
    shapes = meta_original_shapes(cls.load_config(variant.config_dir), cls)
    assert pick_variant(shapes, wan.TRANSFORMER_VARIANTS, "x.safetensors", "Wan") is variant


def test_shipped_configs_have_the_real_sizes():
    configs = {v.name: WanTransformer3DModel.load_config(v.config_dir) for v in wan.TRANSFORMER_VARIANTS}
    for name, dim, layers in [("t2v-1.3B", 1536, 30), ("t2v-14B", 5120, 40), ("i2v-14B", 5120, 40)]:
        assert configs[name]["attention_head_dim"] == 128  # every real Wan 2.1 uses head_dim 128
        assert configs[name]["num_attention_heads"] * 128 == dim
        assert configs[name]["num_layers"] == layers


def test_unknown_variant_is_named_in_the_error():
    # a width no release has (Wan 2.2 TI2V-5B, once unknown here, is a shipped variant now)
    other = dict(WanTransformer3DModel.load_config(wan.TRANSFORMER_VARIANTS[0].config_dir))
    other.update(num_attention_heads=20, ffn_dim=14336)
    with pytest.raises(CheckpointError, match=r"other\.safetensors.*t2v-1\.3B"):
        pick_variant(meta_original_shapes(other), wan.TRANSFORMER_VARIANTS, "other.safetensors", "Wan")


@pytest.mark.parametrize("variant", wan.VAE_VARIANTS, ids=lambda v: v.name)
def test_vae_variant_picked_from_shapes(variant):
    with torch.device("meta"):
        model = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(variant.config_dir))
    shapes = {vae_key_to_original(k): tuple(v.shape) for k, v in model.state_dict().items()}
    assert pick_variant(shapes, wan.VAE_VARIANTS, "vae.safetensors", "VAE") is variant


@pytest.mark.parametrize("variant", wan.TEXT_ENCODER_VARIANTS, ids=lambda v: v.name)
def test_text_encoder_variant_picked_from_shapes(variant):
    with torch.device("meta"):
        model = UMT5EncoderModel(UMT5Config.from_pretrained(variant.config_dir))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert pick_variant(shapes, wan.TEXT_ENCODER_VARIANTS, "te.safetensors", "UMT5") is variant


# ---------------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------------


def test_flux_checkpoint_given_to_wan(tmp_path):
    path = tmp_path / "flux1-dev.safetensors"
    save_file(
        {"double_blocks.0.img_attn.qkv.weight": torch.zeros(96, 32), "img_in.weight": torch.zeros(32, 64)},
        path,
    )
    with pytest.raises(CheckpointError, match=r"flux1-dev\.safetensors.*not a Wan 2\.1 transformer.*FLUX"):
        wan.load_transformer(path, torch.float32)


def test_vae_file_given_as_transformer(fx):
    with pytest.raises(CheckpointError, match=r"wan_2\.1_vae\.safetensors.*Wan VAE"):
        wan.load_transformer(fx["vae_file"], torch.float32)


def test_truncated_file(fx, tmp_path):
    path = tmp_path / "partial.safetensors"
    path.write_bytes(fx["transformer_file"].read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"partial\.safetensors.*download it again"):
        wan.load_transformer(path, torch.float32)


@pytest.mark.parametrize("content", [b"", b"\x05\x00", b"not a checkpoint at all, just text"])
def test_garbage_file(tmp_path, content):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"garbage\.safetensors"):
        read_safetensors_header(path)
    with pytest.raises(CheckpointError, match=r"garbage\.safetensors"):
        wan.load_vae(path, torch.float32)


def test_missing_file_and_missing_keys(fx, tmp_path):
    with pytest.raises(CheckpointError, match=r"nowhere\.safetensors.*no such file"):
        wan.load_transformer(tmp_path / "nowhere.safetensors", torch.float32)
    tensors = load_file(fx["transformer_file"])
    del tensors["blocks.1.cross_attn.o.weight"]
    path = tmp_path / "incomplete.safetensors"
    save_file(tensors, path)
    with pytest.raises(
        CheckpointError, match=r"incomplete\.safetensors.*1 missing.*blocks\.1\.cross_attn\.o\.weight"
    ):
        wan.load_transformer(path, torch.float32)


def test_folder_of_another_model(fx):
    with pytest.raises(CheckpointError, match="AutoencoderKLWan"):
        wan.load_transformer(fx["diffusers"] / "vae", torch.float32)


# ---------------------------------------------------------------------------------------------------
# Key map for LoRA export
# ---------------------------------------------------------------------------------------------------


def test_every_linear_maps_to_an_original_weight(fx):
    model = wan.load_transformer(fx["diffusers"], torch.float32)
    header = read_safetensors_header(fx["transformer_file"])
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 10 + 6  # per block: 8 attention + 2 ffn; embedders: 5; proj_out: 1
    for name, module in linears:
        original = original_module_name(name)
        assert header[original + ".weight"].shape == tuple(module.weight.shape), name
        assert diffusers_module_name(original) == name


def test_key_map_examples_and_image_to_video():
    examples = {
        "blocks.0.attn1.to_q": "blocks.0.self_attn.q",
        "blocks.12.attn2.to_k": "blocks.12.cross_attn.k",
        "blocks.3.attn1.to_out.0": "blocks.3.self_attn.o",
        "blocks.3.ffn.net.0.proj": "blocks.3.ffn.0",
        "blocks.3.ffn.net.2": "blocks.3.ffn.2",
        "blocks.7.attn2.add_k_proj": "blocks.7.cross_attn.k_img",
        "condition_embedder.time_proj": "time_projection.1",
        "condition_embedder.text_embedder.linear_1": "text_embedding.0",
        "proj_out": "head.head",
    }
    for diffusers_name, original in examples.items():
        assert original_module_name(diffusers_name) == original
        assert diffusers_module_name(original) == diffusers_name
    i2v = next(v for v in wan.TRANSFORMER_VARIANTS if v.name == "i2v-14B")
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(i2v.config_dir))
    for key in model.state_dict():  # every tensor, Linear or not, round-trips
        assert diffusers_module_name(original_module_name(key)) == key
    with pytest.raises(KeyError):
        original_module_name("blocks.0.attn1.to_qkv")  # fused projections have no original name


@pytest.mark.parametrize(
    "variant",
    wan.TRANSFORMER_VARIANTS + wan.VAE_VARIANTS,
    ids=lambda v: v.config_dir.parent.name + "/" + v.name,
)
def test_our_renaming_inverts_diffusers_converter(variant):
    """diffusers' own original -> diffusers converters undo our renaming, at the real sizes too."""
    from diffusers.loaders.single_file_utils import (  # internal, but it is what from_single_file runs
        convert_wan_transformer_to_diffusers,
        convert_wan_vae_to_diffusers,
    )

    is_vae = variant in wan.VAE_VARIANTS
    cls = AutoencoderKLWan if is_vae else WanTransformer3DModel
    with torch.device("meta"):
        keys = list(cls.from_config(cls.load_config(variant.config_dir)).state_dict())
    rename = vae_key_to_original if is_vae else original_module_name
    convert = convert_wan_vae_to_diffusers if is_vae else convert_wan_transformer_to_diffusers
    original = {rename(k): torch.empty(0) for k in keys}
    # what the loader hands the converter: FLF2V's `img_emb.emb_pos`, which it has no rule for, renamed
    converted = convert(original if is_vae else wan.fill_converter_gaps(original))
    assert sorted(converted) == sorted(keys)


def test_single_files_use_official_key_names(fx):
    transformer = read_safetensors_header(fx["transformer_file"])
    for key in ["head.modulation", "head.head.weight", "blocks.1.modulation", "blocks.0.norm3.weight"]:
        assert key in transformer
    for key in ["time_embedding.0.weight", "time_projection.1.weight", "text_embedding.2.bias"]:
        assert key in transformer
    vae = read_safetensors_header(fx["vae_file"])
    for key in [
        "conv1.weight",
        "conv2.weight",
        "encoder.conv1.weight",
        "encoder.downsamples.0.residual.0.gamma",
        "encoder.downsamples.3.shortcut.weight",
        "encoder.downsamples.5.time_conv.weight",
        "encoder.middle.1.to_qkv.weight",
        "decoder.upsamples.3.time_conv.weight",
        "decoder.upsamples.4.shortcut.weight",
        "decoder.upsamples.11.resample.1.weight",
        "decoder.upsamples.14.residual.6.weight",
        "decoder.head.2.weight",
    ]:
        assert key in vae, key


# ---------------------------------------------------------------------------------------------------
# Captions and videos -> model inputs
# ---------------------------------------------------------------------------------------------------


def test_encode_prompts_true_lengths_match_the_pipeline(fx):
    text_encoder, tokenizer = wan.load_text_encoder(fx["text_encoder_file"], fx["tokenizer"], torch.float32)
    captions = ["a cat", "a red car drives slowly on a wet road at night", "a  cat "]
    embeds = wan.encode_prompts(text_encoder, tokenizer, captions)
    assert [e.shape for e in embeds] == [(3, 64), (12, 64), (3, 64)]  # words + </s>
    torch.testing.assert_close(embeds[0], embeds[2])  # whitespace is collapsed
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=None, scheduler=None, transformer=None
    )
    with torch.no_grad():  # as in WanPipeline.__call__; autograd mode changes the last bits
        padded = pipe._get_t5_prompt_embeds(captions[:2], max_sequence_length=512, device=torch.device("cpu"))
    for ours, theirs in zip(embeds, padded):
        assert torch.equal(ours, theirs[: len(ours)])
        assert not theirs[len(ours) :].any()  # the pipeline pads with zeros


def test_encode_video_and_decode_latents(fx):
    vae = wan.load_vae(fx["vae_file"], torch.float32)
    seen = {}  # what the VAE returned and was given, recorded so that it runs only once each way
    encode, decode = vae.encode, vae.decode

    def spy_encode(x):
        seen["encoded"] = encode(x)
        return seen["encoded"]

    def spy_decode(z):
        seen["decoded_from"] = z
        return decode(z)

    vae.encode, vae.decode = spy_encode, spy_decode
    pixels = torch.rand(1, 3, 17, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = wan.encode_video(vae, pixels)
    assert latents.shape == (1, 16, 5, 8, 8)
    raw = seen["encoded"].latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    torch.testing.assert_close(latents, (raw - mean) / std)
    decoded = wan.decode_latents(vae, latents)
    assert decoded.shape == (1, 3, 17, 64, 64)
    torch.testing.assert_close(seen["decoded_from"], raw)  # normalization undone before decoding
    with pytest.raises(ValueError, match="1 \\+ 4k frames"):
        wan.encode_video(vae, pixels[:, :, :16])
