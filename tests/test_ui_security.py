"""`tuner ui` safe to leave running (issue 28): one test per item of the issue, each failing on the UI as it
was before. The token cannot be skipped, no file under a root runs as a page (checked in chromium), a job
names nothing outside the roots and no code, bad requests get a 4xx with one line, and the form's
defaults, the caption command offline and the per-architecture form."""

from __future__ import annotations

import os
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from PIL import Image  # noqa: E402

from tuner.cli import main as tuner  # noqa: E402
from tuner.errors import ConfigError  # noqa: E402
from tuner.ui import form  # noqa: E402
from tuner.ui.app import create_app  # noqa: E402
from tuner.ui.jobs import JobQueue  # noqa: E402
from ui_server import LiveServer, ui_client  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def image_folder(folder: Path, count: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (32, 32), (40 * i, 90, 200)).save(folder / f"img_{i}.png")
        (folder / f"img_{i}.txt").write_text(f"caption {i}")
    return folder


def client(*roots: Path, runs: Path | None = None, queue: JobQueue | None = None, **kw):
    runs = runs or roots[0] / "runs"
    queue = queue or JobQueue(runs / "jobs.sqlite", runs)  # not polled: no job starts by itself
    return ui_client(create_app(list(roots), runs, queue=queue, **kw))


@pytest.fixture()
def browser_page():
    playwright = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip("no chromium: `make test` installs it (apt-get install chromium)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        page.set_default_timeout(30_000)
        yield page
        browser.close()


# ---------------------------------------------------------------- 1: no way around the token


def test_1_no_server_beyond_loopback_without_a_token_and_every_post_needs_csrf(tmp_path, monkeypatch, capsys):
    import uvicorn

    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(kw))
    args = ["ui", "--root", str(tmp_path), "--runs", str(tmp_path / "runs"), "--host", "0.0.0.0"]
    assert tuner([*args, "--token", ""]) == 2 and not served
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--token" in err and "empty" in err
    assert tuner([*args, "--token", "   "]) == 2 and not served
    with pytest.raises(ConfigError, match="empty"):
        create_app([tmp_path], tmp_path / "runs", token="")
    assert tuner(args) == 0 and len(served) == 1  # no --token: one is generated and printed
    assert "?token=" in capsys.readouterr().out

    # a POST needs the session's CSRF token besides a matching Origin (or none)
    images = image_folder(tmp_path / "images")
    c = client(tmp_path)
    body = {"path": str(images / "img_0.png"), "text": "changed"}
    no_csrf = {"X-CSRF-Token": ""}
    assert c.post("/api/caption", json=body, headers=no_csrf).status_code == 403
    r = c.post("/api/caption", json=body, headers={**no_csrf, "Origin": "http://127.0.0.1:7860"})
    assert r.status_code == 403 and "CSRF" in r.json()["error"]
    assert c.post("/api/caption", json=body, headers={"X-CSRF-Token": "x" * 43}).status_code == 403
    assert (images / "img_0.txt").read_text() == "caption 0"
    assert c.post("/api/caption", json=body).status_code == 200  # the page's own token
    assert (images / "img_0.txt").read_text() == "changed"


# ---------------------------------------------------------------- 2: nothing under a root runs as a page


