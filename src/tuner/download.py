"""`tuner download ARCH [VARIANT] --to DIR`: the components an architecture trains with, from its official
diffusers pipeline on the hub, and a `[model]` section that points at them.

The pipeline's `model_index.json` names its components; every one of them is fetched (transformer(s),
VAE, text encoders, tokenizers, image encoder, scheduler), and nothing else the repository holds (the
release's single files, other weight formats). Each file is checked against the hub's checksum from the
repository listing; a file already in DIR with the right size is kept, so a second run only fetches what
the first did not finish. The `[model]` section is printed and written to `DIR/model.toml`: every path is
DIR, the pipeline folder, from which each component is read.
"""

from __future__ import annotations

import json
from pathlib import Path

from tuner.errors import ConfigError
from tuner.hub import HubRef, check_digest, one_line_errors, pipeline_files


def download(name: str, variant: str = "", to: str | Path = ".") -> str:
    """Fetch architecture `name`'s pipeline (its `variant`, default the first) into `to`; returns the
    `[model]` TOML section, also written to `to/model.toml`."""
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.hf_api import RepoFile

    from tuner.registry import architecture

    record, to = architecture(name), Path(to)
    repos = dict(record.hub_repos)
    if variant not in repos and not (variant == "" and repos):
        known = ", ".join(v or '""' for v in repos) or "none"
        raise ConfigError(f"{name}: no variant {variant!r} to download; known: {known}.")
    variant = variant or next(iter(repos))
    ref = HubRef(repos[variant])
    with one_line_errors(ref):
        listing = {
            f.path: f
            for f in HfApi(endpoint=constants.ENDPOINT).list_repo_tree(ref.repo, recursive=True)
            if isinstance(f, RepoFile)
        }
    if "model_index.json" not in listing:
        raise ConfigError(f"{ref.repo}: has no model_index.json; it is not a diffusers pipeline.")
    index = json.loads(_fetch(ref, listing["model_index.json"], to, hf_hub_download).read_text())
    wanted = pipeline_files(list(listing), index)
    for path in wanted:
        _fetch(ref, listing[path], to, hf_hub_download)
    model = {"architecture": name}
    fields = {f.split("/")[0] for f in wanted} & {"transformer", "transformer_2", "vae", "image_encoder"}
    fields |= {f for f in {p.split("/")[0] for p in wanted} if f.startswith(("text_encoder", "tokenizer"))}
    model |= {f: str(to.resolve()) for f in sorted(fields)}
    section = "[model]\n" + "".join(f'{k} = "{v}"\n' for k, v in model.items())
    (to / "model.toml").write_text(section)
    return section


def _fetch(ref: HubRef, entry, to: Path, hf_hub_download) -> Path:
    """One file of the listing into `to`, checked against its checksum; kept if already there, whole."""
    from huggingface_hub import constants

    path = to / entry.path
    expected = entry.lfs.sha256 if entry.lfs is not None else entry.blob_id
    if path.is_file() and path.stat().st_size == entry.size:
        return path
    with one_line_errors(ref, entry.path):
        hf_hub_download(ref.repo, entry.path, local_dir=to, endpoint=constants.ENDPOINT)
    check_digest(path, expected, f"{ref.repo}/{entry.path}")
    return path
