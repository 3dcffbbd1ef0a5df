"""``keye serve``: start the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_commands(subparsers: Any) -> None:
    """Register ``keye serve``."""
    from keye.demo.engine import add_model_arguments

    s = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models)",
        description="Serve a Keye checkpoint (default: the embedded keye-tiny, offline) behind OpenAI's chat "
        "completions API, with images and videos, streaming, thinking modes and batched concurrent requests.",
    )
    add_model_arguments(s)
    s.add_argument("--served-model-name", default=None, help="model id reported by /v1/models (default: --model)")
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (an error if it is in use)")
    s.add_argument("--dtype", default="auto",
                   help="weights dtype on GPU (default: auto, the checkpoint's; CPU always runs float32)")
    s.add_argument("--max-batch-size", type=int, default=8, help="rows decoded together (n choices count as n rows)")
    s.add_argument("--batch-window-ms", type=float, default=10.0, help="wait this long for more requests to batch")
    s.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more are answered 429")
    s.add_argument("--max-tokens", type=int, default=2048, help="largest max_tokens a request may ask for")
    s.add_argument("--max-frames", type=int, default=64, help="most frames sampled from one video")
    s.add_argument("--max-upload-mb", type=float, default=32.0, help="largest media item (download or data: URI)")
    s.add_argument("--fetch-timeout", type=float, default=10.0, help="seconds allowed for one media download")
    s.add_argument("--allow-local-media", action="append", default=[], metavar="DIR",
                   help="let requests name local files under DIR (repeatable; default: local paths refused)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs each request)")
    s.set_defaults(func=_serve)


def build_server(args: argparse.Namespace):
    """Load the model and processor named by ``args`` and return a :class:`~keye.serve.app.KeyeServer`."""
    from keye.demo.engine import ModelHost, quiet_transformers
    from keye.serve.app import KeyeServer, ServerConfig
    from keye.serve.engine import EngineConfig
    from keye.serve.media import MediaPolicy
    from keye.serve.protocol import ServerLimits

    quiet_transformers()
    host = ModelHost(args.model, device=args.device, dtype=args.dtype).load_now()
    config = ServerConfig(
        model_name=args.served_model_name or args.model,
        engine=EngineConfig(max_batch_size=args.max_batch_size, batch_window_ms=args.batch_window_ms,
                            max_queue=args.max_queue),
        limits=ServerLimits(max_tokens=args.max_tokens, default_max_tokens=min(256, args.max_tokens),
                            max_frames=args.max_frames),
        media=MediaPolicy(max_bytes=int(args.max_upload_mb * 1024 * 1024), timeout=args.fetch_timeout,
                          allowed_dirs=list(args.allow_local_media)),
        max_body_bytes=int(args.max_upload_mb * 1.5 * 1024 * 1024) + (1 << 20),
    )
    return KeyeServer(host.model, host.processor, config)


def _serve(args: argparse.Namespace) -> int:
    from keye.demo.net import bind_port

    # The port first: a busy one is reported before seconds of model loading, and nothing can take it since.
    sock = bind_port(args.host, args.port)
    try:
        from keye.serve.app import serve

        server = build_server(args)
        port = sock.getsockname()[1]
        print(f"keye serve: {server.config.model_name} on http://{args.host}:{port}/v1", file=sys.stderr, flush=True)
        serve(server, host=args.host, port=port, log_level=args.log_level, sock=sock)
    finally:
        sock.close()
    return 0
