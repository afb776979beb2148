"""Which `model.*` keys an architecture uses, for the new-run form: a Wan 2.1 run is not asked for a second
transformer, an expert, a fourth text encoder or an image encoder.

Read from the architecture's record (`tuner.registry.Architecture`):

- every architecture: `transformer`, `vae`, and the keys that are not components (dtype, guidance, ...);
- `boundary` set (two experts): `transformer_2`, `expert`, `boundary`;
- each tokenizer key of `tokenizers` and its text encoder (`tokenizer_2` → `text_encoder_2`);
- `image_encoder` where the latents or the text encoding read it (`latent_encoders`, `text_extra_encoders`).

`downloads(name)` lists what `tuner download` fetches for it: the hub pipelines (`hub_repos`) and, with
`--comfy`, ComfyUI's repackaged single files (`comfy_files`).
"""

from __future__ import annotations

import dataclasses
from functools import cache

from tuner.config.schema import ModelConfig
from tuner.registry import ARCHITECTURES, architecture

COMPONENTS = (
    "transformer", "transformer_2", "expert", "boundary", "vae", "text_encoder", "tokenizer", "text_encoder_2",
    "tokenizer_2", "text_encoder_3", "tokenizer_3", "text_encoder_4", "tokenizer_4", "image_encoder",
)  # fmt: skip
"""The `model.*` keys that only some architectures use."""


@cache
def model_keys(name: str) -> tuple[str, ...]:
    """The `model.*` keys (dotted) the architecture `name` uses, in the schema's order."""
    record = architecture(name)
    used = set(record.components)
    if record.boundary is not None:
        used |= {"expert", "boundary"}
    return tuple(
        f"model.{f.name}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in COMPONENTS or f.name in used
    )


def model_keys_by_architecture() -> dict[str, list[str]]:
    """`model_keys` of every architecture (the form's script shows only those of the one chosen)."""
    return {name: list(model_keys(name)) for name in ARCHITECTURES}


def downloads(name: str) -> list[dict]:
    """What `tuner download` fetches for `name`: one entry per variant (hub pipeline, and repackaged single
    files where known), each with the command that fetches it into the folder `DIR`."""
    record = architecture(name)
    comfy = dict(record.comfy_files)
    out = []
    for variant, repo in record.hub_repos:
        command = f"tuner download {name}{' ' + variant if variant else ''} --to DIR"
        out.append({"variant": variant, "source": repo, "comfy": False, "command": command})
        if variant in comfy:
            files = ", ".join(f"{field}: {path.rsplit('/', 1)[-1]}" for field, path in comfy[variant])
            out.append({"variant": variant, "source": files, "comfy": True, "command": command + " --comfy"})
    if not record.hub_repos:  # released as single files only (Anima): plain `tuner download` fetches them
        for variant, files in record.comfy_files:
            source = ", ".join(f"{field}: {path.rsplit('/', 1)[-1]}" for field, path in files)
            command = f"tuner download {name}{' ' + variant if variant else ''} --to DIR"
            out.append({"variant": variant, "source": source, "comfy": True, "command": command})
    return out
