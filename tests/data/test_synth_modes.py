"""Thinking-mode targets of the synthetic set: traces checked against the scene's objects, the three
formats parsed and format-checked as the modes they claim, token lengths bounded, default set unchanged."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from keye.data.synth import (
    AUTO_LABELS,
    LETTERS,
    THINK_TYPES,
    VIDEO_TYPES,
    generate,
    make_sample,
    make_scene,
    mixed_auto_think,
    mode_rows,
    mode_targets,
    reasoning_trace,
)
from keye.errors import KeyeConfigError
from keye.processing.chat import parse_response
from keye.rewards.format import check_format

TIME = re.compile(r"\d+\.\d")


def _scenes(qtype: str, n: int, image: bool = False):
    for k in range(n):
        sc = make_scene(np.random.default_rng([77, k, len(qtype)]), qtype, image=image)
        target = sc.choices[LETTERS.index(sc.answer)] if sc.choices is not None else sc.answer
        yield sc, target


def _scene_times(sc) -> set[float]:
    """Every time at which something happens in the scene, from the objects themselves (not ``events``)."""
    times = set()
    for o in sc.objects:
        times.add(o.t_appear)
        for t in (o.t_change, o.bounce_at, o.t_vanish):
            if t < sc.duration:
                times.add(t)
    return times


def _think(trace_target: str) -> str:
    return trace_target[len("<think>"): trace_target.index("</think>")]


@pytest.mark.parametrize("image", [False, True])
def test_count_trace_lists_every_object_and_totals_the_answer(image):
    for sc, target in _scenes("count", 40, image):
        trace = reasoning_trace(sc, target)
        listing, step = trace.split("; ")
        items = listing.split(", ")
        assert len(items) == len(sc.objects) == int(sc.answer)
        assert step == f"total {sc.answer}"
        names = sorted(f"{o.color} {o.shape}" for o in sc.objects)
        assert sorted(" ".join(i.split()[:2]) for i in items) == names
        if not image:  # each object with the second it appears, in order of appearance
            appear = [float(i.split(" at ")[1].split()[0]) for i in items]
            assert appear == sorted(o.t_appear for o in sc.objects)
            gone = sum(" gone at " in i for i in items)
            assert gone == sum(o.t_vanish < sc.duration for o in sc.objects)


@pytest.mark.parametrize("qtype", ["when_appear", "when_change", "when_collide", "when_leave"])
def test_when_trace_times_are_scene_times_and_end_on_the_answer(qtype):
    for sc, target in _scenes(qtype, 40):
        trace = reasoning_trace(sc, target)
        times = [float(t) for t in TIME.findall(trace)]
        assert times and set(times) <= _scene_times(sc)
        assert times[-1] == pytest.approx(float(sc.answer))  # the step reads the asked time
        obj = sc.objects[0]
        asked = {"when_appear": obj.t_appear, "when_change": obj.t_change, "when_leave": obj.t_vanish,
                 "when_collide": obj.bounce_at}[qtype]
        assert float(sc.answer) == pytest.approx(asked)


def test_gap_trace_subtracts_the_two_appearance_times():
    for sc, target in _scenes("when_gap", 40):
        trace = reasoning_trace(sc, target)
        listing, step = trace.split("; ")
        first, second = sorted(sc.objects, key=lambda o: o.t_appear)
        assert listing == f"{first.color} {first.shape} at {first.t_appear:.1f}, {second.color} {second.shape} at " \
                          f"{second.t_appear:.1f}"
        assert step == f"{second.t_appear:.1f} - {first.t_appear:.1f} = {target}"
        assert float(target) == second.t_appear - first.t_appear and float(target).is_integer()
        assert f"after the {first.color} {first.shape} appears does the {second.color} {second.shape}" in sc.question


def test_sum_trace_adds_the_three_appearance_times_in_caption_order():
    for sc, target in _scenes("when_sum", 40):
        trace = reasoning_trace(sc, target)
        listing, first_step, second_step = trace.split("; ")
        objs = sorted(sc.objects, key=lambda o: (o.t_appear, o.x))
        assert listing == ", ".join(f"{o.color} {o.shape} at {o.t_appear:.1f}" for o in objs)
        a, b, c = (o.t_appear for o in objs)
        assert first_step == f"{a:.1f} + {b:.1f} = {a + b:.1f}"
        assert second_step == f"{a + b:.1f} + {c:.1f} = {target}" and float(target) == a + b + c
        assert all(float(o.t_appear).is_integer() and 0 <= o.t_appear <= 4 for o in sc.objects)


def test_price_trace_names_each_shape_with_its_price_then_adds_in_caption_order():
    for sc, target in _scenes("price_sum", 40):
        listing, priced, first_step, second_step = reasoning_trace(sc, target).split("; ")
        objs = sorted(sc.objects, key=lambda o: (o.t_appear, o.x))
        assert listing == ", ".join(f"{o.color} {o.shape} at {o.t_appear:.1f}" for o in objs)
        prices = {m.group(1): int(m.group(2)) for m in re.finditer(r"(\w+) (\d)(?:,|\.)", sc.question)}
        a, b, c = (prices[o.shape] for o in objs)
        assert priced == ", ".join(f"{o.shape} {prices[o.shape]}" for o in objs)
        assert first_step == f"{a} + {b} = {a + b}"
        assert second_step == f"{a + b} + {c} = {target}" and int(target) == a + b + c


def test_order_trace_lists_candidate_times_and_names_the_first():
    for sc, target in _scenes("order", 40):
        trace = reasoning_trace(sc, target)
        listing, step = trace.split("; ")
        assert step == f"first {target}"
        first = min(sc.objects, key=lambda o: o.t_appear)
        assert target == f"the {first.color} {first.shape}"
        listed = [(i.rsplit(" at ", 1)[0], float(i.rsplit(" at ", 1)[1])) for i in listing.split(", ")]
        assert listed == sorted(((f"{o.color} {o.shape}", o.t_appear) for o in sc.objects), key=lambda x: x[1])


@pytest.mark.parametrize("qtype", sorted(VIDEO_TYPES) + ["position", "when_gap", "when_sum", "price_sum"])
def test_three_formats_parse_as_their_modes(qtype):
    for sc, target in _scenes(qtype, 6, image=qtype == "position"):
        m = mode_targets(sc, target)
        p_think, p_direct, p_auto = (parse_response(m[k]) for k in ("think", "no_think", "auto"))
        assert (p_think.mode, p_think.answer) == ("think", target)
        assert p_think.think == reasoning_trace(sc, target)
        assert (p_direct.mode, p_direct.answer) == ("no_think", target)
        thinks = qtype in THINK_TYPES
        assert p_auto.mode == ("auto_think" if thinks else "auto_no_think")
        assert p_auto.answer == target
        assert p_auto.analysis == ("/think" if thinks else "/no_think")
        for mode in ("think", "no_think", "auto"):
            assert check_format(m[mode], mode) == (1.0, ""), (qtype, mode, m[mode])


def test_direct_types_are_exactly_the_non_stepwise_ones():
    assert THINK_TYPES == {"count", "order", "when_appear", "when_change", "when_collide", "when_leave", "when_gap",
                           "when_sum", "price_sum"}
    for qtype in ("color", "shape", "direction", "detail", "color_change"):
        sc, target = next(_scenes(qtype, 1))
        assert mode_targets(sc, target)["auto"] == f"<analysis>/no_think</analysis>{target}"


def test_trace_token_lengths_are_bounded():
    from keye.processing.processor import KeyeProcessor
    from keye.tiny import resolve_model_path

    tok = KeyeProcessor.from_pretrained(resolve_model_path("keye-tiny")).tokenizer
    lengths = {}
    for qtype in sorted(THINK_TYPES):
        lengths[qtype] = [len(tok.encode(reasoning_trace(sc, t))) for sc, t in _scenes(qtype, 60)]
    longest = max(max(v) for v in lengths.values())
    mean = float(np.mean([x for v in lengths.values() for x in v]))
    assert longest <= 64, lengths
    assert mean <= 40, mean


DEFAULT_HASHES = {  # sha256 of the manifests of generate(train=24, test=6, seed=7) before modes existed
    "train": "1e50524a435638ea6867b96ac9e2929c1044f6cd0dd0a3197378f6465a4d1fdd",
    "test": "32b07867d052bb56573547de1402d886154fdb44247086c11a2cef8cc4e004ac",
}


def test_default_set_unchanged_and_modes_only_add_columns(tmp_path: Path):
    plain = generate(tmp_path / "plain", train=24, test=6, seed=7, workers=0, progress=False)
    for split, path in plain.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == DEFAULT_HASHES[split]
    assert not (tmp_path / "plain" / "train_modes.jsonl").exists()
    tagged = generate(tmp_path / "modes", train=24, test=6, seed=7, workers=0, progress=False, modes=True)
    for split in ("train", "test"):
        a = [json.loads(x) for x in plain[split].read_text().splitlines()]
        b = [json.loads(x) for x in tagged[split].read_text().splitlines()]
        assert [{k: v for k, v in r.items() if k not in ("modes", "auto_mode")} for r in b] == a
        assert all(r["auto_mode"] == ("think" if r["question_type"] in THINK_TYPES else "no_think") for r in b)
        rows = [json.loads(x) for x in (tmp_path / "modes" / f"{split}_modes.jsonl").read_text().splitlines()]
        assert len(rows) == 3 * len(b)
        for src, (t, d, u) in zip(b, zip(rows[0::3], rows[1::3], rows[2::3])):
            texts = [r["messages"][0]["content"][-1]["text"] for r in (t, d, u)]
            question = src["messages"][0]["content"][-1]["text"]
            assert texts == [question + "/think", question + "/no_think", question]
            assert [r["mode"] for r in (t, d, u)] == ["think", "no_think", "auto"]
            assert [r["messages"][1]["content"][0]["text"] for r in (t, d, u)] == [
                src["modes"]["think"], src["modes"]["no_think"], src["modes"]["auto"]]
            assert t["messages"][0]["content"][0] == src["messages"][0]["content"][0]  # same clip
            assert t["answer"] == src["answer"] and t["id"] == src["id"] + "-think"


def test_mode_rows_rejects_rows_without_modes():
    with pytest.raises(KeyeConfigError, match="row 'x' has no 'modes'"):
        mode_rows([{"id": "x", "messages": []}])


def test_cli_modes_flag(tmp_path: Path):
    from keye.cli import main

    assert main(["data", "synth", "--out", str(tmp_path), "--train", "3", "--test", "0", "--workers", "0",
                 "--no-progress", "--modes"]) == 0
    assert len((tmp_path / "train_modes.jsonl").read_text().splitlines()) == 9


MODES_HASHES = {  # sha256 of the modes manifests of generate(train=24, test=6, seed=7, modes=True) before
    # auto_labels existed: the default labelling ("type") writes the same bytes
    "train_modes.jsonl": "ff9432e314e4a4225e21076f89f1e716f0b40eedc33df0bef59cf9610482681f",
    "test_modes.jsonl": "bd356000b4f012c488046995c7a5233e9a1862f45f0dae3aa67e2ae8730e3d16",
    "train.jsonl": "aba69b29b0fccf7809909ae7fb9d6ac5cb0063994c3425b660f4bb0bb40bf761",
}


@pytest.mark.parametrize("labels", [None, "type"])
def test_type_auto_labels_are_the_default_and_unchanged(tmp_path: Path, labels):
    kw = {} if labels is None else {"auto_labels": labels}
    generate(tmp_path, train=24, test=6, seed=7, workers=0, progress=False, modes=True, **kw)
    for name, digest in MODES_HASHES.items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == digest, name


def test_mixed_decision_is_a_seeded_fair_coin():
    draws = [mixed_auto_think(3, "train", i) for i in range(4000)]
    assert draws == [mixed_auto_think(3, "train", i) for i in range(4000)]  # deterministic
    assert 0.47 < float(np.mean(draws)) < 0.53
    other = [mixed_auto_think(4, "train", i) for i in range(4000)]
    assert 0.4 < float(np.mean([a == b for a, b in zip(draws, other)])) < 0.6  # a new seed, new draws
    test = [mixed_auto_think(3, "test", i) for i in range(4000)]
    assert 0.4 < float(np.mean([a == b for a, b in zip(draws, test)])) < 0.6  # and a new split


def test_mixed_auto_labels_take_both_decisions_on_every_type(tmp_path: Path):
    n = 360
    mixed = generate(tmp_path / "mixed", train=n, test=0, seed=7, workers=0, progress=False, modes=True,
                     auto_labels="mixed")["train"]
    rows = [json.loads(x) for x in mixed.read_text().splitlines()]
    # the same samples as the default labelling: only the auto decision (and its target) differ
    default = generate(tmp_path / "type", train=24, test=0, seed=7, workers=0, progress=False, modes=True)["train"]
    strip = lambda r: {k: v for k, v in r.items() if k not in ("auto_mode", "modes")}  # noqa: E731
    for a, b in zip(rows, (json.loads(x) for x in default.read_text().splitlines())):
        assert strip(a) == strip(b)
        assert {k: a["modes"][k] for k in ("think", "no_think")} == {k: b["modes"][k] for k in ("think", "no_think")}
    by_type: dict[str, list[bool]] = {}
    for i, r in enumerate(rows):
        thinks = r["auto_mode"] == "think"
        assert thinks == mixed_auto_think(7, "train", i)
        by_type.setdefault(r["question_type"], []).append(thinks)
        auto = r["modes"]["auto"]
        parsed = parse_response(auto)
        assert parsed.mode == ("auto_think" if thinks else "auto_no_think")
        assert parsed.analysis == ("/think" if thinks else "/no_think")
        assert parsed.answer == r["messages"][1]["content"][0]["text"]
        if thinks:
            assert auto == "<analysis>/think</analysis>" + r["modes"]["think"]
        assert check_format(auto, "auto") == (1.0, ""), auto
    assert set(by_type) >= set(VIDEO_TYPES)
    for qtype, ds in by_type.items():
        assert any(ds) and not all(ds), (qtype, ds)  # both decisions on every type
        if len(ds) >= 20:
            assert 0.25 <= float(np.mean(ds)) <= 0.75, (qtype, len(ds), float(np.mean(ds)))
    assert 0.42 <= float(np.mean([d for ds in by_type.values() for d in ds])) <= 0.58
    # each sample's label comes from (seed, split, index) alone: rendering it again gives the same row
    for i in (0, 5, n - 1):
        again = make_sample(str(tmp_path / "again"), "train", i, 7, 0.1, True, "mixed")
        assert again == rows[i]


def test_unknown_auto_labels_rejected(tmp_path: Path):
    assert AUTO_LABELS == ("type", "mixed")
    with pytest.raises(KeyeConfigError, match="unknown auto_labels 'random'"):
        generate(tmp_path, train=1, test=0, workers=0, progress=False, modes=True, auto_labels="random")


def test_cli_auto_labels_flag(tmp_path: Path):
    from keye.cli import main

    assert main(["data", "synth", "--out", str(tmp_path), "--train", "8", "--test", "0", "--workers", "0",
                 "--no-progress", "--modes", "--auto-labels", "mixed"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [r["auto_mode"] == "think" for r in rows] == [mixed_auto_think(0, "train", i) for i in range(8)]
