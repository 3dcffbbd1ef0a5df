"""Elastic resume and data-parallel groups of the loader: a run saved on 2 ranks resumes on 1 (and 1 on 2)
mid-epoch with every sample of the epoch trained exactly once; two gloo ranks as one group yield the 1-process
loader's batches while only one of them reads; a manifest that grew finishes its epoch over the old rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keye.data.loader import build_dataloader
from keye.errors import KeyeConfigError
from tests.data._elastic import TextCost, TextProcessor, fingerprint, write_manifest
from tests.torchrun import torchrun

WORKER = Path(__file__).with_name("dist_elastic_worker.py")
N = 40


def _flat(mbs: list) -> list[int]:
    return [i for mb in mbs for i in mb]


@pytest.mark.slow
def test_elastic_resume_and_one_group_under_torchrun(tmp_path: Path):
    manifest = write_manifest(tmp_path / "train.jsonl", N)
    out = tmp_path / "out.json"
    torchrun([WORKER, manifest, out], timeout=300)
    r0, r1 = json.loads(out.read_text())
    # 2 -> 1: what both ranks trained plus what the 1-rank loader trained after resuming is the epoch, once.
    done = _flat(r0["two_first"]) + _flat(r1["two_first"])
    assert sorted(done + _flat(r0["one_rest"])) == list(range(N))
    assert r0["one_rest"] and all(mb for mb in r0["one_rest"])
    assert r0["one_next_epoch"] == r0["fresh_epoch1"]  # later epochs: planned as usual
    # 1 -> 2: the 1-rank loader's first micro-batches plus both ranks' rest, once; the ranks stay in lock-step.
    assert sorted(_flat(r0["one_first"]) + _flat(r0["two_rest"]) + _flat(r1["two_rest"])) == list(range(N))
    assert len(r0["two_rest"]) == len(r1["two_rest"]) > 0
    # One group of two ranks: the same micro-batches on both, equal to the 1-process loader's; rank 1 read none.
    assert r0["group"] == r1["group"] == r0["single"] == r0["group_workers"] == r1["group_workers"]
    assert len(r0["group"]) == r0["group_len"] >= 4
    assert r0["group_reads"] >= N and r1["group_reads"] == 0
    assert r1["group_resumed"] == r0["single"][2:]


def _loader(manifest: Path, **kw):
    kw = {"batch_size": 2, "micro_batches": 2, "seed": 1, "num_workers": 0, "cost_model": TextCost(), **kw}
    return build_dataloader(manifest, TextProcessor(), **kw)


def test_grown_manifest_finishes_the_epoch_over_its_rows(tmp_path: Path):
    manifest = write_manifest(tmp_path / "train.jsonl", 30)
    ranks = [_loader(manifest, world_size=2, rank=r) for r in range(2)]
    its = [iter(dl) for dl in ranks]
    first = [fingerprint(next(it)) for it in its for _ in range(2)]
    state = ranks[0].state_dict()
    full = [[fingerprint(b) for b in _loader(manifest, world_size=2, rank=r)] for r in range(2)]
    write_manifest(manifest, 10, start=30)  # rows appended while the run was down
    rest, next_epoch = [], []
    for r in range(2):
        dl = _loader(manifest, world_size=2, rank=r)
        dl.load_state_dict(state)
        got = [fingerprint(b) for b in dl]
        assert got == full[r][2:]  # the same layout: exactly the uninterrupted epoch
        rest += [i for f in got for i in f[2]]
        next_epoch += [i for b in dl for i in b["sample_ids"]]
    assert sorted([i for f in first for i in f[2]] + rest) == list(range(30))
    assert sorted(next_epoch) == list(range(40))  # the new rows join from the next epoch
    with pytest.raises(KeyeConfigError, match="seed"):
        _loader(manifest, world_size=2, rank=0, seed=2).load_state_dict(state)
    short = write_manifest(tmp_path / "short.jsonl", 20)
    with pytest.raises(KeyeConfigError, match="over 30 samples"):
        _loader(short, world_size=1, rank=0).load_state_dict(state)


def test_group_size_must_divide_the_world(tmp_path: Path):
    manifest = write_manifest(tmp_path / "train.jsonl", 12)
    with pytest.raises(KeyeConfigError, match="group_size=2"):
        _loader(manifest, world_size=3, rank=0, group_size=2)
    # Without a process group each rank of a group reads for itself: the group's ranks see the same batches.
    a = [fingerprint(b) for b in _loader(manifest, world_size=4, rank=2, group_size=2)]
    b = [fingerprint(b) for b in _loader(manifest, world_size=4, rank=3, group_size=2)]
    c = [fingerprint(b) for b in _loader(manifest, world_size=2, rank=1)]
    assert a == b == c


def test_resumed_epoch_resumes_again_exactly(tmp_path: Path):
    """2 ranks -> 1 rank, saved again inside the rest of that epoch and resumed on 1 rank: the same batches as
    the first 1-rank loader, so a state inside an elastically resumed epoch is exact too."""
    manifest = write_manifest(tmp_path / "train.jsonl", 30)
    two = [_loader(manifest, world_size=2, rank=r) for r in range(2)]
    running = [iter(dl) for dl in two]
    handed = [i for it in running for _ in range(3) for i in next(it)["sample_ids"]]
    one = _loader(manifest, world_size=1, rank=0)
    one.load_state_dict(two[0].state_dict())
    it = iter(one)
    first = [fingerprint(next(it))]
    state = one.state_dict()
    rest = [fingerprint(b) for b in it]
    again = _loader(manifest, world_size=1, rank=0)
    again.load_state_dict(state)
    assert [fingerprint(b) for b in again] == rest
    assert sorted(handed + [i for f in first + rest for i in f[2]]) == list(range(30))

