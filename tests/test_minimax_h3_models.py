"""MiniMax H3: every layout loads the same weights, wrong files are named, and what tuner computes matches
diffusers' own pieces (its single-file converter, the modular pipeline's packing, row timesteps and
schedulers, its LoRA loader); an H3 sample is an mp4 with sound."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from project import NoAccelerator, assert_equal_weights
from tuner.archs.minimax_h3 import loaders as h3
from tuner.archs.minimax_h3.fixture import write_minimax_h3_fixture
from tuner.archs.minimax_h3.trainer import MiniMaxH3Model
from tuner.errors import CheckpointError
from tuner.registry import ARCHITECTURES


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_minimax_h3_fixture(tmp_path_factory.mktemp("minimax_h3"), seed=0)


@pytest.fixture(scope="module")
def transformer(fx):
    return h3.load_transformer(fx["diffusers"], torch.float32)


def test_single_files_and_diffusers_folder_load_identical_weights(fx, transformer):
    assert_equal_weights(h3.load_transformer(fx["transformer_file"], torch.float32), transformer)
    keys = load_file(fx["transformer_file"])
    assert "blocks.0.attn.qkv_proj.weight" in keys and "final_layer.video_out.weight" in keys
    assert "token_refiner.blocks.0.mlp.fc1.weight" in keys
    single = h3.load_text_encoder(fx["text_encoder_file"], fx["tokenizer"], torch.float32)
    folder = h3.load_text_encoder(fx["diffusers"], None, torch.float32)
    assert_equal_weights(single.model, folder.model)


def test_the_release_layout_is_what_diffusers_single_file_converter_reads(fx, transformer, tmp_path):
    """diffusers' converter (q, k, v stacked; fc1 gate first) turns our file into the folder's weights,
    and ComfyUI's `diffusion_model.` prefix and the stored `rope.inv_freq` load too."""
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    release = load_file(fx["transformer_file"])
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        dict(release), dict(transformer.config)
    )
    want = transformer.state_dict()
    assert converted.keys() == want.keys() and all(torch.equal(converted[k], want[k]) for k in want)
    prefixed = {f"diffusion_model.{k}": v for k, v in release.items()}
    prefixed["diffusion_model.rope.inv_freq"] = transformer.rope.inv_freq
    save_file(prefixed, tmp_path / "comfy.safetensors")
    assert_equal_weights(h3.load_transformer(tmp_path / "comfy.safetensors", torch.float32), transformer)


def test_wrong_files_are_named(fx, tmp_path):
    with pytest.raises(CheckpointError, match="qwen3vl_tiny.safetensors"):
        h3.load_transformer(fx["text_encoder_file"], torch.float32)
    release = load_file(fx["transformer_file"])
    pruned = {k: v for k, v in release.items() if not k.startswith("time_embedder.")}
    pruned["adaln_t_table"] = torch.zeros(1000, 24)  # ComfyUI's `*_pruned_*` files
    save_file(pruned, tmp_path / "pruned.safetensors")
    with pytest.raises(CheckpointError, match="pruned.safetensors"):
        h3.load_transformer(tmp_path / "pruned.safetensors", torch.float32)
    with pytest.raises(CheckpointError, match="diffusers folder"):
        h3.load_vae(fx["transformer_file"], torch.float32)


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    video = torch.randn(1, 24, 2, 4, 6, generator=gen)
    audio = torch.randn(1, 2, 32, 5, generator=gen)
    prompt = torch.randn(3, 32, generator=gen)
    return video, audio, prompt


