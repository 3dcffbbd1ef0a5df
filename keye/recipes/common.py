"""What both recipes' entry points share: parse ``--config CFG.yaml [key=value ...]``, load the typed config, run,
and always tear the process group down."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

from keye.train import dist as kdist
from keye.train.config import load_config


def run_from_args(config_cls: type, train: Callable[[Any], Any], config: str | None, overrides: list[str]) -> int:
    """Load ``config_cls`` from the YAML file ``config`` (or its defaults) with dot-list ``overrides``, run
    ``train(cfg)`` and tear the process group down whatever happens; returns the exit code (0)."""
    logging.basicConfig(level=os.environ.get("KEYE_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(config_cls, config, overrides)
    try:
        train(cfg)
    finally:
        kdist.cleanup()
    return 0


def main(argv: list[str] | None, *, prog: str, doc: str | None, example: str, config_cls: type,
         train: Callable[[Any], Any]) -> int:
    """``prog --config CFG.yaml [key=value ...]`` (``example`` shows an override in the help)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML recipe config (see training/configs/)")
    ap.add_argument("overrides", nargs="*", help=f"dot-list overrides, e.g. {example}")
    args = ap.parse_args(argv)
    return run_from_args(config_cls, train, args.config, args.overrides)


__all__ = ["main", "run_from_args"]
