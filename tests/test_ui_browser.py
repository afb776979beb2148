"""`tuner ui` in a real browser: headless Debian chromium, driven by playwright, against a live server on
a loopback port, on the tiny demo project. One flow, in the order a user takes it: open the address with
its token, look at a dataset (buckets, a caption edited in place), fill the new-run form with a typo and
see the did-you-mean, launch the run, watch the loss chart grow and a sample appear, stop it and resume
it until it is done, then its adapters and the compare page. Each page's screenshot goes to the test's
temporary folder, or where TUNER_UI_SCREENSHOTS says: `TUNER_UI_SCREENSHOTS=docs/ui pytest
tests/test_ui_browser.py` refreshes the ones the README shows (a plain `make test` leaves them alone)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
playwright = pytest.importorskip("playwright.sync_api")

from project import make_project  # noqa: E402
from ui_server import LiveServer  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

if not os.path.exists(CHROMIUM):
    if os.environ.get("CI"):
        raise RuntimeError("chromium is missing: `make test` installs it (apt-get install chromium)")
    pytest.skip("no chromium: `make test` installs it (apt-get install chromium)", allow_module_level=True)

pytestmark = pytest.mark.slow


@pytest.fixture()
def project(tmp_path, wan_model):
    # far more steps than the test waits for (the tiny model trains ~25 steps a second): it is stopped
    config = make_project(tmp_path / "project", wan_model, steps=100_000)
    text = config.read_text().replace("every_n_steps = 25", "every_n_steps = 100")
    text += (
        '\n[sample]\nprompts = ["a red circle on a black background"]\nevery_n_steps = 100\nwidth = 64\n'
        "height = 48\nsteps = 2\nguidance = 1.0\n\n[log]\ntensorboard = false\n"
    )
    text = text.replace("[train]\n", "[train]\nvalidate_every_n_steps = 100\n")
    config.write_text(text)
    dataset = config.parent / "dataset.toml"  # the images held out as well: a validation loss to draw
    dataset.write_text(
        dataset.read_text() + '\n[[datasets]]\nimage_directory = "data/images"\nvalidation = true\n'
    )
    return config


@pytest.fixture()
def page():
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1360, "height": 900})
        page.set_default_timeout(30_000)
        yield page
        browser.close()


def shots_dir(tmp_path: Path) -> Path:
    """Where the screenshots go: TUNER_UI_SCREENSHOTS when set, else under the test's `tmp_path`."""
    return Path(os.environ.get("TUNER_UI_SCREENSHOTS") or tmp_path / "screenshots")


def shot(page, folder: Path, name: str, full_page: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / f"{name}.png"), full_page=full_page)


def wait_state(page, *states: str, timeout: float = 300_000) -> str:
    page.wait_for_function(
        "states => states.includes(document.getElementById('job-state').textContent)", arg=list(states),
        timeout=timeout,
    )  # fmt: skip
    return page.inner_text("#job-state")


def chart_points(page) -> int:
    return page.evaluate(
        "() => { const l = document.querySelector('#loss-chart polyline');"
        " return l ? l.getAttribute('points').split(' ').length : 0; }"
    )


