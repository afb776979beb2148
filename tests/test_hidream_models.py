"""HiDream-I1: loading (both layouts), clear errors, model inputs equal to HiDreamImagePipeline's, the MoE
training path, diffusers' LoRA loader, and nf4 text caching."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import pytest
import torch
from diffusers import HiDreamImagePipeline
from safetensors.torch import load_file, save_file

from project import make_project, run, summary
from tuner.archs.flux import loaders as flux
from tuner.archs.hidream import loaders as hidream
from tuner.archs.hidream import text as hidream_text
from tuner.archs.hidream.fixture import write_hidream_fixture
from tuner.archs.hidream.trainer import HiDreamModel
from tuner.errors import CheckpointError
from tuner.models.identify import identify_single_file, pick_variant
from tuner.registry import ARCHITECTURES

CAPTIONS = ["a red circle moving left", "a small dog walks on the beach at sunset"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_hidream_fixture(tmp_path_factory.mktemp("hidream"), seed=0)


@pytest.fixture(scope="module")
def pipe(fx):
    pipe = HiDreamImagePipeline.from_pretrained(fx["diffusers"])
    for part in pipe.components.values():
        if isinstance(part, torch.nn.Module):
            part.eval()
    return pipe


def _single_files(fx) -> tuple:
    return tuple(fx[f"text_encoder{s}_file"] for s in ("", "_2", "_3", "_4"))


def _tokenizers(fx) -> tuple:
    return tuple(fx[f"tokenizer{s}"] for s in ("", "_2", "_3", "_4"))


def _inputs(seed: int, h: int = 8, w: int = 6, batch: int = 1) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    noisy = torch.randn(batch, 16, h, w, generator=gen)
    cond = {
        "t5": torch.randn(batch, 16, 64, generator=gen),
        "llama": torch.randn(batch, 2, 16, 64, generator=gen),
        "pooled": torch.randn(batch, 64, generator=gen),
    }
    return noisy, torch.full((batch,), 0.4), cond


# ---- loading ----------------------------------------------------------------------------------------


def test_transformer_layouts_load_identical_weights(fx, tmp_path):
    """The diffusers folder, the single file and ComfyUI's prefixed fp16 copy give the same model."""
    folder = hidream.load_transformer(fx["diffusers"], torch.float32).state_dict()
    single = hidream.load_transformer(fx["transformer_file"], torch.float32).state_dict()
    prefixed = tmp_path / "hidream_i1_dev_fp16.safetensors"
    save_file(
        {f"model.diffusion_model.{k}": v for k, v in load_file(fx["transformer_file"]).items()}, prefixed
    )
    comfy = hidream.load_transformer(prefixed, torch.float32).state_dict()
    assert folder.keys() == single.keys() == comfy.keys()
    assert all(torch.equal(folder[k], single[k]) and torch.equal(folder[k], comfy[k]) for k in folder)


def test_text_encoder_layouts_load_identical_weights(fx):
    from_files = hidream_text.load_text_encoders(_single_files(fx), _tokenizers(fx), torch.float32)
    from_folder = hidream_text.load_text_encoders(
        (fx["diffusers"], None, None, None), (None,) * 4, torch.float32
    )
    for a, b in zip(from_files.models, from_folder.models, strict=True):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert from_files.clip_l.config.max_position_embeddings == 248  # read from the file


def test_vae_is_flux(fx):
    single = flux.load_vae(fx["vae_file"], torch.float32).state_dict()
    folder = flux.load_vae(fx["diffusers"], torch.float32).state_dict()
    assert all(torch.equal(single[k], folder[k]) for k in folder)


def test_variants_and_releases(fx):
    assert identify_single_file(fx["transformer_file"], hidream.TRANSFORMER_SPEC).name == "tiny"
    shapes = dict(hidream.TRANSFORMER_VARIANTS[0].signature)
    shapes = {k: v for k, v in shapes.items() if v is not None}
    assert pick_variant(shapes, hidream.TRANSFORMER_VARIANTS, "x", "t").name == "i1"
    # Full, Dev and Fast have one shape: only names tell them apart
    assert hidream.release_name("models/hidream_i1_dev_bf16.safetensors") == "dev"
    assert hidream.release_name("HiDream-ai/HiDream-I1-Fast/transformer") == "fast"
    assert hidream.release_name("hidream_i1_full_fp16.safetensors") == "full"
    assert hidream.release_name("my_merge.safetensors") is None


