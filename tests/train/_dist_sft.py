"""Run one SFT job (used by test_sft.py under torchrun); args: OUT_DIR STRATEGY [key=value ...].
The run's summary.json (losses, world size) is what the test compares."""

import sys

from keye.train import dist as kdist
from keye.train.config import load_config
from keye.train.sft import SFTConfig, train

if __name__ == "__main__":
    out_dir, strategy, *overrides = sys.argv[1:]
    cfg = load_config(SFTConfig, None, [f"checkpoint.out_dir={out_dir}", f"train.strategy={strategy}", *overrides])
    try:
        train(cfg)
    finally:
        kdist.cleanup()
