"""HiDream-O1: ComfyUI's file (bare or prefixed names) and the release's folder (`model.` names, an LM head)
load to the same weights; files of other models and tokenizers without HiDream's tokens are refused by
name; the network computes what the release's published procedure computes (its sequence, positions and
mask run through transformers' own Qwen3-VL text model); the objective noises and predicts x0 as
musubi-tuner trains it; pixel entries are keyed like latents."""

import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3VLConfig

from project import assert_equal_weights
from tuner.archs.hidream_o1 import loaders as hidream_o1
from tuner.archs.hidream_o1.fixture import build_hidream_o1_components, write_hidream_o1_fixture
from tuner.archs.hidream_o1.model import HiDreamO1Transformer, patchify, unpatchify
from tuner.archs.hidream_o1.trainer import HiDreamO1Model
from tuner.diffusion.timesteps import X0FlowObjective
from tuner.errors import CheckpointError
from tuner.fixtures.tokenizers import build_qwen2_tokenizer
from tuner.fixtures.weights import tiny_config
from tuner.io import save_safetensors
from tuner.registry import architecture

CAPTIONS = ["a red dog walking in the park", "a cat"]


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return write_hidream_o1_fixture(tmp_path_factory.mktemp("hidream_o1"))


@pytest.fixture(scope="module")
def parts():
    return build_hidream_o1_components()


