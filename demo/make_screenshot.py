"""Regenerate the README screenshot: serve the demo, ask a bundled example, capture the page.

    .venv/bin/python demo/make_screenshot.py                    # keye-tiny -> docs/demo.png
    .venv/bin/python demo/make_screenshot.py --model runs/tiny/final --example 1 --out /tmp/demo.png

Needs a Chromium browser (Debian: apt-get install -y chromium).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from keye.demo.app import build_app, serve
from keye.demo.engine import ModelHost, quiet_transformers
from keye.demo.screenshot import screenshot

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="keye-tiny")
    p.add_argument("--example", type=int, default=0, help="which bundled example to ask")
    p.add_argument("--out", default=str(REPO / "docs" / "demo.png"))
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=1100)
    args = p.parse_args()
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    quiet_transformers()
    host = ModelHost(args.model, device="cpu").start()
    if not host.wait(600):
        print(f"make_screenshot: error: {host.error}", file=sys.stderr)
        return 1
    app = build_app(host)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve(app, port=port, block=False)
    try:
        out = screenshot(
            f"http://127.0.0.1:{port}/?example={args.example}&ask=1",
            args.out,
            wait_for="Generated:",
            timeout=300,
            size=(args.width, args.height),
        )
    finally:
        app.close()
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
