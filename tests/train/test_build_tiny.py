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


def test_shape_twin_changes_every_shape_and_nothing_else():
    rng = np.random.default_rng(1)
    for _ in range(80):
        _, _, objs = see.sample_objects(rng)
        twin = see.shape_twin(objs, rng)
        assert [(o.color, o.size, o.x, o.y) for o in twin] == [(o.color, o.size, o.x, o.y) for o in objs]
        assert all(a.shape != b.shape for a, b in zip(objs, twin))
        coloured = [o.shape for o in twin if o.color != "white"]
        assert len(set(coloured)) == len(coloured)  # a shape still names one coloured object


def test_cell_of_is_the_3x3_grid_cell_row_major():
    from keye.data.synth import Obj

    assert see.cell_of(Obj("circle", "red", 5, 10, 10), 168, 112) == 0
    assert see.cell_of(Obj("circle", "red", 5, 84, 56), 168, 112) == 4
    assert see.cell_of(Obj("circle", "red", 5, 167.9, 111.9), 168, 112) == 8
    assert see.cell_of(Obj("circle", "red", 5, 10, 111), 168, 112) == 6


def test_set_text_encoder_with_positions_tells_places_apart():
    torch.manual_seed(0)
    enc = see.SetTextEncoder(7, 4, 16, 8, positions=True)
    args = (torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([0, 0]), 1)
    here = enc(*args, torch.tensor([0, 8]))
    assert torch.allclose(here, enc(torch.tensor([1, 0]), torch.tensor([3, 2]), torch.tensor([0, 0]), 1,
                                    torch.tensor([8, 0])), atol=1e-6)
    assert not torch.allclose(here, enc(*args, torch.tensor([2, 8])), atol=1e-3)
    with pytest.raises(ValueError, match="cells"):
        enc(*args)


def test_batches_with_twins_pair_each_image_with_its_shape_twin(tiny_init):
    from keye.processing.processor import KeyeProcessor

    batcher = see.Batcher(KeyeProcessor.from_pretrained(tiny_init), seed=3, twin_fraction=1.0)
    b = batcher.batch(10)
    assert b["n"] == 10 and int(b["owner"].max()) == 9 and len(b["grid_thw"]) == 10
    for i in range(0, 10, 2):  # every image is followed by its twin: same colours and cells, other shapes
        a, t = b["owner"] == i, b["owner"] == i + 1
        assert torch.equal(b["colors"][a], b["colors"][t]) and torch.equal(b["cells"][a], b["cells"][t])
        assert (b["shapes"][a] != b["shapes"][t]).all()
        assert torch.equal(b["grid_thw"][i], b["grid_thw"][i + 1])
    plain = see.Batcher(KeyeProcessor.from_pretrained(tiny_init), seed=3).batch(10)
    assert not any(torch.equal(plain["colors"][plain["owner"] == i], plain["colors"][plain["owner"] == i + 1])
                   for i in range(0, 10, 2))
    with pytest.raises(ValueError, match="twin_fraction"):
        see.pretrain_vision(tiny_init, tiny_init.parent / "bad", steps=1, twin_fraction=1.5)


def test_object_map_matches_the_rendered_frame():
    from keye.data.synth import BACKGROUND, COLORS, Scene, render_frame

    rng = np.random.default_rng(4)
    for _ in range(20):
        w, h, objs = see.sample_objects(rng)
        frame = render_frame(Scene(w, h, 0, 0.0, objs, "caption", "", "", "text"), 0.0)
        idx = see.object_map(w, h, objs)
        assert idx.shape == (h, w)
        assert (frame[idx == -1] == np.asarray(BACKGROUND)).all()
        for k, o in enumerate(objs):
            assert (idx == k).any() and (frame[idx == k] == np.asarray(COLORS[o.color])).all()


