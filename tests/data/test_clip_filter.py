"""CLIP-score filtering with a tiny randomly initialised open_clip model built from a model config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from keye.data.clip_filter import ClipScorer, clip_filter_manifest, pair_text
from keye.data.manifest import read_manifest, write_manifest
from keye.errors import KeyeConfigError

TINY = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> tuple[Path, Path]:
    """(config json, checkpoint) of a random tiny open_clip model."""
    d = tmp_path_factory.mktemp("clip")
    cfg = d / "keye-tiny-clip.json"
    cfg.write_text(json.dumps(TINY))
    open_clip.add_model_config(cfg)
    torch.manual_seed(0)
    model = open_clip.create_model("keye-tiny-clip")
    torch.save(model.state_dict(), d / "tiny.pt")
    return cfg, d / "tiny.pt"


def _dataset(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(10):
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(tmp_path / "img" / f"{i}.png")
        rows.append({
            "id": f"p{i}",
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": f"img/{i}.png"}, {"type": "text", "text": "Describe."}]},
                {"role": "assistant", "content": [{"type": "text", "text": f"a photo of thing number {i}"}]},
            ],
        })
    (tmp_path / "img" / "bad.png").write_bytes(b"not a png")
    rows.append({"id": "bad", "messages": [{"role": "user", "content": [{"type": "image", "image": "img/bad.png"}]},
                                           {"role": "assistant", "content": "caption"}]})
    rows.append({"id": "text", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    write_manifest(tmp_path / "in.jsonl", rows)
    return tmp_path / "in.jsonl"


def test_filter_keeps_exactly_the_pairs_above_threshold(tmp_path: Path, tiny_clip):
    cfg, ckpt = tiny_clip
    src = _dataset(tmp_path)
    scorer = ClipScorer.load("ignored", ckpt, model_config=cfg)
    # Independent reference: the same checkpoint through plain open_clip calls.
    ref_model, _, pre = open_clip.create_model_and_transforms("keye-tiny-clip", pretrained=str(ckpt))
    ref_model.eval()
    tok = open_clip.get_tokenizer("keye-tiny-clip")
    man = read_manifest(src)
    ref = {}
    with torch.no_grad():
        for s in man.samples[:10]:
            a = ref_model.encode_image(pre(Image.open(s.media[0].path).convert("RGB"))[None])
            b = ref_model.encode_text(tok([pair_text(s)]))
            ref[s.id] = torch.nn.functional.cosine_similarity(a, b).item()
    threshold = float(np.median(list(ref.values())))
    out = tmp_path / "out" / "kept.jsonl"
    rep = clip_filter_manifest(src, out, scorer, threshold=threshold, batch_size=4)
    kept = read_manifest(out)
    assert not kept.bad_rows
    want = sorted(k for k, v in ref.items() if v > threshold) + ["text"]
    assert sorted(s.id for s in kept.samples) == sorted(want)
    for s in kept.samples:
        if s.id != "text":
            assert s.row["clip_score"] == pytest.approx(ref[s.id], abs=1e-5)
            assert Path(s.media[0].path).is_file()  # paths re-based onto the output directory
    assert rep.kept == 5 and rep.dropped == 5 and rep.passed_through == 1
    assert [b.id for b in rep.bad] == ["bad"]
    assert "kept 5, dropped 5" in rep.format()
    rep2 = clip_filter_manifest(src, tmp_path / "k2.jsonl", scorer, threshold=threshold, drop_non_pairs=True)
    assert rep2.passed_through == 0 and rep2.kept == 5
    cs = scorer.score([Image.new("RGB", (8, 8))], ["x"], "clipscore")
    assert cs.item() == pytest.approx(2.5 * max(scorer.cosine([Image.new("RGB", (8, 8))], ["x"]).item(), 0.0))


def test_bad_configuration_is_typed(tmp_path: Path, tiny_clip):
    cfg, _ = tiny_clip
    with pytest.raises(KeyeConfigError, match="not found"):
        ClipScorer.load("x", tmp_path / "nope.pt", model_config=cfg)
    with pytest.raises(KeyeConfigError, match="cannot build"):
        ClipScorer.load("no-such-arch")
