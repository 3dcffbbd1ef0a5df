"""keye-tiny's build (training/build_tiny.py) and its contrastive vision stage (training/pretrain_vision.py):
the stills match their object lists, retrieval accuracy is counted right, a short contrastive run trains
the tower and projector only, and the build report's figures are the ``keye eval synth`` scores."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / f"training/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


see = _load("pretrain_vision")
build = _load("build_tiny")


def test_stills_hold_distinct_objects_drawn_where_they_are_listed():
    from keye.data.synth import COLORS, Scene, render_frame

    rng = np.random.default_rng(0)
    tiny = 0
    for _ in range(60):
        w, h, objs = see.sample_objects(rng)
        frame = render_frame(Scene(w, h, 0, 0.0, objs, "caption", "", "", "text"), 0.0).astype(int)
        assert 1 <= len(objs) <= 4
        assert len({o.color for o in objs}) == len(objs)  # a colour names one object
        tiny += any(o.color == "white" and o.size <= max(5.0, min(w, h) * 0.06) for o in objs)
        for o in objs:  # every listed object is on the canvas in its colour, at its centre
            cx, cy = int(o.x), int(o.y)
            assert np.abs(frame[cy, cx] - np.asarray(COLORS[o.color])).sum() == 0, (o, w, h)
    assert 0 < tiny < 60


def test_retrieval_accuracy_counts_top1_and_identical_captions():
    txt = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])  # captions 1 and 2 are the same
    img = torch.tensor([[1.0, 0.1], [0.2, 1.0], [1.0, -0.1]])  # image 2 looks like caption 0
    i2t, t2i = see.retrieval_accuracy(img, txt)
    assert i2t == pytest.approx(2 / 3)  # image 1 -> caption 1 or 2 (both its own), image 2 wrong
    # caption 0 -> image 0 (right: sim 1.0 vs 1.0 ties go to the first), captions 1, 2 -> image 1 (2 is right too)
    assert t2i == pytest.approx(1.0)


def test_set_text_encoder_ignores_order_and_keeps_binding():
    torch.manual_seed(0)
    enc = see.SetTextEncoder(7, 4, 16, 8)
    one = enc(torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([0, 0]), 1)
    swapped = enc(torch.tensor([1, 0]), torch.tensor([3, 2]), torch.tensor([0, 0]), 1)
    rebound = enc(torch.tensor([0, 1]), torch.tensor([3, 2]), torch.tensor([0, 0]), 1)
    assert torch.allclose(one, swapped, atol=1e-6)
    assert not torch.allclose(one, rebound, atol=1e-3)  # red circle + blue square != red square + blue circle


@pytest.fixture(scope="module")
def tiny_init(tmp_path_factory):
    from keye.data.synth import generate

    root = tmp_path_factory.mktemp("tiny_build")
    paths = generate(root / "synth", train=60, test=0, seed=0, workers=0, progress=False)
    init = root / "init"
    build.build_init(init, paths["train"], root / "synth" / "train_captions.jsonl")
    return init


def test_contrastive_stage_trains_the_tower_only(tiny_init, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "see"
    metrics = see.pretrain_vision(tiny_init, out, steps=4, batch_size=8, eval_every=2, progress=False,
                                  eval_images=16)
    assert [p["step"] for p in metrics["curve"]] == [0, 2, 4]
    for p in metrics["curve"]:
        assert 0.0 <= p["image_to_caption"] <= 1.0 and 0.0 <= p["caption_to_image"] <= 1.0
    assert json.loads((out / "metrics.json").read_text())["curve"] == metrics["curve"]
    before, after = load_file(tiny_init / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(("visual.", "mlp_AR.")) for k in changed)
    assert any(k.startswith("visual.") for k in changed) and any(k.startswith("mlp_AR.") for k in changed)
    for name in ("tokenizer.json", "preprocessor_config.json", "chat_template.json"):
        assert (out / name).read_bytes() == (tiny_init / name).read_bytes()


def _scores(tmp_path: Path, name: str, responses: dict[str, str], items: list[dict]) -> Path:
    from keye.eval.synth import score_records

    recs = [{**it, "response": responses[it["id"]]} for it in items]
    result = score_records(recs)
    result.pop("per_item")
    out = tmp_path / name
    out.mkdir()
    (out / "scores.json").write_text(json.dumps(result))
    return out


def test_eval_figures_and_report_come_from_the_scores(tmp_path):
    items = [
        {"id": "a", "answer": "B", "answer_kind": "mc", "question_type": "color", "choices": ["red", "blue"]},
        {"id": "b", "answer": "A", "answer_kind": "mc", "question_type": "color", "choices": ["red", "blue"]},
        {"id": "c", "answer": "A", "answer_kind": "mc", "question_type": "color", "choices": ["green", "red"]},
        {"id": "d", "answer": "2", "answer_kind": "numeric", "question_type": "count"},
        {"id": "e", "answer": "3", "answer_kind": "numeric", "question_type": "count"},
    ]
    real = _scores(tmp_path, "real", {"a": "blue", "b": "red", "c": "B", "d": "2", "e": "3"}, items)
    blank = _scores(tmp_path, "blank", {"a": "red", "b": "red", "c": "red", "d": "1", "e": "1"}, items)
    ev = build.eval_figures(real, blank)
    # real: a, b right (option texts), c wrong (B); d, e right -> 4 / 5. blank: only b -> 1 / 5.
    assert (ev["n"], ev["real"], ev["blank"]) == (5, 80.0, 20.0)
    assert ev["question_type"]["color"] == {"n": 3, "real": 66.7, "blank": 33.3, "majority": 66.7}
    assert ev["question_type"]["count"] == {"n": 2, "real": 100.0, "blank": 0.0, "majority": 50.0}
    assert ev["majority"] == 60.0  # "A" for colour (2 of 3), "2" for count (1 of 2)
    report = {"stages": {"2, questions": {"steps": 3, "samples": 30, "first_loss": 2.0, "final_loss": 0.5,
                                          "loss_curve": [[1, 2.0], [2, 1.0], [3, 0.5]], "seconds": 60.0}},
              "evals": {"unseen seed 7": ev}, "demo": [{"question_type": "order", "answer": "B",
                                                       "response": "the red circle", "correct": True}]}
    md = build.report_markdown(report)
    assert "| 2, questions | 3 | 30 | 2.00 -> 0.500 |" in md and "| 1.0 |" in md
    assert "**unseen seed 7** (5 questions): real **80.0 %**, blank clips 20.0 %, majority answer 60.0 %" in md
    assert "| color | 3 | 66.7 | 33.3 | 66.7 |" in md and "| order | B | the red circle | yes |" in md
