"""FLUX.2 dev and klein: both checkpoint layouts, variant detection, and model inputs equal to the
Flux2Pipeline's / Flux2KleinPipeline's."""

import pytest
import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel
from safetensors.torch import load_file

from project import cfg, make_project, run, summary
from tuner.archs.flux import loaders as flux
from tuner.archs.flux2 import loaders as flux2
from tuner.archs.flux2 import text as flux2_text
from tuner.archs.flux2.fixture import write_flux2_fixture
from tuner.archs.flux2.keys import transformer_to_original, vae_key_to_original
from tuner.archs.flux2.trainer import Flux2KleinModel, Flux2Model
from tuner.errors import CheckpointError
from tuner.models.identify import pick_variant
from tuner.registry import ARCHITECTURES

PROMPTS = ["a red cat on a blue chair", "two dogs"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_flux2_fixture(tmp_path_factory.mktemp("flux2"), seed=0)


@pytest.fixture(scope="module")
def pipe(fx):
    pipe = Flux2Pipeline.from_pretrained(fx["diffusers"])
    for part in (pipe.transformer, pipe.vae, pipe.text_encoder):
        part.eval()
    return pipe


@pytest.fixture(scope="module")
def encoder(fx):
    return flux2_text.load_text_encoder(
        fx["text_encoder_file"], fx["tokenizer"], torch.float32, flux2_text.MISTRAL
    )


def trainer_for(text_max_length: int = 64, guidance: float = 2.5, cls: type = Flux2Model) -> Flux2Model:
    trainer = cls.__new__(cls)
    trainer.cfg = type("Cfg", (), {})()
    trainer.cfg.cache = type("Cache", (), {"text_max_length": text_max_length})()
    trainer.cfg.model = type("Model", (), {"guidance": guidance})()
    return trainer


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


# ---------------------------------------------------------------------------------------------------
# Loading: both layouts, variants, wrong files
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_layouts_are_identical(fx, dtype, tmp_path):
    single = flux2.load_transformer(fx["transformer_file"], dtype)
    assert_same_weights(single, flux2.load_transformer(fx["diffusers"], dtype))
    # ComfyUI's prefix
    prefixed = {f"model.diffusion_model.{k}": v for k, v in load_file(fx["transformer_file"]).items()}
    from safetensors.torch import save_file

    save_file(prefixed, tmp_path / "comfy.safetensors")
    assert_same_weights(single, flux2.load_transformer(tmp_path / "comfy.safetensors", dtype))


def test_release_keys_are_bfl_names(fx):
    keys = set(load_file(fx["transformer_file"]))
    assert {"double_blocks.0.img_attn.qkv.weight", "double_blocks.0.txt_attn.norm.key_norm.scale",
            "double_blocks.0.img_mlp.0.weight", "single_blocks.0.linear1.weight", "single_blocks.0.linear2.weight",
            "double_stream_modulation_img.lin.weight", "single_stream_modulation.lin.weight",
            "final_layer.adaLN_modulation.1.weight", "guidance_in.in_layer.weight", "time_in.out_layer.weight",
            } <= keys  # fmt: skip
    assert not any("transformer_blocks" in k for k in keys)


def test_vae_layouts_are_identical(fx):
    single = flux2.load_vae(fx["vae_file"], torch.float32)
    assert_same_weights(single, flux2.load_vae(fx["diffusers"], torch.float32))
    keys = set(load_file(fx["vae_file"]))
    assert {"encoder.quant_conv.weight", "decoder.post_quant_conv.weight", "bn.running_var"} <= keys


def test_vae_file_with_the_batchnorm_counter_loads(fx, tmp_path):
    from safetensors.torch import save_file

    tensors = load_file(fx["vae_file"]) | {"bn.num_batches_tracked": torch.tensor(7)}
    save_file(tensors, tmp_path / "ae.safetensors")
    vae = flux2.load_vae(tmp_path / "ae.safetensors", torch.float32)
    assert int(vae.bn.num_batches_tracked) == 7


def test_text_encoder_layouts_are_identical(fx, encoder):
    folder = flux2_text.load_text_encoder(fx["diffusers"], None, torch.float32, flux2_text.MISTRAL)
    assert_same_weights(encoder.model, folder.model)
    assert folder.tokenizer.get_vocab() == encoder.tokenizer.get_vocab()


def test_text_encoder_single_file_needs_a_tokenizer(fx):
    with pytest.raises(CheckpointError, match="no tokenizer next to this text encoder"):
        flux2_text.load_text_encoder(fx["text_encoder_file"], None, torch.float32, flux2_text.MISTRAL)


@pytest.mark.parametrize("variant", flux2.TRANSFORMER_VARIANTS, ids=lambda v: v.name)
def test_transformer_variant_picked_from_shapes(variant):
    with torch.device("meta"):
        model = Flux2Transformer2DModel.from_config(Flux2Transformer2DModel.load_config(variant.config_dir))
    shapes = {k: tuple(v.shape) for k, v in transformer_to_original(model.state_dict()).items()}
    assert pick_variant(shapes, flux2.TRANSFORMER_VARIANTS, "x.safetensors", "FLUX.2") is variant


@pytest.mark.parametrize("variant", flux2.VAE_VARIANTS, ids=lambda v: v.name)
def test_vae_variant_picked_from_shapes(variant):
    with torch.device("meta"):
        model = AutoencoderKLFlux2.from_config(AutoencoderKLFlux2.load_config(variant.config_dir))
    shapes = {vae_key_to_original(k): tuple(v.shape) for k, v in model.state_dict().items()}
    assert pick_variant(shapes, flux2.VAE_VARIANTS, "vae.safetensors", "VAE") is variant


@pytest.mark.parametrize(
    ("kind", "variant"),
    [(kind, v) for kind in (flux2_text.MISTRAL, flux2_text.QWEN3) for v in kind.variants],
    ids=lambda x: getattr(x, "name", ""),
)
def test_text_encoder_variant_picked_from_shapes(kind, variant):
    import transformers

    config = getattr(transformers, kind.config_class).from_pretrained(variant.config_dir)
    with torch.device("meta"):
        model = getattr(transformers, kind.model_class)(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert pick_variant(shapes, kind.variants, "te.safetensors", kind.what) is variant


def test_shipped_configs_have_the_real_sizes():
    """FLUX.2 dev is a 32B transformer, klein 4B and 9B; Mistral-Small 3.x's language model 23B."""
    billions = {}
    for variant in flux2.TRANSFORMER_VARIANTS:
        with torch.device("meta"):
            model = Flux2Transformer2DModel.from_config(
                Flux2Transformer2DModel.load_config(variant.config_dir)
            )
        billions[variant.name] = round(sum(p.numel() for p in model.parameters()) / 1e9, 1)
    assert billions == {"dev": 32.2, "klein-4b": 3.9, "klein-9b": 9.1, "tiny": 0.0, "tiny-klein": 0.0}


def test_flux1_file_given_to_flux2_names_flux(tmp_path):
    from tuner.archs.flux.fixture import write_flux_fixture

    paths = write_flux_fixture(tmp_path / "flux1", seed=0)
    with pytest.raises(CheckpointError, match=r'FLUX\.1 transformer.*model\.architecture = "flux"'):
        flux2.load_transformer(paths["transformer_file"], torch.float32)


def test_chroma_file_given_to_flux2_names_chroma(tmp_path):
    from tuner.archs.chroma.fixture import write_chroma_fixture

    paths = write_chroma_fixture(tmp_path / "chroma", seed=0)
    with pytest.raises(CheckpointError, match=r'Chroma transformer.*model\.architecture = "chroma"'):
        flux2.load_transformer(paths["transformer_file"], torch.float32)


def test_flux2_file_given_to_flux_names_flux2(fx):
    with pytest.raises(CheckpointError, match=r'FLUX\.2 transformer.*model\.architecture = "flux2"'):
        flux.load_transformer(fx["transformer_file"], torch.float32)


def test_klein_transformer_is_refused_by_name(tmp_path):
    config = Flux2Transformer2DModel.load_config(flux2.TRANSFORMER_VARIANTS[-1].config_dir)
    Flux2Transformer2DModel.from_config({**config, "guidance_embeds": False}).save_pretrained(
        tmp_path / "klein"
    )
    with pytest.raises(CheckpointError, match='FLUX.2 klein transformer.*Qwen3.*"flux2_klein"'):
        flux2.load_transformer(tmp_path / "klein", torch.float32)


def test_wrong_component_files(fx):
    with pytest.raises(CheckpointError, match=r"flux2-vae\.safetensors.*not a FLUX\.2 transformer"):
        flux2.load_transformer(fx["vae_file"], torch.float32)
    with pytest.raises(CheckpointError, match="not a Mistral-Small text encoder"):
        flux2_text.load_text_encoder(fx["vae_file"], fx["tokenizer"], torch.float32, flux2_text.MISTRAL)


# ---------------------------------------------------------------------------------------------------
# Model inputs equal the pipeline's
# ---------------------------------------------------------------------------------------------------


def test_prompt_embeddings_equal_pipeline(pipe, encoder):
    theirs, text_ids = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=64)
    ours = trainer_for(64).encode_text(encoder, PROMPTS)
    assert all(e["prompt_embeds"].shape == (64, 96) for e in ours)
    torch.testing.assert_close(torch.stack([e["prompt_embeds"] for e in ours]), theirs, rtol=0, atol=0)
    torch.testing.assert_close(flux2.text_ids(64).expand(2, -1, -1), text_ids)


def test_latents_equal_pipeline(pipe):
    gen = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 32, 48, generator=gen) * 2 - 1
    ours = flux2.encode_images(pipe.vae, pixels)
    torch.testing.assert_close(ours, pipe._encode_vae_image(pixels, generator=None))
    assert ours.shape == (2, 128, 2, 3)
    # decoding: the pipeline's inverse steps after sampling (un-normalize, unpatchify, decode)
    mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    with torch.no_grad():
        theirs = pipe.vae.decode(pipe._unpatchify_latents(ours * std + mean)).sample
    torch.testing.assert_close(flux2.decode_latents(pipe.vae, ours), theirs)