def test_token_targets_name_the_object_under_each_token():
    from keye.data.synth import COLORS, SHAPES, Obj

    colors, shapes = list(COLORS), list(SHAPES)
    # a 112 x 112 frame, 4 x 4 merged tokens of 28 px: a red square over the middle four tokens, a blue
    # circle filling the top-left token, a tiny green diamond covering < 10 % of the bottom-right one
    objs = [Obj("square", "red", 28 / 0.85, 56, 56), Obj("circle", "blue", 13, 14, 14), Obj("diamond", "green", 3, 98, 98)]
    t = see.token_targets(112, 112, objs, 4, 4, colors, shapes).reshape(4, 4, 2)
    square, red = SHAPES.index("square"), colors.index("red")
    assert all(tuple(t[i, j]) == (square, red) for i in (1, 2) for j in (1, 2))
    assert tuple(t[0, 0]) == (SHAPES.index("circle"), colors.index("blue"))
    assert tuple(t[3, 3]) == (len(shapes), len(colors))  # too little of it to name
    assert tuple(t[0, 3]) == (len(shapes), len(colors))
    # a wide frame, 2 x 3 tokens: the object's token follows the whole-frame resize
    wide = see.token_targets(168, 112, [Obj("triangle", "white", 20, 140, 84)], 2, 3, colors, shapes).reshape(2, 3, 2)
    assert tuple(wide[1, 2]) == (SHAPES.index("triangle"), colors.index("white"))
    assert (wide.reshape(-1, 2)[:5] == [len(shapes), len(colors)]).all()
    assert (see.token_targets(112, 112, [], 2, 2, colors, shapes) == [len(shapes), len(colors)]).all()


def test_token_places_and_dense_heads():
    places = see.token_places(2, 3)
    assert np.allclose(places, [[0.25, 1 / 6], [0.25, 0.5], [0.25, 5 / 6], [0.75, 1 / 6], [0.75, 0.5], [0.75, 5 / 6]])
    torch.manual_seed(0)
    heads = see.DenseHeads(16, 7, 4)
    feats = torch.randn(6, 16, requires_grad=True)
    targets = torch.tensor([[4, 7]] * 5 + [[1, 2]])
    loss = heads.loss(feats, targets, torch.from_numpy(places))
    loss.backward()
    assert loss.item() > 0 and feats.grad.abs().sum() > 0


class _MeanColourTower:
    """A stand-in for keye-tiny's encode_vision: every merged token is the mean RGB of its four patches, so
    the pooled tokens carry colour (and, through the max, a little size) but no shape and no place."""

    class config:  # noqa: N801 - mimics model.config.vision.spatial_merge_size
        class vision:  # noqa: N801
            spatial_merge_size = 2

    def encode_vision(self, pixel_values, grid_thw):
        per_patch = pixel_values.mean(dim=(-1, -2))  # [patches, 3]
        return per_patch.view(-1, 4, 3).mean(1)


def test_linear_probes_read_what_the_tokens_carry_and_nothing_more(tiny_init):
    from keye.processing.processor import KeyeProcessor

    probe = _load("probe_vision")
    res = probe.probe_tokens(_MeanColourTower(), KeyeProcessor.from_pretrained(tiny_init), n=400, seed=0)
    assert set(res) == {"shape", "colour", "x", "y"}
    assert res["colour"]["accuracy"] >= 0.95
    for name in ("shape", "x", "y"):  # mean colour says nothing about them: near the majority class
        assert res[name]["accuracy"] < res[name]["majority"] + 0.2, (name, res[name])
    with pytest.raises(ValueError, match="at least 8"):
        probe.probe_tokens(_MeanColourTower(), KeyeProcessor.from_pretrained(tiny_init), n=4)


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
                                  eval_images=16, twin_fraction=0.5, positions=True, probe_images=16,
                                  dense_weight=1.0)
    assert metrics["twin_fraction"] == 0.5 and metrics["positions"] is True and metrics["dense_weight"] == 1.0
    assert set(metrics["probe"]) == {"shape", "colour", "x", "y"}
    assert all(0.0 <= v["accuracy"] <= 1.0 and 0.0 < v["majority"] <= 1.0 for v in metrics["probe"].values())
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
    report["probe"] = {"after see": {"shape": {"accuracy": 0.957, "majority": 0.27}},
                       "final": {"shape": {"accuracy": 0.5, "majority": 0.27}}}
    md = build.report_markdown(report)
    assert "| linear probe on the vision tokens | shape |" in md
    assert "| after see | 95.7 % (majority 27 %) |" in md and "| final | 50.0 % (majority 27 %) |" in md
    assert "Built with" not in md  # a report from before the field, or a default build, says nothing extra
    report["scene_options"] = {"detail_cut": False, "position_weight": 1.0}
    report["stage2_overrides"] = []
    assert "Built with" not in build.report_markdown(report)
    report["stage2_overrides"] = ["train.seed=1"]
    assert build.report_markdown(report).startswith("Built with the scene options {'detail_cut': False, "
                                                    "'position_weight': 1.0} and the stage-2 overrides ['train.seed=1'].")
    report["scene_options"] = {"detail_cut": True, "position_weight": 3.0}
    report["stage2_overrides"] = []
    assert "{'detail_cut': True, 'position_weight': 3.0} and the stage-2 overrides none." in build.report_markdown(report)


