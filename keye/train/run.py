"""The start of every training run, shared by both recipes: the run directory with the resolved config in it,
and the global seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from keye.train import dist as kdist
from keye.train.config import dump_config


def start_run(cfg: Any, info: kdist.DistInfo) -> Path:
    """Create ``cfg.checkpoint.out_dir`` and write the resolved config into it as ``config.yaml`` (main rank),
    wait for every rank, and seed Python, NumPy and torch with ``cfg.train.seed``. Returns the run directory."""
    out_dir = Path(cfg.checkpoint.out_dir)
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out_dir / "config.yaml")
    kdist.barrier()
    kdist.seed_everything(cfg.train.seed)
    return out_dir


__all__ = ["start_run"]
