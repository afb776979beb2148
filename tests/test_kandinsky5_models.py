"""Kandinsky 5 Lite T2V: loading (both layouts), variants and clear errors, model inputs equal to
Kandinsky5T2VPipeline's, bf16 training, and diffusers' LoRA loader."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers / transformers read it

import pytest
import torch
from diffusers import Kandinsky5T2VPipeline
from safetensors.torch import load_file, save_file

from tuner.archs.kandinsky5 import loaders as kandinsky5
from tuner.archs.kandinsky5.fixture import build_kandinsky5_components, write_kandinsky5_fixture
from tuner.archs.kandinsky5.trainer import Kandinsky5Model
from tuner.errors import CheckpointError
from tuner.registry import ARCHITECTURES

CAPTIONS = ["a red circle moving left", "a small dog walks on the beach at sunset"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_kandinsky5_fixture(tmp_path_factory.mktemp("kandinsky5"), seed=0)


@pytest.fixture
def pipe():
    """Diffusers' pipeline as a user builds it, one per test: tests that want tuner's RoPE on its
    transformer patch their own copy, and the next test sees upstream again."""
    return Kandinsky5T2VPipeline(**build_kandinsky5_components(seed=0))


# tuner's one intended deviation from Kandinsky5T2VPipeline: RoPE rotated in fp32, not rounded to bf16
# (`tuner.archs.kandinsky5.loaders`, "RoPE in fp32"). In fp32 the two outputs differ by that rounding
# of q and k: a relative error (norm of the difference / norm of upstream's output) below bf16's unit
# roundoff, 2^-9 (6e-4 on the fixture).
ROPE_ROUNDING = 2**-9


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def _encoders(fx, layout: str) -> kandinsky5.TextEncoders:
    if layout == "diffusers":
        return kandinsky5.load_text_encoders(fx["diffusers"], None, None, None, torch.float32)
    return kandinsky5.load_text_encoders(
        fx["text_encoder_file"], fx["text_encoder_2_file"], fx["tokenizer"], fx["tokenizer_2"], torch.float32
    )


def _cond(seed: int, lengths: tuple[int, ...]) -> dict:
    gen = torch.Generator().manual_seed(seed)
    entries = [
        {"text": torch.randn(n, 64, generator=gen), "pooled": torch.randn(32, generator=gen)} for n in lengths
    ]
    return kandinsky5.collate(entries)


# ---- loading ----------------------------------------------------------------------------------------


def test_transformer_layouts_load_identical_weights(fx, tmp_path):
    """The release's single file (with or without ComfyUI's prefix) and the diffusers folder give the
    same tensors; the fp32 modules stay fp32 in a bf16 load either way."""
    folder = kandinsky5.load_transformer(fx["diffusers"], torch.bfloat16).state_dict()
    single = kandinsky5.load_transformer(fx["transformer_file"], torch.bfloat16).state_dict()
    prefixed = tmp_path / "kandinsky5lite_t2v_sft_5s_comfy.safetensors"
    save_file(
        {f"model.diffusion_model.{k}": v for k, v in load_file(fx["transformer_file"]).items()}, prefixed
    )
    comfy = kandinsky5.load_transformer(prefixed, torch.bfloat16).state_dict()
    assert folder.keys() == single.keys() == comfy.keys()
    assert all(torch.equal(folder[k], single[k]) and torch.equal(folder[k], comfy[k]) for k in folder)
    assert folder["time_embeddings.in_layer.weight"].dtype == torch.float32
    assert folder["visual_transformer_blocks.0.visual_modulation.out_layer.weight"].dtype == torch.float32
    assert folder["visual_transformer_blocks.0.self_attention.to_query.weight"].dtype == torch.bfloat16


def test_text_encoder_layouts_load_identical_weights(fx):
    a, b = _encoders(fx, "single"), _encoders(fx, "diffusers")
    for x, y in ((a.qwen.model, b.qwen.model), (a.clip, b.clip)):
        sx, sy = x.state_dict(), y.state_dict()
        assert sx.keys() == sy.keys() and all(torch.equal(sx[k], sy[k]) for k in sx)


def test_variants_releases_and_refusals(fx, tmp_path):
    """Lite releases share shapes: the name picks the 10 s (NABLA) config and says which release it is;
    image-to-video files and other architectures' files are refused by name."""
    assert kandinsky5.release_name("kandinsky5lite_t2v_distilled16steps_10s.safetensors") == (
        "distilled16steps", "10s")  # fmt: skip
    assert kandinsky5.release_name("ai-forever/Kandinsky-5.0-T2V-Lite-nocfg-5s-Diffusers") == ("nocfg", "5s")
    assert kandinsky5.release_name("my_finetune.safetensors") is None
    assert kandinsky5.transformer_config("kandinsky5lite_t2v_sft_10s.safetensors").name == "lite-10s"
    assert kandinsky5.transformer_config("kandinsky5lite_t2v_sft_5s.safetensors").name == "lite-5s"
    i2v = tmp_path / "kandinsky5lite_i2v_5s.safetensors"
    i2v.write_bytes(fx["transformer_file"].read_bytes())
    with pytest.raises(CheckpointError, match="image-to-video"):
        kandinsky5.load_transformer(i2v, torch.float32)
    from tuner.models.identify import guess_architecture

    assert "kandinsky5" in guess_architecture(load_file(fx["transformer_file"]))  # named to other loaders
    wan = tmp_path / "wan.safetensors"
    save_file({"blocks.0.self_attn.q.weight": torch.zeros(64, 64)}, wan)
    with pytest.raises(CheckpointError, match="Wan 2.1"):
        kandinsky5.load_transformer(wan, torch.float32)