def test_stage_figures_keep_the_wall_time_of_the_build_that_trained_the_stage(tmp_path):
    """A resumed build reuses a finished stage; its report still gives the time that stage took when it was
    trained (recorded in the stage's folder), not a blank, and never invents one."""
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 2, "samples": 8, "first_loss": 2.0,
                                                       "final_loss": 1.0}))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n')
    assert build.sft_stage_figures(tmp_path, None)["seconds"] is None  # reused, nothing recorded
    trained = build.sft_stage_figures(tmp_path, 123.4)
    assert trained["seconds"] == 123.4 and trained["loss_curve"] == [[1, 2.0], [2, 1.0]]
    assert build.sft_stage_figures(tmp_path, None)["seconds"] == 123.4  # reused: the recorded time


OPTS = {"detail_cut": True, "position_weight": 3.0}


DEFAULT = ["--no-detail-cut", "--position-weight", "1"]


def _resume_check(tmp_path: Path, files: dict[str, str], asked: list[str]):
    """Run a copy of build_tiny.py whose repository is ``tmp_path`` (holding ``files``, paths under data/)
    with ``asked``; --see-steps 0, no unseen seeds and 2-sample sets keep it short. A build its checks accept
    then fails later, on the missing caption / init inputs, which is not what these tests are about."""
    import subprocess

    (tmp_path / "training").mkdir()
    (tmp_path / "training/build_tiny.py").write_text((REPO / "training/build_tiny.py").read_text())
    for rel, text in files.items():
        (tmp_path / "data" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / rel).write_text(text)
    return subprocess.run([sys.executable, str(tmp_path / "training/build_tiny.py"), "--unseen-seeds",
                           "--see-steps", "0", "--warmup", "0", "--train", "2", "--test", "2", *asked],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("sets, asked, ok", [
    ({"synth": None}, DEFAULT, True),  # a set from before the options existed is the default set
    ({"synth": None}, [], True),  # the build's options: its questions are drawn into data/synth/options
    ({"synth": OPTS}, [], False),  # data/synth drawn with the options (the layout before 2026-12-06)
    ({"synth": OPTS}, DEFAULT, False),
    ({"synth": None, "synth/options": OPTS}, [], True),
    ({"synth": None, "synth/options": OPTS}, ["--position-weight", "2"], False),
    ({"synth": None, "synth/options": OPTS}, ["--no-detail-cut"], False),
])
def test_a_resumed_build_refuses_a_set_drawn_with_other_scene_options(tmp_path, sets, asked, ok):
    """build_tiny.py resumes from whatever data/synth holds, so it checks each set's scene options first
    (before any training; the check is what this runs, in a copy of the script whose repository is tmp):
    data/synth is the default set, data/synth/options the questions drawn with the asked options."""
    files = {f"{where}/test.jsonl": "" for where in sets}
    files.update({f"{where}/scene_options.json": json.dumps(recorded) for where, recorded in sets.items()
                  if recorded is not None})
    proc = _resume_check(tmp_path, files, asked)
    refused = proc.returncode == 2 and "was generated with the scene options" in proc.stderr
    assert refused != ok, proc.stderr[-2000:]


@pytest.mark.parametrize("asked, ok", [([], False), (["--questions", "3"], True), (["--questions", "4"], False),
                                       (["--questions", "3", *DEFAULT], False)])
def test_a_resumed_build_refuses_an_options_set_of_another_size(tmp_path, asked, ok):
    """The options' questions are drawn once; a build asking for another number of them (``--questions``,
    default ``--train``) stops instead of training stage 2 on the old count."""
    proc = _resume_check(tmp_path, {"synth/test.jsonl": "", "synth/options/test.jsonl": "",
                                    "synth/options/scene_options.json": json.dumps(OPTS),
                                    "synth/options/train.jsonl": "{}\n{}\n{}\n"}, asked)
    refused = proc.returncode == 2 and ("training questions, this build asks for" in proc.stderr
                                        or "--questions sizes the options' set" in proc.stderr)
    assert refused != ok, proc.stderr[-2000:]


def test_drill_rows_join_another_manifest_with_their_media_and_unique_ids(tmp_path):
    """Stage 3's data: the drilled types of a split drawn into a subfolder, appended to stage 2's rows, parse
    as one manifest with no duplicate ids, every medium resolving to the file the split rendered."""
    from keye.data.manifest import read_manifest
    from keye.data.synth import generate_split

    questions = tmp_path / "options"
    generate_split(questions, "train", 6, seed=0, workers=0, progress=False, image_fraction=0.5)
    generate_split(questions / "drill", "train", 24, seed=11, workers=0, progress=False, image_fraction=0.5)
    drilled = [json.loads(line) for line in (questions / "drill/train.jsonl").read_text().splitlines()]
    types = tuple(sorted({r["question_type"] for r in drilled})[:2])
    rows = build.drill_rows(questions / "drill/train.jsonl", "drill", types)
    assert [r["id"] for r in rows] == [f"drill-{r['id']}" for r in drilled if r["question_type"] in types]
    joined = questions / "drill_mix.jsonl"
    joined.write_text((questions / "train.jsonl").read_text() + "".join(json.dumps(r) + "\n" for r in rows))
    manifest = read_manifest(joined)
    assert manifest.bad_rows == [] and len(manifest) == 6 + len(rows)
    for sample in manifest.samples[6:]:
        assert sample.row["question_type"] in types
        assert all(Path(m.path).is_file() and Path(m.path).is_relative_to(questions / "drill") for m in sample.media)
    with pytest.raises(ValueError, match="no questions of the drilled types"):
        build.drill_rows(questions / "drill/train.jsonl", "drill", ("no_such_type",))


def test_think_figures_and_the_report_show_traces_and_greetings(tmp_path):
    out = tmp_path / "think"
    out.mkdir()
    (out / "scores.json").write_text(json.dumps({"overall": {"accuracy": 0.5}}))
    raw = ["<think>red circle left</think>red", "<think> </think>blue", "green", "<think>a square</think>"]
    (out / "predictions.jsonl").write_text("".join(json.dumps({"raw_output": r}) + "\n" for r in raw))
    fig = build.think_figures(out)
    assert fig == {"accuracy": 50.0, "traced": 50.0}  # an empty trace and no trace do not count
    ev = {"n": 4, "real": 75.0, "blank": 25.0, "majority": 50.0, "question_type": {}, "think": fig}
    md = build.report_markdown({"stages": {}, "evals": {"unseen seed 7, free-form": ev},
                                "chat": [{"prompt": "Hello", "reply": "Hello! I am keye-tiny."}]})
    assert "With `/think`: 50.0 % correct, a non-empty trace in 50.0 % of the replies." in md
    assert "| Hello | Hello! I am keye-tiny. |" in md
