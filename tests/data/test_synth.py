"""Synthetic video-QA set: determinism, schema, and answers checked against the decoded pixels."""

from __future__ import annotations

import json
import re
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from keye.data.manifest import read_manifest
from keye.data.probe import probe_file
from keye.data.synth import (
    COLORS,
    LETTERS,
    generate_split,
    make_scene,
    render_frame,
    sample_scene,
    write_image,
    write_video,
)
from keye.rewards.answers import choice_letter


def _frames(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24").astype(int) for f in c.decode(video=0)]


def _mask(frame: np.ndarray, color: str) -> np.ndarray:
    # H.264 4:2:0 blurs edges; object interiors stay within a small distance of the drawn colour.
    return np.abs(frame - np.asarray(COLORS[color])).sum(-1) < 60


def _present(frame: np.ndarray, color: str) -> bool:
    return int(_mask(frame, color).sum()) >= 6


def _scene_video(qtype: str, k: int, tmp_path: Path):
    sc = make_scene(np.random.default_rng([123, k]), qtype, image=False)
    path = tmp_path / f"{qtype}-{k}.mp4"
    write_video(path, sc)
    return sc, _frames(path)


@pytest.mark.parametrize("k", range(4))
def test_when_appear_matches_pixels(tmp_path: Path, k: int):
    sc, frames = _scene_video("when_appear", k, tmp_path)
    color = sc.events[-1]["object"].split()[0]
    first = next(i for i, f in enumerate(frames) if _present(f, color))
    assert len(frames) == sc.num_frames
    assert first / sc.fps == pytest.approx(float(sc.answer))


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _appearances(sc, frames: list[np.ndarray]) -> list[float]:
    """The second each appearance event's object is first seen in the decoded frames (checked against the
    event's recorded time)."""
    firsts = []
    for ev in sc.events:
        color = ev["object"].split()[0]
        firsts.append(next(i for i, f in enumerate(frames) if _present(f, color)) / sc.fps)
        assert firsts[-1] == pytest.approx(ev["t"]) and float(ev["t"]).is_integer()
    return firsts


@pytest.mark.parametrize("k", range(4))
def test_when_gap_matches_pixels(tmp_path: Path, k: int):
    sc, frames = _scene_video("when_gap", k, tmp_path)
    firsts = _appearances(sc, frames)
    assert firsts[1] - firsts[0] == pytest.approx(float(sc.answer)) and float(sc.answer) >= 1
    assert sc.duration - firsts[1] >= 1  # the later object stays on screen for at least a second


@pytest.mark.parametrize("k", range(3))
def test_when_sum_matches_pixels(tmp_path: Path, k: int):
    sc, frames = _scene_video("when_sum", k, tmp_path)
    firsts = _appearances(sc, frames)
    assert len(firsts) == 3 and sum(firsts) == pytest.approx(float(sc.answer))
    assert sc.duration - max(firsts) >= 2  # every shape stays on screen for at least two seconds


@pytest.mark.parametrize("k", range(3))
def test_price_sum_answer_is_the_price_of_the_shapes_on_screen(tmp_path: Path, k: int):
    sc, frames = _scene_video("price_sum", k, tmp_path)
    firsts = _appearances(sc, frames)
    assert len(firsts) == 3 and max(firsts) <= 2 and sc.duration - max(firsts) >= 2
    listing = re.search(r"Prices: (.*?)\. What do the three shapes", sc.question).group(1)
    prices = {shape: int(p) for shape, p in (item.split(" ") for item in listing.split(", "))}
    assert sorted(prices) == sorted(("circle", "square", "triangle", "diamond"))
    assert all(1 <= p <= 5 for p in prices.values())
    on_screen = [o for o in sc.objects if _present(frames[-1], o.color)]
    assert len(on_screen) == 3 and len({o.shape for o in on_screen}) == 3
    assert int(sc.answer) == sum(prices[o.shape] for o in on_screen) and sc.answer_kind == "numeric"


def test_price_sum_prices_change_from_question_to_question():
    lists = {make_scene(np.random.default_rng([9, k]), "price_sum", image=False).question.split(". ")[0]
             for k in range(20)}
    assert len(lists) >= 15  # drawn per question: no shape has a price to memorise


def test_extra_types_are_opt_in_and_checked(tmp_path: Path):
    from keye.data.cli import parse_type_weights
    from keye.errors import KeyeConfigError

    plain = _rows(generate_split(tmp_path / "a", "train", 30, seed=4, workers=0, progress=False))
    assert not {"when_gap", "when_sum", "price_sum"} & {r["question_type"] for r in plain}
    gap = _rows(generate_split(tmp_path / "b", "train", 30, seed=4, workers=0, progress=False,
                               extra_types={"when_gap": 50.0}))
    kinds = [r["question_type"] for r in gap]
    assert kinds.count("when_gap") >= 15  # weight 50 beside the defaults' ~10
    assert all(r["answer_kind"] == "numeric" and r["tolerance"] == 0.5 for r in gap if r["question_type"] == "when_gap")
    with pytest.raises(KeyeConfigError, match="unknown extra question type 'colour'"):
        generate_split(tmp_path / "c", "train", 1, workers=0, progress=False, extra_types={"colour": 1.0})
    with pytest.raises(KeyeConfigError, match="needs a weight > 0"):
        generate_split(tmp_path / "c", "train", 1, workers=0, progress=False, extra_types={"when_gap": 0.0})
    assert parse_type_weights(["when_gap=3"]) == {"when_gap": 3.0} and parse_type_weights([]) is None
    for bad in ("when_gap", "when_gap=x", "=3"):
        with pytest.raises(KeyeConfigError, match="expected TYPE=WEIGHT"):
            parse_type_weights([bad])


def test_cli_extra_type(tmp_path: Path):
    from keye.cli import main

    assert main(["data", "synth", "--out", str(tmp_path), "--train", "6", "--test", "0", "--seed", "4",
                 "--workers", "0", "--no-progress", "--extra-type", "when_gap=100"]) == 0
    assert {r["question_type"] for r in _rows(tmp_path / "train.jsonl")} >= {"when_gap"}


def test_cli_places_only_changes_the_captions(tmp_path: Path):
    from keye.cli import main

    for name, extra in (("plain", []), ("placed", ["--places"])):
        assert main(["data", "synth", "--out", str(tmp_path / name), "--train", "8", "--test", "0", "--seed", "4",
                     "--workers", "0", "--no-progress", "--warmup", "3", *extra]) == 0
    for split in ("train", "warmup"):
        plain, placed = _rows(tmp_path / "plain" / f"{split}.jsonl"), _rows(tmp_path / "placed" / f"{split}.jsonl")
        key = "caption" if split == "train" else "answer"
        for a, b in zip(plain, placed):
            assert a[key] != b[key] and {k: v for k, v in a.items() if k not in ("caption", "messages", "answer")} \
                == {k: v for k, v in b.items() if k not in ("caption", "messages", "answer")}
        if split == "train":  # the question rows themselves are the same
            assert [r["messages"] for r in plain] == [r["messages"] for r in placed]


@pytest.mark.parametrize("k", range(4))
def test_when_change_matches_pixels(tmp_path: Path, k: int):
    sc, frames = _scene_video("when_change", k, tmp_path)
    new = sc.events[-1]["to"]
    first = next(i for i, f in enumerate(frames) if _present(f, new))
    assert first / sc.fps == pytest.approx(float(sc.answer))


@pytest.mark.parametrize("k", range(4))
def test_when_leave_matches_pixels(tmp_path: Path, k: int):
    sc, frames = _scene_video("when_leave", k, tmp_path)
    color = sc.events[-1]["object"].split()[0]
    seen = [_present(f, color) for f in frames]
    gone = next(i for i in range(len(seen)) if i > seen.index(True) and not any(seen[i:]))
    assert abs(gone / sc.fps - float(sc.answer)) <= sc.tolerance


@pytest.mark.parametrize("k", range(3))
def test_when_collide_is_closest_approach(tmp_path: Path, k: int):
    sc, frames = _scene_video("when_collide", k, tmp_path)
    ca, cb = (name.split()[0] for name in sc.events[-1]["objects"])
    gaps = []
    for f in frames:
        xa, xb = np.nonzero(_mask(f, ca).any(0))[0], np.nonzero(_mask(f, cb).any(0))[0]
        gaps.append(xb.min() - xa.max() if len(xa) and len(xb) else 10**6)
    t_min = int(np.argmin(gaps)) / sc.fps
    assert abs(t_min - float(sc.answer)) <= 1.0 / sc.fps + 1e-9
    assert min(gaps) <= 3  # they really touch (bounding boxes within a few pixels)


@pytest.mark.parametrize("k", range(4))
def test_image_position_and_color(tmp_path: Path, k: int):
    sc = make_scene(np.random.default_rng([7, k]), "position", image=True)
    write_image(tmp_path / "p.png", sc)
    img = np.asarray(Image.open(tmp_path / "p.png")).astype(int)
    a, b = sc.objects
    xa = np.nonzero(_mask(img, a.color))[1].mean()
    xb = np.nonzero(_mask(img, b.color))[1].mean()
    assert sc.choices[LETTERS.index(sc.answer)] == ("left" if xa < xb else "right")


def test_split_is_deterministic_and_valid(tmp_path: Path, synth_dir: Path):
    again = generate_split(tmp_path, "train", 24, seed=3, workers=2, image_fraction=0.25, progress=False)
    rows_a = (synth_dir / "train.jsonl").read_text().splitlines()
    assert again.read_text().splitlines() == rows_a  # parallel == in-process, row for row
    media_a = sorted((synth_dir / "media" / "train").iterdir())
    for p in media_a[:6]:
        assert p.read_bytes() == (tmp_path / "media" / "train" / p.name).read_bytes()
    man = read_manifest(synth_dir / "train.jsonl")
    assert not man.bad_rows and len(man) == 24
    kinds = {s.modality for s in man.samples}
    assert kinds == {"image", "video"}
    for s in man.samples:
        r = s.row
        assert r["answer_kind"] in ("mc", "numeric")
        target = s.messages[-1]["content"][0]["text"]
        if r["answer_kind"] == "mc":
            # scored by the letter, trained and answered with the option's text, which the scorer maps back
            assert r["answer"] in LETTERS[: len(r["choices"])]
            assert target == r["choices"][LETTERS.index(r["answer"])]
            assert choice_letter(target, r["choices"]) == r["answer"]
            assert "Answer with the option's text." in s.messages[0]["content"][1]["text"]
        else:
            float(r["answer"])
            assert target == r["answer"]
        info = probe_file(s.media[0].kind, s.media[0].path)
        assert info.ok and (info.width, info.height) == (r["meta"]["width"], r["meta"]["height"])
        if s.modality == "video":
            assert 2.0 <= info.duration <= 8.0 and info.num_frames == r["meta"]["num_frames"]
    test_ids = [json.loads(x)["id"] for x in (synth_dir / "test.jsonl").read_text().splitlines()]
    assert test_ids == [f"test-{i:06d}" for i in range(6)]
    other = generate_split(tmp_path / "s4", "train", 4, seed=4, workers=0, progress=False)
    assert other.read_text().splitlines()[0] != rows_a[0]


@pytest.mark.parametrize("k", range(3))
def test_caption_lists_what_the_frames_show(tmp_path: Path, k: int):
    from keye.data.synth import describe

    sc, frames = _scene_video("count", k, tmp_path)
    caption = describe(sc)
    parts = caption.rstrip(".").split(", ")
    assert len(parts) == len(sc.objects)  # every object once: the count is in the caption
    times = [float(p.split(" ")[3]) for p in parts]  # "<colour> <shape> at <second> [events]"
    assert times == sorted(times)  # in order of appearance
    for p in parts:
        color, shape, _, t = p.split(" ")[:4]
        i = int(round(float(t) * sc.fps))
        assert _present(frames[i], color)  # the colour is on screen at the stated second
        assert shape in ("circle", "square", "triangle", "diamond")
    img = make_scene(np.random.default_rng([5, k]), "color", image=True)
    assert " at " not in describe(img) and describe(img).count(",") == len(img.objects) - 1


@pytest.mark.parametrize("qtype", ["when_change", "when_leave", "direction"])
def test_caption_events_match_the_pixels(tmp_path: Path, qtype: str):
    from keye.data.synth import describe

    for k in range(3):
        sc, frames = _scene_video(qtype, k, tmp_path)
        caption = describe(sc)
        mover = sc.objects[0]  # the object the question is about
        part = next(p for p in caption.rstrip(".").split(", ") if p.startswith(f"{mover.color} {mover.shape} at"))
        words = part.split(" ")
        if qtype == "when_change":
            new, t = words[words.index("turns") + 1], float(words[words.index("turns") + 3])
            i = int(round(t * sc.fps))
            assert _present(frames[i], new) and not _present(frames[i - 1], new), caption
        elif qtype == "when_leave":
            t = float(words[words.index("gone") + 2])
            i = int(round(t * sc.fps))
            assert _present(frames[i - 1], mover.color) and not any(_present(f, mover.color) for f in frames[i:])
        else:  # the centre of the object's colour moves the stated way between two visible frames
            heading = words[words.index("moving") + 1]
            seen = [i for i, f in enumerate(frames) if _mask(f, mover.color).sum() >= 20]
            a, b = (np.argwhere(_mask(frames[j], mover.color)).mean(0) for j in (seen[0], seen[-1]))
            dy, dx = b - a
            expected = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
            assert heading == expected, (caption, dx, dy)
        assert caption.count(", ") == len(sc.objects) - 1


def test_caption_manifest_pairs_every_row(synth_dir: Path):
    rows = [json.loads(x) for x in (synth_dir / "train.jsonl").read_text().splitlines()]
    caps = read_manifest(synth_dir / "train_captions.jsonl")
    assert not caps.bad_rows and [s.id for s in caps.samples] == [r["id"] + "-caption" for r in rows]
    qa = read_manifest(synth_dir / "train.jsonl").samples
    for r, s, q in zip(rows, caps.samples, qa):
        assert [m.path for m in s.media] == [m.path for m in q.media]  # the same clip
        assert s.messages[-1]["content"][0]["text"] == r["caption"] == s.row["answer"]
        assert s.row["question_type"] == "caption"
        prompt = s.messages[0]["content"][1]["text"]
        assert ("second it appears and what it does" in prompt) == (s.modality == "video")


def test_warmup_rows_are_large_object_captions(tmp_path: Path):
    from keye.data.synth import generate

    paths = generate(tmp_path, train=2, test=1, seed=0, workers=0, progress=False, warmup=6)
    assert set(paths) == {"train", "test", "warmup"} and not (tmp_path / "warmup_captions.jsonl").exists()
    man = read_manifest(paths["warmup"])
    assert not man.bad_rows and len(man) == 6
    for s in man.samples:
        assert s.modality == "image" and s.row["question_type"] == "caption"
        frame = np.asarray(Image.open(s.media[0].path).convert("RGB")).astype(int)
        parts = s.row["answer"].rstrip(".").split(", ")
        for p in parts:
            color = p.split(" ")[0]
            # large: each named object covers well over 2 % of the image (a fifth of the side or more)
            assert _mask(frame, color).mean() > 0.02, (s.id, p)
        assert s.messages[-1]["content"][0]["text"] == s.row["answer"]


def _cells_near(x: float, y: float, w: int, h: int, slack: float = 6.0) -> set[str]:
    """The place words of every 3 x 3 cell within ``slack`` pixels of (x, y) (an encoded frame's object
    centre can sit a few pixels from the drawn one, and a third's boundary can fall between them)."""
    from keye.data.synth import place_word

    return {place_word(x + dx, y + dy, w, h) for dx in (-slack, 0, slack) for dy in (-slack, 0, slack)}


@pytest.mark.parametrize("qtype", ["direction", "when_leave", "count"])
def test_caption_places_match_the_pixels(tmp_path: Path, qtype: str):
    from keye.data.synth import describe

    for k in range(3):
        sc, frames = _scene_video(qtype, k, tmp_path)
        plain, placed = describe(sc), describe(sc, places=True)
        assert plain != placed and placed.count(", ") == plain.count(", ")
        for o, part in zip(sorted(sc.objects, key=lambda o: (o.t_appear, o.x)), placed.rstrip(".").split(", ")):
            words = part.split(" ")
            if sum(p.color == o.color or p.new_color == o.color for p in sc.objects) > 1:
                continue  # two objects share the colour: the pixels do not say which is which
            start = " ".join(words[2:words.index("at")])  # "<colour> <shape> <place> at <second> ..."
            first = int(round(o.t_appear * sc.fps))
            ys, xs = np.nonzero(_mask(frames[first], o.color))
            assert start in _cells_near(xs.mean(), ys.mean(), sc.width, sc.height), (placed, o)
            if "ends" in words:  # a mover: the cell of the last frame it is seen in
                end = " ".join(words[words.index("ends") + 1:words.index("gone") if "gone" in words else None])
                last = max(i for i, f in enumerate(frames) if _mask(f, o.color).sum() >= 6)
                ys, xs = np.nonzero(_mask(frames[last], o.color))
                assert end in _cells_near(xs.mean(), ys.mean(), sc.width, sc.height, slack=o.size), (placed, o)
            else:
                assert "moving" not in words
        # apart from the place words, the caption is the place-free one word for word
        place = {"top", "bottom", "left", "right", "middle", "ends"}
        assert [w for w in re.split("[ ,.]+", placed) if w not in place] == \
            [w for w in re.split("[ ,.]+", plain) if w not in place]
    img = make_scene(np.random.default_rng([7, 1]), "position", image=True)
    a, b = describe(img, places=True).rstrip(".").split(", ")
    assert " at " not in a and len(a.split(" ")) >= 3 and len(b.split(" ")) >= 3


def _detail_in_key_frame(sc) -> bool:
    """Whether the first 2-fps frame showing the scene's white (tiny) shape is a slow-fast key frame."""
    import torch

    from keye.processing.slowfast import SLOW, classify_frames

    tiny = next(o for o in sc.objects if o.color == "white")
    times = np.arange(0, sc.duration, 0.5)
    frames = np.stack([render_frame(sc, float(t)) for t in times]).transpose(0, 3, 1, 2)
    types = classify_frames(torch.from_numpy(np.ascontiguousarray(frames)))
    return bool(types[int(np.searchsorted(times, tiny.t_appear - 1e-9))] == SLOW)


def test_detail_cut_puts_the_brief_tiny_shape_in_a_key_frame():
    """The detail_cut scene keeps the question's premise (a shape much smaller than everything else, on
    screen for one second) and shows it in a key frame, because the big distractors arrive with it; in
    the default scene the tiny shape appears alone and mostly only fast frames show it."""
    cut = [make_scene(np.random.default_rng([321, k]), "detail", image=False, detail_cut=True) for k in range(12)]
    for sc in cut:
        tiny = [o for o in sc.objects if o.color == "white"]
        big = [o for o in sc.objects if o.color != "white"]
        assert len(tiny) == 1 and 2 <= len(big) <= 3
        assert tiny[0].t_vanish - tiny[0].t_appear == 1.0
        assert tiny[0].size <= 0.5 * min(o.size for o in big)
        assert {o.t_appear for o in big} == {tiny[0].t_appear}
    assert sum(map(_detail_in_key_frame, cut)) >= 10
    plain = [make_scene(np.random.default_rng([321, k]), "detail", image=False) for k in range(12)]
    assert sum(map(_detail_in_key_frame, plain)) <= 4  # measured: 2 of 12


def test_scene_options_change_only_their_rows(tmp_path: Path):
    from keye.cli import main

    for name, extra in (("plain", []), ("cut", ["--detail-cut"]), ("pos", ["--position-weight", "40"])):
        assert main(["data", "synth", "--out", str(tmp_path / name), "--train", "60", "--test", "0", "--seed", "2",
                     "--workers", "0", "--no-progress", "--image-fraction", "0.3", *extra]) == 0
    plain, cut, pos = (_rows(tmp_path / n / "train.jsonl") for n in ("plain", "cut", "pos"))
    assert any(r["question_type"] == "detail" for r in plain)
    for a, b in zip(plain, cut):  # detail rows are redrawn, every other row is byte-identical
        assert a["question_type"] == b["question_type"]
        assert (a == b) != (a["question_type"] == "detail")
    images = [(a, b) for a, b in zip(plain, pos) if a["meta"]["modality"] == "image"]
    assert all(a == b for a, b in zip(plain, pos) if a["meta"]["modality"] == "video")
    share = np.mean([b["question_type"] == "position" for _, b in images])
    assert share > 0.8 > np.mean([a["question_type"] == "position" for a, _ in images])
    assert [sample_scene(2, "train", i, 0.3, position_weight=40).question_type for i in range(60)] == [
        r["question_type"] for r in pos]
    from keye.errors import KeyeConfigError

    with pytest.raises(KeyeConfigError, match="position_weight must be > 0"):
        sample_scene(2, "train", 0, position_weight=0)
