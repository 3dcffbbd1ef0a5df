"""Run RLEP jobs (used by test_rlep.py / test_rlep_scale.py / test_rl_sharded.py under torchrun).

Args: ``OUT_DIR [key=value ...] [-- OUT_DIR [key=value ...] ...]``: each ``--``-separated job runs in turn in
the same process group, so one torchrun launch serves several runs (each ``train`` call seeds its own random
state). Every rank writes ``checksum_rank<r>.txt`` (the sum of its parameters) into a job's OUT_DIR so the test
can check that the replicas agree (files, not stdout: torchrun does not guarantee every rank's output reaches
it). With ``rollout.engine=vllm`` the recording stand-in ``_fake_vllm`` serves as ``vllm`` (its environment
variable ``FAKE_VLLM_PLACEHOLDER_RANKS`` makes chosen ranks sample only placeholder ids, i.e. no loss token).
``stop_after=N`` among a job's arguments stops it after N steps without the final save (a simulated crash of a
fresh run: rank 0 empties OUT_DIR first, so a launch rerun after a rank's crash does not resume it instead).

A job whose first argument is ``learner`` runs the fixed learner batch of ``_learner_run.py`` instead:
``learner OUT_DIR CKPT MANIFEST POOL NAME [key=value ...]``."""

import os
import shutil
import sys
from pathlib import Path

from _dist_sft import _jobs  # this script's folder is on sys.path; the same '--' job split

from keye.recipes.rlep import train
from keye.rl.config import RLEPConfig
from keye.train import dist as kdist
from keye.train.config import load_config

if __name__ == "__main__":
    jobs = _jobs(sys.argv[1:])
    if any("rollout.engine=vllm" in job for job in jobs):
        import _fake_vllm  # this script's folder is on sys.path

        _fake_vllm.install()
    try:
        for job in jobs:
            if job[0] == "learner":
                import _learner_run

                out, ckpt, manifest, pool, name, *overrides = job[1:]
                _learner_run.run(Path(out), Path(ckpt), Path(manifest), Path(pool), name, overrides)
                continue
            out_dir, *overrides = job
            stop_after = [int(x.split("=", 1)[1]) for x in overrides if x.startswith("stop_after=")]
            overrides = [x for x in overrides if not x.startswith("stop_after=")]
            cfg = load_config(RLEPConfig, None, [f"checkpoint.out_dir={out_dir}", "train.strategy=ddp", *overrides])
            if stop_after:
                info = kdist.init_distributed(cfg.train.device)
                if info.is_main:
                    shutil.rmtree(out_dir, ignore_errors=True)
                kdist.barrier()
            summary = train(cfg, stop_after=stop_after[0] if stop_after else None)
            rank = os.environ.get("RANK", "0")
            (Path(out_dir) / f"checksum_rank{rank}.txt").write_text(repr(summary["param_checksum"]))
    finally:
        kdist.cleanup()
