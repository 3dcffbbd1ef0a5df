"""The loader end to end on the synthetic set with the tiny processor: batch layout, exactly-once across
simulated ranks, exact resume, and bad rows/samples that are skipped, reported and bounded."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from keye.data.cost import CostModel
from keye.data.loader import build_dataloader
from keye.data.manifest import read_manifest
from keye.data.probe import ProbeCache
from keye.errors import KeyeInputError


def _loader(manifest, processor, cache, **kw):
    kw.setdefault("num_workers", 0)
    kw.setdefault("batch_tokens", 4096)
    return build_dataloader(manifest, processor, cost_model=CostModel(processor, cache=cache), **kw)


def _fingerprint(batch) -> tuple:
    h = hashlib.sha1(batch["input_ids"].numpy().tobytes())
    for k in ("pixel_values", "pixel_values_videos"):
        if k in batch:
            h.update(batch[k].numpy().tobytes())
    return batch["epoch"], batch["micro_batch"], tuple(batch["sample_ids"]), h.hexdigest()


def test_packed_batch_layout(small_synth: Path, tiny_processor, cache: ProbeCache):
    dl = _loader(small_synth, tiny_processor, cache, world_size=1, rank=0)
    costs = dl.costs
    for batch in dl:
        ids = batch["sample_ids"]
        assert batch["input_ids"].shape == batch["labels"].shape == (1, sum(costs[i].tokens for i in ids))
        assert batch["seq_lens"].tolist() == [costs[i].tokens for i in ids]
        assert batch["cu_seqlens"].tolist()[-1] == batch["input_ids"].shape[1]
        assert batch["cu_seqlens"].dtype == torch.int32
        n_vid = sum(costs[i].patches for i in ids if dl.manifest.samples[i].modality == "video")
        n_img = sum(costs[i].patches for i in ids if dl.manifest.samples[i].modality == "image")
        assert batch.get("pixel_values_videos", torch.zeros(0)).shape[0] == n_vid
        assert batch.get("pixel_values", torch.zeros(0)).shape[0] == n_img
        assert batch["input_ids"].shape[1] <= 4096
        assert batch["num_label_tokens"] == int((batch["labels"] != -100).sum()) > 0
    assert dl.epoch == 1


def test_padded_batches(small_synth: Path, tiny_processor, cache: ProbeCache):
    dl = _loader(small_synth, tiny_processor, cache, batch_size=3, batch_tokens=None, packing=False)
    seen = []
    for batch in dl:
        n, L = batch["input_ids"].shape
        assert n == batch["num_samples"] and L == max(batch["seq_lens"].tolist())
        assert batch["attention_mask"].sum(1).tolist() == batch["seq_lens"].tolist()
        assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
        seen += batch["sample_ids"]
    assert sorted(seen) == list(range(12))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_exactly_once_across_simulated_ranks(small_synth: Path, tiny_processor, cache: ProbeCache, world: int):
    seen, lengths = [], set()
    for rank in range(world):
        dl = _loader(small_synth, tiny_processor, cache, world_size=world, rank=rank, seed=5)
        plan = dl.sampler.micro_batches_for(0)
        lengths.add(len(plan))
        seen += [i for mb in plan for i in mb]
    assert len(lengths) == 1
    assert sorted(seen) == list(range(12))


def test_exactly_once_through_the_loader_two_ranks(small_synth: Path, tiny_processor, cache: ProbeCache):
    seen = []
    for rank in range(2):
        for batch in _loader(small_synth, tiny_processor, cache, world_size=2, rank=rank):
            seen += batch["sample_ids"]
    assert sorted(seen) == list(range(12))


def _endless(dl):
    while True:
        yield from dl


def test_resume_equals_uninterrupted(small_synth: Path, tiny_processor, cache: ProbeCache):
    # Two workers with prefetching: the state must count batches handed out, not batches decoded.
    kw = dict(world_size=2, rank=1, seed=9, num_workers=2, batch_tokens=3072, max_bad_fraction=0.0)
    dl = _loader(small_synth, tiny_processor, cache, **kw)
    n = len(dl)
    full = [_fingerprint(b) for b in dl] + [_fingerprint(b) for b in dl]  # two uninterrupted epochs
    assert n >= 3 and len(full) == 2 * n
    k = n + 2  # stop inside the second epoch
    first = _loader(small_synth, tiny_processor, cache, **kw)
    stream = _endless(first)
    got = [_fingerprint(next(stream)) for _ in range(k)]
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    stream.close()
    resumed = _loader(small_synth, tiny_processor, cache, **kw)
    resumed.load_state_dict(state)
    got += [_fingerprint(b) for b in resumed]
    assert got == full
    assert resumed.epoch == 2 and resumed.position == 0
    assert resumed.summary()["samples_ok"] == first.samples_ok + sum(len(f[2]) for f in full[k:])


def test_bad_rows_and_samples_are_skipped_and_reported(small_synth: Path, tiny_processor, cache, tmp_path):
    root = tmp_path / "set"
    shutil.copytree(small_synth.parent, root)
    lines = (root / "train.jsonl").read_text().splitlines()
    lines.insert(3, "{broken json")  # malformed row (line 4)
    lines.insert(7, lines[0].replace('"train-000000"', '"dup-missing"').replace("000000.", "999999."))  # missing file
    (root / "media" / "train" / "corrupt.mp4").write_bytes(b"\x00" * 4096)
    lines.insert(9, lines[1].replace('"train-000001"', '"corrupt"').replace("000001.mp4", "corrupt.mp4").replace("000001.png", "corrupt.mp4"))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    log = tmp_path / "bad.jsonl"
    dl = _loader(root / "train.jsonl", tiny_processor, cache, max_bad_fraction=0.5, bad_log=log)
    assert sorted(b.line for b in dl.plan_bad) == [4, 8, 10]
    # A file that breaks after planning (deleted / replaced on shared storage) is skipped at load time.
    victim = dl.manifest.samples[5]
    Path(victim.media[0].path).write_bytes(b"garbage")
    seen = []
    for batch in dl:
        seen += batch["sample_ids"]
    good = [s.index for s in dl.manifest.samples if s.index != victim.index and dl.costs[s.index] is not None]
    assert sorted(seen) == good
    summary = dl.summary()
    assert summary["bad_before_training"] == 3 and summary["bad_while_loading"] == 1
    assert summary["samples_ok"] == len(good)
    assert dl.load_bad[0].line == victim.line and dl.load_bad[0].id == victim.id
    text = dl.format_summary()
    assert "skipped 3 before training and 1 while loading" in text
    assert len(log.read_text().splitlines()) == 4


def test_too_many_bad_fails_clearly(small_synth: Path, tiny_processor, cache, tmp_path):
    root = tmp_path / "set"
    shutil.copytree(small_synth.parent, root)
    with open(root / "train.jsonl", "a") as f:
        f.write("{bad\n" * 2)
    with pytest.raises(KeyeInputError, match=r"2 of 14 rows are unusable .* max_bad_fraction=10.0%"):
        _loader(root / "train.jsonl", tiny_processor, cache, max_bad_fraction=0.1)
    # Load-time failures past the threshold stop the run at the end of the epoch at the latest.
    dl = _loader(root / "train.jsonl", tiny_processor, cache, max_bad_fraction=0.25)
    for s in read_manifest(root / "train.jsonl").samples[:3]:
        Path(s.media[0].path).write_bytes(b"x")
    with pytest.raises(KeyeInputError, match="samples are bad"):
        for _ in dl:
            pass