@pytest.mark.parametrize("references", [0, 2])
def test_predict_equals_pipeline_transformer_call(pipe, references):
    """Flux2Pipeline's denoising call: packed target tokens (ids t=0), the reference images' tokens
    appended (ids t=10, 20), text ids (0, 0, 0, l), timestep / 1000, the guidance embedding."""
    gen = torch.Generator().manual_seed(1)
    noisy = torch.randn(2, 128, 2, 3, generator=gen)
    refs = [torch.randn(1, 128, 3, 2, generator=gen) for _ in range(references)]
    embeds = torch.randn(2, 11, 96, generator=gen)
    t = torch.tensor([0.3, 0.8])
    trainer = trainer_for(guidance=2.5)
    cond = {"prompt_embeds": embeds} | {f"control_{i}": r.expand(2, -1, -1, -1) for i, r in enumerate(refs)}
    with torch.no_grad():
        ours = trainer.predict(pipe.transformer, noisy, t, cond)
        tokens, ids = pipe._pack_latents(noisy), pipe._prepare_latent_ids(noisy)
        if refs:
            ref_ids = pipe._prepare_image_ids(refs).expand(2, -1, -1)
            ref_tokens = torch.cat([pipe._pack_latents(r) for r in refs], dim=1).expand(2, -1, -1)
            tokens, ids = torch.cat([tokens, ref_tokens], dim=1), torch.cat([ids, ref_ids], dim=1)
        out = pipe.transformer(
            hidden_states=tokens, timestep=t * 1000 / 1000, guidance=torch.full([2], 2.5),
            encoder_hidden_states=embeds, txt_ids=pipe._prepare_text_ids(embeds), img_ids=ids, return_dict=False,
        )[0][:, : 6]  # fmt: skip
        theirs = pipe._unpack_latents_with_ids(out, pipe._prepare_latent_ids(noisy))
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize(
    ("name", "fixture", "pipeline"), [("flux2", "fx", "pipe"), ("flux2_klein", "klein", "klein_pipe")]
)
def test_saved_lora_loads_in_the_diffusers_pipeline(name, fixture, pipeline, request, tmp_path):
    """What training writes by default (kohya: `lora_unet_` + BFL names, fused `qkv`, `.alpha`) is what
    diffusers' FLUX.2 LoRA loader reads too, with the same result. (Its loader for the comfy layout,
    `diffusion_model.` names, raises on `.alpha` keys, which is why the default is kohya.)"""
    pytest.importorskip("peft")
    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec
    from tuner.registry import resolve_save_format

    fx, pipe = request.getfixturevalue(fixture), request.getfixturevalue(pipeline)
    record = ARCHITECTURES[name]
    model = flux2.load_transformer(fx["diffusers"], torch.float32, klein=name == "flux2_klein")
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), rank=4, alpha=2, name_map=record.key_table()
    )
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    network.save(tmp_path / "lora.safetensors", format=resolve_save_format(name, "auto"))
    saved = load_file(tmp_path / "lora.safetensors")
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in saved
    assert "lora_unet_single_blocks_0_linear1.alpha" in saved
    trainer = trainer_for()
    noisy, t = torch.randn(1, 128, 2, 3, generator=gen), torch.tensor([0.5])
    cond = {"prompt_embeds": torch.randn(1, 7, 96, generator=gen)}
    with torch.no_grad():
        ours = trainer.predict(model, noisy, t, cond)
        pipe.load_lora_weights(tmp_path / "lora.safetensors", adapter_name="tuner")
        try:
            theirs = trainer.predict(pipe.transformer, noisy, t, cond)
        finally:
            pipe.delete_adapters("tuner")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Through the CLI: quantized text caching, reference images
