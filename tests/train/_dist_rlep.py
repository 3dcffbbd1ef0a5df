"""Run one RLEP job (used by test_rlep.py / test_rlep_scale.py under torchrun); args: OUT_DIR [key=value ...].
Every rank writes ``checksum_rank<r>.txt`` (the sum of its parameters) into OUT_DIR so the test can check
that the replicas agree (files, not stdout: torchrun does not guarantee every rank's output reaches it).
With ``rollout.engine=vllm`` the recording stand-in ``_fake_vllm`` serves as ``vllm`` (its environment
variable ``FAKE_VLLM_PLACEHOLDER_RANKS`` makes chosen ranks sample only placeholder ids, i.e. no loss token)."""

import os
import sys
from pathlib import Path

from keye.train import dist as kdist
from keye.train.config import load_config
from keye.train.rlep import RLEPConfig, train

if __name__ == "__main__":
    out_dir, *overrides = sys.argv[1:]
    if "rollout.engine=vllm" in overrides:
        import _fake_vllm  # this script's folder is on sys.path

        _fake_vllm.install()
    cfg = load_config(RLEPConfig, None, [f"checkpoint.out_dir={out_dir}", "train.strategy=ddp", *overrides])
    try:
        summary = train(cfg)
        rank = os.environ.get("RANK", "0")
        (Path(out_dir) / f"checksum_rank{rank}.txt").write_text(repr(summary["param_checksum"]))
    finally:
        kdist.cleanup()