def test_shipped_configs_have_the_shapes_their_signatures_name():
    """The Lite config, built on the meta device, holds the tensors its signature names (so a real file
    is recognised) and has the release's 2B parameters; 5 s and 10 s differ only in attention."""
    import json

    from diffusers import Kandinsky5Transformer3DModel as Transformer

    with torch.device("meta"):
        for variant in kandinsky5.TRANSFORMER_VARIANTS:
            state = Transformer.from_config(Transformer.load_config(variant.config_dir)).state_dict()
            for key, shape in variant.signature.items():
                assert (key not in state) if shape is None else tuple(state[key].shape) == shape, key
            if variant.name == "lite-5s":
                assert 1.9e9 < sum(t.numel() for t in state.values()) < 2.1e9
    configs = {n: json.loads((kandinsky5.CONFIGS / "transformer" / n / "config.json").read_text())
               for n in ("lite-5s", "lite-10s")}  # fmt: skip
    differ = {k for k in configs["lite-5s"] if configs["lite-5s"][k] != configs["lite-10s"][k]}
    assert differ and all(k.startswith("attention_") for k in differ)


def test_key_table_names_every_linear_layer():
    import re

    from diffusers import Kandinsky5Transformer3DModel as Transformer

    with torch.device("meta"):
        model = Transformer.from_config(
            Transformer.load_config(kandinsky5.TRANSFORMER_VARIANTS[0].config_dir)
        )
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    patterns = [
        re.compile(re.escape(d).replace(r"\{i\}", r"\d+")) for d, _ in kandinsky5.KANDINSKY5_KEYS.renames
    ]
    assert all(any(p.fullmatch(n) for p in patterns) for n in linears)
    assert all(any(p.fullmatch(n) for n in linears) for p in patterns)


# ---- model inputs -----------------------------------------------------------------------------------


def test_prompt_encoding_matches_the_pipeline(fx, pipe):
    """Template, crop (the tiny tokenizer cuts the template's prefix into the pipeline's 128 tokens),
    last hidden state and CLIP's pooled output, per caption, as Kandinsky5T2VPipeline.encode_prompt."""
    assert pipe.prompt_template == kandinsky5.PROMPT_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == kandinsky5.CROP_START
    encoders = _encoders(fx, "single")
    prefix = kandinsky5.PROMPT_TEMPLATE.split("{}")[0]
    assert len(encoders.qwen.tokenizer(text=prefix).input_ids) == kandinsky5.CROP_START
    ours = kandinsky5.encode_prompts(encoders, [f"  {CAPTIONS[0]} &amp; more ", CAPTIONS[1]])
    for caption, entry in zip([f"  {CAPTIONS[0]} &amp; more ", CAPTIONS[1]], ours):
        text, pooled, cu = pipe.encode_prompt(caption, device="cpu", dtype=torch.float32)
        assert int(cu[-1]) == entry["text"].shape[0] > 0
        torch.testing.assert_close(entry["text"], text[0], rtol=0, atol=0)
        torch.testing.assert_close(entry["pooled"], pooled[0], rtol=0, atol=0)


