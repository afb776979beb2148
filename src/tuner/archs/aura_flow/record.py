"""The aura_flow family's architecture record(s): what shared code knows about them (`tuner.archs.record`)."""

from __future__ import annotations

from tuner.archs.record import DIFFUSERS_ONLY, Architecture, SamplingDefaults, hub_tokenizers

_JOINT = r"joint_transformer_blocks\.\d+\."
_SINGLE = r"single_transformer_blocks\.\d+\."

AURA_FLOW = Architecture(
    name="aura_flow",
    sampling=SamplingDefaults(
        steps=50,
        guidance=3.5,
        shift=1.73,
        source="diffusers AuraFlowPipeline's defaults (50 steps, guidance 3.5); shift: the release's scheduler "
        "(fal/AuraFlow-v0.3 scheduler/), ComfyUI's default",
    ),
    variants=("v0.1", "v0.3"),
    checkpoints=(
        "Variants: `v0.1` (also v0.2: a 64² position table), `v0.3` (96²), told apart by shapes. "
        "`transformer`: fal's `aura_flow_0.3.safetensors` (the release's keys: `double_layers.0.attn.w1q`, "
        "`single_layers.*`, `modF`; under ComfyUI's `model.` prefix too, its bundled VAE and text encoder "
        "skipped; fp8 too), the same network in diffusers' keys, or a diffusers folder; `vae`: SDXL's "
        "(`sdxl_vae.safetensors` or `vae/`); `text_encoder`: Pile-T5-XL as UMT5 (a file in transformers' T5 "
        "names + `tokenizer`, or `text_encoder/`). Prompts are padded to `cache.text_max_length` tokens, "
        "which is part of the conditioning: set 256 as AuraFlowPipeline does"
    ),
    save_format_loads="ComfyUI (`transformer.<name>`, its diffusers key map); diffusers (`load_lora_weights`)",
    title="AuraFlow text-to-image (v0.1-v0.3; 6.8B MMDiT, Pile-T5-XL)",
    family="AuraFlowModel",
    block_lists=("joint_transformer_blocks", "single_transformer_blocks"),
    # the attention and MLP linears of both streams and of the single-stream blocks; the modulations,
    # embedders and the output head are left alone
    default_targets=(
        _JOINT + r"attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
        _JOINT + r"(ff|ff_context)\.(linear_1|linear_2|out_projection)",
        _SINGLE + r"attn\.(to_q|to_k|to_v|to_out\.0)",
        _SINGLE + r"ff\.(linear_1|linear_2|out_projection)",
    ),
    tokenizers=hub_tokenizers("fal/AuraFlow-v0.3", "tokenizer"),
    hub_repos=(("v0.3", "fal/AuraFlow-v0.3"), ("v0.1", "fal/AuraFlow")),
    # no Comfy-Org repackaging: ComfyUI's AuraFlow example loads fal's own file
    comfy_files=(
        (
            "v0.3",
            (
                ("transformer", "fal/AuraFlow-v0.3/aura_flow_0.3.safetensors"),
                ("vae", "stabilityai/sdxl-vae/sdxl_vae.safetensors"),
                ("text_encoder", "fal/AuraFlow-v0.3/text_encoder/model.safetensors"),
            ),
        ),
    ),
    # diffusers' AuraFlow loader reads only its own names (no converter), and ComfyUI's AuraFlow key map
    # reads them under `transformer.`: the one layout both load. `comfy` is the release's names under
    # `diffusion_model.` (ComfyUI only); full fine-tunes are written in the release's file layout
    save_format="diffusers",
    diffusers_loader="AuraFlowLoraLoaderMixin",
    diffusers_reads=DIFFUSERS_ONLY,
    timestep_mode="shift",
)


RECORDS = (AURA_FLOW,)
