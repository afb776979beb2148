"""The tiny Wan 2.1 fixture: its files, determinism, and that diffusers' own pipeline runs on it offline;
and the helpers every family's fixture declares itself with (`tuner.fixtures`)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import json

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from tuner.archs.wan import loaders as wan
from tuner.archs.wan.fixture import build_wan_components, write_wan_fixture
from tuner.fixtures import model_section, tokenizer_folders
from tuner.fixtures.encoders import t5_file, vision_tower_file
from tuner.fixtures.tokenizers import build_t5_tokenizer
from tuner.fixtures.weights import fill_random_, tiny_config, tiny_model


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_wan_fixture(tmp_path_factory.mktemp("wan"), seed=0)


def test_fixture_tree(fx):
    root = fx["root"]
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == [
        "diffusers/model_index.json",
        "diffusers/scheduler/scheduler_config.json",
        "diffusers/text_encoder/config.json",
        "diffusers/text_encoder/model.safetensors",
        "diffusers/tokenizer/tokenizer.json",
        "diffusers/tokenizer/tokenizer_config.json",
        "diffusers/transformer/config.json",
        "diffusers/transformer/diffusion_pytorch_model.safetensors",
        "diffusers/vae/config.json",
        "diffusers/vae/diffusion_pytorch_model.safetensors",
        "single/tokenizer/tokenizer.json",
        "single/tokenizer/tokenizer_config.json",
        "single/umt5_tiny.safetensors",
        "single/wan2.1_t2v_tiny.safetensors",
        "single/wan_2.1_vae.safetensors",
    ]
    index = json.loads((fx["diffusers"] / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    for key in ("transformer_file", "vae_file", "text_encoder_file", "tokenizer"):
        assert fx[key].exists()


def test_fixture_is_deterministic(tmp_path):
    single = ("wan2.1_t2v_tiny.safetensors", "wan_2.1_vae.safetensors", "umt5_tiny.safetensors")
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = write_wan_fixture(tmp_path / "a", seed=0)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's random stream is left alone
    b = write_wan_fixture(tmp_path / "b", seed=0)
    for name in single:
        assert (a["root"] / "single" / name).read_bytes() == (b["root"] / "single" / name).read_bytes()
    c = write_wan_fixture(tmp_path / "a", seed=1)  # rewriting in place replaces the old files
    assert (c["root"] / "single" / single[0]).read_bytes() != (b["root"] / "single" / single[0]).read_bytes()


def test_wan_pipeline_loads_offline_and_generates(fx):
    pipe = WanPipeline.from_pretrained(fx["diffusers"], local_files_only=True)
    assert isinstance(pipe.transformer, WanTransformer3DModel)
    out = pipe(
        prompt="a cat walks on the grass",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).frames
    assert out.shape == (1, 5, 3, 32, 32)
    assert torch.isfinite(out).all()


def test_weights_are_random_everywhere():
    parts = build_wan_components(seed=0)
    for name in ("transformer", "vae", "text_encoder"):
        for key, param in parts[name].named_parameters():
            assert param.std() > 0 and not torch.all(param == 1), f"{name}.{key} kept its library init"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    first = [p.clone() for p in fill_random_(model, seed=5).parameters()]
    assert all(torch.equal(x, y) for x, y in zip(first, fill_random_(model, seed=5).parameters()))


def test_tokenizer_covers_captions_and_fits_the_encoder(fx):
    tokenizer = AutoTokenizer.from_pretrained(fx["tokenizer"], local_files_only=True)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = tokenizer("A Dog, 2 cats & a horse: running quickly!").input_ids
    assert tokenizer.unk_token_id not in ids and ids[-1] == tokenizer.eos_token_id
    assert tokenizer("a red car").input_ids == build_t5_tokenizer()("a red car").input_ids
    tiny = next(v for v in wan.TEXT_ENCODER_VARIANTS if v.name == "tiny")
    assert len(tokenizer) <= UMT5Config.from_pretrained(tiny.config_dir).vocab_size


def test_model_section_points_at_single_files_and_their_tokenizers():
    section = model_section(
        "flux", transformer="t.safetensors", vae="diffusers", text_encoder_2="t5.safetensors"
    )
    assert section == (
        'architecture = "flux"\n'
        'transformer = "{root}/single/t.safetensors"\n'
        'vae = "{root}/diffusers"\n'
        'text_encoder_2 = "{root}/single/t5.safetensors"\n'
        'tokenizer_2 = "{root}/single/tokenizer_2"\n'  # single files hold no tokenizer
    )
    assert "tokenizer" not in model_section("wan", text_encoder="diffusers")


def test_tiny_model_reads_either_library_and_leaves_the_random_stream():
    torch.manual_seed(7)
    expected_next = torch.rand(2)
    torch.manual_seed(7)
    umt5 = tiny_model(UMT5EncoderModel, tiny_config("wan", "text_encoder"), seed=2)
    transformer = tiny_model(WanTransformer3DModel, tiny_config("wan", "transformer"), seed=0)
    assert torch.equal(torch.rand(2), expected_next)
    assert not umt5.training and not transformer.training
    parts = build_wan_components(seed=0)
    for name, model in (("text_encoder", umt5), ("transformer", transformer)):
        reference = parts[name].state_dict()
        assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    with pytest.raises(FileNotFoundError):
        tiny_config("wan", "transformer", "no-such-variant")


def test_encoder_files_drop_the_tied_embedding_and_use_transformers_4_names():
    parts = build_wan_components(seed=0)
    t5 = t5_file(parts["text_encoder"])
    assert "encoder.embed_tokens.weight" not in t5 and "shared.weight" in t5
    assert tokenizer_folders(parts) == {"tokenizer": parts["tokenizer"]}
    vision = torch.nn.Module()
    vision.vision_model = torch.nn.Linear(2, 2)
    assert set(vision_tower_file(vision)) == {"vision_model.weight", "vision_model.bias"}
