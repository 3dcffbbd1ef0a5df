"""``keye process``: what the processor makes of a message file (``keye chat`` lives in :mod:`keye.demo.chat`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from keye.errors import KeyeInputError


def _default_dir() -> str | None:
    try:
        from keye.hub import tiny_dir

        return str(tiny_dir())
    except Exception:  # the embedded checkpoint is optional; the user then has to name a directory
        return None


def add_commands(subparsers: Any) -> None:
    """Register ``keye process``."""
    p = subparsers.add_parser(
        "process", help="show token counts, sampled frames, slow/fast types and grids for a message JSON file",
        description="Run KeyeProcessor on a JSON file holding one conversation (a list of messages) or a "
        "list of conversations, and print a JSON summary (no pixels).",
    )
    p.add_argument("messages", help="JSON file with messages in the qwen-vl-utils form ('-' for stdin)")
    p.add_argument(
        "--processor", default=None, help="processor / checkpoint directory or hub id (default keye-tiny)"
    )
    p.add_argument("--variant", choices=["preview", "1.5"], default=None,
                   help="model family to process for (default: read from the checkpoint)")
    p.add_argument("--mode", choices=["think", "no_think", "auto"], default=None,
                   help="thinking-mode switch added to the last user turn (default: none, the model's own)")
    p.add_argument("--backend", choices=["pyav", "decord", "torchcodec"], default=None, help="video decoder")
    p.add_argument("--training", action="store_true", help="build labels and count the trained tokens")
    p.set_defaults(func=_process)


def _load_messages(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        return json.loads(text)
    except FileNotFoundError as err:
        raise KeyeInputError("message file not found", path=path) from err
    except (OSError, ValueError) as err:
        raise KeyeInputError(f"cannot read messages as JSON ({err})", path=path) from err


def _summary(proc: Any, batch: Any, for_training: bool) -> dict[str, Any]:
    rows = []
    for r in range(batch["input_ids"].shape[0]):
        row: dict[str, Any] = {
            "tokens": int(batch["attention_mask"][r].sum()),
            "image_tokens": int((batch["input_ids"][r] == proc.image_token_id).sum()),
            "video_tokens": int((batch["input_ids"][r] == proc.video_token_id).sum()),
        }
        if for_training:
            row["trained_tokens"] = int((batch["labels"][r] != -100).sum())
        rows.append(row)
    return {
        "variant": proc.variant,
        "rows": rows,
        "images": [vars(m) for m in batch.image_meta],
        "videos": [m.to_dict() for m in batch.video_meta],
    }


def _process(args: argparse.Namespace) -> int:
    from keye.processing.processor import KeyeProcessor

    where = args.processor or _default_dir()
    if where is None:
        raise KeyeInputError("no --processor given and the embedded keye-tiny checkpoint is not installed")
    proc = KeyeProcessor.from_pretrained(where, variant=args.variant, video_backend=args.backend)
    batch = proc(_load_messages(args.messages), mode=args.mode, for_training=args.training)
    print(json.dumps(_summary(proc, batch, args.training), indent=1, default=str))
    return 0
