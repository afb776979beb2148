"""SDXL text-encoder training (`network.train_text_encoder`): token ids cached instead of outputs, both
encoders' adapters trained at their own rate and resumed exactly, kohya's `lora_te1_` / `lora_te2_` parts in
the saved file, read by diffusers' `StableDiffusionXLPipeline.load_lora_weights` and by `tuner generate`."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from diffusers import StableDiffusionXLPipeline
from safetensors.torch import load_file

from project import cfg, killed_at_first_save, make_cached_project, make_project, run
from tuner.archs.parts.text_encoder_training import attach_text_adapters, attach_to_denoiser
from tuner.archs.sdxl import loaders as sdxl
from tuner.archs.sdxl.text_training import TEXT_ENCODER_TARGETS
from tuner.archs.sdxl.trainer import SDXLModel
from tuner.cache.commands import cache_text
from tuner.cli import main as tuner
from tuner.fixtures import write_fixture
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec
from tuner.trainers import trainer_class

TEXT = ("network.train_text_encoder=true", "network.text_encoder_lr=5e-3")
QUIET = ("log.tensorboard=false", "train.lr_warmup_steps=0")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("sdxl", tmp_path_factory.mktemp("sdxl_model"))


@pytest.fixture(scope="module")
def pipe(paths):
    pipeline = StableDiffusionXLPipeline.from_pretrained(paths["diffusers"], local_files_only=True)
    for part in (pipeline.unet, pipeline.vae, pipeline.text_encoder, pipeline.text_encoder_2):
        part.eval()
    return pipeline


@pytest.fixture(scope="module")
def project(paths, tmp_path_factory):
    """The demo project with text-encoder training on in its file, latents cached, text cached (ids)."""
    config = make_project(tmp_path_factory.mktemp("sdxl_te_project"), paths["root"], architecture="sdxl")
    text = config.read_text()
    config.write_text(re.sub(r"(?m)^\[network\]$", "[network]\ntrain_text_encoder = true", text, count=1))
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    return config


def _train(config, out, *overrides, resume=None, log=lambda s: None):
    trainer = trainer_class("sdxl")(cfg(config, f"save.output_dir='{out}'", *QUIET, *TEXT, *overrides))
    trainer.train(resume=resume, log=log)
    return trainer


def test_cache_text_stores_token_ids_and_both_commands_say_so(project, tmp_path):
    logs: list[str] = []
    cache_text(cfg(project), log=logs.append)
    assert any("not cached; caching the captions' token ids only" in line for line in logs), logs
    trainer = _train(project, tmp_path / "run", "train.max_steps=1", "save.save_state=false", log=logs.append)
    assert any("their outputs are computed at every step" in line for line in logs), logs
    assert trainer.history and all(map(torch.isfinite, torch.tensor(trainer.history)))


def test_train_names_the_missing_token_ids_when_only_outputs_are_cached(paths, tmp_path):
    """Text outputs cached before text-encoder training was switched on are not silently used, and the
    command the error names caches the token ids: it carries the `--set` that switched training on."""
    from tuner.errors import CacheError

    config = make_cached_project(tmp_path / "p", paths["root"], architecture="sdxl")
    with pytest.raises(
        CacheError, match="token ids: the text encoders train, their outputs are not cached"
    ) as e:
        _train(config, tmp_path / "run", "train.max_steps=1")
    assert f"Run: tuner cache text --config {config.resolve()}" in str(e.value)
    assert "--set network.train_text_encoder=true" in str(e.value)


def test_text_encoder_adapters_train_at_their_rate_and_resume_exactly(project, tmp_path, monkeypatch):
    """Both encoders' adapters are in the file under kohya's names and were trained (their up matrices
    left zero); a run killed after its first save and resumed equals a straight one, bit for bit."""
    cache_text(cfg(project), log=lambda s: None)
    common = ("train.max_steps=4", "save.every_n_steps=2", "save.every_n_epochs=0", "network.dropout=0.1")
    straight = _train(project, tmp_path / "straight", *common)
    killed_at_first_save(monkeypatch, lambda: _train(project, tmp_path / "resumed", *common))
    resumed = _train(project, tmp_path / "resumed", *common, resume="latest")
    assert len(resumed.history) == 2
    a = load_file(tmp_path / "straight" / "demo_lora.safetensors")
    b = load_file(tmp_path / "resumed" / "demo_lora.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    for prefix in (
        "lora_unet_",
        "lora_te1_text_model_encoder_layers_0_",
        "lora_te2_text_model_encoder_layers_",
    ):
        ups = [v for k, v in a.items() if k.startswith(prefix) and k.endswith("lora_up.weight")]
        assert ups and any(v.abs().sum() > 0 for v in ups), prefix
    assert "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight" in a
    assert "lora_te2_text_model_encoder_layers_1_mlp_fc2.lora_down.weight" in a
    assert straight.history


def test_text_encoder_learning_rate_has_its_own_groups(project, paths):
    trainer = SDXLModel(cfg(project, *TEXT))
    network = trainer.build_trained(trainer.load_transformer(torch.float32))
    rates = {group["name"]: group["lr"] for group in network.param_groups(1e-4)}
    assert rates == {"lora": 1e-4, "lora_te1": 5e-3, "lora_te2": 5e-3}
    assert sum(n.startswith("te1.") for n in network.names()) == 2 * 6  # 2 layers × q k v out fc1 fc2


def test_text_encoder_training_is_refused_for_a_full_fine_tune_and_other_models(project):
    from tuner.archs.wan.trainer import WanModel
    from tuner.errors import ConfigError

    with pytest.raises(ConfigError, match="train_text_encoder"):
        cache_text(cfg(project, "network.type='full'", *TEXT))
    with pytest.raises(ConfigError, match="wan trains no text encoder adapter"):
        assert WanModel(cfg(project, *TEXT)).trains_text_encoder


def _random_network(trainer, model, pair) -> LoRANetwork:
    unet = LoRANetwork.apply_to(model, TargetSpec(trainer.default_targets), 4, 2, name_map=trainer.layout)
    text = LoRANetwork.apply_to(pair, TargetSpec(TEXT_ENCODER_TARGETS), 4, 2, name_map=trainer.layout)
    network = LoRANetwork([*unet, *text], name_map=trainer.layout)
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    return network


def test_kohya_file_with_text_encoder_parts_loads_in_diffusers_with_equal_output(paths, pipe, tmp_path):
    """A file with UNet and both text encoders' parts (kohya layout) through
    `StableDiffusionXLPipeline.load_lora_weights`: diffusers' prompt embeddings and UNet output equal
    ours, the text parts attached the way `tuner generate` attaches them."""
    trainer = SDXLModel(cfg(make_project(tmp_path / "p", paths["root"], architecture="sdxl")))
    model = trainer.load_transformer(torch.float32)
    encoders = sdxl.load_text_encoders(paths["diffusers"], None, None, None, torch.float32)
    network = _random_network(trainer, model, sdxl.TextEncoderPair(encoders.clip_l, encoders.clip_g))
    path = tmp_path / "lora.safetensors"
    network.save(path, trainer.layout, format="kohya")
    network.remove()  # the UNet and encoders as loaded; the file is applied again below
    prefixes = {re.match(r"lora_(unet|te1|te2)_", k)[0] for k in load_file(path)}
    assert prefixes == {"lora_unet_", "lora_te1_", "lora_te2_"}

    before = trainer.encode_text(encoders, ["a red circle"])[0]["hidden"]
    attach_text_adapters(trainer, encoders, [(str(path), 1.0)])
    attach_to_denoiser(trainer, model, str(path), 1.0)
    ours = trainer.collate_text(trainer.encode_text(encoders, ["a red circle"]))
    assert not torch.allclose(before, ours["hidden"][0])  # the text parts act

    loaded = copy.deepcopy(pipe)
    loaded.load_lora_weights(str(path))
    with torch.no_grad():
        hidden, _, pooled, _ = loaded.encode_prompt(
            "a red circle", device="cpu", do_classifier_free_guidance=False
        )
    torch.testing.assert_close(hidden, ours["hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pooled, ours["pooled"], rtol=1e-5, atol=1e-5)
    noisy = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    time_ids = sdxl.time_ids((64, 64), (0, 0), (64, 64)).unsqueeze(0)
    with torch.no_grad():
        mine = trainer.predict(model, noisy, torch.tensor([0.5]), {**ours, "time_ids": time_ids})
        theirs = loaded.unet(noisy, torch.tensor([500.0]), encoder_hidden_states=hidden,
                             added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample  # fmt: skip
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)


def test_diffusers_layout_uses_the_unet_and_text_encoder_prefixes(paths, pipe, tmp_path):
    """`save.format = "diffusers"` writes `unet.` / `text_encoder.` / `text_encoder_2.` (what diffusers'
    SDXL loader reads), which loads back into our network exactly."""
    trainer = SDXLModel(cfg(make_project(tmp_path / "p", paths["root"], architecture="sdxl")))
    model = trainer.load_transformer(torch.float32)
    encoders = sdxl.load_text_encoders(paths["diffusers"], None, None, None, torch.float32)
    network = _random_network(trainer, model, sdxl.TextEncoderPair(encoders.clip_l, encoders.clip_g))
    path = tmp_path / "lora.safetensors"
    network.save(path, trainer.layout, format="diffusers")
    assert {k.split(".")[0] for k in load_file(path)} == {"unet", "text_encoder", "text_encoder_2"}
    before = {name: network[name].weights().tensors["up"].clone() for name in network.names()}
    for adapter in network:
        adapter.up.data.zero_()
    network.load_weights(path)
    for name, up in before.items():
        torch.testing.assert_close(network[name].weights().tensors["up"], up, rtol=0, atol=1e-7)
    loaded = copy.deepcopy(pipe)
    loaded.load_lora_weights(str(path))  # diffusers reads its own layout without complaint


@pytest.mark.slow
def test_cli_generate_applies_a_trained_text_encoder_lora(project, tmp_path, capsys):
    cache_text(cfg(project), log=lambda s: None)
    _train(project, tmp_path / "run", "train.max_steps=1", "save.save_state=false")
    lora = tmp_path / "run" / "demo_lora.safetensors"
    code, log = run(capsys, "generate", "--config", project, "--prompt", "a red circle", "--lora", f"{lora}:1",
                    "--size", "64x64", "--frames", "1", "--steps", "2", "--out", tmp_path / "out.png")  # fmt: skip
    assert code == 0, log
    assert (tmp_path / "out.png").is_file()


def test_lora_merge_folds_the_text_encoder_parts_into_the_bundled_checkpoint(paths, tmp_path):
    """`tuner lora merge` into the A1111 / ComfyUI file: CLIP-L's parts into `conditioner.embedders.0.*`,
    bigG's into OpenCLIP's `conditioner.embedders.1.*` (q / k / v into thirds of `in_proj_weight`), the
    UNet's into `model.diffusion_model.*`; the merged file computes what the adapters do."""
    trainer = SDXLModel(cfg(make_project(tmp_path / "p", paths["root"], architecture="sdxl")))
    model = trainer.load_transformer(torch.float32)
    bundled = paths["bundled_file"]
    encoders = sdxl.load_text_encoders(bundled, None, paths["tokenizer"], paths["tokenizer_2"], torch.float32)
    network = _random_network(trainer, model, sdxl.TextEncoderPair(encoders.clip_l, encoders.clip_g))
    lora = tmp_path / "lora.safetensors"
    network.save(lora, trainer.layout, format="kohya")  # no metadata: the table is found from the names
    want = trainer.collate_text(trainer.encode_text(encoders, ["a red circle"]))
    merged = tmp_path / "merged.safetensors"
    assert tuner(["lora", "merge", "--model", str(bundled), "--lora", f"{lora}:1", "--out", str(merged)]) == 0
    again = sdxl.load_text_encoders(merged, None, paths["tokenizer"], paths["tokenizer_2"], torch.float32)
    got = trainer.collate_text(trainer.encode_text(again, ["a red circle"]))
    for name in ("hidden", "pooled"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    noisy = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    cond = {**want, "time_ids": sdxl.time_ids((64, 64), (0, 0), (64, 64)).unsqueeze(0)}
    with torch.no_grad():
        torch.testing.assert_close(trainer.predict(sdxl.load_unet(merged, torch.float32), noisy, torch.tensor([0.5]), cond),
                                   trainer.predict(model, noisy, torch.tensor([0.5]), cond), rtol=1e-5, atol=1e-5)  # fmt: skip


def test_lora_info_and_convert_read_the_text_encoder_parts(paths, tmp_path, capsys):
    """`tuner lora info` says kohya; `convert` to diffusers (`unet.` / `text_encoder.` / `text_encoder_2.`)
    and back to kohya gives the same tensors."""
    trainer = SDXLModel(cfg(make_project(tmp_path / "p", paths["root"], architecture="sdxl")))
    encoders = sdxl.load_text_encoders(paths["diffusers"], None, None, None, torch.float32)
    network = _random_network(trainer, trainer.load_transformer(torch.float32),
                              sdxl.TextEncoderPair(encoders.clip_l, encoders.clip_g))  # fmt: skip
    lora, there, back = (tmp_path / f"{n}.safetensors" for n in ("lora", "diffusers", "back"))
    network.save(lora, trainer.layout, format="kohya")
    code, log = run(capsys, "lora", "info", lora)
    assert code == 0 and re.search(r"format\s+kohya\n", log), log
    assert run(capsys, "lora", "convert", lora, there, "--to", "diffusers")[0] == 0
    assert {k.split(".")[0] for k in load_file(there)} == {"unet", "text_encoder", "text_encoder_2"}
    assert run(capsys, "lora", "convert", there, back, "--to", "kohya")[0] == 0
    a, b = load_file(lora), load_file(back)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-7)


def test_samples_drawn_while_training_use_the_text_encoders_as_trained(project, tmp_path):
    """Samples during training encode their prompts with the encoders being trained (adapters and all)."""
    cache_text(cfg(project), log=lambda s: None)
    samples = ("sample.prompts=['a red circle']", "sample.every_n_steps=1", "sample.width=64", "sample.height=64",
               "sample.steps=2", "train.learning_rate=1e-2")  # fmt: skip
    trainer = _train(project, tmp_path / "run", "train.max_steps=1", "save.save_state=false", *samples)
    assert list((tmp_path / "run" / "samples").glob("*step000001*.png"))
    trained = trainer.load_text_encoder(torch.device("cpu"), "fp32")
    assert trained.clip_l is trainer.trained_text.encoders[0]
    fresh = SDXLModel(cfg(project)).load_text_encoder(torch.device("cpu"), "fp32")
    moved = trainer.encode_text(trained, ["a red circle"])[0]["hidden"]
    assert not torch.allclose(moved, trainer.encode_text(fresh, ["a red circle"])[0]["hidden"])
