"""`tuner ui` without a browser: paths, the token, dataset pages, captions and the config form, through
FastAPI's TestClient on the tiny demo project (the job pages are tested in test_ui_pages.py)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from tuner.config import load_config  # noqa: E402
from tuner.data.check import check_datasets  # noqa: E402
from tuner.registry import ARCHITECTURES  # noqa: E402
from tuner.ui import folders, form  # noqa: E402
from tuner.ui.app import create_app  # noqa: E402
from tuner.ui.paths import OutsideRoots, Roots  # noqa: E402
from tuner.ui.toml_text import dumps  # noqa: E402
from ui_server import ui_client  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.fixture()
def project(tmp_path, wan_model):
    from project import make_project

    return make_project(tmp_path / "project", wan_model)


def client_for(root: Path, token: str | None = None) -> TestClient:
    """An app on `root` with a queue that is not polled (no job starts)."""
    from tuner.ui.jobs import JobQueue

    runs = root / "runs"
    queue = JobQueue(runs / "jobs.sqlite", runs)
    return ui_client(create_app([root], runs, token=token, queue=queue))


# ---------------------------------------------------------------- folders the UI may touch


def test_roots_refuse_dotdot_and_symlinks_out(tmp_path):
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    (inside / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text("no")
    os.symlink(outside, inside / "link_out")
    os.symlink(inside / "sub", inside / "link_in")
    roots = Roots([inside])
    assert roots.resolve(inside / "sub") == (inside / "sub").resolve()
    assert roots.resolve("sub") == (inside / "sub").resolve()  # relative: from the first root
    assert roots.resolve(inside / "link_in") == (inside / "sub").resolve()
    for bad in (
        inside / ".." / "outside" / "secret.txt",
        "../outside",
        inside / "link_out" / "secret.txt",
        "/etc",
    ):
        with pytest.raises(OutsideRoots, match="outside the folders"):
            roots.resolve(bad)


def test_requests_outside_the_roots_are_refused(project):
    root = project.parent
    c = client_for(root)
    secret = root.parent / "secret.png"
    secret.write_bytes((root / "data" / "images" / "image_000.png").read_bytes())
    for url, params in (
        ("/file", {"path": str(secret)}),
        ("/thumb", {"path": str(root / ".." / "secret.png")}),
        ("/datasets", {"path": str(root.parent)}),
        ("/runs/new", {"config": "/etc/hostname"}),
    ):
        r = c.get(url, params=params)
        assert r.status_code == 403, (url, r.text)
    os.symlink(secret, root / "data" / "images" / "link.png")
    assert c.get("/file", params={"path": str(root / "data" / "images" / "link.png")}).status_code == 403
    r = c.post("/api/caption", json={"path": str(secret), "text": "x"})
    assert r.status_code == 403 and not (root.parent / "secret.txt").exists()
    assert c.get("/file", params={"path": str(project)}).status_code == 200


# ---------------------------------------------------------------- the access token


def test_token_is_checked_on_every_request(project):
    c = client_for(project.parent, token="s3cret-token")
    for url in ("/jobs", "/static/app.js", "/api/jobs", "/datasets"):
        assert c.get(url).status_code == 401, url
    assert c.get("/jobs", params={"token": "wrong"}).status_code == 401
    r = c.get("/jobs", params={"token": "s3cret-token"}, follow_redirects=False)
    assert r.status_code == 303 and "token" not in r.headers["location"]
    assert "tuner_ui_token" in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]
    assert c.get("/jobs").status_code == 200  # the cookie now
    assert c.get("/static/app.js").status_code == 200
    fresh = client_for(project.parent, token="s3cret-token")
    assert fresh.get("/api/jobs", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
    assert client_for(project.parent).get("/jobs").status_code == 200  # loopback without --token: open


def test_other_sites_cannot_use_a_loopback_server(project):
    c = client_for(project.parent)
    media = str(project.parent / "data" / "images" / "image_000.png")
    r = c.post("/api/caption", json={"path": media, "text": "x"}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "another site" in r.text
    r = c.post("/runs/check", data={}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    r = c.post(
        "/api/caption", json={"path": media, "text": "ok"}, headers={"Origin": "http://127.0.0.1:7860"}
    )
    assert r.status_code == 200
    # a name made to resolve to 127.0.0.1 (DNS rebinding) is not this server's name
    assert c.get("/jobs", headers={"Host": "evil.example:7860"}).status_code == 403
    assert c.get("/jobs", headers={"Host": "localhost:7860"}).status_code == 200


# ---------------------------------------------------------------- datasets


def test_dataset_page_lists_items_thumbnails_and_buckets(project):
    root = project.parent
    images, videos = root / "data" / "images", root / "data" / "videos"
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (images / "broken.txt").write_text("a broken file")
    c = client_for(root)
    page = c.get("/datasets", params={"path": str(images)}).text
    assert page.count('class="item') == 5 and "image_000.png" in page and "broken.png" in page
    assert (images / "image_000.txt").read_text() in page

    # buckets and the failing file, as `tuner data check` plans them at the chosen resolution
    params = {"path": str(images), "check": True, "architecture": "wan", "width": 64, "height": 48}
    page = c.get("/datasets", params=params).text
    spec = folders.folder_specs(images, (64, 48))
    (report,) = check_datasets(ARCHITECTURES["wan"], spec, log=lambda s: None)
    assert {j.bucket_key for j in report.jobs} == {"64x48x1"}
    assert page.count('<span class="bucket">64x48x1</span>') == 4
    assert '<span class="problem">undecodable</span>' in page
    checks, _ = folders.check_folder(images, "wan", (64, 48))
    assert checks[str(images / "broken.png")].problem == "undecodable"
    assert checks[str(images / "image_001.png")].buckets == ("64x48x1",)

    # thumbnails: an image, a video's first frame; a file that does not decode says so
    r = c.get("/thumb", params={"path": str(images / "image_000.png")})
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    r = c.get("/thumb", params={"path": str(videos / "video_000.mp4")})
    assert r.status_code == 200 and r.content[:2] == b"\xff\xd8"
    from io import BytesIO

    import numpy as np
    from PIL import Image

    from tuner.data.media import read_video_frames

    thumb = np.asarray(Image.open(BytesIO(r.content)).convert("RGB"), dtype=np.float32)
    first = read_video_frames(videos / "video_000.mp4", [0])[0].astype(np.float32)
    assert thumb.shape == first.shape and np.abs(thumb - first).mean() < 8  # JPEG's loss only
    r = c.get("/thumb", params={"path": str(images / "broken.png")})
    assert r.status_code == 422 and "broken.png" in r.text


def test_caption_edit_is_atomic_under_concurrent_writers(project):
    images = project.parent / "data" / "images"
    media = images / "image_000.png"
    c = client_for(project.parent)
    r = c.post("/api/caption", json={"path": str(media), "text": "a red circle, edited"})
    assert r.status_code == 200 and (images / "image_000.txt").read_text() == "a red circle, edited"
    r = c.post("/api/caption", json={"path": str(images / "image_000.txt"), "text": "x"})
    assert r.status_code == 400 and "not an image or video" in r.json()["error"]

    # two writers, one long caption each, while a reader checks every version it sees is whole
    texts = ["A" * 200_000, "B" * 300_000]
    seen, stop = set(), threading.Event()

    def write(text):
        for _ in range(25):
            folders.save_caption(media, text)

    def read():
        while not stop.is_set():
            seen.add((images / "image_000.txt").read_text())

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(t,)) for t in texts]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert seen <= {*texts, "a red circle, edited"} and seen & set(texts)
    assert (images / "image_000.txt").read_text() in texts
    assert not [p for p in images.iterdir() if p.name.startswith(".")]  # no temporary left behind


# ---------------------------------------------------------------- the config form


def test_form_shows_every_schema_key():
    from tuner.config.schema import TrainingFile

    views = form.sections()
    assert [s.name for s in views] == list(TrainingFile.__dataclass_fields__)
    assert {s.name for s in views if s.open} == {"model", "data", "network", "train"}
    lr = next(f for s in views for f in s.fields if f.key == "train.learning_rate")
    assert (
        lr.type == "a number"
        and lr.doc.startswith("Peak")
        and lr.range == "> 0, ≤ 10"
        and lr.default == "0.0001"
    )
    sched = next(f for s in views for f in s.fields if f.key == "train.lr_scheduler")
    assert sched.widget == "choice" and "cosine" in sched.choices


def _roundtrip(config: Path, client: TestClient) -> Path:
    values = form.toml_to_form(config.read_text(), config.parent)
    r = client.post("/runs/toml", data={**values, "_name": "round"})
    assert r.status_code == 200 and 'filename="round.toml"' in r.headers["content-disposition"]
    out = config.parent / "downloaded.toml"
    out.write_text(r.text)
    return out


def test_form_roundtrips_to_a_toml_the_cli_loads_unchanged(project, capsys):
    c = client_for(project.parent)
    downloaded = _roundtrip(project, c)
    assert load_config(downloaded).file == load_config(project).file
    from project import run

    code, out = run(capsys, "check", "--config", downloaded)
    assert code == 0 and "ok" in out

    # a preset from examples/: its paths are made absolute, every key survives
    preset = EXAMPLES / "wan21_t2v_lora.toml"
    values = form.toml_to_form(preset.read_text(), preset.parent)
    data = tomllib.loads(form.form_to_toml(values))
    original = tomllib.loads(preset.read_text())
    original["data"]["dataset_config"] = str(EXAMPLES / "wan_dataset.toml")
    assert data == original
    hub = form.toml_to_form(
        '[model]\ntransformer = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"\nvae = "vae.sft"\n', EXAMPLES
    )
    assert hub == {
        "model.transformer": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "model.vae": str(EXAMPLES / "vae.sft"),
    }
    page = c.get("/runs/new", params={"preset": "wan21_t2v_lora"}).text
    assert "a cat walking on a beach at sunset" in page and str(EXAMPLES / "wan_dataset.toml") in page


def test_form_validation_is_tuner_checks_with_did_you_mean(project):
    c = client_for(project.parent)
    values = form.toml_to_form(project.read_text(), project.parent)
    r = c.post("/runs/check", data={**values, "train.lr_scheduler": "cosin"})
    result = r.json()
    assert not result["ok"] and result["key"] == "train.lr_scheduler"
    assert "Did you mean 'cosine'?" in result["message"]
    r = c.post("/runs/check", data={**values, "train.learning_rate": "fast"})
    assert r.json()["key"] == "train.learning_rate" and "expected a number" in r.json()["message"]
    r = c.post("/runs/check", data=values)
    assert r.json()["ok"], r.json()
    # the processes each stage runs as: checked against this machine (no GPU here: CPU processes)
    for bad, says in (("0", "not a whole number"), ("two", "not a whole number"), ("100000", "at most")):
        result = c.post("/runs/check", data={**values, "_processes": bad}).json()
        assert not result["ok"] and result["message"].startswith("processes: ") and says in result["message"]
    assert c.post("/runs/check", data={**values, "_processes": "2"}).json()["ok"]
    r = c.post("/runs", data={**values, "_processes": "0", "_name": "none"})
    assert r.status_code == 400 and "not a whole number" in r.text and 'name="_processes"' in r.text
    # submitting a bad form shows the message beside its key and starts nothing
    r = c.post("/runs", data={**values, "train.lr_scheduler": "cosin", "_name": "bad"})
    assert r.status_code == 400 and "Did you mean &#39;cosine&#39;?" in r.text
    assert c.get("/api/jobs").json() == []


def test_dataset_text_from_a_folder_replaces_the_dataset_file(project):
    root = project.parent
    c = client_for(root)
    page = c.get("/runs/new", params={"dataset": str(root / "data" / "images"), "width": 64, "height": 48})
    dataset = dumps(folders.dataset_toml(root / "data" / "images", (64, 48)))
    assert page.status_code == 200 and str(root / "data" / "images") in page.text
    values = form.toml_to_form(project.read_text(), project.parent)
    assert c.post("/runs/check", data={**values, "_dataset": dataset}).json()["ok"]
    r = c.post("/runs/check", data={**values, "_dataset": dataset.replace("resolution", "resolutoin")})
    assert "Did you mean 'resolution'?" in r.json()["message"]
