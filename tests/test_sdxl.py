"""SDXL: loading both layouts, key conversion, model inputs against diffusers' pipeline, the DDPM
objective against hand-computed numbers, bad input, and the kohya adapter file in diffusers' loader."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from diffusers import DDPMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

from project import assert_equal_weights, cfg, make_cached_project
from tuner.archs.flux.keys import vae_to_original
from tuner.archs.sdxl import loaders as sdxl
from tuner.archs.sdxl.keys import SDXL_LAYOUT, clip_g_to_diffusers, clip_g_to_original, unet_key_to_original
from tuner.archs.sdxl.trainer import SDXLModel
from tuner.config.schema import TimestepConfig
from tuner.diffusion.ddpm import DDPMObjective, objective_from_config, offset_noise, scheduler
from tuner.errors import CheckpointError, ConfigError
from tuner.fixtures import write_fixture
from tuner.generate import GenerateOptions, sample_latents
from tuner.io import save_safetensors
from tuner.models.identify import diffusers_meta_keys
from tuner.models.loading import load_tensors
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec
from tuner.trainers import trainer_class


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("sdxl", tmp_path_factory.mktemp("sdxl_model"))


@pytest.fixture(scope="module")
def pipe(paths):
    pipeline = StableDiffusionXLPipeline.from_pretrained(paths["diffusers"], local_files_only=True)
    for part in (pipeline.unet, pipeline.vae, pipeline.text_encoder, pipeline.text_encoder_2):
        part.eval()  # built in train mode otherwise (dropout)
    return pipeline


@pytest.fixture(scope="module")
def trainer(paths, tmp_path_factory):
    config = make_cached_project(tmp_path_factory.mktemp("sdxl_project"), paths["root"], architecture="sdxl")
    return SDXLModel(cfg(config))


def _unet_inputs(seed: int = 0, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 4, 8, 8, generator=g), torch.randn(batch, 77, 96, generator=g),
            torch.randn(batch, 64, generator=g))  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def test_bundled_file_unet_file_and_diffusers_folder_load_identical_weights(paths, tmp_path):
    root, bundled = paths["diffusers"], paths["bundled_file"]
    unet = sdxl.load_unet(root, torch.float32)
    assert_equal_weights(sdxl.load_unet(bundled, torch.float32), unet)
    assert_equal_weights(sdxl.load_unet(paths["transformer_file"], torch.float32), unet)
    vae = sdxl.load_vae(root, torch.float32)
    assert_equal_weights(sdxl.load_vae(bundled, torch.float32), vae)
    # a VAE file of its own in either layout: sdxl_vae.safetensors (LDM), the fp16-fix VAE's diffusers file
    save_safetensors(vae_to_original(vae.state_dict()), tmp_path / "sdxl_vae.safetensors")
    save_safetensors(vae.state_dict(), tmp_path / "diffusion_pytorch_model.safetensors")
    assert_equal_weights(sdxl.load_vae(tmp_path / "sdxl_vae.safetensors", torch.float32), vae)
    assert_equal_weights(sdxl.load_vae(tmp_path / "diffusion_pytorch_model.safetensors", torch.float32), vae)
    single = sdxl.load_text_encoders(bundled, None, paths["tokenizer"], paths["tokenizer_2"], torch.float32)
    folder = sdxl.load_text_encoders(root, None, None, None, torch.float32)
    assert_equal_weights(single.clip_l, folder.clip_l)
    assert_equal_weights(single.clip_g, folder.clip_g)


def test_diffusers_own_single_file_loader_reads_the_bundled_file_exactly(paths, pipe):
    """An independent check of the bundled layout: diffusers' converters (what `from_single_file` uses,
    and what mirrors A1111's / ComfyUI's checkpoint layout) read our file to the same four models."""
    loaded = StableDiffusionXLPipeline.from_single_file(str(paths["bundled_file"]), config=str(paths["diffusers"]),
                                                        local_files_only=True)  # fmt: skip
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        assert_equal_weights(getattr(loaded, name), getattr(pipe, name))


def test_unet_rules_name_every_tensor_of_the_real_sdxl_unet_both_ways():
    keys = diffusers_meta_keys(UNet2DConditionModel, sdxl.UNET_VARIANTS[0].config_dir)
    original = [unet_key_to_original(k) for k in keys]
    assert len(set(original)) == len(keys) == 1680  # the tensor count of sd_xl_base_1.0's UNet
    assert [SDXL_LAYOUT.keys.to_diffusers(o) for o in original] == keys
    for name in ("input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight", "input_blocks.3.0.op.weight",
                 "input_blocks.8.1.transformer_blocks.9.ff.net.2.weight", "middle_block.1.proj_in.weight",
                 "output_blocks.2.2.conv.weight", "output_blocks.5.2.conv.weight", "output_blocks.8.0.skip_connection.weight",
                 "label_emb.0.2.weight", "time_embed.0.weight", "out.2.weight"):  # fmt: skip
        assert name in original, name


def test_open_clip_layout_round_trips(pipe):
    state = pipe.text_encoder_2.state_dict()
    original = clip_g_to_original(state)
    assert original["transformer.resblocks.0.attn.in_proj_weight"].shape == (3 * 64, 64)
    back = clip_g_to_diffusers(original)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_sd1_and_sd2_checkpoints_are_named(tmp_path):
    for width, family in ((768, "Stable Diffusion 1.x"), (1024, "Stable Diffusion 2.x")):
        path = tmp_path / f"sd_{width}.safetensors"
        prefix = "model.diffusion_model."
        save_safetensors({f"{prefix}input_blocks.0.0.weight": torch.zeros(320, 4, 3, 3),
                          f"{prefix}input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": torch.zeros(320, width),
                          f"{prefix}out.2.weight": torch.zeros(4, 320, 3, 3),
                          "first_stage_model.decoder.conv_in.weight": torch.zeros(512, 4, 3, 3)}, path)  # fmt: skip
        with pytest.raises(CheckpointError, match=family):
            sdxl.load_unet(path, torch.float32)


def test_files_of_other_architectures_are_named(paths, tmp_path):
    flux_file = write_fixture("flux", tmp_path / "flux")["transformer_file"]
    with pytest.raises(CheckpointError, match="FLUX"):
        sdxl.load_unet(flux_file, torch.float32)
    from tuner.archs.flux import loaders as flux

    with pytest.raises(CheckpointError, match='model.architecture = "sdxl"'):
        flux.load_transformer(paths["bundled_file"], torch.float32)


def test_v_prediction_marker_warns_when_trained_as_epsilon(paths, trainer, tmp_path):
    path = tmp_path / "vpred.safetensors"
    save_safetensors({**load_tensors(paths["transformer_file"]), "v_pred": torch.zeros(0)}, path)
    with pytest.warns(UserWarning, match="v-prediction"):
        SDXLModel(cfg(trainer.cfg.path, f"model.transformer='{path}'")).load_transformer(torch.float32)
    vpred = SDXLModel(cfg(trainer.cfg.path, f"model.transformer='{path}'", "timesteps.prediction='v'"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vpred.load_transformer(torch.float32)


# ---------------------------------------------------------------------------------------------------
# Model inputs against StableDiffusionXLPipeline
# ---------------------------------------------------------------------------------------------------


def test_text_encoding_matches_the_pipeline(trainer, pipe):
    encoders = trainer.load_text_encoder(torch.device("cpu"), "fp32")
    ours = trainer.collate_text(trainer.encode_text(encoders, ["a red circle", "two blue squares"]))
    hidden, _, pooled, _ = pipe.encode_prompt(["a red circle", "two blue squares"], device="cpu",
                                              do_classifier_free_guidance=False)  # fmt: skip
    torch.testing.assert_close(ours["hidden"], hidden, rtol=0, atol=0)
    torch.testing.assert_close(ours["pooled"], pooled, rtol=0, atol=0)


def test_a_dropped_caption_trains_on_the_empty_captions_encoding(trainer):
    """Caption dropout trains on the encoding of "" (sd-scripts' and kohya's rule, `caption = ""` before
    encoding), not on zeros as SDXL's own training did; see the trainer's docstring for why."""
    from tuner.cache.plan import open_training_data
    from tuner.cache.store import CacheStore

    sample = open_training_data(trainer, trainer.cfg, log=lambda s: None).samples[0]
    dropped = CacheStore(sample.cache_dir, readonly=True).get(sample.empty_text_key)
    encoders = trainer.load_text_encoder(torch.device("cpu"), trainer.cfg.cache.text_encoder_dtype)
    (empty,) = trainer.encode_text(encoders, [""])
    assert dropped.keys() == empty.keys() and all(dropped[k].any() for k in dropped)
    for name in dropped:
        torch.testing.assert_close(dropped[name], empty[name].to(dropped[name].dtype), rtol=0, atol=0)


def test_predict_matches_the_pipelines_unet_call(trainer, pipe):
    model = trainer.load_transformer(torch.float32)
    noisy, hidden, pooled = _unet_inputs()
    time_ids = pipe._get_add_time_ids((48, 64), (0, 10), (64, 64), torch.float32,
                                      text_encoder_projection_dim=64).repeat(2, 1)  # fmt: skip
    levels = torch.tensor([999, 261])
    with torch.no_grad():
        want = pipe.unet(noisy, levels, encoder_hidden_states=hidden,
                         added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample  # fmt: skip
        got = trainer.predict(model, noisy, levels / 1000, {"hidden": hidden, "pooled": pooled,
                                                            "time_ids": sdxl.time_ids((48, 64), (0, 10), (64, 64)).repeat(2, 1)})  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_cached_time_ids_hold_source_size_and_crop(trainer):
    from tuner.cache.plan import open_training_data

    batch = next(iter(open_training_data(trainer, trainer.cfg, log=lambda s: None).epoch(0)))
    ids = batch["extra"]["time_ids"]
    assert ids.shape == (batch["latents"].shape[0], 6)
    h, w = batch["latents"].shape[-2] * 8, batch["latents"].shape[-1] * 8
    assert (ids[:, 4:] == torch.tensor([h, w])).all()  # the bucket
    # the demo's sources are not all of the bucket's aspect: cropped ones start inside the resized image
    assert (ids[:, 2:4] >= 0).all() and (ids[:, :2] > 0).all()


def test_generation_matches_the_pipeline_with_guidance(trainer, pipe):
    model = trainer.load_transformer(torch.float32)
    opts = GenerateOptions(prompt="a red circle", out="unused", negative_prompt="blue", width=64, height=64,
                           frames=1, steps=4, guidance_scale=4.0, seed=3)  # fmt: skip
    encoders = trainer.load_text_encoder(torch.device("cpu"), "fp32")
    cond, uncond = (
        trainer.collate_text(trainer.encode_text(encoders, [p])) for p in ("a red circle", "blue")
    )
    ours = sample_latents(trainer, model, opts, cond, uncond, "cpu", torch.float32, progress=False)
    pipe.scheduler = copy.deepcopy(pipe.scheduler)
    noise = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(3))
    want = pipe("a red circle", negative_prompt="blue", height=64, width=64, num_inference_steps=4,
                guidance_scale=4.0, latents=noise, output_type="latent").images  # fmt: skip
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-5)


def test_v_prediction_dpm_sampling_matches_the_pipeline(trainer, pipe):
    """DPM++ 2M on a v-prediction, zero-terminal-SNR schedule, against the pipeline given the same
    scheduler."""
    vpred = SDXLModel(cfg(trainer.cfg.path, "timesteps.prediction='v'", "timesteps.zero_terminal_snr=true"))
    model = vpred.load_transformer(torch.float32)
    opts = GenerateOptions(prompt="a red circle", out="unused", width=64, height=64, frames=1, steps=5,
                           guidance_scale=1.0, seed=5, sampler="dpm++2m")  # fmt: skip
    encoders = vpred.load_text_encoder(torch.device("cpu"), "fp32")
    cond = vpred.collate_text(vpred.encode_text(encoders, ["a red circle"]))
    ours = sample_latents(vpred, model, opts, cond, cond, "cpu", torch.float32, progress=False)
    assert torch.isfinite(ours).all()
    other = copy.copy(pipe)
    other.scheduler = scheduler(vpred.training_objective(), "dpm++2m")
    noise = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(5))
    want = other("a red circle", height=64, width=64, num_inference_steps=5, guidance_scale=1.0, latents=noise,
                 output_type="latent").images  # fmt: skip
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# The DDPM objective
# ---------------------------------------------------------------------------------------------------


def test_objective_options_of_the_other_kind_are_refused():
    with pytest.raises(ConfigError, match="timesteps.prediction, timesteps.min_snr_gamma"):
        objective_from_config("flow", TimestepConfig(prediction="v", min_snr_gamma=5.0), "flux")
    with pytest.raises(ConfigError, match="loss_weighting"):
        objective_from_config("ddpm", TimestepConfig(loss_weighting="cosmap"), "sdxl")
    objective = objective_from_config("ddpm", TimestepConfig(prediction="v", zero_terminal_snr=True), "sdxl")
    assert (objective.prediction, objective.zero_terminal_snr) == ("v", True)


def _hand_alphas_cumprod() -> list[float]:
    """ᾱ_k of SD's scaled-linear schedule, in plain Python floats."""
    start, end, n = 0.00085**0.5, 0.012**0.5, 1000
    product, out = 1.0, []
    for k in range(n):
        product *= 1 - (start + k / (n - 1) * (end - start)) ** 2
        out.append(product)
    return out