# ---------------------------------------------------------------------------------------------------


def test_nf4_text_encoder_caches_apart_from_bf16(fx, tmp_path, capsys):
    """The 24B encoder is cached at `cache.text_encoder_dtype = "nf4"` (bitsandbytes, CPU too); its
    entries are another encoder's, never mixed with the bf16 ones."""
    pytest.importorskip("bitsandbytes")
    from tuner.cache.store import CacheStore

    project = make_project(tmp_path, fx["root"], architecture="flux2")
    encoded, _, _ = summary(run(capsys, "cache", "text", "--config", project)[1])
    code, out = run(capsys, "cache", "text", "--config", project, "--set", "cache.text_encoder_dtype=nf4")
    assert code == 0 and summary(out) == (encoded, 0, 0)
    store = CacheStore(project.parent / "cache", readonly=True)
    keys = store.keys("text")
    assert {store.meta(k)["encoder"].split("/")[1] for k in keys} == {"bf16", "nf4"}
    shapes = {
        (store.meta(k)["encoder"].split("/")[1], tuple(store.get(k)["prompt_embeds"].shape)) for k in keys
    }
    length = cfg(project).cache.text_max_length
    assert shapes == {("bf16", (length, 96)), ("nf4", (length, 96))}
    assert all(torch.isfinite(store.get(k)["prompt_embeds"]).all() for k in keys)


