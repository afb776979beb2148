"""Chroma loading, key conversion, text encoding and the model call, checked against diffusers on the
tiny fixture; and FLUX.1 / Chroma files each naming the architecture that trains them."""

from types import SimpleNamespace

import pytest
import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel
from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

from project import assert_equal_weights
from tuner.archs.chroma import loaders as chroma
from tuner.archs.chroma.keys import (
    CHROMA_KEYS,
    CHROMA_LAYOUT,
    transformer_to_diffusers,
    transformer_to_original,
)
from tuner.archs.chroma.trainer import ChromaModel
from tuner.archs.flux import loaders as flux
from tuner.errors import CheckpointError
from tuner.fixtures import write_fixture
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors
from tuner.models.identify import check_keys, pick_variant
from tuner.models.loading import load_tensors
from tuner.networks import FullNetwork, LoRANetwork, TargetSpec
from tuner.networks.targets import find_targets
from tuner.registry import ARCHITECTURES

PROMPT = "a red circle on a black background"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("chroma", tmp_path_factory.mktemp("chroma_model"))


@pytest.fixture(scope="module")
def flux_paths(tmp_path_factory):
    return write_fixture("flux", tmp_path_factory.mktemp("flux_model"))


@pytest.fixture(scope="module")
def pipe(paths):
    pipe = ChromaPipeline.from_pretrained(paths["diffusers"], local_files_only=True)
    for component in (pipe.transformer, pipe.vae, pipe.text_encoder):
        component.eval()
    return pipe


def _trainer(text_length: int) -> ChromaModel:
    return ChromaModel(SimpleNamespace(cache=SimpleNamespace(text_max_length=text_length)))


# ---------------------------------------------------------------------------------------------------
# Loading both layouts
# ---------------------------------------------------------------------------------------------------


def test_single_files_load_like_the_diffusers_folder(paths, tmp_path):
    root = paths["diffusers"]
    assert_equal_weights(chroma.load_transformer(paths["transformer_file"], torch.bfloat16),
                  chroma.load_transformer(root, torch.bfloat16))  # fmt: skip
    single = chroma.load_text_encoder(paths["text_encoder_file"], paths["tokenizer"], torch.float32)
    folder = chroma.load_text_encoder(root, None, torch.float32)  # the pipeline's text_encoder/, tokenizer/
    assert_equal_weights(single.t5, folder.t5)
    assert single.tokenizer(PROMPT).input_ids == folder.tokenizer(PROMPT).input_ids
    # ComfyUI's prefix, and the diffusers layout saved as one file
    prefixed = {f"model.diffusion_model.{k}": v for k, v in load_tensors(paths["transformer_file"]).items()}
    save_safetensors(prefixed, tmp_path / "comfy.safetensors")
    expected = chroma.load_transformer(root, torch.float32)
    save_safetensors(expected.state_dict(), tmp_path / "diffusers.safetensors")
    for name in ("comfy", "diffusers"):
        assert_equal_weights(
            chroma.load_transformer(tmp_path / f"{name}.safetensors", torch.float32), expected
        )


def test_flux_and_chroma_files_name_the_architecture_that_trains_them(paths, flux_paths, tmp_path):
    """Chroma keeps FLUX.1's names: each loader tells the other's files apart, in every layout."""
    flux_diffusers = tmp_path / "flux_transformer.safetensors"
    save_safetensors(load_tensors(flux_paths["diffusers"] / "transformer" / "diffusion_pytorch_model.safetensors"),
                     flux_diffusers)  # fmt: skip
    for path in (flux_paths["transformer_file"], flux_paths["diffusers"], flux_diffusers):
        with pytest.raises(CheckpointError, match='use architecture = "flux"'):
            chroma.load_transformer(path, torch.float32)
    for path in (paths["transformer_file"], paths["diffusers"]):
        with pytest.raises(CheckpointError, match='use architecture = "chroma"'):
            flux.load_transformer(path, torch.float32)