def test_epsilon_and_v_losses_match_a_hand_computed_reference():
    x0 = torch.tensor([[[[1.0, -2.0]]], [[[0.5, 0.25]]]])  # [2, 1, 1, 2]
    noise = torch.tensor([[[[0.3, 0.1]]], [[[-1.0, 2.0]]]])
    pred = torch.tensor([[[[0.2, 0.4]]], [[[-0.5, 1.0]]]])
    t = torch.tensor([0.25, 0.9005])  # levels 250 and 900
    ac = _hand_alphas_cumprod()
    eps_terms, v_terms, gamma_terms = [], [], []
    for b, k in enumerate((250, 900)):
        a, s = math.sqrt(ac[k]), math.sqrt(1 - ac[k])
        snr = ac[k] / (1 - ac[k])
        xs, ns, ps = x0[b].flatten().tolist(), noise[b].flatten().tolist(), pred[b].flatten().tolist()
        eps = sum((p - n) ** 2 for p, n in zip(ps, ns)) / 2
        v = sum((p - (a * n - s * x)) ** 2 for p, n, x in zip(ps, ns, xs)) / 2
        eps_terms.append(eps)
        v_terms.append(v)
        gamma_terms.append(eps * min(snr, 5.0) / snr)
        noisy = DDPMObjective().add_noise(x0, noise, t)[b].flatten().tolist()
        assert noisy == pytest.approx([a * x + s * n for x, n in zip(xs, ns)], rel=1e-6)
    assert DDPMObjective("epsilon").loss(pred, x0, noise, t).item() == pytest.approx(
        sum(eps_terms) / 2, rel=1e-6
    )
    assert DDPMObjective("v").loss(pred, x0, noise, t).item() == pytest.approx(sum(v_terms) / 2, rel=1e-6)
    gamma = DDPMObjective("epsilon", min_snr_gamma=5.0).loss(pred, x0, noise, t).item()
    assert gamma == pytest.approx(sum(gamma_terms) / 2, rel=1e-6)