def test_reference_images_cache_train_and_generate(fx, tmp_path, capsys):
    """Two reference images per item: cached as control latents, appended after the target's tokens in
    training, and given to `generate --control` twice."""
    from project import check_reference_images_cli

    check_reference_images_cli(capsys, tmp_path, fx["root"], "flux2")


# ---------------------------------------------------------------------------------------------------
# klein: the same network on Qwen3, no guidance embedding
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    return write_flux2_fixture(tmp_path_factory.mktemp("flux2_klein"), seed=0, klein=True)


@pytest.fixture(scope="module")
def klein_pipe(klein):
    pipe = Flux2KleinPipeline.from_pretrained(klein["diffusers"])
    for part in (pipe.transformer, pipe.vae, pipe.text_encoder):
        part.eval()
    return pipe


def test_klein_layouts_are_identical(klein):
    single = flux2.load_transformer(klein["transformer_file"], torch.float32, klein=True)
    assert not single.config.guidance_embeds
    assert_same_weights(single, flux2.load_transformer(klein["diffusers"], torch.float32, klein=True))
    tokenizer = klein["tokenizer"]
    text = flux2_text.load_text_encoder(
        klein["text_encoder_file"], tokenizer, torch.float32, flux2_text.QWEN3
    )
    folder = flux2_text.load_text_encoder(klein["diffusers"], None, torch.float32, flux2_text.QWEN3)
    assert_same_weights(text.model, folder.model)
    assert "lm_head.weight" in load_file(klein["text_encoder_file"])