def test_2_files_under_a_root_never_run_in_the_browser(tmp_path, browser_page):
    page = browser_page
    images = image_folder(tmp_path / "data")
    target = images / "img_0.png"
    script = (
        "fetch('/api/caption', {method: 'POST', headers: {'Content-Type': 'application/json'}, "
        f"body: JSON.stringify({{path: {str(target)!r}, text: 'rewritten by a dataset page'}})}})"
    )
    (images / "readme.html").write_text(f"<html><body><h1>hi</h1><script>{script}</script></body></html>")
    (images / "logo.svg").write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg"><script>{script}</script><rect width="9" height="9"/></svg>'
    )
    server = LiveServer("--root", str(tmp_path), "--runs", str(tmp_path / "runs"), "--token", "t" * 24)
    try:
        page.goto(server.address)  # the token cookie, as a user has it
        for name in ("readme.html", "logo.svg"):
            url = f"{server.url}/file?path={images / name}"
            try:
                page.goto(url)
            except Exception as e:  # chromium saves an attachment instead of showing it
                assert "Download" in str(e), e
            page.wait_for_timeout(1500)
            assert target.with_suffix(".txt").read_text() == "caption 0", name
            request = urllib.request.Request(url, headers={"Authorization": "Bearer " + "t" * 24})
            with urllib.request.urlopen(request) as r:
                assert r.headers["Content-Type"] == "application/octet-stream"
                assert r.headers["Content-Disposition"].startswith("attachment;")
                assert r.headers["X-Content-Type-Options"] == "nosniff"
                assert "sandbox" in r.headers["Content-Security-Policy"]
        # every page has a strict CSP (no inline script), and the pages still work under it
        page.goto(f"{server.url}/datasets?path={images}")
        item = page.locator(f'.item[data-path="{images / "img_1.png"}"]')
        item.locator("textarea").fill("edited in place")
        item.locator(".save-caption").click()
        item.locator(".saved", has_text="saved").wait_for()
        assert (images / "img_1.txt").read_text() == "edited in place"
        with urllib.request.urlopen(
            urllib.request.Request(f"{server.url}/jobs", headers={"Authorization": "Bearer " + "t" * 24})
        ) as r:
            assert "script-src 'self'" in r.headers["Content-Security-Policy"]
            assert "unsafe-inline" not in r.headers["Content-Security-Policy"]
    finally:
        server.stop()


# ---------------------------------------------------------------- 3: a job names nothing outside the roots


def _job_form(root: Path, model: Path, **changes: str) -> dict[str, str]:
    from project import make_project

    config = make_project(root, model)
    values = form.toml_to_form(config.read_text(), config.parent)
    return {**values, "_name": "job", **changes}


def test_3_job_paths_inside_the_roots_and_no_code_references(tmp_path, wan_model):
    root, outside = tmp_path / "project", tmp_path / "elsewhere"
    values = _job_form(root, wan_model)
    runs = root / "runs"
    queue = JobQueue(runs / "jobs.sqlite", runs)
    c = client(root, wan_model, runs=runs, queue=queue)
    dataset = (root / "dataset.toml").read_text().replace('"data/', f'"{root}/data/')

    refused = {
        "save.output_dir": {**values, "save.output_dir": str(outside / "out")},
        "cache_directory": {**values, "_dataset": dataset + f'\ncache_directory = "{outside}/cache"\n'},
        "image_directory": {**values, "_dataset": dataset.replace(f"{root}/data/images", str(outside))},
        "model.vae": {**values, "model.vae": str(outside / "vae.safetensors")},
    }
    outside.mkdir()
    for key, data in refused.items():
        r = c.post("/runs", data=data, follow_redirects=False)
        assert r.status_code == 403 and "outside the folders" in r.text, (key, r.status_code)
    assert queue.list() == [] and list(outside.iterdir()) == [] and list(runs.glob("0*")) == []

    # checked again when the job starts: a dataset file changed in between fails the job, runs nothing
    r = c.post("/runs", data={**values, "_dataset": dataset}, follow_redirects=False)
    assert r.status_code == 303, r.text
    job = queue.list()[0]
    moved = (job.run_dir / "dataset.toml").read_text() + f'\ncache_directory = "{outside}/cache"\n'
    (job.run_dir / "dataset.toml").write_text(moved)
    queue.start(job.id)
    job = queue.get(job.id)
    assert job.state == "failed" and "outside the folders" in job.error and job.pid is None
    assert not (job.run_dir / "job.log").exists() and list(outside.iterdir()) == []

    # code references and numbers beyond the UI's bounds, at check time and at submit
    for key, text in (
        ("train.optimizer", "os.system"),
        ("train.max_steps", str(10**26)),
        ("network.rank", str(10**8)),
    ):
        result = c.post("/runs/check", data={**values, key: text}).json()
        assert not result["ok"] and result["key"] == key, result
        assert c.post("/runs", data={**values, key: text}).status_code == 400
    assert len(queue.list()) == 1
    rank = next(f for s in form.sections() for f in s.fields if f.key == "network.rank")
    assert "≤ 1024" in rank.range  # the bound is shown beside the key