def test_browser_flow(project, page, wan_model, tmp_path):
    root, shots = project.parent, shots_dir(tmp_path)
    server = LiveServer(
        "--root", str(root), "--root", str(wan_model), "--runs", str(root / "runs"), "--token", "browser-test-token"
    )  # fmt: skip
    try:
        # the printed address carries the token; the cookie it sets lets every later page in
        assert server.address.endswith("?token=browser-test-token")
        page.goto(server.url + "/jobs")
        assert "needs its access token" in page.content()
        page.goto(server.address)
        assert page.url.endswith("/jobs") and "Jobs" in page.inner_text("h1")

        # ---- a dataset: bucket check at 64x48 for wan, a caption edited in place
        images = root / "data" / "images"
        page.goto(f"{server.url}/datasets?path={images}")
        page.select_option("select[name=architecture]", "wan")
        page.fill("input[name=width]", "64")
        page.fill("input[name=height]", "48")
        page.click("#check-form button[type=submit]")
        page.wait_for_selector("#check-report")
        assert page.locator(".bucket", has_text="64x48x1").count() == 4
        item = page.locator(f'.item[data-path="{images / "image_002.png"}"]')
        item.locator("textarea").fill("a yellow square, edited in the browser")
        item.locator(".save-caption").click()
        item.locator(".saved", has_text="saved").wait_for()
        assert (images / "image_002.txt").read_text() == "a yellow square, edited in the browser"
        page.wait_for_function("() => [...document.images].every(i => i.complete && i.naturalWidth > 0)")
        shot(page, shots, "datasets")

        # ---- the new-run form: the demo's config, a typo in a key's value, the did-you-mean inline
        page.goto(f"{server.url}/runs/new?config={project}")
        page.fill("input[name=_name]", "browser-demo")
        assert page.input_value("input[name=_processes]") == "1"  # one process per stage unless asked
        page.fill("input[name=_processes]", "0")
        page.click("#check-button")
        page.locator("#check.error", has_text="processes: 0 is not a whole number").wait_for()
        page.fill("input[name=_processes]", "1")
        page.fill("input[name='train.lr_scheduler']", "cosin")
        page.click("#check-button")
        field_error = page.locator('.field[data-key="train.lr_scheduler"] .field-error')
        field_error.filter(has_text="Did you mean 'cosine'?").wait_for()
        page.locator('.field[data-key="train.optimizer"]').scroll_into_view_if_needed()
        shot(page, shots, "new_run", full_page=False)  # the form is long: the part around the message
        page.fill("input[name='train.lr_scheduler']", "constant")
        page.click("#check-button")
        page.locator("#check.ok").wait_for()

        # ---- launch it; watch the log, the loss chart grow, a sample appear
        page.click("#start-run")
        page.wait_for_url(re.compile(r"/jobs/\d+$"))
        wait_state(page, "running")
        page.wait_for_function("() => document.querySelector('#loss-chart polyline')", timeout=300_000)
        assert re.fullmatch(r"rank 0 \(pid \d+\): running", page.inner_text("#job-ranks"))
        first = chart_points(page)
        page.wait_for_function(
            f"() => document.querySelector('#loss-chart polyline').getAttribute('points').split(' ').length > {first}",
            timeout=120_000,
        )  # fmt: skip
        page.wait_for_selector("#samples img", timeout=120_000)
        assert "a red circle on a black background" in page.inner_text("#samples")
        assert "train" in page.inner_text("#log")
        assert page.inner_text("#stat-loss") != "–" and page.inner_text("#stat-eta") != "–"
        page.wait_for_function("() => document.getElementById('stat-val').textContent !== '–'")
        assert page.locator("#loss-chart circle").count() >= 1  # the validation losses
        assert page.locator("#loss-chart polyline.smoothed").count() == 1  # the trend beside the raw loss

        # ---- stop (the trainer saves a resumable state), resume: it goes on from there; stop again
        page.click("button.action-stop")
        assert wait_state(page, "stopped", "failed") == "stopped", page.inner_text("#job-error")
        page.wait_for_timeout(2500)  # the last metrics poll
        stopped_at = int(page.inner_text("#stat-step"))
        assert page.inner_text("#stat-eta") == "–"  # a stopped job has no ETA
        samples = page.locator("#samples img").count()
        page.click("button.action-resume")
        wait_state(page, "running")
        page.wait_for_function(
            f"() => +document.getElementById('stat-step').textContent > {stopped_at + 150}", timeout=300_000
        )
        assert "--resume latest" in page.inner_text("#log")
        page.wait_for_function(f"() => document.querySelectorAll('#samples img').length > {samples}")
        page.click("button.action-stop")
        assert wait_state(page, "stopped", "failed") == "stopped", page.inner_text("#job-error")
        page.reload()  # adapters are listed with `tuner lora info`'s content
        assert (
            page.locator(".adapter").count() >= 1 and "rank" in page.locator(".adapter pre").last.inner_text()
        )
        page.wait_for_selector("#samples img")
        shot(page, shots, "job")

        # ---- one prompt across steps
        page.click("text=compare a prompt across steps")
        page.wait_for_selector(".compare img")
        steps = page.locator(".compare figcaption").all_inner_texts()
        assert len(steps) >= 2 and len(set(steps)) == len(steps), steps
        shot(page, shots, "compare")
        page.goto(server.url + "/jobs")
        shot(page, shots, "jobs")
    finally:
        server.stop()
