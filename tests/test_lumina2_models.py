"""Lumina Image 2.0: loading (both layouts, ComfyUI's all-in-one file), clear errors, model inputs and
the velocity convention equal to diffusers' Lumina2Pipeline, and our LoRA files in diffusers' loader."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import pytest
import torch
from diffusers import Lumina2Pipeline, Lumina2Transformer2DModel
from safetensors.torch import load_file, save_file

from tuner.archs.flux import loaders as flux
from tuner.archs.lumina2 import loaders as lumina2
from tuner.archs.lumina2.fixture import write_lumina2_fixture
from tuner.archs.lumina2.keys import transformer_to_original
from tuner.archs.lumina2.trainer import Lumina2Model
from tuner.errors import CheckpointError
from tuner.models.identify import pick_variant
from tuner.registry import ARCHITECTURES

CAPTIONS = ["a red circle", "a small dog walks on the beach at sunset"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_lumina2_fixture(tmp_path_factory.mktemp("lumina2"), seed=0)


@pytest.fixture(scope="module")
def pipe(fx):
    pipe = Lumina2Pipeline.from_pretrained(fx["diffusers"])
    for part in (pipe.transformer, pipe.vae, pipe.text_encoder):
        part.eval()
    return pipe


@pytest.fixture(scope="module")
def encoder(fx):
    return lumina2.load_text_encoder(fx["diffusers"], None, torch.float32)


def trainer(text_max_length: int = 512) -> Lumina2Model:
    """A trainer without a config run: only `encode_text` reads `cfg.cache.text_max_length`."""
    from types import SimpleNamespace

    t = Lumina2Model.__new__(Lumina2Model)
    t.cfg = SimpleNamespace(cache=SimpleNamespace(text_max_length=text_max_length))
    return t


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
    folder = lumina2.load_transformer(fx["diffusers"], dtype)
    assert_same_weights(folder, lumina2.load_transformer(fx["transformer_file"], dtype))
    # ComfyUI's all-in-one file: only the `model.diffusion_model.` keys are the transformer
    assert_same_weights(folder, lumina2.load_transformer(fx["all_in_one_file"], dtype))


def test_transformer_file_in_diffusers_keys_loads_too(fx, tmp_path):
    model = lumina2.load_transformer(fx["diffusers"], torch.float32)
    save_file(model.state_dict(), tmp_path / "diffusers_keys.safetensors")
    assert_same_weights(
        model, lumina2.load_transformer(tmp_path / "diffusers_keys.safetensors", torch.float32)
    )


def test_release_file_holds_the_fused_qkv_and_the_unused_norm(fx):
    keys = set(load_file(fx["transformer_file"]))
    assert {
        "layers.0.attention.qkv.weight",
        "context_refiner.0.attention_norm1.weight",
        "norm_final.weight",
    } <= keys
    assert {
        "noise_refiner.0.adaLN_modulation.1.weight",
        "cap_embedder.1.weight",
        "t_embedder.mlp.2.bias",
    } <= keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_text_encoder_layouts_are_identical(fx, dtype):
    folder = lumina2.load_text_encoder(fx["diffusers"], None, dtype)
    single = lumina2.load_text_encoder(fx["text_encoder_file"], fx["tokenizer"], dtype)
    assert_same_weights(folder.model, single.model)
    assert folder.tokenizer("a dog").input_ids == single.tokenizer("a dog").input_ids


def test_vae_layouts_are_identical(fx):
    assert_same_weights(
        flux.load_vae(fx["diffusers"], torch.float32), flux.load_vae(fx["vae_file"], torch.float32)
    )


def test_text_encoder_single_file_needs_a_tokenizer(fx):
    with pytest.raises(CheckpointError, match="tokenizer"):
        lumina2.load_text_encoder(fx["text_encoder_file"], None, torch.float32)


# ---------------------------------------------------------------------------------------------------
# Variants and clear errors
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", lumina2.TRANSFORMER_VARIANTS, ids=lambda v: v.name)
def test_transformer_variant_picked_from_shapes(variant):
    with torch.device("meta"):
        model = Lumina2Transformer2DModel.from_config(
            Lumina2Transformer2DModel.load_config(variant.config_dir)
        )
    shapes = {k: tuple(v.shape) for k, v in transformer_to_original(model.state_dict()).items()}
    assert pick_variant(shapes, lumina2.TRANSFORMER_VARIANTS, "x.safetensors", "Lumina 2") is variant


@pytest.mark.parametrize("variant", lumina2.TEXT_ENCODER_VARIANTS, ids=lambda v: v.name)
def test_text_encoder_variant_picked_from_shapes(variant):
    from transformers import Gemma2Config, Gemma2Model

    with torch.device("meta"):
        model = Gemma2Model(Gemma2Config.from_pretrained(variant.config_dir))
    shapes = {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}
    assert pick_variant(shapes, lumina2.TEXT_ENCODER_VARIANTS, "te.safetensors", "Gemma 2") is variant


def test_shipped_configs_have_the_real_sizes():
    from transformers import Gemma2Config, Gemma2Model

    with torch.device("meta"):
        model = Lumina2Transformer2DModel.from_config(
            Lumina2Transformer2DModel.load_config(lumina2.TRANSFORMER_VARIANTS[0].config_dir)
        )
        gemma = Gemma2Model(Gemma2Config.from_pretrained(lumina2.TEXT_ENCODER_VARIANTS[0].config_dir))
    # the published sizes: a 2.6B transformer over Gemma-2-2B (2.6B with its embedding)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 2.61
    assert round(sum(p.numel() for p in gemma.parameters()) / 1e9, 2) == 2.61
    assert model.config.cap_feat_dim == gemma.config.hidden_size


def test_flux_file_given_as_lumina2_and_back(fx, tmp_path):
    from tuner.archs.flux.fixture import write_flux_fixture

    flux_paths = write_flux_fixture(tmp_path / "flux")
    with pytest.raises(CheckpointError, match=r"not a Lumina Image 2\.0 transformer.*FLUX"):
        lumina2.load_transformer(flux_paths["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match=r"not a FLUX\.1 transformer.*lumina2"):
        flux.load_transformer(fx["transformer_file"], torch.float32)


def test_wrong_component_files(fx):
    with pytest.raises(CheckpointError, match=r"ae\.safetensors.*not a Lumina Image 2\.0 transformer"):
        lumina2.load_transformer(fx["vae_file"], torch.float32)
    with pytest.raises(
        CheckpointError, match=r"lumina_2_model_tiny\.safetensors.*not a Gemma 2 text encoder"
    ):
        lumina2.load_text_encoder(fx["transformer_file"], fx["tokenizer"], torch.float32)


def test_partial_transformer_file(fx, tmp_path):
    path = tmp_path / "partial.safetensors"
    tensors = load_file(fx["transformer_file"])
    save_file({k: v for k, v in tensors.items() if "feed_forward.w3" not in k}, path)
    with pytest.raises(CheckpointError, match=r"partial\.safetensors.*missing"):
        lumina2.load_transformer(path, torch.float32)


# ---------------------------------------------------------------------------------------------------
# Model inputs and the velocity equal the pipeline's
# ---------------------------------------------------------------------------------------------------


def test_prompt_embeddings_equal_pipeline(pipe, encoder):
    embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False)
    ours = trainer().encode_text(encoder, CAPTIONS)
    for i, entry in enumerate(ours):
        # the pipeline pads to 256 tokens; the transformer only ever reads the unmasked rows
        torch.testing.assert_close(entry["prompt_embeds"], embeds[i][mask[i].bool()], rtol=0, atol=0)
    assert ours[0]["prompt_embeds"].shape[0] < ours[1]["prompt_embeds"].shape[0]


def test_empty_caption_is_the_pipeline_negative_prompt(pipe, encoder):
    _, _, negative, mask = pipe.encode_prompt(CAPTIONS[:1], do_classifier_free_guidance=True)
    (ours,) = trainer().encode_text(encoder, [""])
    assert ours["prompt_embeds"].shape[0] == int(mask.sum()) == 1  # <bos> alone, no system prompt
    # one token against 256 padded ones: attention over one key runs another kernel path (~3e-6)
    torch.testing.assert_close(ours["prompt_embeds"], negative[0][mask[0].bool()], rtol=1e-5, atol=1e-5)


def test_long_captions_are_cut_to_the_pipeline_limit(pipe, encoder):
    caption = " ".join(["dog"] * 400)
    embeds, mask, _, _ = pipe.encode_prompt([caption], do_classifier_free_guidance=False)
    (ours,) = trainer(text_max_length=512).encode_text(encoder, [caption])
    assert ours["prompt_embeds"].shape[0] == int(mask.sum()) == lumina2.MAX_TEXT_TOKENS
    torch.testing.assert_close(ours["prompt_embeds"], embeds[0], rtol=0, atol=0)


def test_predict_equals_pipeline_transformer_calls(pipe, encoder):
    """Run the pipeline (no guidance, 3 steps) recording each transformer call. Our `predict` at
    t = 1 − (the pipeline's timestep) is the negated model output, and Euler steps of our velocity
    over the scheduler's sigmas end at the pipeline's latents: the time and sign conventions hold."""
    calls = []

    def record(module, args, kwargs, output):
        calls.append((kwargs["hidden_states"].clone(), kwargs["timestep"].clone(), output[0].clone()))

    hook = pipe.transformer.register_forward_hook(record, with_kwargs=True)
    try:
        latents = torch.randn(2, 16, 4, 6, generator=torch.Generator().manual_seed(0))
        final = pipe(
            CAPTIONS, height=32, width=48, num_inference_steps=3, guidance_scale=1.0, latents=latents.clone(),
            output_type="latent",
        ).images  # fmt: skip
    finally:
        hook.remove()
    t_ = trainer()
    cond = t_.collate_text(t_.encode_text(encoder, CAPTIONS))
    sigmas = pipe.scheduler.sigmas
    x = latents
    with torch.no_grad():
        for step, (noisy, timestep, output) in enumerate(calls):
            t = 1 - timestep
            torch.testing.assert_close(t, sigmas[step].expand(2), rtol=0, atol=1e-6)
            v = t_.predict(pipe.transformer, noisy, t, cond)
            torch.testing.assert_close(v, -output, rtol=1e-5, atol=1e-5)
            x = x + (sigmas[step + 1] - sigmas[step]) * t_.predict(pipe.transformer, x, t, cond)
    assert len(calls) == 3
    torch.testing.assert_close(x, final, rtol=1e-4, atol=1e-4)


def test_guidance_equals_the_pipeline_rule():
    gen = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(2, 16, 4, 6, generator=gen), torch.randn(2, 16, 4, 6, generator=gen)
    # the pipeline's rule on its own (negated) outputs, then negated back
    guided = -uncond + 4.0 * (-cond + uncond)
    expected = -(guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True)))
    torch.testing.assert_close(trainer().combine_guidance(cond, uncond, 4.0), expected)


def test_latents_equal_pipeline(pipe):
    pixels = torch.rand(1, 3, 1, 32, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latents = trainer().encode_pixels(pipe.vae, pixels)
    assert latents.shape == (1, 16, 4, 6)
    raw = pipe.vae.encode(pixels[:, :, 0]).latent_dist.mode()
    torch.testing.assert_close(latents, (raw - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor)


# ---------------------------------------------------------------------------------------------------
# Adapter files
# ---------------------------------------------------------------------------------------------------


def test_saved_lora_loads_in_the_diffusers_pipeline(fx, pipe, tmp_path):
    """Our diffusers-layout file (`transformer.` + diffusers names, alpha in the metadata) loads through
    `Lumina2Pipeline.load_lora_weights` with the same result. The default (comfy) layout does not:
    diffusers' Lumina 2 converter splits `qkv` at the 2.6B model's fixed sizes (2304 / 768 / 768), wants
    an adapter on every block's `adaLN_modulation` and rejects `.alpha` keys, so the auto layout is for
    ComfyUI and `save.format = "diffusers"` is for diffusers."""
    pytest.importorskip("peft")
    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec

    record = ARCHITECTURES["lumina2"]
    model = lumina2.load_transformer(fx["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), rank=4, alpha=2, name_map=record.key_table()
    )
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    network.save(tmp_path / "lora.safetensors", format="diffusers")
    noisy, t = torch.randn(2, 16, 4, 6, generator=gen), torch.tensor([0.3, 0.8])
    cond = {
        "prompt_embeds": torch.randn(2, 7, 64, generator=gen),
        "prompt_mask": torch.ones(2, 7, dtype=torch.bool),
    }
    cond["prompt_mask"][0, 5:] = False
    t_ = trainer()
    with torch.no_grad():
        ours = t_.predict(model, noisy, t, cond)
        base = t_.predict(pipe.transformer, noisy, t, cond)
        pipe.load_lora_weights(tmp_path / "lora.safetensors", adapter_name="tuner")
        try:
            theirs = t_.predict(pipe.transformer, noisy, t, cond)
        finally:
            pipe.delete_adapters("tuner")
    assert not torch.allclose(base, ours, atol=1e-3)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_gemma_tokenizer_is_built_offline_and_round_trips(encoder, tmp_path):
    from transformers import AutoTokenizer

    from tuner.fixtures.tokenizers import build_gemma_tokenizer

    tokenizer = build_gemma_tokenizer([lumina2.SYSTEM_PROMPT])
    ids = tokenizer("You are an assistant ü").input_ids
    pieces = tokenizer.convert_ids_to_tokens(ids)
    # <bos> first, words as one piece each (the first without "▁"), unknown characters as UTF-8 bytes
    assert pieces == ["<bos>", "You", "▁are", "▁an", "▁assistant", "▁", "<0xC3>", "<0xBC>"]
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<eos>", "<bos>", "<unk>"]) == [0, 1, 2, 3]
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("You are an assistant ü").input_ids == ids
    assert loaded.decode(ids, skip_special_tokens=True) == "You are an assistant ü"
    assert len(encoder.tokenizer) <= encoder.model.config.vocab_size


def test_comfy_lora_fuses_qkv_exactly_as_the_release_holds_it(fx, tmp_path):
    """The default (comfy) file names the release's fused `attention.qkv`, and the update it applies to
    that matrix is q's, k's and v's updates stacked 3 : 1 : 1, as ComfyUI adds it to the fused weight."""
    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec
    from tuner.registry import resolve_save_format

    record = ARCHITECTURES["lumina2"]
    model = lumina2.load_transformer(fx["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), rank=4, alpha=2, name_map=record.key_table()
    )
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    path = tmp_path / "lora.safetensors"
    network.save(path, format=resolve_save_format("lumina2", "auto"))
    saved = load_file(path)
    release = load_file(fx["transformer_file"])
    modules = {k.rsplit(".", 2)[0] for k in saved if not k.endswith(".alpha")}
    assert {m.removeprefix("diffusion_model.") + ".weight" for m in modules} <= set(release)
    deltas = {a.name: a.delta_weight() for a in network}
    for block in ("noise_refiner.0", "context_refiner.0", "layers.1"):
        stem = f"diffusion_model.{block}.attention.qkv"
        down, up = saved[f"{stem}.lora_A.weight"], saved[f"{stem}.lora_B.weight"]
        scale = saved[f"{stem}.alpha"].item() / down.shape[0]
        fused = up @ down * scale
        assert fused.shape == release[f"{block}.attention.qkv.weight"].shape
        parts = torch.cat([deltas[f"{block}.attn.to_{p}"] for p in "qkv"])
        torch.testing.assert_close(fused, parts, rtol=1e-5, atol=1e-6)