@pytest.mark.parametrize("height,width", [(64, 64), (512, 512)])
def test_predict_matches_the_pipelines_transformer_call(pipe, height, width):
    """One pipeline step, its transformer's inputs and output captured: our `predict` on the same
    latents, t and text gives the same velocity (channel-last layout, zero visual condition, RoPE
    positions and the resolution's RoPE scale: 512 px is in the pipeline's 480p band)."""
    captured = {}

    def hook(module, args, kwargs, output):
        # the pipeline steps its latents in place after the call: keep a copy
        captured.update(kwargs, hidden_states=kwargs["hidden_states"].clone(), output=output)

    kandinsky5.rotate_in_compute_dtype(pipe.transformer)  # tuner's fp32 RoPE (bf16: identical, tested below)
    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(prompt=CAPTIONS[1], height=height, width=width, num_frames=5, num_inference_steps=1,
                 guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        handle.remove()
    latents = captured["hidden_states"][..., :16].permute(0, 4, 1, 2, 3)
    t = captured["timestep"] / 1000
    text = captured["encoder_hidden_states"]
    cond = kandinsky5.collate([{"text": text[0], "pooled": captured["pooled_projections"][0]}])
    trainer = Kandinsky5Model.__new__(Kandinsky5Model)
    with torch.no_grad():
        ours = trainer.predict(pipe.transformer, latents, t, cond)
    torch.testing.assert_close(ours, captured["output"].sample.permute(0, 4, 1, 2, 3), rtol=0, atol=0)


def test_unequal_captions_run_each_at_its_own_length(fx):
    """A batch whose captions differ in length gives each sample what it gets alone (no padding rows)."""
    model = kandinsky5.load_transformer(fx["diffusers"], torch.float32)
    cond = _cond(1, (3, 7))
    noisy = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        batch = kandinsky5.predict_velocity(model, noisy, t, cond)
        for i, n in enumerate((3, 7)):
            alone = {"text": cond["text"][i : i + 1, :n], "length": cond["length"][i : i + 1],
                     "pooled": cond["pooled"][i : i + 1]}  # fmt: skip
            torch.testing.assert_close(
                batch[i : i + 1], kandinsky5.predict_velocity(model, noisy[i : i + 1], t[i : i + 1], alone)
            )


def test_bf16_forward_and_backward_run_on_the_fixture(fx):
    """Why the model "needs autocast" in bf16: its time embedding is computed in fp32 and fed to
    `time_embeddings.in_layer`, so a model cast whole to bf16 fails without autocast. Loaded by tuner
    (fp32 time embedding and modulations, as `from_pretrained` keeps them), bf16 trains without autocast:
    forward and backward run and adapter-like gradients reach the blocks."""
    model = kandinsky5.load_transformer(fx["transformer_file"], torch.bfloat16)
    cond = _cond(3, (5, 5))
    noisy = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(4)).bfloat16()
    t = torch.tensor([0.25, 0.75])
    out = kandinsky5.predict_velocity(model, noisy, t, cond)
    assert out.dtype == torch.bfloat16 and out.shape == noisy.shape and torch.isfinite(out.float()).all()
    out.float().square().mean().backward()
    grad = model.visual_transformer_blocks[1].self_attention.to_query.weight.grad
    assert grad is not None and torch.isfinite(grad.float()).all() and grad.abs().sum() > 0
    whole = kandinsky5.load_transformer(fx["transformer_file"], torch.float32).to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="dtype"):
        kandinsky5.predict_velocity(whole, noisy, t, cond)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_in_compute_dtype_is_upstream_in_bf16(fx, dtype):
    """Upstream rounds rotated q/k to bf16 in any dtype (this test fails when diffusers stops, and the
    patch can go); tuner rotates in fp32 from the compute dtype: bit-identical to upstream in bf16,
    within bf16 rounding of it in fp32."""
    import inspect

    from diffusers import Kandinsky5Transformer3DModel
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5AttnProcessor

    from tuner.models.loading import cast_like_from_pretrained_

    assert ".to(torch.bfloat16)" in inspect.getsource(Kandinsky5AttnProcessor.__call__)
    ours = kandinsky5.load_transformer(fx["diffusers"], dtype)
    upstream = Kandinsky5Transformer3DModel.from_pretrained(fx["diffusers"] / "transformer").eval()
    cast_like_from_pretrained_(upstream, dtype)
    assert ours.state_dict().keys() == upstream.state_dict().keys()
    cond = _cond(7, (6, 6))
    noisy = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(8)).to(dtype)
    t = torch.tensor([0.2, 0.9])
    with torch.no_grad():
        got = kandinsky5.predict_velocity(ours, noisy, t, cond)
        want = kandinsky5.predict_velocity(upstream, noisy, t, cond)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        assert not torch.equal(got, want)
        assert _relative_error(got, want) < ROPE_ROUNDING, _relative_error(got, want)


