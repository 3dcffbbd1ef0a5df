"""Data-parallel inference under torchrun: items sharded by rank, parts gathered by rank 0 (2 CPU ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.torchrun import torchrun

pytestmark = pytest.mark.slow


def test_torchrun_two_ranks(tmp_path) -> None:
    worker = Path(__file__).with_name("dist_eval_worker.py")
    torchrun([worker, tmp_path], timeout=180, cwd=Path(__file__).parents[2])
    lines = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == [f"q{i}" for i in range(7)]  # gathered in item order
    for i, rec in enumerate(lines):
        assert rec["raw_output"] == f"rank {i % 2}: question {i}"  # item i answered by rank i % 2
    assert not list(tmp_path.glob("predictions.rank*.jsonl"))  # parts merged and removed
    r0 = json.loads((tmp_path / "returned.rank0.json").read_text())
    r1 = json.loads((tmp_path / "returned.rank1.json").read_text())
    assert r0["world"] == 2 and [r["id"] for r in r0["records"]] == [f"q{i}" for i in range(7)]
    assert [r["id"] for r in r1["records"]] == ["q1", "q3", "q5"]
