"""``--quick``: every benchmark's smoke-test mode, the same code path at a size that takes seconds.

A script declares its quick sizes once, as option defaults; :func:`parse_args` adds the ``--quick`` flag and,
when it is given, uses those sizes for every option the command line left unset (an option given explicitly
still wins, so ``--quick --repeats 2`` is a quick run with two repeats). Quick figures are for checking that
the script runs and prints its last line, not for quoting: the sizes are too small for the ratios to mean much.
Quick runs use one torch thread (:func:`torch_threads`): at these sizes a second thread buys nothing, and on a
shared machine two threads that wait for each other's core spin for seconds per operation.
``tests/test_benchmarks_quick.py`` runs every script's quick mode.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

QUICK_HELP = "smoke-test sizes (seconds): the same code path, one torch thread, figures not meaningful"


def parse_args(ap: argparse.ArgumentParser, argv: Sequence[str] | None, quick: dict[str, Any]) -> argparse.Namespace:
    """Parse ``argv`` (``None``: ``sys.argv[1:]``) with ``ap`` plus a ``--quick`` flag; with ``--quick`` the
    options named in ``quick`` (argparse ``dest`` names) that the command line did not set take the values of
    ``quick``. Raises ValueError when ``quick`` names an option ``ap`` does not have (a typo would silently run
    the full size)."""
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    dests = {a.dest for a in ap._actions}
    unknown = sorted(set(quick) - dests)
    if unknown:
        raise ValueError(f"quick sizes for options the parser does not have: {unknown}")
    args = ap.parse_args(argv)
    if not args.quick:
        return args
    # a second parse with the quick sizes as defaults: what the command line set still overrides them
    ap.set_defaults(**quick)
    return ap.parse_args(argv)


def torch_threads(args: argparse.Namespace, full: int = 2) -> int:
    """The torch thread count of a run: ``full`` normally, 1 with ``--quick``."""
    return 1 if getattr(args, "quick", False) else full
