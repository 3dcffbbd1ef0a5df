"""Regenerate the README screenshot: serve the demo, ask a bundled example, capture the page.

    .venv/bin/python demo/make_screenshot.py                    # keye-tiny -> docs/demo.png + docs/demo.json
    .venv/bin/python demo/make_screenshot.py --model runs/tiny/final --example 1 --out /tmp/demo.png

Needs a Chromium browser (Debian: apt-get install -y chromium); it is looked for first, before anything loads.
Beside the PNG it writes the figures the page shows (question, answer, token counts, frame captions: what
keye.demo.app.page_figures computes, checked against the captured page's text) and the PNG's SHA-256;
tests/demo/test_readme_screenshot.py recomputes the figures and fails when they are stale.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    """Take the screenshot; returns the exit code (1 with a one-line error on stderr)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="keye-tiny", help="checkpoint to demo (default: keye-tiny)")
    p.add_argument("--example", type=int, default=0, help="which bundled example to ask (default: 0)")
    p.add_argument("--out", default=str(REPO / "docs" / "demo.png"),
                   help="PNG to write; the figures go beside it as .json (default: docs/demo.png)")
    p.add_argument("--width", type=int, default=1280, help="window width in pixels (default: 1280)")
    p.add_argument("--height", type=int, default=1100, help="window height in pixels (default: 1100)")
    args = p.parse_args(argv)

    from keye.demo.screenshot import find_browser
    from keye.errors import KeyeError

    try:
        browser = find_browser()  # before seconds of model loading and a server that would be of no use
    except KeyeError as err:
        print(f"make_screenshot: error: {err}", file=sys.stderr)
        return 1
    try:
        return _take(args, browser)
    except KeyeError as err:
        print(f"make_screenshot: error: {err}", file=sys.stderr)
        return 1


def _take(args: argparse.Namespace, browser: str) -> int:
    from keye.demo.app import build_app, figures_on_page, page_figures, serve
    from keye.demo.engine import ModelHost, quiet_transformers
    from keye.demo.examples import load_examples
    from keye.demo.screenshot import capture
    from keye.errors import KeyeConfigError

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    quiet_transformers()
    examples = load_examples()
    if not 0 <= args.example < len(examples):
        raise KeyeConfigError(f"--example {args.example}: there are {len(examples)} examples (0-{len(examples) - 1})")
    host = ModelHost(args.model, device="cpu").start()
    if not host.wait(600):
        raise KeyeConfigError(f"the model did not load: {host.error}")
    figures = page_figures(host, examples[args.example])
    app = build_app(host)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve(app, port=port, block=False)
    try:
        out, text = capture(f"http://127.0.0.1:{port}/?example={args.example}&ask=1", args.out,
                            wait_for="Generated:", timeout=300, size=(args.width, args.height), browser=browser)
    finally:
        app.close()
    missing = [t for t in figures_on_page(figures) if t not in text]
    if missing:
        raise KeyeConfigError(f"the captured page does not show {missing[0]!r} (the figures recorded beside it)")
    record = {**figures, "png_sha256": hashlib.sha256(Path(out).read_bytes()).hexdigest()}
    figures_file = Path(out).with_suffix(".json")
    figures_file.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(out)
    print(figures_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
