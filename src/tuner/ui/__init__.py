"""`tuner ui`: a local web app that drives the same commands a CLI user runs.

Nothing here trains, caches or converts by itself. Each page calls the library function behind a CLI
command, or hands a config to the job queue, which runs the CLI commands as subprocesses:

- `paths.py`: the folders the UI may touch (`--root`); every path a request names is resolved here.
- `auth.py`: the access token a non-loopback server requires; requests from other sites refused.
- `folders.py`: a dataset folder's items, thumbnails, caption edits, and `tuner data check`'s buckets.
- `form.py`: the new-run form, generated from the config schema; validated by `load_config`.
- `toml_text.py`: config values written back as TOML that the CLI reads unchanged.
- `jobs.py`, `job_store.py`, `runner.py`: the job queue (SQLite) and the process that drives each job
  through cache latents → cache text → train with `accelerate launch`.
- `app.py` and `routes_*.py`: the FastAPI application; `server.py`: the `tuner ui` command.

Pages are rendered on the server (Jinja2); `static/app.js` is our own small script for live updates
(log tail, the loss chart drawn as SVG, samples) and in-place caption edits.
"""
