"""`tuner ui`'s job and adapter pages through FastAPI's TestClient (the queue is real; no job is started
here: test_ui_browser.py runs one), and the `tuner ui` command itself on all interfaces."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from test_lora_tools import single_file, write_lora  # noqa: E402
from tuner.networks.keys import read_safetensors  # noqa: E402
from tuner.ui import form  # noqa: E402
from tuner.ui.app import create_app  # noqa: E402
from tuner.ui.jobs import JobQueue  # noqa: E402
from ui_server import ui_client  # noqa: E402


@pytest.fixture()
def project(tmp_path, wan_model):
    from project import make_project

    return make_project(tmp_path / "project", wan_model)


def client_for(root, queue, *more_roots) -> TestClient:
    return ui_client(create_app([root, *more_roots], queue.runs_dir, queue=queue))


def test_submit_list_stop_delete_a_job(project, wan_model):
    root = project.parent
    queue = JobQueue(root / "runs" / "jobs.sqlite", root / "runs")  # not polled: jobs stay queued
    c = client_for(root, queue, wan_model)  # the model's folder is a root: a job reads only under them
    values = form.toml_to_form(project.read_text(), project.parent)
    r = c.post("/runs", data={**values, "_name": "first run"}, follow_redirects=False)
    assert r.status_code == 303
    job_id = int(r.headers["location"].rsplit("/", 1)[1])
    job = queue.get(job_id)
    assert job.state == "queued" and (job.run_dir / "config.toml").is_file()
    from tuner.config import load_config

    # the job's config is the form's TOML: the same run as the file it came from
    assert load_config(job.run_dir / "config.toml").file.train == load_config(project).file.train
    assert [j["name"] for j in c.get("/api/jobs").json()] == ["first run"]
    page = c.get(f"/jobs/{job_id}").text
    assert "first run" in page and "queued" in page and 'id="loss-chart"' in page
    assert c.get(f"/api/jobs/{job_id}").json()["log"] == []
    assert c.get(f"/api/jobs/{job_id}/metrics").json() == []
    assert c.get("/api/jobs/999").status_code == 404
    assert c.post(f"/jobs/{job_id}/explode").status_code == 400

    # a dataset TOML from the form goes beside the config, which then names it
    dataset = (root / "dataset.toml").read_text().replace('"data/', f'"{root}/data/')
    r = c.post("/runs", data={**values, "_name": "second", "_dataset": dataset}, follow_redirects=False)
    second = queue.get(int(r.headers["location"].rsplit("/", 1)[1]))
    assert (second.run_dir / "dataset.toml").read_text() == dataset
    assert load_config(second.run_dir / "config.toml").file.data.dataset_config == str(
        second.run_dir / "dataset.toml"
    )

    assert c.post(f"/jobs/{job_id}/resume").status_code == 400  # only stopped or failed jobs resume
    assert c.post(f"/jobs/{job_id}/stop", follow_redirects=False).status_code == 303
    assert queue.get(job_id).state == "stopped"
    assert c.post(f"/jobs/{job_id}/delete", follow_redirects=False).headers["location"] == "/jobs"
    assert not job.run_dir.exists()
    assert [j["id"] for j in c.get("/api/jobs").json()] == [second.id]


def test_adapters_listed_converted_merged_downloaded(project, wan_model):
    root = project.parent
    queue = JobQueue(root / "runs" / "jobs.sqlite", root / "runs")
    job_id = queue.submit(
        "adapters", project.read_text().replace('dataset_config = "', f'dataset_config = "{root}/')
    )
    job = queue.get(job_id)
    adapter = job.output_dir / "demo_lora.safetensors"
    job.output_dir.mkdir(parents=True)
    write_lora(wan_model, adapter, seed=1, rank=4)
    c = client_for(root, queue)

    page = c.get(f"/jobs/{job_id}").text
    assert "demo_lora.safetensors" in page and "rank       4" in page and "format     comfy" in page
    r = c.get("/file", params={"path": str(adapter), "download": True})
    assert r.content == adapter.read_bytes() and "attachment" in r.headers["content-disposition"]

    r = c.post("/api/adapters/convert", json={"path": str(adapter), "to": "kohya"})
    assert r.status_code == 200, r.text
    converted = job.output_dir / "demo_lora-kohya.safetensors"
    assert r.json()["path"] == str(converted) and r.json()["layout"] == "kohya"
    tensors, _ = read_safetensors(converted)
    assert all(k.startswith("lora_unet_") for k in tensors)
    assert c.post("/api/adapters/convert", json={"path": str(adapter), "to": "nope"}).status_code == 400

    model = root / "base.safetensors"
    model.write_bytes(single_file(wan_model).read_bytes())
    out = job.run_dir / "merged.safetensors"
    r = c.post(
        "/api/adapters/merge", json={"model": str(model), "loras": [[str(adapter), 1.0]], "out": str(out)}
    )
    assert r.status_code == 200, r.text
    merged, _ = read_safetensors(out)
    base, _ = read_safetensors(model)
    assert merged.keys() == base.keys() and any(not (merged[k] == base[k]).all() for k in base)
    r = c.post(
        "/api/adapters/merge",
        json={"model": str(model), "loras": [[str(adapter), 1.0]], "out": "/tmp/x.safetensors"},
    )
    assert r.status_code == 403


@pytest.mark.slow
def test_ui_command_on_all_interfaces_requires_a_generated_token(tmp_path):
    from ui_server import LiveServer

    server = LiveServer("--root", str(tmp_path), "--runs", str(tmp_path / "runs"), host="0.0.0.0")
    try:
        assert "?token=" in server.address
        token = server.address.split("?token=")[1]
        assert len(token) >= 24
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(server.url + "/api/jobs")
        assert refused.value.code == 401
        request = urllib.request.Request(
            server.url + "/api/jobs", headers={"Authorization": f"Bearer {token}"}
        )
        assert urllib.request.urlopen(request).read() == b"[]"
    finally:
        server.stop()
