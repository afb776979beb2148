"""LTX-2: loading (both layouts), model inputs equal to diffusers' LTX2Pipeline, both streams in the loss."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import pytest
import torch
from diffusers import LTX2Pipeline
from safetensors.torch import load_file, save_file

from project import NoAccelerator
from tuner.archs.ltx2 import loaders as ltx2
from tuner.archs.ltx2.fixture import write_ltx2_fixture
from tuner.archs.ltx2.trainer import LTX2Model
from tuner.errors import CheckpointError
from tuner.registry import ARCHITECTURES

CAPTIONS = ["a red circle moving left", "a small dog walks on the beach at sunset"]
MAX_LENGTH = 16


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_ltx2_fixture(tmp_path_factory.mktemp("ltx2"), seed=0)


@pytest.fixture(scope="module")
def pipe(fx):
    pipe = LTX2Pipeline.from_pretrained(fx["diffusers"])
    for name in ("transformer", "vae", "audio_vae", "vocoder", "connectors", "text_encoder"):
        getattr(pipe, name).eval()
    return pipe


def _bare_trainer() -> LTX2Model:
    """The trainer's model-input code, without a config (what these tests call needs none)."""
    return LTX2Model(None)


@pytest.mark.parametrize("file", ["checkpoint_file", "transformer_file"])
def test_single_file_and_diffusers_folder_load_identical_weights(fx, file):
    single = ltx2.load_transformer(fx[file], torch.float32)
    folder = ltx2.load_transformer(fx["diffusers"], torch.float32)
    a, b = single.state_dict(), folder.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = load_file(fx["transformer_file"])
    assert "model.diffusion_model.patchify_proj.weight" in keys
    assert "model.diffusion_model.transformer_blocks.0.attn1.q_norm.weight" in keys
    assert "model.diffusion_model.av_ca_a2v_gate_adaln_single.linear.weight" in keys


@pytest.mark.parametrize("load", [ltx2.load_vae, ltx2.load_audio_vae], ids=["video", "audio"])
def test_vaes_of_the_release_file_equal_the_diffusers_folders(fx, load):
    single, folder = load(fx["checkpoint_file"], torch.float32), load(fx["diffusers"], torch.float32)
    a, b = single.state_dict(), folder.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = load_file(fx["checkpoint_file"])
    # the release's names: one sequence of stages and resamplers, `res_blocks`, per-channel statistics
    assert "vae.encoder.down_blocks.8.res_blocks.0.conv1.conv.weight" in keys
    assert "vae.decoder.up_blocks.1.conv.conv.weight" in keys
    assert "audio_vae.per_channel_statistics.mean-of-means" in keys


def test_a_file_without_vaes_is_named(fx):
    only = fx["transformer_file"]
    with pytest.raises(CheckpointError, match=r"holds no LTX-2 video VAE \(no `vae\.\*` keys"):
        ltx2.load_vae(only, torch.float32)


def test_release_file_bundling_connectors_loads_and_another_architecture_is_named(fx, tmp_path):
    tensors = load_file(fx["transformer_file"])
    bundled = tmp_path / "ltx-2-bundle.safetensors"
    extra = {"model.diffusion_model.video_embeddings_connector.x.weight": torch.zeros(2)}
    save_file({**tensors, **extra, "vae.per_channel_statistics.mean-of-means": torch.zeros(2)}, bundled)
    model = ltx2.load_transformer(bundled, torch.float32)
    assert model.config.num_layers == 2
    from tuner.archs.wan.fixture import write_wan_fixture

    wan = write_wan_fixture(tmp_path / "wan")
    with pytest.raises(CheckpointError, match="not a LTX-2 transformer.*Wan 2.1 transformer"):
        ltx2.load_transformer(wan["transformer_file"], torch.float32)
    from tuner.archs.wan import loaders as wan

    with pytest.raises(CheckpointError, match="LTX-2 transformer"):
        wan.load_transformer(fx["transformer_file"], torch.float32)


def test_text_encoding_matches_the_pipeline(fx, pipe):
    model, tokenizer = ltx2.load_text_encoder(fx["diffusers"], None, torch.float32)
    connectors = ltx2.load_connectors(fx["diffusers"], torch.float32)
    ours = ltx2.encode_prompts(model, tokenizer, connectors, CAPTIONS, MAX_LENGTH)
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                max_sequence_length=MAX_LENGTH, device="cpu")  # fmt: skip
        video, audio, text_mask = pipe.connectors(embeds, mask, padding_side="left")
    torch.testing.assert_close(ours["video_context"], video, rtol=0, atol=0)
    torch.testing.assert_close(ours["audio_context"], audio, rtol=0, atol=0)
    assert torch.equal(ours["text_mask"], text_mask)


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    noisy = torch.randn(1, 128, 2, 2, 3, generator=gen)
    audio = torch.randn(1, 8, 5, 16, generator=gen)
    cond = {
        "video_context": torch.randn(1, MAX_LENGTH, 32, generator=gen),
        "audio_context": torch.randn(1, MAX_LENGTH, 32, generator=gen),
        "text_mask": torch.ones(1, MAX_LENGTH, dtype=torch.long),
    }
    return noisy, audio, cond


