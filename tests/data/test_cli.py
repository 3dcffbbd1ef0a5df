"""``keye data check / synth / clip-filter`` through the real ``keye`` entry point."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import open_clip
import torch

from keye.cli import main
from keye.data.manifest import read_manifest


def test_check_lists_bad_rows_and_summary(synth_dir: Path, tmp_path: Path, capsys, tiny_processor):
    root = tmp_path / "set"
    shutil.copytree(synth_dir, root)
    lines = (root / "train.jsonl").read_text().splitlines()
    lines.insert(1, '{"messages": 3}')
    lines.append(lines[0].replace('"train-000000"', '"gone"').replace("000000.", "424242."))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    cache = ["--cache", str(tmp_path / "c.sqlite")]
    assert main(["data", "check", str(root / "train.jsonl"), *cache]) == 1
    out = capsys.readouterr().out
    assert "line 2: missing or empty 'messages' list" in out
    assert "line 26 (gone)" in out and "file not found" in out
    assert "rows: 26  valid: 24  bad: 2" in out and "(approximate" in out
    proc_dir = tmp_path / "proc"
    tiny_processor.save_pretrained(proc_dir)
    assert main(["data", "check", str(synth_dir / "train.jsonl"), "--json", "--processor", str(proc_dir), *cache]) == 0
    rep = json.loads(capsys.readouterr().out)
    s = rep["summary"]
    assert rep["bad_rows"] == [] and s["tokens_exact"] and s["valid"] == 24
    assert s["modalities"]["image"] + s["modalities"]["video"] == 24 == s["images"] + s["videos"]
    meta = [json.loads(x)["meta"] for x in (synth_dir / "train.jsonl").read_text().splitlines()]
    assert abs(s["video_seconds"] - sum(m["duration"] for m in meta)) < 1e-3


def test_synth_command(tmp_path: Path, capsys):
    rc = main(["data", "synth", "--out", str(tmp_path / "s"), "--train", "5", "--test", "2", "--seed", "1",
               "--workers", "0", "--no-progress"])
    assert rc == 0
    assert len(read_manifest(tmp_path / "s" / "train.jsonl")) == 5
    assert len(read_manifest(tmp_path / "s" / "test.jsonl")) == 2
    assert "samples/s" in capsys.readouterr().err


def test_clip_filter_command(tmp_path: Path, synth_dir: Path, capsys):
    cfg = tmp_path / "cli-tiny-clip.json"
    cfg.write_text(json.dumps({
        "embed_dim": 8,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "head_width": 8, "patch_size": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
    }))
    open_clip.add_model_config(cfg)
    torch.save(open_clip.create_model("cli-tiny-clip").state_dict(), tmp_path / "w.pt")
    out = tmp_path / "kept.jsonl"
    rc = main(["data", "clip-filter", str(synth_dir / "train.jsonl"), "--out", str(out), "--model-config", str(cfg),
               "--checkpoint", str(tmp_path / "w.pt"), "--threshold", "-2", "--drop-non-pairs"])
    assert rc == 0
    kept = read_manifest(out)
    n_img = sum(s.modality == "image" for s in read_manifest(synth_dir / "train.jsonl").samples)
    assert len(kept) == n_img and all("clip_score" in s.row for s in kept.samples)  # cosine > -2 always
    assert f"kept {n_img}, dropped 0" in capsys.readouterr().out
