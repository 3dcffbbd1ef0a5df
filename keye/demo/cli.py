"""``keye demo`` (the Gradio video Q&A app) and ``keye chat`` (the same, in the terminal)."""

from __future__ import annotations

import argparse
from typing import Any

from keye.demo.chat import add_chat_parser
from keye.demo.engine import add_model_arguments


def add_commands(subparsers: Any) -> None:
    """Register ``keye demo`` and ``keye chat``."""
    d = subparsers.add_parser("demo", help="start the Gradio video Q&A demo (default model: the embedded keye-tiny)",
                              description="Serve a web page to upload a video or images, ask questions and watch "
                              "the answer stream, with the sampled frames, their slow/fast types and token counts.")
    add_model_arguments(d)
    d.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for all)")
    d.add_argument("--port", type=int, default=7860, help="port to listen on (an error if it is in use)")
    d.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    d.add_argument("--max-video-seconds", type=float, default=600.0, help="refuse longer uploads")
    d.add_argument("--queue-size", type=int, default=32, help="requests that may wait in the queue")
    d.set_defaults(func=_demo)
    add_chat_parser(subparsers)


def _demo(args: argparse.Namespace) -> int:
    from keye.demo.app import launch

    launch(model=args.model, host=args.host, port=args.port, share=args.share, device=args.device,
           max_video_seconds=args.max_video_seconds, queue_size=args.queue_size)
    return 0