def test_both_streams_match_the_pipelines_transformer_call(pipe):
    """`LTX2Sound.predict_streams` feeds the transformer exactly as LTX2Pipeline's denoising loop does (its own
    packing of both streams, timestep t·1000 as `timestep` and `sigma`), and unpacks both outputs."""
    noisy, audio, cond = _inputs()
    t = torch.tensor([0.7])
    with torch.no_grad():
        video_v, audio_v = (
            _bare_trainer().sound_stream().predict_streams(pipe.transformer, noisy, t, audio, t, cond)
        )
        packed = pipe._pack_latents(noisy, 1, 1)
        packed_audio = pipe._pack_audio_latents(audio)
        coords = pipe.transformer.rope.prepare_video_coords(1, 2, 2, 3, noisy.device, fps=24.0)
        audio_coords = pipe.transformer.audio_rope.prepare_audio_coords(1, 5, noisy.device)
        theirs_v, theirs_a = pipe.transformer(
            hidden_states=packed, audio_hidden_states=packed_audio,
            encoder_hidden_states=cond["video_context"], audio_encoder_hidden_states=cond["audio_context"],
            timestep=(t * 1000).expand(1), sigma=(t * 1000).expand(1), encoder_attention_mask=cond["text_mask"],
            audio_encoder_attention_mask=cond["text_mask"], num_frames=2, height=2, width=3, fps=24.0,
            audio_num_frames=5, video_coords=coords, audio_coords=audio_coords, return_dict=False,
        )  # fmt: skip
    torch.testing.assert_close(video_v, pipe._unpack_latents(theirs_v, 2, 2, 3, 1, 1), rtol=0, atol=0)
    torch.testing.assert_close(audio_v, pipe._unpack_audio_latents(theirs_a, 5, 16), rtol=0, atol=0)


def test_loss_covers_both_streams(pipe, tmp_path):
    """With sound the loss is the video stream's plus the audio stream's flow-matching loss, and the
    audio output head gets gradients; without sound only the video stream counts."""
    from tuner.diffusion.timesteps import FlowObjective, flow_loss, flow_target

    trainer = _bare_trainer()
    trainer._objective = FlowObjective()
    trainer.cfg = type("Cfg", (), {"model": type("M", (), {"dtype": "fp32"})})()
    model = pipe.transformer
    model.requires_grad_(True)  # a LoRA another test loaded into the shared pipeline froze its weights
    noisy, audio, cond = _inputs(1)
    x0, noise = noisy, torch.randn_like(noisy)
    t = torch.tensor([0.4])
    audio_noise = torch.randn_like(audio)
    with_sound = {**cond, "audio_latents": audio, "audio_noise": audio_noise}
    model.zero_grad()
    loss = trainer.loss(model, x0, noise, t, with_sound, NoAccelerator())
    loss.backward()
    assert model.audio_proj_out.weight.grad.abs().sum() > 0
    with torch.no_grad():
        xt, at = (1 - t) * x0 + t * noise, (1 - t) * audio + t * audio_noise
        v, a = trainer.sound_stream().predict_streams(model, xt, t, at, t, cond)
        expected = flow_loss(v, flow_target(x0, noise), t, "none") + flow_loss(
            a, flow_target(audio, audio_noise), t, "none"
        )
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=1e-6)
    # a dataset's loss mask weighs the video stream only; its loss_weight scales the sum
    masked = {**with_sound, "loss_mask": torch.zeros(1, 1, *x0.shape[2:]), "loss_weight": torch.tensor([2.0])}
    with torch.no_grad():
        audio_only = flow_loss(a, flow_target(audio, audio_noise), t, "none")
        torch.testing.assert_close(trainer.loss(model, x0, noise, t, masked, NoAccelerator()), 2 * audio_only)
    model.zero_grad()
    silent = trainer.loss(model, x0, noise, t, cond, NoAccelerator())
    silent.backward()
    assert model.audio_proj_out.weight.grad is None or model.audio_proj_out.weight.grad.abs().sum() == 0
    model.zero_grad()