def _family(transformer: str = "hidream_o1_image_bf16.safetensors") -> HiDreamO1Model:
    family = HiDreamO1Model.__new__(HiDreamO1Model)
    family.record = architecture("hidream_o1")
    family.cfg = SimpleNamespace(
        model=SimpleNamespace(transformer=transformer),
        timesteps=SimpleNamespace(prediction="auto", zero_terminal_snr=False, min_snr_gamma=0.0,
                                  debiased_estimation=False, loss_weighting="none", logit_mean=0.0,
                                  logit_std=1.0, mode_scale=1.29),
    )  # fmt: skip
    family._objective = None
    return family


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def test_every_layout_loads_the_same_weights(fixture, parts, tmp_path):
    from_file = hidream_o1.load_transformer(fixture["transformer_file"], torch.float32)
    assert_equal_weights(from_file, parts["transformer"])
    assert_equal_weights(hidream_o1.load_transformer(fixture["diffusers"], torch.float32), from_file)
    # ComfyUI's prefixed form, and a checkpoint bundling other components beside the network
    stored = load_file(fixture["transformer_file"])
    prefixed = {f"model.diffusion_model.{k}": v for k, v in stored.items()}
    save_safetensors(
        {**prefixed, "text_encoders.llm.tokenizer_json": torch.zeros(3)}, tmp_path / "c.safetensors"
    )
    assert_equal_weights(hidream_o1.load_transformer(tmp_path / "c.safetensors", torch.float32), from_file)
    bf16 = hidream_o1.load_transformer(fixture["transformer_file"], torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16


def test_incomplete_or_foreign_files_are_refused_by_name(fixture, tmp_path):
    stored = load_file(fixture["transformer_file"])
    del stored["final_layer2.linear.bias"]
    save_safetensors(stored, tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match="HiDream-O1"):
        hidream_o1.load_transformer(tmp_path / "missing.safetensors", torch.float32)
    save_safetensors({"blocks.0.attn.wq.weight": torch.zeros(4, 4)}, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="HiDream-O1 transformer"):
        hidream_o1.load_transformer(tmp_path / "other.safetensors", torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no .safetensors"):
        hidream_o1.load_transformer(tmp_path / "empty", torch.float32)


def test_the_tokenizer_must_know_hidreams_tokens(fixture, tmp_path):
    tokenizer = hidream_o1.load_prompt_tokenizer(str(fixture["tokenizer"]), fixture["transformer_file"])
    ids = hidream_o1.tokenize(tokenizer, CAPTIONS, 512)
    assert tokenizer.convert_ids_to_tokens(ids[1][-2:].tolist()) == ["<|boi_token|>", "<|tms_token|>"]
    assert tokenizer.decode(ids[1]) == hidream_o1.PROMPT.format("a cat")
    # the release's folder carries its tokenizer
    assert hidream_o1.load_prompt_tokenizer(None, fixture["diffusers"]).get_vocab() == tokenizer.get_vocab()
    build_qwen2_tokenizer(["a cat"]).save_pretrained(tmp_path / "plain")
    with pytest.raises(CheckpointError, match="boi_token"):
        hidream_o1.load_prompt_tokenizer(str(tmp_path / "plain"), fixture["transformer_file"])


def test_dev_is_told_apart_by_name():
    assert hidream_o1.is_dev("hidream_o1_image_dev_bf16.safetensors")
    assert not hidream_o1.is_dev("hidream_o1_image_bf16.safetensors")
    record = architecture("hidream_o1")
    assert record.noise_scale("x/hidream_o1_image_dev_bf16.safetensors") == (7.5, 2.5)
    assert record.noise_scale("x/hidream_o1_image_bf16.safetensors") == (8.0, 0.0)
    dev = record.sampling.for_transformer("hidream_o1_image_dev_bf16.safetensors")
    assert (dev.steps, dev.shift) == (28, 1.0)


# ---------------------------------------------------------------------------------------------------
# The network against the release's published procedure
# ---------------------------------------------------------------------------------------------------


def test_patches_are_channel_major_32x32_tiles_in_row_order():
    pixels = torch.randn(1, 3, 64, 96)
    tokens = patchify(pixels)
    assert tokens.shape == (1, 6, 3072)
    for row, col, c, i, j in [(0, 0, 0, 0, 0), (1, 2, 2, 31, 5), (0, 1, 1, 7, 30)]:
        assert tokens[0, row * 3 + col, c * 1024 + i * 32 + j] == pixels[0, c, row * 32 + i, col * 32 + j]
    assert torch.equal(unpatchify(tokens, 64, 96), pixels)


def test_the_timestep_token_is_dits_sinusoidal_embedding(parts):
    embedder = parts["transformer"].t_embedder1
    t = torch.tensor([0.0, 0.25, 0.9])
    features = torch.tensor(
        [
            [f(1000 * float(s) * 10000 ** (-k / 128)) for f in (math.cos, math.sin) for k in range(128)]
            for s in t
        ]
    )
    linear1, linear2 = embedder.mlp[0], embedder.mlp[2]
    want = (
        torch.nn.functional.silu(features @ linear1.weight.T + linear1.bias) @ linear2.weight.T + linear2.bias
    )
    torch.testing.assert_close(embedder(t), want, rtol=1e-5, atol=1e-5)


def _release_forward(network: HiDreamO1Transformer, ids: torch.Tensor, noisy: torch.Tensor, t: float,
                     tms_id: int) -> torch.Tensor:  # fmt: skip
    """One sample the way the release builds it (musubi-tuner's `build_t2i_text_sample` and
    `_forward_generation`), run through transformers' own `Qwen3VLTextModel.forward`: the timestep
    embedding where the ids are `<|tms_token|>`, the patch tokens appended, positions from the fixed image
    origin, and an additive mask that is causal except for the generated tokens' rows."""
    _, _, height, width = noisy.shape
    rows, cols = height // 32, width // 32
    length, tokens = ids.shape[0], rows * cols
    text = network.language_model.embed_tokens(ids[None])
    text = torch.where((ids == tms_id)[None, :, None], network.t_embedder1(torch.tensor([t])), text)
    tiles = noisy.reshape(1, 3, rows, 32, cols, 32).permute(0, 2, 4, 1, 3, 5).reshape(1, tokens, 3072)
    embeds = torch.cat([text, network.x_embedder(tiles)], dim=1)
    # positions (get_rope_index_fix_point for one image whose vision-start token is skipped)
    text_positions = torch.arange(length).expand(3, length)
    grid = torch.stack(
        [torch.zeros(tokens), torch.arange(tokens) // cols, torch.arange(tokens) % cols]
    ).long()
    positions = torch.cat([text_positions, grid + 4096], dim=1)[:, None]
    generated = torch.zeros(length + tokens, dtype=torch.bool)
    generated[length - 1 :] = True  # the timestep token and the image
    mask = torch.full((length + tokens,) * 2, torch.finfo(torch.float32).min).triu(1)
    mask[generated] = 0
    hidden = network.language_model(
        inputs_embeds=embeds, attention_mask=mask[None, None], position_ids=positions, use_cache=False
    ).last_hidden_state
    return network.final_layer2(hidden)[0, length:]


def test_the_network_computes_the_releases_procedure(fixture, parts):
    """Batched with padding, the network's prediction of each sample equals the release's one-sample
    procedure; a wiring change (mask, positions, timestep token, embedders, head) moves it."""
    network = parts["transformer"]
    tokenizer = hidream_o1.load_prompt_tokenizer(str(fixture["tokenizer"]), fixture["transformer_file"])
    tms_id = tokenizer.convert_tokens_to_ids("<|tms_token|>")
    ids = hidream_o1.tokenize(tokenizer, CAPTIONS, 512)
    batch = hidream_o1.padded_ids([{"input_ids": i} for i in ids])
    noisy = torch.randn(2, 3, 1, 64, 96, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.3, 0.8])  # σ; the network is told 1 − σ
    with torch.no_grad():
        got = hidream_o1.predict_clean(network, noisy, t, batch["input_ids"], batch["text_mask"])
        for i in range(2):
            want = _release_forward(network, ids[i], noisy[i, :, 0][None], 1.0 - float(t[i]), tms_id)
            torch.testing.assert_close(patchify(got[i, :, 0][None])[0], want, rtol=1e-4, atol=1e-4)
        # the prompt reaches the image: another caption, another prediction
        other = hidream_o1.padded_ids([{"input_ids": ids[1]}, {"input_ids": ids[1]}])
        assert not torch.allclose(
            hidream_o1.predict_clean(network, noisy, t, other["input_ids"], other["text_mask"])[0], got[0]
        )


# ---------------------------------------------------------------------------------------------------
# The objective and the cache
# ---------------------------------------------------------------------------------------------------


def test_the_objective_noises_8x_and_learns_x0():
    objective = _family().training_objective()
    assert isinstance(objective, X0FlowObjective) and objective.noise_scale == 8.0
    x0, noise, t = torch.rand(2, 3, 1, 32, 32), torch.randn(2, 3, 1, 32, 32), torch.tensor([0.25, 1.0])
    noisy = objective.add_noise(x0, noise, t)
    torch.testing.assert_close(noisy[0], 0.75 * x0[0] + 0.25 * 8 * noise[0])
    torch.testing.assert_close(noisy[1], 8 * noise[1])
    assert objective.loss(x0, x0, noise, t) == 0
    # sampling steps along (x_t − x̂0)/t from 8x noise: an exact x̂0 moves x_t onto the clean image
    torch.testing.assert_close(objective.velocity(noisy, t, x0)[0], 8 * noise[0] - x0[0])
    assert objective.initial_noise(noise).std() > 6
    dev = _family("hidream_o1_image_dev_bf16.safetensors").training_objective()
    assert (dev.noise_scale, dev.noise_clip_std) == (7.5, 2.5)
    spiky = torch.zeros(1000)
    spiky[0] = 100.0
    assert dev.scaled_noise(spiky).max() == pytest.approx(7.5 * 2.5 * spiky.std().item())


def test_pixel_entries_are_keyed_by_what_they_hold_and_the_model():
    from tuner.cache.plan import latent_encoder

    config = SimpleNamespace(model=SimpleNamespace(vae_dtype="fp32"), one_frame=None)
    family = _family()
    family.cfg = config
    identity = latent_encoder(family)
    assert identity.architecture == "hidream_o1-pixels" and identity.weights_fingerprint == ""
    # the pictures themselves, 3 channels at full size
    codec = family.load_vae("cpu", torch.float32)
    pixels = torch.rand(2, 3, 1, 64, 32) * 2 - 1
    assert torch.equal(family.encode_pixels(codec, pixels), pixels)
    assert family.latent_shape(32, 64, 1) == (3, 1, 64, 32)
    assert torch.equal(family.decode_latents(codec, pixels * 3), (pixels * 3).clamp(-1, 1))
    assert architecture("hidream_o1").components == ("transformer", "text_encoder", "tokenizer")


def test_shipped_configs_build_the_released_shapes():
    """The real variants' configs give the release's tensor shapes (the variant table's signature)."""
    full = Qwen3VLConfig.from_pretrained(tiny_config("hidream_o1", "transformer", "full"))
    with torch.device("meta"):
        network = HiDreamO1Transformer(full)
    shapes = {k: tuple(v.shape) for k, v in network.state_dict().items()}
    assert shapes["x_embedder.proj1.weight"] == (1024, 3072) and shapes["final_layer2.linear.weight"] == (
        3072,
        4096,
    )
    assert "language_model.layers.35.mlp.gate_proj.weight" in shapes and not any(
        "deepstack" in k for k in shapes
    )


@pytest.mark.parametrize("contract", ["hidream_o1"], indirect=True)
def test_a_pixel_cache_of_another_size_or_dtype_is_refused_like_latents(contract, tmp_path):
    """The contract project's cached pictures train; asked for another resolution or pixel dtype, the same
    cache is missing those entries and training is refused before it starts, as for a VAE's latents."""
    import shutil

    from project import cfg
    from tuner.cache.plan import open_training_data
    from tuner.errors import CacheError
    from tuner.trainers import trainer_class

    _, config, _ = contract
    project = tmp_path / "project"
    shutil.copytree(config.parent, project, ignore=shutil.ignore_patterns("output"))
    config = project / config.name
    trainer = trainer_class("hidream_o1")(cfg(config))
    batch = next(iter(open_training_data(trainer, trainer.cfg, log=lambda s: None).epoch(0)))
    assert batch["latents"].shape[1:] == (3, 1, 64, 64) and batch["latents"].abs().max() <= 1
    with pytest.raises(CacheError, match="cache latents"):
        other = trainer_class("hidream_o1")(cfg(config, "model.vae_dtype='bf16'"))
        open_training_data(other, other.cfg, log=lambda s: None)
    dataset = project / "dataset.toml"
    dataset.write_text(dataset.read_text().replace("resolution = [64, 64]", "resolution = [96, 96]"))
    with pytest.raises(CacheError, match="cache latents"):
        resized = trainer_class("hidream_o1")(cfg(config))
        open_training_data(resized, resized.cfg, log=lambda s: None)


def test_gradient_checkpointing_recomputes_the_layers_to_the_same_gradients(parts):
    import copy

    noisy = torch.randn(1, 3, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    ids, mask = torch.tensor([[5, 9, 11, 7]]), torch.ones(1, 4, dtype=torch.long)
    grads = []
    for checkpointing in (False, True):
        network = copy.deepcopy(parts["transformer"]).train()
        if checkpointing:
            network.enable_gradient_checkpointing()
            assert all(layer.gradient_checkpointing for layer in network.language_model.layers)
        hidream_o1.predict_clean(network, noisy, torch.tensor([0.5]), ids, mask).square().mean().backward()
        grads.append(network.language_model.layers[0].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