def test_dev_file_given_to_klein_names_flux2(fx):
    with pytest.raises(CheckpointError, match='FLUX.2 dev transformer.*model.architecture = "flux2"'):
        flux2.load_transformer(fx["transformer_file"], torch.float32, klein=True)
    with pytest.raises(CheckpointError, match="not the Qwen3 text encoder"):
        flux2_text.load_text_encoder(fx["diffusers"], None, torch.float32, flux2_text.QWEN3)
    with pytest.raises(CheckpointError, match='a Mistral-Small text encoder.*architecture = "flux2"'):
        flux2_text.load_text_encoder(
            fx["text_encoder_file"], fx["tokenizer"], torch.float32, flux2_text.QWEN3
        )


def test_klein_text_encoder_given_to_dev_names_flux2_klein(klein):
    with pytest.raises(CheckpointError, match='a Qwen3 text encoder.*architecture = "flux2_klein"'):
        flux2_text.load_text_encoder(
            klein["text_encoder_file"], klein["tokenizer"], torch.float32, flux2_text.MISTRAL
        )


def test_klein_prompt_embeddings_equal_pipeline(klein_pipe, klein):
    encoder = flux2_text.load_text_encoder(klein["diffusers"], None, torch.float32, flux2_text.QWEN3)
    theirs, _ = klein_pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=48)
    ours = trainer_for(48, cls=Flux2KleinModel).encode_text(encoder, PROMPTS)
    torch.testing.assert_close(torch.stack([e["prompt_embeds"] for e in ours]), theirs, rtol=0, atol=0)
    # the template's tokens: user turn, then the assistant's turn with an empty think block
    text = encoder.tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_klein_predict_equals_pipeline_transformer_call(klein_pipe):
    """Flux2KleinPipeline calls the transformer with `guidance=None`; `model.guidance` is ignored."""
    pipe = klein_pipe
    gen = torch.Generator().manual_seed(2)
    noisy, ref = torch.randn(1, 128, 2, 2, generator=gen), torch.randn(1, 128, 2, 2, generator=gen)
    embeds, t = torch.randn(1, 5, 96, generator=gen), torch.tensor([0.4])
    with torch.no_grad():
        ours = trainer_for(cls=Flux2KleinModel).predict(
            pipe.transformer, noisy, t, {"prompt_embeds": embeds, "control_0": ref}
        )
        tokens = torch.cat([pipe._pack_latents(noisy), pipe._pack_latents(ref)], dim=1)
        ids = torch.cat([pipe._prepare_latent_ids(noisy), pipe._prepare_image_ids([ref])], dim=1)
        out = pipe.transformer(
            hidden_states=tokens, timestep=t, guidance=None, encoder_hidden_states=embeds,
            txt_ids=pipe._prepare_text_ids(embeds), img_ids=ids, return_dict=False,
        )[0][:, :4]  # fmt: skip
    torch.testing.assert_close(ours, pipe._unpack_latents_with_ids(out, pipe._prepare_latent_ids(noisy)))


def test_klein_shares_dev_tables():
    """klein is dev's network: one key table, so saved adapters use the same BFL names."""
    from tuner.networks.architectures import architecture_keys

    assert architecture_keys("flux2_klein") is architecture_keys("flux2")
    assert ARCHITECTURES["flux2_klein"].save_format == ARCHITECTURES["flux2"].save_format == "kohya"


def test_chat_template_kept_by_the_processor_is_used(fx, encoder, tmp_path):
    """FLUX.2-dev's tokenizer/ is a processor folder whose chat template sits in chat_template.json."""
    import json
    import shutil

    folder = tmp_path / "tokenizer"
    shutil.copytree(fx["tokenizer"], folder)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = folder / name
        if name == "tokenizer_config.json":
            config = json.loads(path.read_text())
            config.pop("chat_template", None)
            path.write_text(json.dumps(config))
        else:
            path.unlink(missing_ok=True)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": encoder.tokenizer.chat_template}))
    loaded = flux2_text.load_text_encoder(fx["text_encoder_file"], folder, torch.float32, flux2_text.MISTRAL)
    assert loaded.tokenizer.chat_template == encoder.tokenizer.chat_template
    (folder / "chat_template.json").unlink()
    with pytest.raises(CheckpointError, match="no chat template"):
        flux2_text.load_text_encoder(fx["text_encoder_file"], folder, torch.float32, flux2_text.MISTRAL)
