"""Faster cost estimation with the same numbers: sizes stated in the row skip the probe, estimation in worker
processes equals the one-process run (rejected rows included)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from keye.data.cost import CostModel, estimate_parallel, given_info
from keye.data.manifest import read_manifest
from keye.data.probe import ProbeCache, probe_media
from keye.data.table import ManifestTable, estimate_costs
from keye.errors import KeyeInputError


def _stated(synth_dir: Path, tmp_path: Path, n: int) -> Path:
    """The first ``n`` rows with each media item's probed size written into the item (``media/`` kept)."""
    man = read_manifest(synth_dir / "train.jsonl")
    lines = (synth_dir / "train.jsonl").read_text().splitlines()[:n]
    out = []
    for line, s in zip(lines, man.samples):
        row = json.loads(line)
        items = [c for m in row["messages"] if isinstance(m["content"], list) for c in m["content"]
                 if c.get("type") in ("image", "video")]
        for item, ref in zip(items, s.media):
            info = probe_media(ref)
            item.update(width=info.width, height=info.height)
            if ref.kind == "video":
                item.update(duration=info.duration, num_frames=info.num_frames)
        out.append(json.dumps(row))
    path = synth_dir / f"stated-{tmp_path.name}.jsonl"  # next to media/, so the paths resolve
    path.write_text("\n".join(out) + "\n")
    return path


@pytest.mark.parametrize("variant", ["preview", "1.5"])
def test_stated_sizes_skip_the_probe_with_the_same_costs(synth_dir, tiny_processor, tiny_processor_15, tmp_path,
                                                         monkeypatch, variant):
    proc = tiny_processor if variant == "preview" else tiny_processor_15
    stated = read_manifest(_stated(synth_dir, tmp_path, 8))
    plain = read_manifest(synth_dir / "train.jsonl").samples[:8]
    # slowfast_exact=False: the 1.5 costs then need only sizes and frame times (the exact split decodes).
    want = [CostModel(proc, cache=ProbeCache(tmp_path / "a.sqlite"), slowfast_exact=False).estimate(s) for s in plain]
    assert all(given_info(r) is not None for s in stated.samples for r in s.media)

    def no_probe(*a, **k):
        raise AssertionError("probed although the row states the sizes")

    monkeypatch.setattr("keye.data.cost.probe_media", no_probe)
    monkeypatch.setattr("keye.processing.video.probe_video", no_probe)
    cm = CostModel(proc, cache=ProbeCache(tmp_path / "b.sqlite"), slowfast_exact=False)
    assert [cm.estimate(s) for s in stated.samples] == want


def test_stated_sizes_are_checked(tmp_path, tiny_processor):
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "gone.png", "width": 64,
                                                      "height": 0}, {"type": "text", "text": "hi"}]},
                        {"role": "assistant", "content": "ok"}]}
    (tmp_path / "m.jsonl").write_text(json.dumps(row) + "\n")
    ref = read_manifest(tmp_path / "m.jsonl").samples[0].media[0]
    with pytest.raises(KeyeInputError, match="height must be a positive number"):
        given_info(ref)
    row["messages"][0]["content"][0]["height"] = 64  # stated, but the file is missing: still rejected
    (tmp_path / "m.jsonl").write_text(json.dumps(row) + "\n")
    s = read_manifest(tmp_path / "m.jsonl").samples[0]
    with pytest.raises(KeyeInputError, match="file not found"):
        CostModel(tiny_processor, cache=ProbeCache(tmp_path / "c.sqlite")).estimate(s)


def test_estimation_in_workers_equals_one_process(synth_dir, tiny_processor, tmp_path):
    lines = (synth_dir / "train.jsonl").read_text().splitlines()
    lines.insert(3, lines[0].replace("train/000000.", "train/missing.").replace('"train-000000"', '"gone"'))
    path = synth_dir / f"workers-{tmp_path.name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    table = ManifestTable.read(path)
    cm = CostModel(tiny_processor, cache=ProbeCache(tmp_path / "p.sqlite"))
    one, bad_one = estimate_costs(table, cm, shard=(1, 2))
    many, bad_many = estimate_parallel(table, cm, shard=(1, 2), workers=2)
    for name in ("tokens", "patches", "vision_flops", "llm_flops", "ok"):
        assert np.array_equal(getattr(one, name), getattr(many, name)), name
    assert [c == d for c, d in zip(one.objects, many.objects)] == [True] * len(table)
    assert [(b.line, b.id) for b in bad_many] == [(b.line, b.id) for b in bad_one] == [(4, "gone")]
    assert int(many.ok.sum()) == len(range(1, len(table), 2)) - 1