# ---------------------------------------------------------------- 4: a caption beside a root


def test_4_caption_of_a_root_folder_of_frames_is_not_written_outside(tmp_path):
    frames = image_folder(tmp_path / "clip", count=3)  # a folder of frames is one video item
    c = client(frames, runs=tmp_path / "runs_root" / "runs")
    r = c.post("/api/caption", json={"path": str(frames), "text": "a clip"})
    assert r.status_code == 403 and "outside" in r.json()["error"]
    assert not (tmp_path / "clip.txt").exists()


# ---------------------------------------------------------------- 5: bad requests get 4xx, one line


def test_5_bad_requests_get_a_4xx_with_one_line(tmp_path):
    images = image_folder(tmp_path / "images")
    c = client(tmp_path)
    for url, params, status in (
        ("/api/jobs/99999999999999999999", {}, 404),
        ("/jobs/99999999999999999999", {}, 404),
        ("/api/jobs/-1", {}, 404),
        ("/thumb", {"path": str(images / "missing.png")}, 404),
        ("/thumb", {"path": str(images) + "/\0x.png"}, 400),
        ("/file", {"path": "a\0b"}, 400),
        ("/file", {"path": str(images / ("x" * 5000))}, 400),
        ("/datasets", {"path": str(images), "width": "0"}, 400),
        ("/runs/new", {"config": str(images / "img_0.txt")}, 400),
    ):
        r = c.get(url, params=params)
        assert r.status_code == status, (url, params, r.status_code, r.text[:200])
        message = (
            r.json()["error"]
            if url.startswith("/api/")
            else re.search(r'id="error-message">(.*?)<', r.text)[1]
        )
        assert message and "\n" not in message, (url, message)

    # a huge bucket check is refused at once, not planned for minutes
    start = time.monotonic()
    r = c.get("/datasets", params={"path": str(images), "width": 10**8, "height": 10**8, "check": "true"})
    assert r.status_code == 400 and "width" in r.text and time.monotonic() - start < 10

    # job names that would break the download header
    for name, fallback in (
        ("evil\r\nSet-Cookie: a=b", "evil Set-Cookie_ a_b.toml"),
        ('my "run"', "my _run_.toml"),
    ):
        r = c.post("/runs/toml", data={"_name": name, "model.architecture": "wan"})
        assert r.status_code == 200 and "a=b" not in r.headers.get("set-cookie", "")
        disposition = r.headers["content-disposition"]
        assert "\r" not in disposition and "\n" not in disposition
        assert disposition.startswith(f'attachment; filename="{fallback}"; filename*=UTF-8'), disposition

    # bodies are bounded
    r = c.post("/api/caption", content=b"x" * (9 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


# ---------------------------------------------------------------- 6: defaults and the cosmetic items


def test_6_save_defaults_from_the_run_length_and_the_cosmetic_items(tmp_path):
    c = client(tmp_path)
    page = c.get("/runs/new").text
    assert (
        "**required**" not in page
        and 'placeholder="&#34;&#34;"' not in page
        and 'placeholder="""' not in page
    )
    values = dict(re.findall(r'<input id="(save\.[a-z_]+)" name="[^"]+" value="([^"]*)"', page))
    assert values["save.keep_last"] == "3" and values["save.every_n_steps"] == "auto"
    text = form.form_to_toml({**values, "model.architecture": "wan", "train.max_steps": "400"})
    assert "every_n_steps = 40" in text and "every_n_epochs = 0" in text and "keep_last = 3" in text
    text = form.form_to_toml({**values, "model.architecture": "wan", "train.epochs": "50"})
    assert "every_n_epochs = 5" in text and "every_n_steps" not in text

    assert c.get("/favicon.ico").headers["content-type"].startswith("image/svg+xml")
    r = c.get("/jobs", headers={"Host": "evil.example:7860"})
    assert (
        r.status_code == 403
        and r.headers["content-type"].startswith("text/html")
        and "<h1>403</h1>" in r.text
    )

    # the browser test writes its screenshots over the tracked docs/ui/ only when asked
    import test_ui_browser

    assert not test_ui_browser.shots_dir(tmp_path).is_relative_to(Path(__file__).parents[1] / "docs")


# ---------------------------------------------------------------- 7: tuner caption offline


def test_7_caption_offline_says_in_one_line_what_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    image_folder(tmp_path / "images")
    code = tuner(
        ["caption", str(tmp_path / "images"), "--model", "tuner-test/not-cached-vlm", "--device", "cpu"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err, err
    assert "hf download tuner-test/not-cached-vlm" in err


# ---------------------------------------------------------------- 8: the form asks for what the model uses


def test_8_form_asks_for_what_the_architecture_uses(tmp_path, browser_page):
    from tuner.ui.components import downloads, model_keys

    wan = model_keys("wan")
    assert {"model.transformer", "model.vae", "model.text_encoder", "model.tokenizer"} <= set(wan)
    for unused in ("transformer_2", "expert", "boundary", "text_encoder_3", "text_encoder_4", "tokenizer_4",
                   "image_encoder"):  # fmt: skip
        assert f"model.{unused}" not in wan
    assert {"model.transformer_2", "model.expert", "model.boundary"} <= set(model_keys("wan22_t2v"))
    assert "model.text_encoder_4" in model_keys("hidream") and "model.image_encoder" in model_keys("wan_i2v")
    assert "model.image_encoder" in model_keys("framepack_1f")
    assert "tuner download wan 1.3B --to DIR --comfy" in [d["command"] for d in downloads("wan")]

    # the file picker lists the roots only
    image_folder(tmp_path / "images")
    c = client(tmp_path)
    listing = c.get("/api/browse", params={"path": str(tmp_path / "images")}).json()
    assert {e["name"] for e in listing["entries"]} >= {"img_0.png", "img_1.txt"}
    assert c.get("/api/browse", params={"path": "/etc"}).status_code == 403
    assert [e["path"] for e in c.get("/api/browse").json()["entries"]][0] == str(tmp_path)

    # in the browser: simple keys first, the rest under "advanced"; only the chosen model's components
    server = LiveServer("--root", str(tmp_path), "--runs", str(tmp_path / "runs"))
    try:
        page = browser_page
        page.goto(server.url + "/runs/new")
        assert page.locator("#advanced").get_attribute("open") is None
        assert page.locator('.basics .field[data-key="train.learning_rate"]').is_visible()
        assert not page.locator('.field[data-key="train.max_grad_norm"]').is_visible()
        page.select_option("select[name='model.architecture']", "wan")
        for key in ("transformer_2", "expert", "text_encoder_4", "image_encoder"):
            assert page.locator(f'.field[data-key="model.{key}"]').is_hidden(), key
        assert page.locator('.field[data-key="model.text_encoder"]').is_visible()
        assert "tuner download wan 1.3B" in page.inner_text("#downloads")
        page.select_option("select[name='model.architecture']", "wan22_t2v")
        assert page.locator('.field[data-key="model.transformer_2"]').is_visible()
        # the picker: browse into the images, pick a file into the key
        page.click('.pick[data-for="data.dataset_config"]')
        page.locator(f'.picker-entry[data-path="{tmp_path}"]').click()
        page.locator(f'.picker-entry[data-path="{tmp_path / "images"}"]').click()
        page.locator(f'.picker-entry[data-path="{tmp_path / "images" / "img_0.txt"}"]').click()
        assert page.input_value("input[name='data.dataset_config']") == str(tmp_path / "images" / "img_0.txt")
    finally:
        server.stop()