def test_both_streams_match_the_pipelines_packed_transformer_call(transformer):
    """The rows, layout and row timesteps are the t2va pipeline's (`patchify_video_latents`, channel-major
    audio rows, `build_packed_sequence`, `build_row_timesteps` at 1 − σ per stream); the velocities are
    the model's data-ward output negated (tuner's noise − x0)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
        patchify_video_latents,
    )

    video, audio, prompt = _inputs()
    sigma, sound_sigma = 0.8, 0.5
    with torch.no_grad():
        v, a = h3.predict_velocities(
            transformer, video, torch.tensor([sigma]), audio, torch.tensor([sound_sigma]), [prompt]
        )
        rows = patchify_video_latents(video, (1, 2, 2))
        audio_rows = audio[0].transpose(1, 2).reshape(-1, 32)  # the two channels, one after the other
        layout = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            torch.full((3,), 1), 2, 4, 6, 5, (1, 2, 2), 2, 2, 0
        )
        positions, tags, video_idx, audio_idx, text_idx = layout[:5]
        timestep, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            video_idx, audio_idx, 0, 0, 3, 1 - sigma, 1 - sound_sigma, 1.0, 1.0
        )
        theirs_v, theirs_a = transformer(
            hidden_states=rows[None], audio_hidden_states=audio_rows[None], encoder_hidden_states=prompt[None],
            timestep=timestep, timestep_indices=indices, token_tags=tags, position_ids=positions.float(),
            video_indices=video_idx, audio_indices=audio_idx, text_indices=text_idx, return_dict=False,
        )  # fmt: skip
    torch.testing.assert_close(h3.pack_video(v)[0], -theirs_v[0], rtol=0, atol=0)
    torch.testing.assert_close(h3.pack_audio(a)[0], -theirs_a[0], rtol=0, atol=0)


def test_the_sound_schedule_is_the_release_audio_scheduler():
    """Generation's video levels are the video scheduler's (shift 12), and the sound's, mapped from them,
    the audio scheduler's (shift 3) over the same grid."""
    from diffusers import MiniMaxH3Scheduler

    from tuner.diffusion.sampling import flow_sigmas

    video, sound = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video.set_timesteps(9)
    sound.set_timesteps(9)
    ours = flow_sigmas(8, 12.0)
    torch.testing.assert_close(ours, video.sigmas.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        _sound_stream().sound_levels(ours, 12.0), sound.sigmas.float(), rtol=0, atol=1e-6
    )


def test_generation_steps_both_streams_down_the_release_schedulers(fx, transformer, tmp_path):
    """tuner's sampler (both streams as one tensor, the sound's Euler step scaled onto the video's) lands
    where the pipeline's two MiniMaxH3Schedulers (shift 12 and 3, data-ward velocities) take each stream."""
    from diffusers import MiniMaxH3Scheduler

    from project import cfg, make_project
    from tuner.generate import GenerateOptions, sample_latents

    family = ARCHITECTURES["minimax_h3"].family_model(
        cfg(make_project(tmp_path, fx["root"], architecture="minimax_h3"))
    )
    prompt = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    cond = {"prompt_embeds": prompt[None], "prompt_mask": torch.ones(1, 3, dtype=torch.bool)}
    opts = GenerateOptions(
        prompt="-", out="-", width=64, height=64, frames=22, steps=4, guidance_scale=1.0, device="cpu"
    )
    with torch.no_grad():
        video, sound = sample_latents(family, transformer, opts, cond, cond, torch.device("cpu"), torch.float32,
                                      progress=False)  # fmt: skip
        gen = torch.Generator().manual_seed(opts.seed)  # the video's noise, then the sound's
        x = torch.randn((1, *family.latent_shape(64, 64, 22)), generator=gen)
        a = torch.randn((1, *family.sound_stream().latent_shape(22)), generator=gen)
        video_steps, sound_steps = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
        video_steps.set_timesteps(5)
        sound_steps.set_timesteps(5)
        for tv, ta in zip(video_steps.timesteps, sound_steps.timesteps, strict=True):
            v, s = h3.predict_velocities(transformer, x, (1 - tv)[None], a, (1 - ta)[None], [prompt])
            x = video_steps.step(-v, tv, x).prev_sample  # the model's own (data-ward) output
            a = sound_steps.step(-s, ta, a).prev_sample
    torch.testing.assert_close(video, x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sound, a, rtol=1e-4, atol=1e-4)


def _sound_stream():
    family = MiniMaxH3Model.__new__(MiniMaxH3Model)
    family.record = ARCHITECTURES["minimax_h3"]
    return family.sound_stream()