@pytest.mark.parametrize("zero_terminal_snr", [False, True])
def test_schedule_matches_diffusers(zero_terminal_snr):
    ours = DDPMObjective(zero_terminal_snr=zero_terminal_snr).alphas_cumprod
    theirs = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                           rescale_betas_zero_snr=zero_terminal_snr).alphas_cumprod  # fmt: skip
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-5, atol=1e-7)
    assert (ours[-1].item() == pytest.approx(0.0, abs=1e-12)) is zero_terminal_snr


def test_levels_timestep_limits_and_weights():
    objective = DDPMObjective("v", zero_terminal_snr=True, min_snr_gamma=5.0)
    t = torch.tensor([0.0, 0.2, 0.999, 1.0])
    assert objective.level(t).tolist() == [0, 200, 999, 999]
    assert objective.level(objective.discretize(t)).tolist() == [0, 200, 999, 999]
    weights = objective.weights(t)
    assert torch.isfinite(weights).all() and weights[-1] == 0  # v at SNR 0: min(0, γ) / (0 + 1)
    eps = DDPMObjective("epsilon", zero_terminal_snr=True, min_snr_gamma=5.0, debiased_estimation=True)
    assert torch.isfinite(eps.weights(t)).all()


def test_debiased_estimation_is_sd_scripts_weight_for_each_prediction():
    """sd-scripts' `apply_debiased_estimation`: 1/√SNR for epsilon, 1/(SNR + 1) for v, SNR capped at
    1000; SNR from diffusers' own schedule here."""
    ac = DDPMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"
    ).alphas_cumprod.double()
    snr = (ac / (1 - ac)).clamp_max(1000)
    t = torch.tensor([0.0, 0.25, 0.5, 0.999])
    k = [0, 250, 500, 999]
    eps = DDPMObjective("epsilon", debiased_estimation=True).weights(t)
    v = DDPMObjective("v", debiased_estimation=True).weights(t)
    torch.testing.assert_close(eps.double(), 1 / snr[k].sqrt(), rtol=1e-5, atol=0)
    torch.testing.assert_close(v.double(), 1 / (snr[k] + 1), rtol=1e-5, atol=0)
    assert (eps[2].item(), v[2].item()) == (pytest.approx(1.62, abs=0.01), pytest.approx(0.72, abs=0.01))
    # zero terminal SNR: v's pure-noise level weighs 1 (1 / (0 + 1)); epsilon's stays finite
    ztsnr = torch.tensor([1.0])
    assert DDPMObjective("v", zero_terminal_snr=True, debiased_estimation=True).weights(ztsnr).item() == 1.0
    assert torch.isfinite(
        DDPMObjective("epsilon", zero_terminal_snr=True, debiased_estimation=True).weights(ztsnr)
    ).all()


