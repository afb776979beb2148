"""`tuner ui`: serve the web app (needs the `ui` extra: `pip install 'tuner[ui]'`). Its arguments are
parsed in `tuner.cli`, so that no other command imports the UI.

    tuner ui --root /data --root /models            # http://127.0.0.1:7860/
    tuner ui --host 0.0.0.0 --root /data             # prints http://HOST:7860/?token=... (required)

On the loopback interface the server is only for this machine's user, and no token is asked unless
`--token` gives one. Anywhere else a token is required: `--token`, or one generated and printed. An
empty `--token` is an error (it would let anyone in).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tuner.errors import ConfigError


def serve(args: argparse.Namespace) -> None:
    """Run `tuner ui` with the arguments `tuner.cli` parsed (see the module docstring)."""
    try:
        import uvicorn

        from tuner.ui.app import create_app
    except ImportError as e:
        raise ConfigError(
            f"tuner ui needs the ui extra ({e.name} is missing): pip install 'tuner[ui]'"
        ) from None
    from tuner.ui.auth import is_loopback, new_token

    token = args.token
    if token is not None and not token.strip():
        raise ConfigError(
            "--token: empty; an empty access token would let anyone in. Give one (at least 16 characters), "
            "or leave --token out to have one generated."
        )
    if token is not None and len(token) < 16:
        raise ConfigError("--token: too short to guess-proof; give at least 16 characters, or leave it out.")
    if token is None and not is_loopback(args.host):
        token = new_token()
    roots = args.root or ["."]
    for root in roots:
        if not Path(root).expanduser().is_dir():
            raise ConfigError(f"--root {root}: not a folder.")
    app = create_app(roots, args.runs, token=token)
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    address = f"http://{shown}:{args.port}/" + (f"?token={token}" if token else "")
    print(f"tuner ui: {address}", flush=True)
    print(f"  folders it may use: {', '.join(str(r) for r in app.state.ui.roots.folders)}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
