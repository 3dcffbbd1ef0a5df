"""Two real processes under torchrun (gloo, CPU): each rank gets its share, nothing seen twice or dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keye.data.cost import CostModel
from keye.data.manifest import read_manifest
from keye.data.probe import ProbeCache
from keye.processing.processor import KeyeProcessor
from keye.testing.processor import make_tiny_processor_dir
from tests.torchrun import torchrun

WORKER = Path(__file__).with_name("dist_loader_worker.py")


@pytest.mark.slow
def test_torchrun_two_ranks_share_each_epoch(small_synth: Path, tmp_path: Path):
    proc_dir = make_tiny_processor_dir(tmp_path / "proc", "preview")
    out = tmp_path / "result.json"
    cache = tmp_path / "probe.sqlite"
    ProbeCache(cache)  # both ranks share one on-disk cache
    torchrun([WORKER, small_synth, proc_dir, cache, out], timeout=300)
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    proc = KeyeProcessor.from_pretrained(proc_dir)
    local = [CostModel(proc, cache=ProbeCache(tmp_path / "local.sqlite")).estimate(s).tokens
             for s in read_manifest(small_synth).samples]
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == local  # sharded estimation, gathered
    for epoch in range(2):
        per_rank = [r["epochs"][epoch] for r in ranks]
        assert len(per_rank[0]) == len(per_rank[1])  # lock-step micro-batch count
        flat = [i for mbs in per_rank for mb in mbs for i in mb]
        assert sorted(flat) == list(range(12))  # every sample once: none twice, none dropped
        assert all(mb for mbs in per_rank for mb in mbs)
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # reshuffled per epoch
