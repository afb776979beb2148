"""`tuner download ARCH [VARIANT] --to DIR [--comfy]`: the components an architecture trains with, from the
hub, and a `[model]` section that points at them.

By default the architecture's official diffusers pipeline (`Architecture.hub_repos`): its
`model_index.json` names its components, and every one of them is fetched (transformer(s), VAE, text
encoders, tokenizers, image encoder, scheduler), and nothing else the repository holds (the release's
single files, other weight formats); every path of the section is DIR, the pipeline folder.

With `--comfy` (and by default for a model released as such files only, Anima), the single files ComfyUI users have (`Architecture.comfy_files`: Comfy-Org's repackaged
repositories, e.g. `wan2.1_t2v_1.3B_fp16.safetensors`, `wan_2.1_vae.safetensors`,
`umt5_xxl_fp16.safetensors`), one per component, kept under DIR at their repository path; the section
points at each file. Single-file text encoders carry no tokenizer: training uses the record's default
tokenizer folder (`Architecture.tokenizers`, fetched once on first use).

Each file is checked against the hub's checksum from the repository listing; a file already in DIR with
the right size is kept, so a second run only fetches what the first did not finish. The section is
printed and written to `DIR/model.toml`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tuner.errors import ConfigError
from tuner.hub import HubError, HubRef, check_digest, one_line_errors, parse_ref, pipeline_files
from tuner.io import write_text


def download(name: str, variant: str = "", to: str | Path = ".", comfy: bool = False) -> str:
    """Fetch architecture `name`'s pipeline, or with `comfy` its repackaged single files (its `variant`,
    default the first) into `to`; returns the `[model]` TOML section, also written to `to/model.toml`."""
    from tuner.registry import ARCHITECTURES, architecture

    record, to = architecture(name), Path(to)
    comfy = comfy or not record.hub_repos  # released as single files only: there is no pipeline to fetch
    choices = dict(record.comfy_files if comfy else record.hub_repos)
    if comfy and not choices:
        covered = ", ".join(a.name for a in ARCHITECTURES.values() if a.comfy_files)
        raise ConfigError(
            f"{name}: no repackaged single files are known for it (--comfy covers {covered}); download its "
            "diffusers pipeline without --comfy."
        )
    if variant not in choices and not (variant == "" and choices):
        known = ", ".join(v or '""' for v in choices) or "none"
        raise ConfigError(
            f"{name}: no variant {variant!r} to download{' with --comfy' * comfy}; known: {known}."
        )
    variant = variant or next(iter(choices))
    paths = (
        _single_files(choices[variant], to)
        if comfy
        else _pipeline(HubRef(choices[variant]), to, record.hub_folders)
    )
    section = "[model]\n" + "".join(f'{k} = "{v}"\n' for k, v in {"architecture": name, **paths}.items())
    write_text(to / "model.toml", section)
    return section


def _pipeline(ref: HubRef, to: Path, renamed: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """The components of a diffusers pipeline into `to`; every config field that names one (or whose
    `renamed` folder is one) points at `to`."""
    from huggingface_hub import hf_hub_download

    listing = _listing(ref)
    if "model_index.json" not in listing:
        raise ConfigError(
            f"{ref.repo}: has no model_index.json; it is not a diffusers pipeline. Fetch the model's "
            "single files with --comfy."
        )
    index = json.loads(_fetch(ref, listing["model_index.json"], to, hf_hub_download).read_text())
    wanted = pipeline_files(list(listing), index)
    for path in wanted:
        _fetch(ref, listing[path], to, hf_hub_download)
    folders = {f.split("/")[0] for f in wanted}
    fields = folders & {"transformer", "transformer_2", "vae", "image_encoder"}
    fields |= {f for f in folders if f.startswith(("text_encoder", "tokenizer"))}
    fields |= {field for field, folder in renamed if folder in folders}
    return {f: str(to.resolve()) for f in sorted(fields)}


def _single_files(files: tuple[tuple[str, str], ...], to: Path) -> dict[str, str]:
    """Each (config field, hub file) into `to` at its repository path; each field points at its file."""
    from huggingface_hub import hf_hub_download

    paths, listings = {}, {}
    for field, spec in files:
        ref = parse_ref(spec)
        folder = ref.filename.rpartition("/")[0]
        if (ref.repo, folder) not in listings:  # one listing per folder of a repository
            listings[ref.repo, folder] = _listing(ref, folder)
        entry = listings[ref.repo, folder].get(ref.filename)
        if entry is None:
            raise HubError(
                f"{ref.repo} has no file {ref.filename} (the repackaged files may have been renamed); "
                "download the diffusers pipeline without --comfy."
            )
        paths[field] = str(_fetch(ref, entry, to, hf_hub_download).resolve())
    return paths


def _listing(ref: HubRef, folder: str = "") -> dict:
    """Path -> `RepoFile` (size, checksums) of the repository's files, under `folder` if given."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.hf_api import RepoFile

    with one_line_errors(ref):
        tree = HfApi(endpoint=constants.ENDPOINT).list_repo_tree(
            ref.repo, folder or None, recursive=not folder
        )
        return {f.path: f for f in tree if isinstance(f, RepoFile)}


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