def test_wrong_and_partial_files_are_refused(paths, tmp_path):
    with pytest.raises(CheckpointError, match="not a Chroma transformer"):
        chroma.load_transformer(paths["vae_file"], torch.float32)
    with pytest.raises(CheckpointError, match="T5"):
        chroma.load_text_encoder(paths["transformer_file"], paths["tokenizer"], torch.float32)
    state = load_tensors(paths["transformer_file"])
    del state["distilled_guidance_layer.norms.0.scale"]
    save_safetensors(state, tmp_path / "partial.safetensors")
    with pytest.raises(CheckpointError, match="partial.safetensors.*missing"):
        chroma.load_transformer(tmp_path / "partial.safetensors", torch.float32)


# ---------------------------------------------------------------------------------------------------
# Key conversion
# ---------------------------------------------------------------------------------------------------


def test_release_layout_is_what_diffusers_converter_reads():
    """diffusers' converter splits `linear1` at the real sizes only (hidden 3072), so it runs on the real
    config on the meta device: from our release-layout state dict it makes exactly the model's keys and
    shapes. Values: the round trip below, and the tiny fixture loading like the diffusers folder."""
    with torch.device("meta"):
        model = ChromaTransformer2DModel.from_config(
            ChromaTransformer2DModel.load_config(chroma.TRANSFORMER_VARIANTS[0].config_dir)
        )
    state = model.state_dict()
    theirs = convert_chroma_transformer_checkpoint_to_diffusers(transformer_to_original(state))
    assert theirs.keys() == state.keys()
    assert all(theirs[k].shape == state[k].shape for k in state)


def test_round_trip_and_the_release_names():
    model = fill_random_(ChromaTransformer2DModel(num_attention_heads=3, attention_head_dim=32, num_layers=2,
                                                  num_single_layers=3, joint_attention_dim=96,
                                                  axes_dims_rope=(8, 12, 12), approximator_hidden_dim=64,
                                                  approximator_layers=3), seed=3)  # fmt: skip
    state = model.state_dict()
    original = transformer_to_original(state)
    assert original["single_blocks.2.linear1.weight"].shape == (7 * 96, 96)
    assert original["double_blocks.1.txt_attn.qkv.weight"].shape == (3 * 96, 96)
    assert "distilled_guidance_layer.layers.2.out_layer.weight" in original
    assert "distilled_guidance_layer.norms.2.scale" in original
    back = transformer_to_diffusers(original)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_shipped_signatures_fit_the_shipped_configs():
    for variant in chroma.TRANSFORMER_VARIANTS:
        with torch.device("meta"):
            model = ChromaTransformer2DModel.from_config(
                ChromaTransformer2DModel.load_config(variant.config_dir)
            )
        shapes = {k: tuple(v.shape) for k, v in transformer_to_original(model.state_dict()).items()}
        assert pick_variant(shapes, chroma.TRANSFORMER_VARIANTS, "x", "Chroma") is variant
        check_keys(chroma.TRANSFORMER_SPEC.expected_keys(variant), shapes, "x", "Chroma")


def test_default_targets_are_flux_layers_and_leave_the_approximator_alone(paths):
    model = chroma.load_transformer(paths["transformer_file"], torch.float32)
    original = set(load_tensors(paths["transformer_file"]))
    names = list(find_targets(model, TargetSpec(ARCHITECTURES["chroma"].default_targets)))
    assert len(names) == 17 and not any("distilled_guidance_layer" in n for n in names)
    for name in names:
        fused = [layer for layer in CHROMA_KEYS.fused if layer.part_of(name)]
        stem = fused[0].part_of(name)[0] if fused else CHROMA_KEYS(name)
        assert f"{stem}.weight" in original, name


def test_full_model_save_gives_back_the_release_file_exactly(paths, tmp_path):
    model = chroma.load_transformer(paths["transformer_file"], torch.float32)
    FullNetwork(model).save(tmp_path / "full.safetensors", CHROMA_LAYOUT)
    saved, fixture = load_tensors(tmp_path / "full.safetensors"), load_tensors(paths["transformer_file"])
    assert saved.keys() == fixture.keys()
    assert all(torch.equal(value, saved[key]) for key, value in fixture.items())


