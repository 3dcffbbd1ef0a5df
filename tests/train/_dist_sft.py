"""Run SFT jobs (used by test_sft.py / test_sft_scale.py under torchrun).

Args: ``OUT_DIR STRATEGY [key=value ...] [-- OUT_DIR STRATEGY [key=value ...] ...]``: each ``--``-separated
job runs in turn in the same process group, so one torchrun launch (and one DeepSpeed import) serves
several runs. ``stop_after=N`` among a job's arguments stops it after N steps without the final save (a
simulated crash; the next job on the same OUT_DIR resumes). Each run's summary.json and final/ export are
what the tests compare, with each rank's data-loader summary (``data_rank<R>.json``)."""

import json
import os
import sys
from pathlib import Path

from keye.recipes.sft import train
from keye.sft.config import SFTConfig
from keye.train import dist as kdist
from keye.train.config import load_config


def _jobs(argv: list[str]) -> list[list[str]]:
    jobs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--":
            jobs.append([])
        else:
            jobs[-1].append(arg)
    return [j for j in jobs if j]


if __name__ == "__main__":
    try:
        for out_dir, strategy, *overrides in _jobs(sys.argv[1:]):
            stop = [int(o.split("=", 1)[1]) for o in overrides if o.startswith("stop_after=")]
            overrides = [o for o in overrides if not o.startswith("stop_after=")]
            cfg = load_config(SFTConfig, None, [f"checkpoint.out_dir={out_dir}", f"train.strategy={strategy}",
                                                *overrides])
            summary = train(cfg, stop_after=stop[-1] if stop else None)
            rank = os.environ.get("RANK", "0")
            (Path(out_dir) / f"data_rank{rank}.json").write_text(json.dumps(summary["data"], default=str))
    finally:
        kdist.cleanup()
