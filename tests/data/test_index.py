"""The indexed training set (keye data index): every source form gives the same samples, costs and rank
assignment as the JSONL file; bad rows and unreadable shards are listed, never fatal; re-indexing touches only
new shards; the loader over an index resumes exactly and reads only its own rank's samples; the streaming
check reports what check_manifest reports."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
import tarfile
from pathlib import Path

import pytest

from keye.data.check import check_source
from keye.data.cost import CostModel
from keye.data.index import IndexTable, build_index
from keye.data.loader import build_dataloader
from keye.data.manifest import check_manifest, read_manifest
from keye.data.probe import ProbeCache


def _index(sources, out, processor, cache, **kw):
    kw.setdefault("workers", 0)
    return build_index([str(s) for s in sources], out, processor=processor, cache=cache.path, progress=False, **kw)


def _digest(path: str) -> str:
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()


def _conversation(sample) -> str:
    """The messages with each media path replaced by its file's digest (a tar's media are extracted elsewhere)."""
    msgs = json.loads(json.dumps(sample.messages))
    for m in msgs:
        for item in m["content"] if isinstance(m["content"], list) else []:
            for k in ("image", "video"):
                if k in item:
                    item[k] = [_digest(p) for p in item[k]] if isinstance(item[k], list) else _digest(item[k])
    return json.dumps(msgs, sort_keys=True)


def _write_forms(manifest: Path, out: Path) -> dict[str, str]:
    """The same rows as JSONL shards (a glob), Parquet, a WebDataset tar, a saved datasets folder, file:// and
    memory:// URLs; returns form -> source."""
    import datasets
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = manifest.parent
    rows = [json.loads(x) for x in manifest.read_text().splitlines() if x.strip()]
    for k in range(3):  # shards next to the manifest: the same relative media paths
        (root / f"part-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[k * 4:(k + 1) * 4]))
    as_text = [{**r, "messages": json.dumps(r["messages"]), "meta": json.dumps(r.get("meta"))} for r in rows]
    pq.write_table(pa.Table.from_pylist(as_text), root / "train.parquet", row_group_size=5)
    datasets.Dataset.from_list(as_text).save_to_disk(str(root / "train_hf"))
    with tarfile.open(root / "train.tar", "w") as tar:
        for r in rows:
            key = r["id"]
            r = json.loads(json.dumps(r))
            for m in r["messages"]:
                for item in m["content"] if isinstance(m["content"], list) else []:
                    for kind in ("image", "video"):
                        if kind in item:
                            src = root / item[kind]
                            name = f"{key}.{kind}{src.suffix}"
                            tar.add(src, arcname=name)
                            item[kind] = name
            data = json.dumps(r).encode()
            info = tarfile.TarInfo(f"{key}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    mem = fsspec.filesystem("memory")
    mem.pipe(f"/{out.name}/train.jsonl", manifest.read_bytes())
    for r in rows:
        for m in r["messages"]:
            for item in m["content"] if isinstance(m["content"], list) else []:
                for kind in ("image", "video"):
                    if kind in item:
                        mem.pipe(f"/{out.name}/{item[kind]}", (root / item[kind]).read_bytes())
    return {"jsonl shards": str(root / "part-*.jsonl"), "parquet": str(root / "train.parquet"),
            "webdataset": str(root / "train.tar"), "datasets": str(root / "train_hf"),
            "file url": f"file://{manifest}", "memory url": f"memory://{out.name}/train.jsonl"}


def test_every_source_form_gives_the_same_samples_costs_and_ranks(small_synth: Path, tiny_processor, cache,
                                                                    tmp_path: Path):
    root = tmp_path / "set"
    shutil.copytree(small_synth.parent, root)
    manifest = root / "train.jsonl"
    forms = _write_forms(manifest, tmp_path)
    ref = read_manifest(manifest)
    cm = CostModel(tiny_processor, cache=ProbeCache(tmp_path / "ref.sqlite"))  # an independent cache
    ref_costs = [cm.estimate(s) for s in ref.samples]
    ref_conv = [_conversation(s) for s in ref.samples]
    kw = dict(batch_tokens=2048, micro_batches=2, world_size=2, num_workers=0, seed=4, probe_cache=cache)
    ref_plan = [build_dataloader(manifest, tiny_processor, rank=r, **kw).sampler.micro_batches_for(0) for r in (0, 1)]
    for form, source in {"jsonl": str(manifest), **forms}.items():
        out = tmp_path / f"index-{form.replace(' ', '-')}"
        rep = _index([source], out, tiny_processor, cache)
        assert (rep.samples, rep.bad, rep.bad_shards) == (12, 0, []), (form, rep.format())
        table = IndexTable(out)
        assert [table.sample(i).id for i in range(12)] == [s.id for s in ref.samples], form
        assert [_conversation(table.sample(i)) for i in range(12)] == ref_conv, form
        stored = table.stored_costs(table.fingerprint)
        assert stored.tokens.tolist() == [c.tokens for c in ref_costs], form
        assert stored.flops.tolist() == pytest.approx([c.flops for c in ref_costs], rel=1e-12), form
        plan = []
        for r in (0, 1):
            dl = build_dataloader(out, tiny_processor, rank=r, **kw)
            assert dl.costs.objects is None  # the stored columns, not estimated again
            plan.append(dl.sampler.micro_batches_for(0))
        assert plan == ref_plan, form


def test_corrupt_shards_are_named_and_skipped(small_synth: Path, tiny_processor, cache, tmp_path: Path):
    src = tmp_path / "shards"
    src.mkdir()
    lines = small_synth.read_text().splitlines()
    for name, part in (("a.jsonl", lines[:6]), ("b.jsonl", lines[6:])):
        text = "\n".join(part).replace('"media/', f'"{small_synth.parent}/media/')
        (src / name).write_text(text + "\n{not json\n")
    (src / "c.tar").write_bytes(b"this is not a tar archive" * 40)
    (src / "d.parquet").write_bytes(b"PAR1 garbage")
    rep = _index([src], tmp_path / "index", tiny_processor, cache, workers=2)  # a tar failing in a worker process
    assert sorted(Path(u).name for u, _ in rep.bad_shards) == ["c.tar", "d.parquet"]
    assert "bad shard (skipped):" in rep.format() and "c.tar" in rep.format()
    assert (rep.samples, rep.bad) == (12, 2)
    table = IndexTable(tmp_path / "index")
    assert sorted(b.reason for b in table.bad_rows)[0].startswith("a.jsonl: invalid JSON")
    assert [table.where(i) for i in (0, 6)] == ["a.jsonl:1", "b.jsonl:1"]


def test_reindexing_adds_a_shard_without_probing_the_old(small_synth: Path, tiny_processor, cache, tmp_path: Path,
                                                         monkeypatch):
    import keye.data.probe as probe

    calls: list[str] = []
    real = probe.probe_file
    monkeypatch.setattr(probe, "probe_file", lambda kind, path, c=None: (calls.append(path), real(kind, path, c))[1])
    src = tmp_path / "shards"
    src.mkdir()
    lines = small_synth.read_text().replace('"media/', f'"{small_synth.parent}/media/').splitlines()
    (src / "a.jsonl").write_text("\n".join(lines[:8]) + "\n")
    _index([src], tmp_path / "index", tiny_processor, cache)
    first = set(calls)
    assert first and len(IndexTable(tmp_path / "index")) == 8
    calls.clear()
    (src / "b.jsonl").write_text("\n".join(lines[8:]) + "\n")
    rep = _index([src], tmp_path / "index", tiny_processor, cache)
    assert (rep.indexed, rep.skipped, rep.samples) == (1, 1, 12)
    new_media = {m.path for s in read_manifest(src / "b.jsonl").samples for m in s.media}
    assert calls and set(calls) <= new_media  # only the new shard's media were probed
    table = IndexTable(tmp_path / "index")
    assert [table.sample(i).id for i in range(12)] == [json.loads(x)["id"] for x in lines]


def test_resume_mid_epoch_on_an_index_equals_the_uninterrupted_order(small_synth: Path, tiny_processor, cache,
                                                                     tmp_path: Path):
    _index([small_synth], tmp_path / "index", tiny_processor, cache)
    kw = dict(world_size=2, rank=0, seed=3, num_workers=1, batch_tokens=2048, micro_batches=2, probe_cache=cache)

    def ids(dl, n=None):
        out = []
        for b in dl:
            out.append((b["epoch"], b["micro_batch"], tuple(b["sample_ids"]), int(b["input_ids"].sum())))
            if n is not None and len(out) == n:
                break
        return out

    full = ids(build_dataloader(tmp_path / "index", tiny_processor, **kw))
    first = build_dataloader(tmp_path / "index", tiny_processor, **kw)
    got = ids(first, 2)
    state = pickle.loads(pickle.dumps(first.state_dict()))  # what a checkpoint keeps
    del first  # the run is killed here
    resumed = build_dataloader(tmp_path / "index", tiny_processor, **kw)
    resumed.load_state_dict(state)
    assert got + ids(resumed) == full and len(full) > 2


def test_each_rank_reads_only_its_own_samples(small_synth: Path, tiny_processor, cache, tmp_path: Path, monkeypatch):
    _index([small_synth], tmp_path / "index", tiny_processor, cache)
    read: list[int] = []
    real = IndexTable.sample
    monkeypatch.setattr(IndexTable, "sample", lambda self, i: (read.append(i), real(self, i))[1])
    dl = build_dataloader(tmp_path / "index", tiny_processor, world_size=2, rank=1, batch_tokens=2048, num_workers=0,
                          probe_cache=cache)
    assert read == []  # planning used the stored cost columns only
    mine = sorted(i for mb in dl.sampler.micro_batches_for(0) for i in mb)
    for _ in dl:
        pass
    assert sorted(read) == mine and len(mine) < 12


def test_streaming_check_reports_what_check_manifest_reports(small_synth: Path, tiny_processor, cache,
                                                             tmp_path: Path):
    root = tmp_path / "set"
    shutil.copytree(small_synth.parent, root)
    lines = (root / "train.jsonl").read_text().splitlines()
    lines[3:3] = ["{broken", lines[0], lines[1].replace("train-000001", "missing").replace("000001.", "999999.")]
    lines.append(json.dumps({"id": "multi", "messages": [{"role": "user", "content": "q"}], "answers": ["a", "bb b"]}))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    for proc in (None, tiny_processor):
        want = check_manifest(root / "train.jsonl", processor=proc, cache=cache)
        got = check_source(root / "train.jsonl", processor=proc, cache=cache, workers=0)
        assert got.format() == want.format()
        _index([root / "train.jsonl"], tmp_path / f"index-{proc is None}", proc, cache)
        on_index = check_source(tmp_path / f"index-{proc is None}", processor=proc, cache=cache)
        assert on_index.summary == want.summary
        assert [(b.line, b.id) for b in on_index.bad_rows] == [(b.line, b.id) for b in want.bad_rows]


@pytest.mark.slow
def test_torchrun_two_ranks_on_an_index_equal_the_one_process_run(small_synth: Path, tmp_path: Path):
    from keye.processing.processor import KeyeProcessor
    from keye.testing.processor import make_tiny_processor_dir
    from tests.torchrun import torchrun

    proc_dir = make_tiny_processor_dir(tmp_path / "proc", "preview")
    proc = KeyeProcessor.from_pretrained(proc_dir)
    cache = ProbeCache(tmp_path / "probe.sqlite")
    _index([small_synth], tmp_path / "index", proc, cache)
    out = tmp_path / "result.json"
    torchrun([Path(__file__).with_name("dist_index_worker.py"), tmp_path / "index", proc_dir, cache.path, out],
             timeout=300)
    ranks = json.loads(out.read_text())
    assert [(r["rank"], r["world"], r["stored"]) for r in ranks] == [(0, 2, True), (1, 2, True)]
    for r in ranks:  # the same micro-batches as the one-process loader planning for that rank
        dl = build_dataloader(tmp_path / "index", proc, batch_tokens=2048, micro_batches=2, num_workers=0, seed=6,
                              probe_cache=cache, world_size=2, rank=r["rank"])
        assert [[b["sample_ids"], int(b["input_ids"].sum())] for b in dl] == r["batches"]
        assert r["read"] == sorted(i for ids, _ in r["batches"] for i in ids)  # it read only its own samples
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) >= 2
    assert sorted(ranks[0]["read"] + ranks[1]["read"]) == list(range(12))  # together: every sample once


def test_cli_index_then_check(small_synth: Path, cache, tmp_path: Path, capsys):
    from keye.cli import main

    out = tmp_path / "index"
    assert main(["data", "index", str(small_synth), "--out", str(out), "--workers", "0", "--cache", str(cache.path),
                 "--no-progress"]) == 0
    assert f"index {out}: 12 samples in 1 shard(s), 0 bad rows" in capsys.readouterr().out
    assert main(["data", "check", str(out), "--cache", str(cache.path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bad_rows"] == [] and report["summary"]["valid"] == 12
    assert report["summary"] == check_manifest(small_synth, cache=cache).summary