def test_loss_noises_the_sound_at_its_own_level_and_sums_both_streams(transformer):
    from tuner.diffusion.timesteps import FlowObjective, flow_loss, flow_target

    family = MiniMaxH3Model.__new__(MiniMaxH3Model)
    family.record = ARCHITECTURES["minimax_h3"]
    family._objective = FlowObjective()
    family.cfg = type("Cfg", (), {"model": type("M", (), {"dtype": "fp32"})})()
    video, audio, prompt = _inputs(1)
    noise, audio_noise = torch.randn_like(video), torch.randn_like(audio)
    t = torch.tensor([0.6])
    cond = {"prompt_embeds": prompt[None], "prompt_mask": torch.ones(1, 3, dtype=torch.bool)}
    with torch.no_grad():
        loss = family.loss(transformer, video, noise, t, {**cond, "audio_latents": audio,
                                                           "audio_noise": audio_noise}, NoAccelerator())  # fmt: skip
        st = _sound_stream().sound_levels(t)
        assert 0 < st.item() < t.item()  # the sound is shifted less: nearer clean than the video
        v, a = h3.predict_velocities(
            transformer, (1 - t) * video + t * noise, t, (1 - st) * audio + st * audio_noise, st, [prompt]
        )
        expected = flow_loss(v, flow_target(video, noise), t, "none") + flow_loss(
            a, flow_target(audio, audio_noise), st, "none"
        )
        # a clip without sound: the video stream's loss beside the stream's silence at t = 1
        silent = family.loss(transformer, video, noise, t, cond, NoAccelerator())
        noisy = (1 - t) * video + t * noise
        quiet = _sound_stream().silence(transformer, noisy)
        assert quiet.shape == (1, 2, 32, 8)  # 5 frames (2 latent frames) at 40 latents per second
        v, _ = h3.predict_velocities(transformer, noisy, t, quiet, torch.ones(1), [prompt])
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        silent, flow_loss(v, flow_target(video, noise), t, "none"), rtol=1e-6, atol=1e-6
    )


def test_saved_lora_is_comfyuis_layout_and_loads_in_diffusers(fx, transformer, tmp_path):
    """The default `comfy` file names `diffusion_model.` + the release's modules (the fused qkv_proj
    whole), and diffusers' MiniMax H3 LoRA loader reads it to the same outputs."""
    import diffusers

    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec
    from tuner.registry import resolve_save_format

    pytest.importorskip("peft")
    record = ARCHITECTURES["minimax_h3"]
    assert resolve_save_format("minimax_h3", "auto") == "comfy"
    model = h3.load_transformer(fx["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), rank=4, alpha=2, name_map=record.key_table()
    )
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    video, audio, prompt = _inputs(2)
    t = torch.tensor([0.5])
    with torch.no_grad():
        want = h3.predict_velocities(model, video, t, audio, t, [prompt])
    network.save(tmp_path / "lora.safetensors", format="comfy")
    release = set(load_file(fx["transformer_file"]))
    stems = {
        k.rsplit(".", 2)[0] if ".lora_" in k else k.rsplit(".", 1)[0]
        for k in load_file(tmp_path / "lora.safetensors")
    }
    assert "diffusion_model.blocks.0.attn.qkv_proj" in stems
    assert all(s.startswith("diffusion_model.") and f"{s.removeprefix('diffusion_model.')}.weight" in release
               for s in stems)  # fmt: skip

    class Host(diffusers.loaders.lora_pipeline.MiniMaxH3LoraLoaderMixin):
        hf_device_map = None

        def __init__(self, denoiser) -> None:
            self.transformer = denoiser
            self.components = {"transformer": denoiser}

    fresh = h3.load_transformer(fx["diffusers"], torch.float32)
    Host(fresh).load_lora_weights(str(tmp_path / "lora.safetensors"))
    with torch.no_grad():
        got = h3.predict_velocities(fresh, video, t, audio, t, [prompt])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_generate_writes_an_mp4_with_sound_of_the_clips_length(fx, tmp_path):
    import av

    from project import cfg, make_project
    from tuner.data.audio import read_audio
    from tuner.generate import GenerateOptions, generate

    config = make_project(tmp_path, fx["root"], architecture="minimax_h3")
    opts = GenerateOptions(prompt="a red circle", out=str(tmp_path / "clip.mp4"), width=64, height=64, frames=22,
                           steps=2, device="cpu")  # fmt: skip
    out = generate(cfg(config), opts, log=lambda s: None)
    with av.open(str(out)) as container:
        assert container.streams.video[0].frames == 22
        assert (
            container.streams.audio[0].rate == 32000
            and container.streams.audio[0].codec_context.channels == 2
        )
    sound = read_audio(out, 32000, 2)
    assert torch.isfinite(sound).all() and sound.abs().max() > 0
    assert abs(sound.shape[1] / 32000 - 22 / 24) < 0.05  # 40 latents per second, hop 800


def test_the_audio_vae_is_found_beside_the_given_vae_folder(fx):
    """The trainer hands `model.vae` to both VAE loaders: the pipeline root, or its `vae/` folder."""
    beside = h3.load_audio_vae(fx["diffusers"] / "vae", torch.float32)
    assert_equal_weights(beside, h3.load_audio_vae(fx["diffusers"], torch.float32))
    assert_equal_weights(
        h3.load_vae(fx["diffusers"] / "vae", torch.float32), h3.load_vae(fx["diffusers"], torch.float32)
    )