def test_audio_vae_round_trip_shapes(fx):
    audio_vae = ltx2.load_audio_vae(fx["diffusers"], torch.float32)
    vocoder = ltx2.load_vocoder(fx["diffusers"], torch.float32)
    waveform = torch.sin(torch.arange(6000) / 16000 * 2 * torch.pi * 220).repeat(2, 1)
    with torch.no_grad():
        latents = ltx2.encode_audio(audio_vae, waveform)
        assert latents.shape == (8, ltx2.audio_latent_frames(audio_vae, 6000), 16)
        sound = ltx2.decode_audio(audio_vae, vocoder, latents[None])
    assert sound.shape[:2] == (1, 2) and torch.isfinite(sound).all()


def test_saved_lora_loads_in_the_diffusers_pipeline(fx, pipe, tmp_path):
    """The default, `comfy_folded` (`diffusion_model.` + the release's names, alpha folded in, what ComfyUI
    reads), loads in diffusers' LTX-2 LoRA loader with the same result. A `comfy` file does not: diffusers
    0.42's LTX-2 converter keeps the `.alpha` keys and then refuses them as not LoRA parameters (pinned
    below, so a diffusers that starts reading them shows up here)."""
    pytest.importorskip("peft")
    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec
    from tuner.registry import resolve_save_format

    record = ARCHITECTURES["ltx2"]
    model = ltx2.load_transformer(fx["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), rank=4, alpha=2, name_map=record.key_table()
    )
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    network.save(tmp_path / "comfy.safetensors", format="comfy")
    saved = load_file(tmp_path / "comfy.safetensors")
    assert "diffusion_model.transformer_blocks.0.audio_to_video_attn.to_q.alpha" in saved
    with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):
        pipe.load_lora_weights(tmp_path / "comfy.safetensors", adapter_name="comfy")
    assert resolve_save_format("ltx2", "auto") == "comfy_folded"  # the default: no `.alpha` keys
    network.save(tmp_path / "lora.safetensors", format="comfy_folded")
    assert not any(k.endswith(".alpha") for k in load_file(tmp_path / "lora.safetensors"))
    noisy, audio, cond = _inputs(2)
    t = torch.tensor([0.5])
    trainer = _bare_trainer()
    with torch.no_grad():
        ours = trainer.sound_stream().predict_streams(model, noisy, t, audio, t, cond)
        pipe.load_lora_weights(tmp_path / "lora.safetensors", adapter_name="tuner")
        try:
            theirs = trainer.sound_stream().predict_streams(pipe.transformer, noisy, t, audio, t, cond)
        finally:
            pipe.delete_adapters("tuner")
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_generate_writes_an_mp4_with_sound(fx, tmp_path):
    """`tuner generate` denoises the audio stream beside the video and muxes the vocoder's waveform."""
    import av

    from project import cfg, make_project
    from tuner.data.audio import has_audio, read_audio
    from tuner.generate import GenerateOptions, generate

    config = make_project(tmp_path, fx["root"], architecture="ltx2")
    opts = GenerateOptions(prompt="a red circle", out=str(tmp_path / "clip.mp4"), width=64, height=64, frames=17,
                           steps=2, guidance_scale=2.0, device="cpu")  # fmt: skip
    out = generate(cfg(config), opts, log=lambda s: None)
    assert out.suffix == ".mp4" and has_audio(out)
    with av.open(str(out)) as container:
        assert container.streams.audio[0].rate == 16000  # the tiny vocoder's output rate
    sound = read_audio(out, 16000, 2)
    assert torch.isfinite(sound).all()
    # the tiny vocoder keeps the real 160 samples per mel frame: the sound lasts as long as the clip
    assert abs(sound.shape[1] / 16000 - 17 / 24) < 0.1


def test_another_audio_vae_in_the_pipeline_folder_re_encodes_the_latents(fx, tmp_path, capsys):
    import shutil

    from project import make_project, run, summary

    folder = tmp_path / "LTX-2"
    shutil.copytree(fx["diffusers"], folder)
    config = make_project(tmp_path / "project", fx["root"], architecture="ltx2", vae=f'"{folder}"')
    assert summary(run(capsys, "cache", "latents", "--config", config)[1]) == (6, 0, 0)
    assert summary(run(capsys, "cache", "latents", "--config", config)[1]) == (0, 6, 0)
    weights = next((folder / "audio_vae").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)  # another audio VAE
    assert summary(run(capsys, "cache", "latents", "--config", config)[1])[0] == 6


def test_the_audio_vae_is_found_beside_the_given_vae_folder(fx):
    """The trainer hands `model.vae` to both VAE loaders: given the `vae/` folder, `audio_vae/` beside it."""
    beside = ltx2.load_audio_vae(Path(fx["diffusers"]) / "vae", torch.float32).state_dict()
    root = ltx2.load_audio_vae(fx["diffusers"], torch.float32).state_dict()
    assert beside.keys() == root.keys() and all(torch.equal(beside[k], root[k]) for k in root)
