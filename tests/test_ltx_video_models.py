"""LTX-Video 0.9: loading (both layouts), model inputs equal to diffusers' LTXPipeline, adapters in its loader."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import pytest
import torch
from diffusers import LTXPipeline
from safetensors.torch import load_file

from tuner.archs.ltx2 import loaders as ltx2
from tuner.archs.ltx_video import loaders as ltx_video
from tuner.archs.ltx_video.fixture import write_ltx_video_fixture
from tuner.archs.ltx_video.trainer import LTXVideoModel
from tuner.errors import CheckpointError
from tuner.registry import ARCHITECTURES

CAPTIONS = ["a red circle moving left", "a small dog walks on the beach at sunset"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_ltx_video_fixture(tmp_path_factory.mktemp("ltx_video"), seed=0)


@pytest.fixture(scope="module")
def pipe(fx):
    pipe = LTXPipeline.from_pretrained(fx["diffusers"])
    for name in ("transformer", "vae", "text_encoder"):
        getattr(pipe, name).eval()
    return pipe


def test_single_file_and_diffusers_folder_load_identical_weights(fx):
    single = ltx_video.load_transformer(fx["transformer_file"], torch.float32)
    folder = ltx_video.load_transformer(fx["diffusers"], torch.float32)
    a, b = single.state_dict(), folder.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = load_file(fx["transformer_file"])
    assert "model.diffusion_model.patchify_proj.weight" in keys
    assert "model.diffusion_model.transformer_blocks.0.attn1.q_norm.weight" in keys


def test_ltx2_and_ltx_video_files_are_named_to_each_other(fx, tmp_path):
    from tuner.archs.ltx2.fixture import write_ltx2_fixture

    other = write_ltx2_fixture(tmp_path / "ltx2")
    with pytest.raises(CheckpointError, match='an LTX-2 transformer .*architecture = "ltx2"'):
        ltx_video.load_transformer(other["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="LTX-2 transformer.*LTX-Video 0.9 transformer"):
        ltx2.load_transformer(fx["transformer_file"], torch.float32)


def test_text_encoding_matches_the_pipeline(fx, pipe):
    from transformers import AutoTokenizer

    from tuner.archs.flux.loaders import load_t5

    t5, tokenizer_dir = load_t5(fx["diffusers"], torch.float32, "text_encoder", "tokenizer")
    embeds, mask = ltx_video.encode_prompts(
        t5.eval(), AutoTokenizer.from_pretrained(str(tokenizer_dir)), CAPTIONS, 32
    )
    with torch.no_grad():
        theirs, their_mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                      max_sequence_length=32, device="cpu")  # fmt: skip
    torch.testing.assert_close(embeds, theirs, rtol=0, atol=0)
    assert torch.equal(mask.bool(), their_mask.bool())


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    noisy = torch.randn(1, 128, 2, 2, 3, generator=gen)
    mask = torch.ones(1, 16, dtype=torch.long)
    mask[:, 9:] = 0
    return noisy, {"context": torch.randn(1, 16, 64, generator=gen), "mask": mask}


def test_predict_matches_the_pipelines_transformer_call(pipe):
    noisy, cond = _inputs()
    t = torch.tensor([0.6])
    trainer = LTXVideoModel.__new__(LTXVideoModel)
    trainer.record = ARCHITECTURES["ltx_video"]  # predict reads the record's frame rate
    with torch.no_grad():
        ours = trainer.predict(pipe.transformer, noisy, t, cond)
        theirs = pipe.transformer(
            hidden_states=pipe._pack_latents(noisy, 1, 1), encoder_hidden_states=cond["context"],
            timestep=(t * 1000).expand(1), encoder_attention_mask=cond["mask"], num_frames=2, height=2, width=3,
            rope_interpolation_scale=(8 / 25, 32, 32), return_dict=False,
        )[0]  # fmt: skip
    torch.testing.assert_close(ours, pipe._unpack_latents(theirs, 2, 2, 3, 1, 1), rtol=0, atol=0)


def test_saved_lora_loads_in_the_diffusers_pipeline(fx, pipe, tmp_path):
    """`save.format = "diffusers"` files load in diffusers' LTX-Video LoRA loader with the same result.
    The default (comfy: the release's names with `.alpha`, what ComfyUI reads) does not: diffusers 0.42
    keeps the `.alpha` keys and refuses them (pinned below)."""
    pytest.importorskip("peft")
    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec

    record = ARCHITECTURES["ltx_video"]
    model = ltx_video.load_transformer(fx["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), rank=4, alpha=2, name_map=record.key_table()
    )
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    network.save(tmp_path / "comfy.safetensors", format="comfy")
    with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):
        pipe.load_lora_weights(tmp_path / "comfy.safetensors", adapter_name="comfy")
    network.save(tmp_path / "lora.safetensors", format="diffusers")
    noisy, cond = _inputs(1)
    t = torch.tensor([0.5])
    trainer = LTXVideoModel.__new__(LTXVideoModel)
    trainer.record = ARCHITECTURES["ltx_video"]  # predict reads the record's frame rate
    with torch.no_grad():
        ours = trainer.predict(model, noisy, t, cond)
        pipe.load_lora_weights(tmp_path / "lora.safetensors", adapter_name="tuner")
        try:
            theirs = trainer.predict(pipe.transformer, noisy, t, cond)
        finally:
            pipe.delete_adapters("tuner")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_a_given_first_frame_matches_the_image_to_video_pipelines_call(pipe):
    """`clean_first`: the image's latent in frame 0 and the per-token timestep `t * (1 - conditioning_mask)`
    of diffusers' `LTXImageToVideoPipeline`; frame 0's velocity is the straight line to the given latent."""
    from diffusers import LTXImageToVideoPipeline

    i2v = LTXImageToVideoPipeline(**pipe.components)
    noisy, cond = _inputs(2)
    first = torch.randn(1, 128, 1, 2, 3, generator=torch.Generator().manual_seed(3))
    t = torch.tensor([0.6])
    trainer = LTXVideoModel.__new__(LTXVideoModel)
    trainer.record = ARCHITECTURES["ltx_video"]  # predict reads the record's frame rate
    given = {**cond, "first_frame": first, "clean_first": torch.tensor([True])}
    mask = torch.zeros(1, 1, 2, 2, 3)
    mask[:, :, 0] = 1
    with torch.no_grad():
        ours = trainer.predict(pipe.transformer, noisy, t, given)
        hidden = torch.cat([first, noisy[:, :, 1:]], dim=2)
        theirs = pipe.transformer(
            hidden_states=i2v._pack_latents(hidden, 1, 1), encoder_hidden_states=cond["context"],
            timestep=(t * 1000).expand(1).unsqueeze(-1) * (1 - i2v._pack_latents(mask, 1, 1).squeeze(-1)),
            encoder_attention_mask=cond["mask"], num_frames=2, height=2, width=3,
            rope_interpolation_scale=(8 / 25, 32, 32), return_dict=False,
        )[0]  # fmt: skip
        plain = trainer.predict(pipe.transformer, noisy, t, cond)
    theirs = i2v._unpack_latents(theirs, 2, 2, 3, 1, 1)
    torch.testing.assert_close(ours[:, :, 1:], theirs[:, :, 1:], rtol=0, atol=0)
    torch.testing.assert_close(ours[:, :, :1], (noisy[:, :, :1] - first) / 0.6)
    assert not torch.allclose(ours[:, :, 1:], plain[:, :, 1:], atol=1e-4)  # the frame changes the rest