def test_wrong_files_are_refused_naming_what_they_are(fx, tmp_path):
    from tuner.archs.flux.fixture import write_flux_fixture

    flux_paths = write_flux_fixture(tmp_path / "flux")
    with pytest.raises(CheckpointError, match="FLUX"):
        hidream.load_transformer(flux_paths["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="HiDream-I1"):
        flux.load_transformer(fx["transformer_file"], torch.float32)
    with pytest.raises(CheckpointError, match="model.text_encoder_4"):
        hidream_text.load_text_encoders(_single_files(fx)[:3] + (None,), _tokenizers(fx), torch.float32)


# ---- model inputs equal the pipeline's ----------------------------------------------------------------


def test_prompt_encoding_matches_the_pipeline(fx, pipe):
    encoders = hidream_text.load_text_encoders(_single_files(fx), _tokenizers(fx), torch.float32)
    ours = hidream_text.encode_prompts(encoders, CAPTIONS, max_length=24)
    with torch.no_grad():
        t5, _, llama, _, pooled, _ = pipe.encode_prompt(
            CAPTIONS, do_classifier_free_guidance=False, max_sequence_length=24, device="cpu"
        )
    assert llama.shape == (2, 2, 24, 64)  # [layers, B, L, D]
    for i, entry in enumerate(ours):
        torch.testing.assert_close(entry["t5"], t5[i], rtol=0, atol=0)
        torch.testing.assert_close(entry["llama"], llama[:, i], rtol=0, atol=0)
        torch.testing.assert_close(entry["pooled"], pooled[i], rtol=0, atol=0)


@pytest.mark.parametrize(("h", "w"), [(8, 8), (8, 6)])  # square, and non-square (padded with a mask)
def test_predict_matches_the_pipelines_transformer_call(fx, pipe, h, w):
    trainer = HiDreamModel(None)
    noisy, t, cond = _inputs(1, h, w, batch=2)
    with torch.no_grad():
        ours = trainer.predict(pipe.transformer, noisy, t, cond)
        theirs = -pipe.transformer(
            hidden_states=noisy, timesteps=t * 1000, encoder_hidden_states_t5=cond["t5"],
            encoder_hidden_states_llama3=cond["llama"].transpose(0, 1), pooled_embeds=cond["pooled"],
            return_dict=False,
        )[0]  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_training_mode_trains_the_routed_experts_and_matches_inference(fx):
    """In train mode with grad, the MoE takes diffusers' differentiable path and the output is read from
    its token layout: same numbers as inference, and the routed experts get gradients (diffusers'
    inference path, which `force_inference_output=True` would force, is no-grad)."""
    model = hidream.load_transformer(fx["diffusers"], torch.float32)
    noisy, t, cond = _inputs(2, 8, 6)
    with torch.no_grad():
        reference = hidream.predict_velocity(model, noisy, t, cond["t5"], cond["llama"], cond["pooled"])
    model.train().requires_grad_(True)
    out = hidream.predict_velocity(model, noisy, t, cond["t5"], cond["llama"], cond["pooled"])
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    experts = model.double_stream_blocks[0].block.ff_i.experts
    assert any(e.w1.weight.grad is not None and e.w1.weight.grad.abs().sum() > 0 for e in experts)


def test_non_square_latents_beyond_the_models_capacity_are_refused(fx):
    model = hidream.load_transformer(fx["diffusers"], torch.float32)
    noisy, t, cond = _inputs(3, 34, 32)  # 17 × 16 tokens > 16 × 16
    with pytest.raises(ValueError, match="at most 256 tokens"):
        hidream.predict_velocity(model, noisy, t, cond["t5"], cond["llama"], cond["pooled"])


def test_linear_modules_name_every_linear_layer():
    import re

    from diffusers import HiDreamImageTransformer2DModel as Transformer

    for variant in hidream.TRANSFORMER_VARIANTS:
        with torch.device("meta"):
            model = Transformer.from_config(Transformer.load_config(variant.config_dir))
        linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        patterns = [re.compile(re.escape(p).replace(r"\{i\}", r"\d+")) for p in hidream.LINEAR_MODULES]
        assert all(any(p.fullmatch(n) for p in patterns) for n in linears)
        assert all(any(p.fullmatch(n) for n in linears) for p in patterns)


# ---- adapters ---------------------------------------------------------------------------------------


def test_saved_lora_loads_in_the_diffusers_pipeline(fx, pipe, tmp_path):
    """What training writes by default (diffusers: `transformer.` + the release's names, which are
    diffusers', alpha folded in) is what diffusers' HiDream LoRA loader reads, with the same result; the
    default targets reach the routed experts. (The comfy layout's `.alpha` keys make that loader refuse
    the file: "all LoRA param names contain 'lora'".)"""
    pytest.importorskip("peft")
    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec
    from tuner.registry import resolve_save_format

    record = ARCHITECTURES["hidream"]
    model = hidream.load_transformer(fx["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), rank=4, alpha=2, name_map=record.key_table()
    )
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    network.save(tmp_path / "lora.safetensors", format=resolve_save_format("hidream", "auto"))
    saved = load_file(tmp_path / "lora.safetensors")
    assert "transformer.double_stream_blocks.0.block.ff_i.experts.3.w2.lora_A.weight" in saved
    assert "transformer.single_stream_blocks.0.block.attn1.to_out.lora_B.weight" in saved
    trainer = HiDreamModel(None)
    noisy, t, cond = _inputs(4, 8, 8)
    with torch.no_grad():
        ours = trainer.predict(model, noisy, t, cond)
        pipe.load_lora_weights(tmp_path / "lora.safetensors", adapter_name="tuner")
        try:
            theirs = trainer.predict(pipe.transformer, noisy, t, cond)
        finally:
            pipe.delete_adapters("tuner")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


# ---- caching ----------------------------------------------------------------------------------------


def test_nf4_text_caching_runs_and_is_kept_apart(fx, tmp_path, capsys):
    """`cache.text_encoder_dtype = "nf4"` loads the encoders (Llama included) 4-bit; its entries are
    another encoder's, never mixed with the bf16 ones."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from project import cfg
    from tuner.cache.store import CacheStore

    project = make_project(tmp_path / "project", fx["root"], architecture="hidream")
    trainer = HiDreamModel(cfg(project))
    encoders = trainer.load_text_encoder(torch.device("cpu"), "nf4")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in encoders.llama.modules())
    encoded, _, _ = summary(run(capsys, "cache", "text", "--config", project)[1])
    code, out = run(capsys, "cache", "text", "--config", project, "--set", "cache.text_encoder_dtype=nf4")
    assert code == 0 and summary(out) == (encoded, 0, 0)
    store = CacheStore(project.parent / "cache", readonly=True)
    assert {store.meta(k)["encoder"].split("/")[1] for k in store.keys("text")} == {"bf16", "nf4"}


def test_shipped_configs_have_the_shapes_their_signatures_name():
    """Each real variant's config, built on the meta device, holds the tensors its signature names (so
    a real file of those shapes is recognised); the transformer has HiDream-I1's 17B parameters."""
    from diffusers import HiDreamImageTransformer2DModel as Transformer
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, LlamaConfig, LlamaForCausalLM

    def check(state: dict, signature: dict) -> None:
        for key, shape in signature.items():
            assert (key not in state) if shape is None else tuple(state[key].shape) == shape, key

    with torch.device("meta"):
        sizes = {}
        for variant in hidream.TRANSFORMER_VARIANTS:
            model = Transformer.from_config(Transformer.load_config(variant.config_dir))
            check(model.state_dict(), variant.signature)
            sizes[variant.name] = sum(p.numel() for p in model.parameters())
        assert 16.5e9 < sizes["i1"] < 17.5e9
        for variant in (*hidream_text.CLIP_L_VARIANTS, *hidream_text.CLIP_G_VARIANTS):
            model = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(variant.config_dir))
            check(model.state_dict(), variant.signature)
        for variant in hidream_text.LLAMA_VARIANTS:
            check(
                LlamaForCausalLM(LlamaConfig.from_pretrained(variant.config_dir)).state_dict(),
                variant.signature,
            )


def test_generation_shift_follows_the_release_named_by_the_file():
    from types import SimpleNamespace

    trainer = HiDreamModel(None)
    for name, shift in (
        ("hidream_i1_dev_bf16.safetensors", 6.0),
        ("HiDream-I1-Full", 3.0),
        ("x.safetensors", 3.0),
    ):
        trainer.cfg = SimpleNamespace(model=SimpleNamespace(transformer=name))
        assert trainer.default_sample_shift((16, 128, 128)) == shift
