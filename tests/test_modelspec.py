"""The ModelSpec metadata saved with every adapter (`tuner.trainers.report.modelspec`)."""

from datetime import datetime, timezone
from pathlib import Path

from tuner.config import load_config
from tuner.trainers.report import modelspec

EXAMPLES = Path(__file__).parent.parent / "examples"


def _cfg(*overrides: str):
    return load_config(EXAMPLES / "wan21_t2v_lora.toml", list(overrides), check_paths=False)


def test_modelspec_keys():
    cfg = _cfg(
        "save.output_name='ohwx_style'", "save.trigger_phrase='ohwx'", "network.rank=8", "network.alpha=4"
    )
    spec = modelspec(cfg, now=datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc))
    width, height = cfg.datasets[0].resolution
    assert spec == {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "wan/lora",
        "modelspec.title": "ohwx_style",
        "modelspec.resolution": f"{width}x{height}",
        "modelspec.date": "2026-11-30T12:00:00+00:00",
        "modelspec.implementation": "https://github.com/comfyanonymous/ComfyUI",  # wan saves the comfy layout
        "modelspec.trigger_phrase": "ohwx",
        "tuner.rank": "8",
        "tuner.alpha": "4.0",
    }


def test_modelspec_without_trigger_and_for_full_finetunes():
    spec = modelspec(_cfg("network.type='full'", "save.format='diffusers'"))
    assert "modelspec.trigger_phrase" not in spec and "tuner.rank" not in spec
    assert spec["modelspec.architecture"] == "wan"
    assert spec["modelspec.implementation"] == "https://github.com/huggingface/diffusers"