# ---------------------------------------------------------------------------------------------------
# Model inputs: ours against ChromaPipeline's
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_text_encoding_matches_the_pipeline(pipe):
    """The same T5 rows; the rows we keep are those its mask leaves visible: the tokens and one padding."""
    captions = [PROMPT, "x", "a b c d e f g h i j k l m n o p q r s t"]  # the last fills all 16 tokens
    embeds, _, masks, *_ = pipe.encode_prompt(
        captions, do_classifier_free_guidance=False, max_sequence_length=16
    )
    trainer = _trainer(16)
    entries = trainer.encode_text(chroma.TextEncoder(pipe.text_encoder, pipe.tokenizer), captions)
    cond = trainer.collate_text(entries)
    # diffusers 0.42 hands the transformer this mask as floats, which attention adds instead of masking
    # (huggingface/diffusers#12116); when this fails, the pipeline masks and the docstrings can say so
    assert masks.is_floating_point()
    visible = masks.bool()
    assert visible.sum(dim=1).tolist() == [e["t5"].shape[0] for e in entries]
    assert visible.sum(dim=1).tolist()[:2] == [
        pipe.tokenizer(c).attention_mask.count(1) + 1 for c in captions[:2]
    ]
    assert torch.equal(cond["t5_mask"], visible[:, : cond["t5"].shape[1]])
    for entry, embed, mask in zip(entries, embeds, visible):
        assert torch.equal(entry["t5"], embed[mask])


