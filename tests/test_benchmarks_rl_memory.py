"""benchmarks/rl_memory.py: the worker's record in one process on a tiny model; how ranks' records combine."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import rl_memory  # noqa: E402


def _record(rank: int, peak: float, seconds: list[float], logp=(-30.0, -29.0), norms=(0.5, 0.4),
            strategy: str = "fsdp2") -> dict:
    return {"rank": rank, "world_size": 2, "strategy": strategy, "peak_mib": peak, "built_mib": 10.0 + rank,
            "resident_mib": 20.0 - rank, "logp_sums": list(logp), "grad_norms": list(norms),
            "seconds": seconds, "local_samples": 4}


def test_aggregate_takes_the_worst_rank():
    run = rl_memory.aggregate([_record(1, 300.0, [1.0, 5.0]), _record(0, 250.0, [2.0, 4.0])])
    assert (run["peak_mib"], run["peak_rank"]) == (300.0, 1)
    assert (run["built_mib"], run["resident_mib"]) == (11.0, 20.0)
    assert run["seconds"] == [2.0, 5.0]
    assert run["logp_sums"] == [-30.0, -29.0] and run["grad_norms"] == [0.5, 0.4]
    assert run["strategy"] == "fsdp2" and run["world_size"] == 2


@pytest.mark.parametrize("records", [
    [],
    [_record(0, 1.0, [1.0])],  # rank 1 missing
    [_record(0, 1.0, [1.0]), _record(0, 1.0, [1.0])],  # rank 0 twice
    [_record(0, 1.0, [1.0]), _record(1, 1.0, [1.0], logp=(-30.0, -28.0))],  # ranks trained different models
    [_record(0, 1.0, [1.0]), _record(1, 1.0, [1.0], norms=(0.5, 0.41))],
    [_record(0, 1.0, [1.0]), _record(1, 1.0, [1.0], norms=(0.5,))],
    [_record(0, 1.0, [1.0]), _record(1, 1.0, [1.0], strategy="ddp")],
])
def test_aggregate_rejects_inconsistent_runs(records):
    with pytest.raises(ValueError):
        rl_memory.aggregate(records)


def test_worker_in_one_process(tmp_path):
    ckpt = rl_memory.build_checkpoint(tmp_path / "ckpt", hidden=128, layers=2)
    samples = rl_memory.build_samples(ckpt, tmp_path / "samples.pt", prompts=2, group=2, new_tokens=4)
    overrides = rl_memory.config_overrides(ckpt, tmp_path / "out", micro=2, new_tokens=4, tree=False,
                                           strategy="ddp")
    with pytest.raises(ValueError, match="steps"):
        rl_memory.worker(tmp_path / "out", ckpt, samples, overrides, steps=1)
    rec = rl_memory.worker(tmp_path / "out", ckpt, samples, overrides, steps=2)
    assert json.loads((tmp_path / "out" / "rank0.json").read_text()) == rec
    # one process: no process group, so the learner runs unsharded whatever train.strategy says
    assert (rec["rank"], rec["world_size"], rec["strategy"], rec["local_samples"]) == (0, 1, "none", 4)
    assert len(rec["logp_sums"]) == 2 and all(math.isfinite(x) and x < 0 for x in rec["logp_sums"])
    assert rec["logp_sums"][0] != rec["logp_sums"][1]  # the first update changed the policy
    assert len(rec["grad_norms"]) == 2 and all(math.isfinite(x) and x > 0 for x in rec["grad_norms"])
    assert rec["peak_mib"] > 0 and len(rec["seconds"]) == 2
    run = rl_memory.aggregate([rec])
    assert run["peak_mib"] == rec["peak_mib"] and run["strategy"] == "none"
    assert rl_memory.plan_mib(ckpt, samples, overrides) > 0
