"""Run one RLEP job (used by test_rlep.py under torchrun); args: OUT_DIR [key=value ...].
Every rank prints ``RANK <r> CHECKSUM <sum of parameters>`` so the test can check the replicas agree."""

import os
import sys

from keye.train import dist as kdist
from keye.train.config import load_config
from keye.train.rlep import RLEPConfig, train

if __name__ == "__main__":
    out_dir, *overrides = sys.argv[1:]
    cfg = load_config(RLEPConfig, None, [f"checkpoint.out_dir={out_dir}", "train.strategy=ddp", *overrides])
    try:
        summary = train(cfg)
        print(f"RANK {os.environ.get('RANK', '0')} CHECKSUM {summary['param_checksum']!r}", flush=True)
    finally:
        kdist.cleanup()