def test_ten_second_models_train_with_dense_attention(fx):
    """A NABLA (10 s) config computes what the same weights compute with regular attention: dense
    attention, with gradients (diffusers' NABLA needs its flex backend, which has no CPU backward)."""
    import json

    from diffusers import Kandinsky5Transformer3DModel as Transformer

    ten = json.loads((kandinsky5.CONFIGS / "transformer" / "lite-10s" / "config.json").read_text())
    tiny = Transformer.load_config(fx["diffusers"] / "transformer")
    sparse = Transformer.from_config({**tiny, **{k: v for k, v in ten.items() if k.startswith("attention_")}})
    sparse.load_state_dict(kandinsky5.load_transformer(fx["diffusers"], torch.float32).state_dict())
    sparse = kandinsky5.rotate_in_compute_dtype(sparse.eval())
    dense = kandinsky5.load_transformer(fx["diffusers"], torch.float32)
    assert sparse.config.attention_type == "nabla" and dense.config.attention_type == "regular"
    cond = _cond(9, (4,))
    noisy = torch.randn(1, 16, 2, 16, 16, generator=torch.Generator().manual_seed(10))
    t = torch.tensor([0.5])
    out = kandinsky5.predict_velocity(sparse, noisy, t, cond)
    out.square().mean().backward()
    with torch.no_grad():  # the same numbers up to kernel rounding
        torch.testing.assert_close(
            out.detach(), kandinsky5.predict_velocity(dense, noisy, t, cond), rtol=1e-5, atol=1e-5
        )


# ---- adapters ---------------------------------------------------------------------------------------


def test_saved_lora_loads_in_the_diffusers_pipeline(fx, pipe, tmp_path):
    """`save.format = "diffusers"` (`transformer.` + the release's names, which are diffusers', alpha
    folded in) is what diffusers' Kandinsky LoRA loader reads, with the same result. The default (comfy:
    `diffusion_model.` + the same names, with `.alpha`) is ComfyUI's key map; diffusers' loader, which has
    no converter for Kandinsky, takes only `transformer.` keys."""
    pytest.importorskip("peft")
    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec

    record = ARCHITECTURES["kandinsky5"]
    model = kandinsky5.load_transformer(fx["diffusers"], torch.float32)
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), rank=4, alpha=2, name_map=record.key_table()
    )
    gen = torch.Generator().manual_seed(0)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    network.save(tmp_path / "lora.safetensors", format="diffusers")
    network.save(tmp_path / "comfy.safetensors", format="comfy")
    saved = load_file(tmp_path / "lora.safetensors")
    assert "transformer.visual_transformer_blocks.1.cross_attention.to_key.lora_A.weight" in saved
    comfy = load_file(tmp_path / "comfy.safetensors")
    assert "diffusion_model.text_transformer_blocks.0.feed_forward.in_layer.alpha" in comfy
    cond = _cond(5, (4,))
    noisy = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(6))
    t = torch.tensor([0.6])
    with torch.no_grad():
        ours = kandinsky5.predict_velocity(model, noisy, t, cond)
        pipe.load_lora_weights(tmp_path / "lora.safetensors", adapter_name="tuner")
        upstream = kandinsky5.predict_velocity(pipe.transformer, noisy, t, cond)
        kandinsky5.rotate_in_compute_dtype(pipe.transformer)  # tuner's RoPE, on purpose
        theirs = kandinsky5.predict_velocity(pipe.transformer, noisy, t, cond)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    # diffusers as users run it: the same output up to the stated RoPE rounding, and not identical (the
    # deviation is real in fp32; if it vanishes, upstream stopped rounding and the patch can go)
    assert not torch.equal(upstream, ours)
    assert _relative_error(ours, upstream) < ROPE_ROUNDING, _relative_error(ours, upstream)
