"""The ``keye`` command line.

Each area of the library contributes its own sub-commands through a module ``keye.<area>.cli`` that
defines ``add_commands(subparsers)``; every command it adds sets ``func`` (a callable taking the parsed
namespace and returning an exit code).

``keye --help``, ``keye <command> --help``, ``keye --version`` and argument errors answer at once: building
the parser imports no torch and no transformers. The area modules import only the standard library at the
top and import what a command needs inside the command. Some area *packages* re-export their heavy modules
from ``__init__`` (``keye.processing`` loads transformers, ``keye.rl`` torch), so while such a package is not
imported yet its ``cli.py`` is read straight from its file for the parser (:func:`_load_cli`), and the command
that runs is taken from the real module, imported normally (:func:`_runnable`). ``tests/test_cli.py`` checks
that none of these paths imports torch or transformers.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from keye.errors import KeyeError

# Order is the order of ``keye --help``.
_AREAS = (
    "keye.processing.cli",  # keye process
    "keye.data.cli",  # keye data check / synth / clip-filter / autothink
    "keye.recipes.cli",  # keye train sft / rlep, keye rlep collect, keye init, keye merge
    "keye.rl.cli",  # keye rl plan
    "keye.sft.cli",  # keye sft plan
    "keye.eval.cli",  # keye eval mmmu / mathvista / videoqa / synth / score
    "keye.demo.cli",  # keye demo, keye chat
    "keye.serve.cli",  # keye serve
)
_KEYE_DIR = Path(__file__).resolve().parent
# Names of the area modules this process read from their files (their functions carry these module names).
_FROM_FILE: set[str] = set()


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` with each option's default: ``(default: X)`` is appended to a help text that does not
    already state its default. Left out for flags (``store_true``), options whose default is None or an
    empty list (nothing to show), and help texts that mention "default" themselves."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not text
            or "default" in text.lower()
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or default == []
            or (not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))
        ):
            return text
        return text + " (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """The parser class of ``keye`` and of every sub-command parser (sub-parsers inherit the class).

    - help texts show defaults (:class:`HelpFormatter`, combined with any formatter a command asks for);
    - an argument a sub-command does not know is reported by *that* sub-command's parser, so the error
      comes with its usage (``keye chat --bogus`` prints ``usage: keye chat ...``), not the top-level one.
    """

    def __init__(self, *args: Any, formatter_class: type[argparse.HelpFormatter] = HelpFormatter,
                 **kwargs: Any):
        if not issubclass(formatter_class, HelpFormatter):
            # e.g. RawDescriptionHelpFormatter for a long description: keep its layout, add the defaults
            formatter_class = type(f"Keye{formatter_class.__name__}", (HelpFormatter, formatter_class), {})
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
        self._is_subcommand = False

    def add_subparsers(self, **kwargs: Any) -> Any:
        """As argparse's, with parsers of this class that know they are sub-commands."""
        kwargs.setdefault("parser_class", type(self))
        action = super().add_subparsers(**kwargs)
        add_parser = action.add_parser

        def add_subcommand(name: str, **kw: Any) -> argparse.ArgumentParser:
            parser = add_parser(name, **kw)
            parser._is_subcommand = True
            return parser

        action.add_parser = add_subcommand
        return action

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, except that a sub-command reports arguments it does not know itself (exit code 2)
        instead of handing them up to the top-level parser."""
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self._is_subcommand:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _load_cli(name: str) -> ModuleType | None:
    """The area module ``name`` (``keye.<area>.cli``) for building the parser, or None when this install has
    no such file.

    When its package is already imported this is the module itself. Otherwise the file is executed as a
    module of that name *without* running the package's ``__init__`` (which may import torch or
    transformers) and without registering it in ``sys.modules``: it is a parser-building copy, and
    :func:`_runnable` swaps its command functions for the real module's before they run.
    """
    package = name.rpartition(".")[0]
    if name in sys.modules or package in sys.modules:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            # An area that is not part of this install simply adds no commands; a missing third-party
            # dependency inside an existing area is a real error.
            if err.name is not None and (err.name == name or name.startswith(err.name + ".")):
                return None
            raise
    path = _KEYE_DIR.joinpath(*name.split(".")[1:]).with_suffix(".py")
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # Present in sys.modules only while it executes (dataclasses and typing look their module up there).
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    _FROM_FILE.add(name)
    return module


def _runnable(func: Any) -> Any:
    """The command function to call for ``func`` (a parsed namespace's ``func``): for a function of an area
    module read by :func:`_load_cli`, the same function of the real module, imported now with its package
    (the command needs those imports anyway, and patches and module state then behave as usual)."""
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", "")
    if module not in _FROM_FILE or "<locals>" in qualname:
        return func  # a local helper (e.g. "print this group's help") works as it is
    real = getattr(importlib.import_module(module), qualname, None)
    return real if callable(real) else func


def build_parser() -> argparse.ArgumentParser:
    """Return the full ``keye`` argument parser with every installed area's commands (imports neither torch
    nor transformers)."""
    parser = ArgumentParser(prog="keye", description="Keye-VL video-language models.")
    parser.add_argument("--version", action="store_true", help="print the keye version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _AREAS:
        module = _load_cli(name)
        if module is not None:
            module.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``keye`` command line; returns the process exit code (argument errors exit with 2 from
    argparse; a :class:`~keye.errors.KeyeError` is printed as one line ``keye: error: ...`` with code 1)."""
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
        return int(_runnable(func)(args) or 0)
    except KeyeError as err:
        print(f"keye: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
