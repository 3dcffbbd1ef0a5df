"""``keye chat``: ask a checkpoint about videos / images from the terminal, the answer streamed as it is
generated. With a question: one answer, then exit. Without one: an interactive multi-turn chat about the
same media (``/reset`` forgets earlier turns, ``/exit`` or Ctrl-D quits). After each answer a line says
which mode the model chose and how many tokens it spent (``[mode: direct · 7 tokens]``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from keye.demo.engine import ModelHost, add_model_arguments, quiet_transformers
from keye.demo.session import MODES, ChatSession, SamplingSettings, VideoSettings, split_partial, stream_reply
from keye.errors import KeyeError, KeyeInputError

_DIM, _RESET = "\033[2m", "\033[0m"


class MediaAction(argparse.Action):
    """``--video FILE`` / ``--image FILE``: appends FILE to ``args.video`` / ``args.image`` and
    ``(kind, FILE)`` to ``args.media``, which keeps the command line's order across both options (the
    model is given the media in that order, and each file is checked as the kind it was given as)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: str | None = None):
        # copies: argparse shares the default list between parses
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values])
        namespace.media = [*(getattr(namespace, "media", None) or []), (self.dest, values)]


def add_chat_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``keye chat`` on ``subparsers`` and return its parser."""
    c = subparsers.add_parser(
        "chat", help="ask a Keye-VL checkpoint about videos / images (streamed; interactive without a question)",
        description="Stream a Keye-VL answer to a question about videos and images. Without a question, "
        "start an interactive multi-turn chat about the same media.",
    )
    c.add_argument("text", nargs="?", default=None, help="the question (omit for an interactive chat)")
    add_model_arguments(c)
    c.add_argument("--video", action=MediaAction, default=[], metavar="FILE",
                   help="a video file (repeatable); media go to the model in the order given")
    c.add_argument("--image", action=MediaAction, default=[], metavar="FILE",
                   help="an image file (repeatable); media go to the model in the order given")
    c.set_defaults(media=[])
    c.add_argument(
        "--mode", choices=list(MODES), default=None, help="thinking mode (default: the model's own)"
    )
    g = c.add_argument_group("video sampling")
    g.add_argument(
        "--fps", type=float, default=None, help="frames sampled per second (default: checkpoint's, else 2)"
    )
    g.add_argument(
        "--max-frames", type=int, default=None, help="cap on sampled frames (default: checkpoint's)"
    )
    g.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="visual tokens per video (default: checkpoint's, else 65536)",
    )
    g.add_argument("--no-slow-fast", action="store_true", help="encode every frame at full size (1.5)")
    g.add_argument("--similarity", type=float, default=None, help="slow/fast similarity threshold, 0-1 (default: checkpoint's, else 0.9)")
    s = c.add_argument_group("decoding (greedy unless --sample)")
    s.add_argument("--max-new-tokens", type=int, default=512, help="answer budget in tokens")
    s.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    s.add_argument("--temperature", type=float, default=0.7,
                   help="with --sample: softmax temperature (> 0; lower is more deterministic)")
    s.add_argument("--top-p", type=float, default=0.9,
                   help="with --sample: keep the smallest set of tokens whose probability reaches this, in (0, 1]")
    s.add_argument("--top-k", type=int, default=50, help="with --sample: keep the k likeliest tokens (0: all)")
    s.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalise tokens already in the text: their positive scores are divided by this, negative "
                        "ones multiplied (1: off; applies to greedy decoding too)")
    s.add_argument("--seed", type=int, default=None, help="torch seed set before sampling (default: unseeded)")
    c.add_argument("--max-video-seconds", type=float, default=None, help="refuse longer videos (default: no limit)")
    c.add_argument("--json", action="store_true", help="print the parsed reply (think/answer/boxed) as JSON")
    c.set_defaults(func=run_chat)
    return c


def _settings(args: argparse.Namespace) -> tuple[VideoSettings, SamplingSettings]:
    # Options not given on the command line stay None and are left out of the video item, so the
    # checkpoint's own video_defaults (or Keye's) apply.
    video = VideoSettings(
        fps=args.fps,
        max_frames=args.max_frames,
        token_budget=args.token_budget,
        slow_fast=False if args.no_slow_fast else None,
        min_frame_similarity=args.similarity,
    )
    sampling = SamplingSettings(
        max_new_tokens=args.max_new_tokens,
        greedy=not args.sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
    )
    sampling.kwargs()  # range checks before the (slow) model load
    return video, sampling


class _Printer:
    """Writes a stream of partial replies: thinking dimmed (on a terminal) under a header, then the answer."""

    def __init__(self, out: TextIO):
        self.out = out
        self.tty = out.isatty()
        self.think_shown = 0
        self.answer_shown = 0
        self.in_think = False

    def update(self, text: str) -> None:
        view = split_partial(text)
        if view.thinking is not None and len(view.thinking) > self.think_shown:
            if not self.in_think and self.think_shown == 0:
                self.out.write((_DIM if self.tty else "") + "[thinking] ")
                self.in_think = True
            self.out.write(view.thinking[self.think_shown :])
            self.think_shown = len(view.thinking)
        if view.answer and len(view.answer) > self.answer_shown:
            if self.in_think:
                self.out.write((_RESET if self.tty else "") + "\n\n")
                self.in_think = False
            self.out.write(view.answer[self.answer_shown :])
            self.answer_shown = len(view.answer)
        self.out.flush()

    def finish(self) -> None:
        if self.in_think and self.tty:
            self.out.write(_RESET)
        self.out.write("\n")
        self.out.flush()

    def footer(self, line: str) -> None:
        """The mode / token line under a finished answer, dimmed on a terminal."""
        self.out.write((_DIM if self.tty else "") + f"[{line}]" + (_RESET if self.tty else "") + "\n")
        self.out.flush()


def _ask(host: ModelHost, session: ChatSession, question: str, args: argparse.Namespace, quiet: bool) -> str:
    video, sampling = _settings(args)
    batch = host.processor(session.messages(question, video), mode=args.mode)
    printer = None if quiet else _Printer(sys.stdout)
    text, gen = "", {"tokens": 0}
    for piece in stream_reply(host.model, host.processor, batch, sampling, gen):
        text += piece
        if printer is not None:
            printer.update(text)
    parsed, reply = session.finish_turn(question, text, host.processor, gen["tokens"])
    if printer is not None:
        printer.finish()
        printer.footer(reply["line"])
    if quiet:
        extra = {k: reply[k] for k in ("reply_tokens", "think_tokens")}
        print(json.dumps({**vars(parsed), **extra}, indent=1, ensure_ascii=False))
    return text


def run_chat(args: argparse.Namespace) -> int:
    """Entry point of ``keye chat``; returns the exit code. Errors are :class:`keye.errors.KeyeError`
    (printed as one line with exit code 1 by ``keye.cli.main``)."""
    _settings(args)
    # Checked before anything heavy is imported or loaded: a wrong file is reported at once.
    session = ChatSession.for_media(args.media, args.max_video_seconds)
    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    quiet_transformers()
    host = ModelHost(args.model, device=args.device).load_now()
    if args.text is not None:
        _ask(host, session, args.text, args, quiet=args.json)
        return 0
    print(f"keye chat · {host.describe().replace('**', '').replace('`', '')}")
    print("Ask about the media; /reset forgets earlier turns, /exit or Ctrl-D quits.")
    while True:
        try:
            question = input("\nyou> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if question in ("/exit", "/quit"):
            return 0
        if question == "/reset":
            session.turns.clear()
            print("(conversation cleared)")
            continue
        if not question:
            continue
        print("keye> ", end="", flush=True)
        try:
            _ask(host, session, question, args, quiet=args.json)
        except KeyeInputError as err:
            # In an interactive chat a bad setting or question must not end the session.
            print(f"\nkeye: error: {err}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """``python -m keye.demo.chat ...``: the same command as ``keye chat``; a :class:`KeyeError` is printed
    as one line (``keye chat: error: ...``) with exit code 1."""
    from keye.cli import ArgumentParser

    parser = ArgumentParser(prog="keye")
    add_chat_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["chat", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except KeyeError as err:
        print(f"keye chat: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
