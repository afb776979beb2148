"""Hub ids and default tokenizers (`tuner.hub`), through the real `huggingface_hub` client against a local
stand-in for the hub (`tests/hub_server.py`): resolution, the cache, offline mode, a download cut and
resumed, a checksum that does not match, unknown and gated repositories."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hub_server import FakeHub
from project import assert_equal_weights
from tuner.config.schema import ModelConfig
from tuner.hub import HubError, HubRef, parse_ref, resolve, resolve_model_paths
from tuner.registry import ARCHITECTURES

WEIGHTS = b"\x00\x01safetensors-ish" * 100
WAN = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> dict[str, bytes]:
    from tuner.fixtures.tokenizers import build_t5_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    build_t5_tokenizer().save_pretrained(folder)
    return {f"tokenizer/{p.name}": p.read_bytes() for p in folder.iterdir()}


@pytest.fixture
def hub(tmp_path, monkeypatch, tokenizer_files):
    from huggingface_hub import constants

    server = FakeHub(
        repos={
            "org/model": {
                "transformer/diffusion.safetensors": WEIGHTS,
                "transformer/config.json": b'{"a": 1}',
            },
            "org/gated": {"model.safetensors": WEIGHTS},
            WAN: {**tokenizer_files, "text_encoder/model.safetensors": WEIGHTS},
        },
        gated={"org/gated"},
    )
    monkeypatch.setattr(
        constants, "ENDPOINT", server.url
    )  # what HF_ENDPOINT sets when the client is imported
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.file_download.time.sleep", lambda s: None)  # retries without waiting
    yield server
    server.close()


def _offline(monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


# --- what is a hub id -------------------------------------------------------------------------------


def test_parse_ref():
    assert parse_ref(WAN) == HubRef(WAN)
    assert parse_ref(f"{WAN}:vae") == HubRef(WAN, subfolder="vae")
    assert parse_ref("org/repo/split_files/vae/wan_2.1_vae.safetensors") == HubRef(
        "org/repo", filename="split_files/vae/wan_2.1_vae.safetensors"
    )
    for local in (
        "/models/wan.safetensors",
        "./org/repo",
        "~/x/y",
        "wan.safetensors",
        "models/wan.safetensors",
        "",
    ):
        assert parse_ref(local) is None, local


# --- resolution through the client ------------------------------------------------------------------


def test_file_downloads_once_then_resolves_offline(hub, monkeypatch):
    path = resolve(parse_ref("org/model/transformer/diffusion.safetensors"))
    assert path.read_bytes() == WEIGHTS
    before = len(hub.requests)
    _offline(monkeypatch)
    assert resolve(parse_ref("org/model/transformer/diffusion.safetensors")) == path
    assert len(hub.requests) == before  # from the cache, no request


def test_folder_resolves_and_then_offline(hub, monkeypatch):
    folder = resolve(parse_ref("org/model:transformer"))
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "diffusion.safetensors"]
    assert (folder / "config.json").read_bytes() == b'{"a": 1}'
    _offline(monkeypatch)
    assert resolve(parse_ref("org/model:transformer")) == folder


def test_offline_and_not_cached_names_the_command(hub, monkeypatch):
    _offline(monkeypatch)
    with pytest.raises(
        HubError,
        match=r"org/model:transformer: not in the hub cache .*hf download org/model --include 'transformer/\*'",
    ):
        resolve(parse_ref("org/model:transformer"))
    with pytest.raises(HubError, match="hf download org/model transformer/config.json"):
        resolve(parse_ref("org/model/transformer/config.json"))


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("org/nothing:x", "org/nothing: no such repository on the hub"),
        ("org/nothing/file.safetensors", "org/nothing: no such repository on the hub"),
        ("org/gated/model.safetensors", "org/gated: a gated repository; accept its terms"),
        ("org/gated:", "org/gated: a gated repository"),
        ("org/model/missing.safetensors", "org/model/missing.safetensors: the repository has no such file"),
    ],
)
def test_bad_ids_are_one_line(hub, ref, message):
    with pytest.raises(HubError, match=message) as e:
        resolve(parse_ref(ref))
    assert "\n" not in str(e.value)


def test_checksum_mismatch_leaves_no_file(hub):
    hub.corrupt.add("org/model/transformer/diffusion.safetensors")
    with pytest.raises(HubError, match="does not match the hub's checksum") as e:
        resolve(parse_ref("org/model/transformer/diffusion.safetensors"))
    assert "\n" not in str(e.value)
    _assert_no_file(hub)
    hub.corrupt.clear()  # the next run downloads it anew
    assert resolve(parse_ref("org/model/transformer/diffusion.safetensors")).read_bytes() == WEIGHTS


def test_cut_download_resumes_from_where_it_stopped(hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64)  # written to disk in chunks this small
    hub.cuts["org/model/transformer/diffusion.safetensors"] = 1
    path = resolve(parse_ref("org/model/transformer/diffusion.safetensors"))
    assert path.read_bytes() == WEIGHTS
    ranges = [r for method, p, r in hub.requests if method == "GET" and p.endswith("diffusion.safetensors")]
    resumed_at = len(WEIGHTS) // 2 // 64 * 64  # the whole chunks received before the cut
    assert ranges == ["", f"bytes={resumed_at}-"]  # the second request asked only for the rest


def test_download_cut_for_good_is_one_line_and_leaves_no_partial_file(hub):
    hub.cuts["org/model/transformer/diffusion.safetensors"] = 100
    with pytest.raises(HubError, match="download failed .*run the command again") as e:
        resolve(parse_ref("org/model/transformer/diffusion.safetensors"))
    assert "\n" not in str(e.value)
    _assert_no_file(hub)


def _assert_no_file(hub) -> None:
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE)
    assert not list(cache.rglob("diffusion.safetensors"))
    assert not [p for p in cache.rglob("*") if p.is_file() and p.suffix == ".incomplete"]


# --- config paths and default tokenizers ------------------------------------------------------------


def test_model_paths_resolve_hub_ids_and_default_tokenizer(hub, tmp_path):
    from transformers import AutoTokenizer

    encoder = tmp_path / "umt5_xxl_fp16.safetensors"  # a ComfyUI single file: no tokenizer beside it
    encoder.write_bytes(b"x")
    raw = {"architecture": "wan", "transformer": "org/model:transformer", "text_encoder": str(encoder)}
    model = ModelConfig(**{**raw, "transformer": str(tmp_path / raw["transformer"])})
    model = resolve_model_paths(model, raw, tmp_path)
    assert (Path(model.transformer) / "diffusion.safetensors").read_bytes() == WEIGHTS
    tokenizer = Path(model.tokenizer)
    assert tokenizer.name == "tokenizer" and WAN.replace("/", "--") in str(tokenizer)
    assert AutoTokenizer.from_pretrained(tokenizer)("a cat").input_ids  # a working tokenizer
    # only the tokenizer was fetched, not the text encoder beside it in that repository
    assert not any("text_encoder" in p for method, p, r in hub.requests if method == "GET")


def test_model_paths_leave_local_paths_and_given_tokenizers(hub, tmp_path):
    (tmp_path / "models").mkdir()
    encoder = tmp_path / "te.safetensors"
    encoder.write_bytes(b"x")
    raw = {
        "architecture": "wan",
        "transformer": "models/missing",
        "text_encoder": str(encoder),
        "tokenizer": "tok",
    }
    model = ModelConfig(
        **{**raw, "transformer": str(tmp_path / "models/missing"), "tokenizer": str(tmp_path / "tok")}
    )
    assert resolve_model_paths(model, raw, tmp_path) == model  # a missing local path, a given tokenizer
    assert hub.requests == []
    folder_encoder = dataclasses.replace(model, tokenizer="", text_encoder=str(tmp_path / "models"))
    assert resolve_model_paths(folder_encoder, raw, tmp_path).tokenizer == ""  # a folder finds its own


def test_load_config_resolves_hub_ids(hub, tmp_path):
    from tuner.config import load_config

    examples = Path(__file__).parent.parent / "examples"
    overrides = [
        "model.transformer=org/model:transformer",
        "network.network_weights=org/model/transformer/config.json",
    ]
    cfg = load_config(examples / "wan21_t2v_lora.toml", overrides, check_paths=False)
    assert (Path(cfg.model.transformer) / "config.json").is_file()
    assert Path(cfg.network.network_weights).read_bytes() == b'{"a": 1}'


# --- every record names its tokenizers --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_architecture_names_its_tokenizers_and_repositories(name):
    record = ARCHITECTURES[name]
    assert record.tokenizers, f"{name}: Architecture.tokenizers is empty"
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for field, spec in record.tokenizers:
        assert field.startswith("tokenizer") and field in model_fields, field
        assert field.replace("tokenizer", "text_encoder") in model_fields
        ref = parse_ref(spec)
        # a folder: the repository's tokenizer folder, or its root where the tokenizer lies there (HiDream-O1's;
        # only the tokenizer files are fetched, `resolve_tokenizer`)
        assert ref is not None and not ref.filename, spec
    assert record.hub_repos or record.comfy_files, f"{name}: nothing for `tuner download` to fetch"
    for _, repo in record.hub_repos:
        assert parse_ref(repo) == HubRef(repo), repo


# --- tuner download -----------------------------------------------------------------------------------


@pytest.fixture
def wan_hub(hub, wan_model):
    """The tiny Wan pipeline served as the 1.3B repository, with a release single file at its root and
    a second weight format that `tuner download` must leave alone."""
    folder = wan_model / "diffusers"
    files = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    files |= {"wan2.1_t2v_1.3B.safetensors": WEIGHTS, "transformer/diffusion_pytorch_model.bin": b"pickle"}
    hub.repos[WAN] = files
    return hub, folder


def test_download_fetches_the_pipeline_and_writes_the_model_section(wan_hub, tmp_path, capsys):
    from tuner.cli import main

    hub, folder = wan_hub
    to = tmp_path / "wan"
    assert main(["download", "wan", "--to", str(to)]) == 0
    out = capsys.readouterr().out
    assert f'transformer = "{to}"' in out and f'tokenizer = "{to}"' in out and (to / "model.toml").is_file()
    for p in folder.rglob("*"):
        if p.is_file():
            assert (to / p.relative_to(folder)).read_bytes() == p.read_bytes(), p
    assert not (to / "wan2.1_t2v_1.3B.safetensors").exists()
    assert not (to / "transformer/diffusion_pytorch_model.bin").exists()


@pytest.mark.slow
def test_download_points_a_renamed_component_folder_at_the_pipeline(hub, tmp_path, capsys):
    """OmniGen2 keeps Qwen2.5-VL in `mllm/` (`Architecture.hub_folders`): the section points `text_encoder`
    at the pipeline, which loads with the tokenizer of its `processor/`."""
    import torch

    from tuner.archs.omnigen2 import loaders as omnigen2
    from tuner.cli import main
    from tuner.fixtures import write_fixture

    folder = write_fixture("omnigen2", tmp_path / "fixture")["diffusers"]
    hub.repos["OmniGen2/OmniGen2"] = {
        str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }
    to = tmp_path / "omnigen2"
    assert main(["download", "omnigen2", "--to", str(to)]) == 0
    out = capsys.readouterr().out
    assert all(f'{field} = "{to}"' in out for field in ("transformer", "vae", "text_encoder")), out
    encoder = omnigen2.load_text_encoder(to, None, torch.float32)
    assert_equal_weights(encoder.model, omnigen2.load_text_encoder(folder, None, torch.float32).model)


def test_download_resumes_and_checks_checksums(wan_hub, tmp_path, capsys):
    from tuner.cli import main

    hub, folder = wan_hub
    to = tmp_path / "wan"
    weights = next(
        str(p.relative_to(folder)) for p in folder.rglob("*.safetensors") if "transformer" in str(p)
    )
    hub.corrupt.add(f"{WAN}/{weights}")
    assert main(["download", "wan", "1.3B", "--to", str(to)]) == 2
    err = capsys.readouterr().err
    assert "does not match the hub's checksum" in err and err.count("\n") == 1
    assert not (to / weights).exists()
    hub.corrupt.clear()
    fetched, kept = len(hub.requests), {str(p.relative_to(to)) for p in to.rglob("*") if p.is_file()}
    assert main(["download", "wan", "--to", str(to)]) == 0
    prefix = f"/{WAN}/resolve/main/"
    again = {
        p.removeprefix(prefix) for m, p, r in hub.requests[fetched:] if m == "GET" and p.startswith(prefix)
    }
    assert weights in again and not again & kept  # only what the first run did not finish
    assert (to / weights).read_bytes() == (folder / weights).read_bytes()
    assert main(["download", "wan", "2B", "--to", str(to)]) == 2
    assert "no variant '2B' to download; known: 1.3B, 14B" in capsys.readouterr().err


def test_check_offline_names_the_tokenizer_to_fetch(hub, tmp_path, monkeypatch, capsys):
    from tuner.cli import main

    encoder = tmp_path / "umt5_xxl_fp16.safetensors"
    encoder.write_bytes(b"x")
    _offline(monkeypatch)
    config = Path(__file__).parent.parent / "examples" / "wan21_t2v_lora.toml"
    args = [
        "check",
        "--config",
        str(config),
        "--set",
        f"model.text_encoder='{encoder}'",
        "--set",
        "model.tokenizer=''",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"hf download {WAN} --include 'tokenizer/*'" in err and err.count("\n") == 1


def test_a_pipeline_repository_fetches_its_components_only(wan_hub, monkeypatch):
    hub, folder = wan_hub
    root = resolve(parse_ref(WAN))
    for p in folder.rglob("*"):
        if p.is_file():
            assert (root / p.relative_to(folder)).read_bytes() == p.read_bytes(), p
    assert not (root / "wan2.1_t2v_1.3B.safetensors").exists()  # the release's single file at the root
    assert not (root / "transformer/diffusion_pytorch_model.bin").exists()  # the same weights again
    _offline(monkeypatch)
    assert resolve(parse_ref(WAN)) == root


# --- tuner download --comfy ---------------------------------------------------------------------------


@pytest.fixture
def comfy_hub(hub, wan_model):
    """The tiny Wan fixture's single files served as Comfy-Org's repackaged 1.3B files (at the names the
    record gives), beside other files of that repository that a download must leave alone."""
    files = dict(ARCHITECTURES["wan"].comfy_files)["1.3B"]
    single = {"transformer": "wan2.1_t2v_tiny.safetensors", "vae": "wan_2.1_vae.safetensors",
              "text_encoder": "umt5_tiny.safetensors"}  # fmt: skip
    repos: dict[str, dict[str, bytes]] = {}
    for field, spec in files:
        ref = parse_ref(spec)
        repos.setdefault(ref.repo, {})[ref.filename] = (wan_model / "single" / single[field]).read_bytes()
    repo = next(iter(repos))
    repos[repo]["split_files/diffusion_models/wan2.1_t2v_14B_fp16.safetensors"] = WEIGHTS  # the other variant
    hub.repos |= repos
    return hub, repo, files


def test_download_comfy_fetches_the_single_files_and_the_section_trains(comfy_hub, tmp_path, capsys):
    """`--comfy`: the record's files (and nothing else of the repository), each checked and kept at its
    repository path, a `[model]` section naming each one, and that section caches and trains as is (the
    tokenizer comes from the record's default)."""
    from project import make_project
    from tuner.cli import main

    hub, repo, files = comfy_hub
    to = tmp_path / "comfy"
    assert main(["download", "wan", "--comfy", "--to", str(to)]) == 0
    section = capsys.readouterr().out.split("(written to")[0]
    for field, spec in files:
        path = to / parse_ref(spec).filename
        assert path.read_bytes() == hub.repos[repo][parse_ref(spec).filename]
        assert f'{field} = "{path}"' in section
    assert not (to / "split_files/diffusion_models/wan2.1_t2v_14B_fp16.safetensors").exists()
    assert (to / "model.toml").read_text() == section

    config = make_project(tmp_path / "project", tmp_path / "unused")
    text = config.read_text()
    config.write_text(section + 'dtype = "fp32"\n' + text[text.index("\n[data]") :])
    for command in (["cache", "latents"], ["cache", "text"], ["train"]):
        assert main([*command, "--config", str(config), "--set", "train.max_steps=1"]) == 0, command
    assert (tmp_path / "project" / "output" / "demo_lora.safetensors").is_file()

    fetched = len(hub.requests)
    assert main(["download", "wan", "1.3B", "--comfy", "--to", str(to)]) == 0  # all there: nothing fetched
    assert not [r for r in hub.requests[fetched:] if r[0] == "GET" and "/resolve/" in r[1]]


def test_download_comfy_failures_are_one_line(comfy_hub, tmp_path, capsys):
    from tuner.cli import main

    hub, repo, files = comfy_hub
    vae = parse_ref(dict(files)["vae"]).filename
    hub.corrupt.add(f"{repo}/{vae}")
    assert main(["download", "wan", "--comfy", "--to", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "does not match the hub's checksum" in err and err.count("\n") == 1
    assert not (tmp_path / "a" / vae).exists()
    hub.corrupt.clear()
    del hub.repos[repo][vae]  # renamed upstream
    assert main(["download", "wan", "--comfy", "--to", str(tmp_path / "b")]) == 2
    assert f"{repo} has no file {vae}" in capsys.readouterr().err
    assert main(["download", "wan", "2B", "--comfy", "--to", str(tmp_path / "c")]) == 2
    assert "no variant '2B' to download with --comfy; known: 1.3B, 14B" in capsys.readouterr().err
    assert main(["download", "flux", "--comfy", "--to", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert (
        "flux: no repackaged single files are known" in err and "wan_i2v" in err and "without --comfy" in err
    )


@pytest.mark.parametrize("name", sorted(n for n, a in ARCHITECTURES.items() if a.comfy_files))
def test_comfy_files_name_known_variants_fields_and_single_files(name):
    record = ARCHITECTURES[name]
    variants, model_fields = dict(record.hub_repos), {f.name for f in dataclasses.fields(ModelConfig)}
    for variant, files in record.comfy_files:
        # a model released as single files only (Anima) has no pipelines: its variants are its own
        assert variant in variants or not variants, f"{name}: comfy variant {variant!r} is not in hub_repos"
        fields = dict(files)
        # the transformer and what shapes the latents (a pixel-space model has no VAE)
        assert "transformer" in fields and set(record.latent_encoders) <= set(fields) <= model_fields, fields
        for spec in fields.values():
            ref = parse_ref(spec)
            assert ref is not None and ref.filename.endswith(".safetensors"), spec