def test_noise_offset_adds_a_constant_per_sample_and_channel():
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    offset = offset_noise(noise, 0.1, torch.Generator().manual_seed(1)) - noise
    assert offset.abs().sum() > 0
    assert torch.allclose(offset, offset[..., :1, :1].expand_as(offset))


# ---------------------------------------------------------------------------------------------------
# Adapter files in diffusers' own loader
# ---------------------------------------------------------------------------------------------------


def test_kohya_file_loads_in_diffusers_with_equal_output(trainer, pipe, tmp_path):
    """The default layout (`lora_unet_input_blocks_4_1_...`, with `.alpha`) through
    `StableDiffusionXLPipeline.load_lora_weights`: diffusers maps the original block names onto its own
    and applies alpha / rank, so its UNet computes exactly what ours does."""
    model = trainer.load_transformer(torch.float32)
    network = LoRANetwork.apply_to(model, TargetSpec(trainer.default_targets), rank=4, alpha=2,
                                   name_map=trainer.layout)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    path = tmp_path / "lora.safetensors"
    network.save(path, trainer.layout, format=trainer.record.save_format)
    assert all(k.startswith("lora_unet_") for k in load_tensors(path))
    noisy, hidden, pooled = _unet_inputs(1)
    time_ids = sdxl.time_ids((64, 64), (0, 0), (64, 64)).repeat(2, 1)
    t = torch.tensor([0.5, 0.25])
    with torch.no_grad():
        ours = trainer.predict(model, noisy, t, {"hidden": hidden, "pooled": pooled, "time_ids": time_ids})
    loaded = copy.deepcopy(pipe)
    loaded.load_lora_weights(str(path))
    with torch.no_grad():
        theirs = loaded.unet(noisy, t * 1000, encoder_hidden_states=hidden,
                             added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample  # fmt: skip
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Full fine-tune: the bundled checkpoint
# ---------------------------------------------------------------------------------------------------


def test_full_fine_tune_saves_the_bundled_checkpoint_uis_load(trainer, paths, pipe, tmp_path):
    """One step of a full fine-tune writes the A1111 / ComfyUI checkpoint: the trained UNet beside the
    VAE and both text encoders (copied from the bundled file they came from), which diffusers'
    `from_single_file` and our loader both read."""
    run = trainer_class("sdxl")(cfg(trainer.cfg.path, "network.type='full'", "train.max_steps=1", "train.lr_warmup_steps=0", "save.save_state=false",
                          f"save.output_dir='{tmp_path}'", "log.tensorboard=false", "train.learning_rate=1e-3"))  # fmt: skip
    saved = run.train(log=lambda s: None)
    written, fixture = load_tensors(saved), load_tensors(paths["bundled_file"])
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in fixture.items()}
    unet = sdxl.UNET_PREFIX
    assert all(torch.equal(written[k], v) for k, v in fixture.items() if not k.startswith(unet))
    assert any(not torch.equal(written[k], v) for k, v in fixture.items() if k.startswith(unet))  # trained
    loaded = StableDiffusionXLPipeline.from_single_file(
        str(saved), config=str(paths["diffusers"]), local_files_only=True
    )
    assert_equal_weights(loaded.unet, sdxl.load_unet(saved, torch.float32))
    assert_equal_weights(loaded.text_encoder_2, pipe.text_encoder_2)


def test_bundle_companions_convert_parts_from_a_diffusers_folder(paths):
    """Parts from a diffusers folder are converted to the same tensors the bundled file holds (OpenCLIP's
    `logit_scale`, which no text tower has, aside)."""
    root, bundled = paths["diffusers"], paths["bundled_file"]
    converted = sdxl.bundle_companions(root, root, root, torch.float32)
    copied = sdxl.bundle_companions(bundled, bundled, None, torch.float32)
    assert set(copied) - set(converted) == {f"{sdxl.CLIP_G_PREFIX}logit_scale"}
    for key, value in converted.items():
        assert torch.equal(value, copied[key]), key


def test_cli_generates_with_dpm_and_refuses_flow_options(trainer, capsys, tmp_path):
    from tuner.cli import main

    args = ["generate", "--config", str(trainer.cfg.path), "--prompt", "a red circle", "--size", "64x64",
            "--frames", "1", "--steps", "3", "--out", str(tmp_path / "out.png")]  # fmt: skip
    assert main([*args, "--sampler", "dpm++2m"]) == 0
    assert (tmp_path / "out.png").is_file()
    assert main([*args, "--shift", "3"]) != 0
    assert "--shift 3.0" in capsys.readouterr().err
