"""The ``keye`` command line.

Each area of the library contributes its own sub-commands through a module ``keye.<area>.cli`` that
defines ``add_commands(subparsers)``; every command it adds sets ``func`` (a callable taking the parsed
namespace and returning an exit code). Areas are imported only when the command line is built, so
``keye --help`` does not pay for training imports it never runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from keye.errors import KeyeError

# Order is the order of ``keye --help``.
_AREAS = (
    "keye.processing.cli",  # keye process
    "keye.data.cli",  # keye data check / synth / clip-filter / autothink
    "keye.recipes.cli",  # keye train sft / rlep, keye rlep collect, keye init, keye merge
    "keye.rl.cli",  # keye rl plan
    "keye.eval.cli",  # keye eval mmmu / mathvista / videoqa / synth / score
    "keye.demo.cli",  # keye demo, keye chat
    "keye.serve.cli",  # keye serve
)


def build_parser() -> argparse.ArgumentParser:
    """Return the full ``keye`` argument parser with every installed area's commands."""
    parser = argparse.ArgumentParser(prog="keye", description="Keye-VL video-language models.")
    parser.add_argument("--version", action="store_true", help="print the keye version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _AREAS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            # An area that is not part of this install (or not written yet) simply adds no commands;
            # a missing third-party dependency inside an existing area is a real error.
            if err.name is not None and (err.name == name or name.startswith(err.name + ".")):
                continue
            raise
        module.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``keye`` command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from keye import __version__

        print(__version__)
        return 0
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyeError as err:
        print(f"keye: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