@torch.no_grad()
def test_predict_matches_the_transformer_with_the_pipelines_mask(pipe):
    """Our call (visible rows only) against diffusers' transformer given the pipeline's full-length
    embeddings and its mask as booleans (see `tuner.archs.chroma.loaders` on the pipeline's float mask); a batch
    of prompts of different lengths."""
    captions = [PROMPT, "x"]
    embeds, text_ids, masks, *_ = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                                     max_sequence_length=24)  # fmt: skip
    trainer = _trainer(24)
    cond = trainer.collate_text(
        trainer.encode_text(chroma.TextEncoder(pipe.text_encoder, pipe.tokenizer), captions)
    )
    x = torch.randn(2, 16, 6, 4, generator=torch.Generator().manual_seed(0))  # 48×32 images
    t = torch.tensor([0.7, 0.3])
    tokens = flux.pack_latents(x)
    mask = pipe._prepare_attention_mask(2, tokens.shape[1], x.dtype, masks.bool())
    theirs = pipe.transformer(hidden_states=tokens, timestep=t, encoder_hidden_states=embeds, txt_ids=text_ids,
                              img_ids=pipe._prepare_latent_image_ids(2, 3, 2, "cpu", x.dtype),
                              attention_mask=mask, return_dict=False)[0]  # fmt: skip
    ours = trainer.predict(pipe.transformer, x, t, cond)
    torch.testing.assert_close(flux.pack_latents(ours), theirs, rtol=1e-5, atol=1e-5)
    # one sample alone gives what it gives in the mixed batch
    alone = trainer.predict(pipe.transformer, x[1:], t[1:], trainer.collate_text(trainer.encode_text(
        chroma.TextEncoder(pipe.text_encoder, pipe.tokenizer), captions[1:])))  # fmt: skip
    torch.testing.assert_close(alone, ours[1:], rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_two_guided_euler_steps_match_the_pipeline(pipe):
    """Real classifier-free guidance with a negative prompt, as ChromaPipeline applies it: our text
    entries, model calls (cond and uncond of different lengths) and guidance, stepped with Euler, give
    the pipeline's latents. The pipeline is given its own embeddings with its masks as booleans (see
    `tuner.archs.chroma.loaders`): its own float masks would not mask."""
    negative = "blurry, low quality"
    embeds, _, mask, neg_embeds, _, neg_mask = pipe.encode_prompt(PROMPT, negative, max_sequence_length=24)
    trainer = _trainer(24)
    encoder = chroma.TextEncoder(pipe.text_encoder, pipe.tokenizer)
    cond, uncond = (trainer.collate_text(trainer.encode_text(encoder, [p])) for p in (PROMPT, negative))
    x = torch.randn(1, 16, 6, 4, generator=torch.Generator().manual_seed(0))  # a 48×32 image
    out = pipe(prompt_embeds=embeds, prompt_attention_mask=mask.bool(), negative_prompt_embeds=neg_embeds,
               negative_prompt_attention_mask=neg_mask.bool(), height=48, width=32, num_inference_steps=2,
               guidance_scale=4.0, latents=flux.pack_latents(x), output_type="latent",
               max_sequence_length=24).images  # fmt: skip
    sigmas = pipe.scheduler.sigmas
    for i in range(2):
        t = sigmas[i].reshape(1)
        v = trainer.combine_guidance(trainer.predict(pipe.transformer, x, t, cond),
                                     trainer.predict(pipe.transformer, x, t, uncond), 4.0)  # fmt: skip
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    torch.testing.assert_close(flux.pack_latents(x), out, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# diffusers' LoRA loader (ChromaPipeline.load_lora_weights is FLUX.1's)
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_diffusers_layout_loads_in_chroma_pipeline(paths, pipe, tmp_path):
    """Our diffusers-layout file through `ChromaPipeline.load_lora_weights` gives our output. The auto
    layout (kohya, FLUX.1's `qkv` / `linear1` names) goes through diffusers' FLUX.1 kohya converter,
    which hard-codes FLUX.1's hidden size and cannot take the tiny fixture; the layers and names are
    FLUX.1's, which `test_diffusers_interop.py` checks at the real size."""
    pytest.importorskip("peft")
    model = chroma.load_transformer(paths["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(model, TargetSpec(ARCHITECTURES["chroma"].default_targets), rank=4, alpha=2,
                                   name_map=CHROMA_KEYS)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=g) * 0.1)
    network.save(tmp_path / "lora.safetensors", format="diffusers")
    trainer = _trainer(16)
    cond = trainer.collate_text([{"t5": torch.randn(5, 64, generator=g)}])
    x, t = torch.randn(1, 16, 4, 4, generator=g), torch.tensor([0.5])
    ours = trainer.predict(model, x, t, cond)
    base = trainer.predict(pipe.transformer, x, t, cond)
    pipe.load_lora_weights(tmp_path / "lora.safetensors", adapter_name="tuner")
    try:
        theirs = trainer.predict(pipe.transformer, x, t, cond)
    finally:
        pipe.delete_adapters("tuner")
    assert not torch.allclose(ours, base, atol=1e-3)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_auto_layout_is_flux_and_diffusers_converts_it_at_the_real_width(tmp_path):
    """The default file (kohya: FLUX.1's fused `qkv` / `linear1` names) is exactly what FLUX.1 writes for
    the same adapters, and `ChromaPipeline.lora_state_dict` (diffusers' FLUX.1 kohya converter, which
    needs the real width 3072) gives back one LoRA per diffusers module with our ΔW, alpha folded in."""
    from tuner.networks.delta import LORA, ModuleWeights
    from tuner.networks.formats import layout_state
    from tuner.registry import resolve_save_format

    hidden, mlp, rank = 3072, 12288, 4
    g = torch.Generator().manual_seed(0)
    sizes = {"attn.to_q": (hidden, 1.0), "attn.to_k": (hidden, 2.0), "attn.to_v": (hidden, 6.0),
             "proj_mlp": (mlp, 3.0)}  # fmt: skip
    modules = {
        f"single_transformer_blocks.0.{name}": ModuleWeights(
            LORA,
            {
                "down": torch.randn(rank, hidden, generator=g) * 0.02,
                "up": torch.randn(rows, rank, generator=g) * 0.02,
            },
            alpha,
        )  # fmt: skip
        for name, (rows, alpha) in sizes.items()
    }
    fmt = resolve_save_format("chroma", "auto")
    state, metadata = layout_state(modules, fmt, ARCHITECTURES["chroma"].key_table())
    flux_state, _ = layout_state(modules, fmt, ARCHITECTURES["flux"].key_table())
    assert state.keys() == flux_state.keys() and all(torch.equal(state[k], flux_state[k]) for k in state)
    assert "lora_unet_single_blocks_0_linear1.lora_down.weight" in state
    save_safetensors(state, tmp_path / "lora.safetensors", metadata=metadata)
    converted = ChromaPipeline.lora_state_dict(str(tmp_path / "lora.safetensors"))
    assert {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in converted} == set(modules)
    for name, weights in modules.items():
        up, down = (converted[f"transformer.{name}.lora_{ab}.weight"].double() for ab in "BA")
        probe = torch.randn(hidden, 8, generator=g, dtype=torch.float64)
        ours = weights.scale * (weights.tensors["up"].double() @ (weights.tensors["down"].double() @ probe))
        torch.testing.assert_close(up @ (down @ probe), ours, atol=1e-6 * ours.abs().max().item(), rtol=1e-6)
