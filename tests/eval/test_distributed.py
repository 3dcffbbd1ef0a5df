"""Data-parallel inference under torchrun: items sharded by rank, parts gathered by rank 0 (2 CPU ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_torchrun_two_ranks(tmp_path) -> None:
    worker = Path(__file__).with_name("dist_eval_worker.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(worker),
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, cwd=Path(__file__).parents[2], env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == [f"q{i}" for i in range(7)]  # gathered in item order
    for i, rec in enumerate(lines):
        assert rec["raw_output"] == f"rank {i % 2}: question {i}"  # item i answered by rank i % 2
    assert not list(tmp_path.glob("predictions.rank*.jsonl"))  # parts merged and removed
    r0 = json.loads((tmp_path / "returned.rank0.json").read_text())
    r1 = json.loads((tmp_path / "returned.rank1.json").read_text())
    assert r0["world"] == 2 and [r["id"] for r in r0["records"]] == [f"q{i}" for i in range(7)]
    assert [r["id"] for r in r1["records"]] == ["q1", "q3", "q5"]
