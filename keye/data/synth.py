"""Synthetic video-QA set: coloured shapes that appear, move, change colour, collide or leave.

Every clip is rendered from a small scene description drawn from ``numpy.random.default_rng([seed, split,
index])``, so a sample depends only on (seed, split, index): the set is deterministic, can be generated in
any order and in parallel, and the test split never overlaps the train split. Each clip comes with one
question whose answer is known exactly from the scene:

============== ======= ==================================================================
question_type  kind    what it needs
============== ======= ==================================================================
color          mc      colour of the (unique) shape
shape          mc      shape of the (unique) colour
count          numeric how many objects appear in total (some appear late / leave early)
direction      mc      direction of motion of one object
order          mc      which of 2-3 objects appears first (gaps of 0.5-1 s: temporal order)
color_change   mc      the colour an object turns into
when_appear    numeric the second at which an object appears (timestamps)
when_change    numeric the second at which an object changes colour
when_collide   numeric the second at which two objects touch (they bounce apart)
when_leave     numeric the second at which an object has fully left the frame
detail         mc      shape of a tiny object shown for ~1 s (with ``detail_cut``: in a key frame)
position       mc      (image-only) whether one object is left or right of another
when_gap       numeric (opt-in) how many whole seconds after one object the other appears
when_sum       numeric (opt-in) the sum of the (whole-second) times at which three objects appear
price_sum      numeric (opt-in) what three shapes cost together, at prices the question gives (1-5 each)
============== ======= ==================================================================

Opt-in types (:data:`EXTRA_VIDEO_TYPES`, ``extra_types={"when_gap": w}``, ``keye data synth --extra-type
when_gap=W``) are drawn only when asked for, with weight ``w`` beside the defaults' (each 0.7-1), so the
default set is unchanged. ``when_gap`` is a two-step question: two appearance times, then their
difference; its think-mode trace writes the subtraction out (``"; 4.0 - 1.0 = 3.0"``). ``when_sum`` chains
two additions over three appearance times (``"; 1.0 + 2.0 = 3.0; 3.0 + 4.0 = 7.0"``): answered directly it
is a function of three perceived numbers, step by step two small additions. ``price_sum`` gives a price
(1-5, drawn per question) for each of the four shapes in the question text and asks what the three shapes
on screen cost together; its trace names each shape with its price, then adds (``"; square 4, circle 2,
triangle 1; 4 + 2 = 6; 6 + 1 = 7"``). Its readings are shapes, the tiny model's most reliable look, and its
direct answer must bind each seen shape to a number that changes with every question, then add three: the
composition a few layers cannot do in one step, which the trace turns into lookups and two small
additions. They are the AutoThink experiment's candidates for a type on which writing the steps helps a
small model.

Two opt-in scene options leave the default set unchanged. ``detail_cut`` (``keye data synth --detail-cut``)
redraws the detail scenes so that their answer reaches the model at key-frame resolution: by default the tiny
shape (radius 6 % of the short side) appears alone, mid-clip, and Keye-VL-1.5's slow-fast rule keeps every
frame showing it a 2-4-token fast frame (a frame becomes a key frame only when over 10 % of its patches
change; ``training/probe_detail.py``); with the option the two or three big distractors come on screen with
it (a scene change, so that frame is a key frame) and it is a little larger (radius 7.5 %, still under half
the smallest distractor's). ``position_weight`` (``--position-weight``) weighs the image-only position type
against the three other image types (default 1: 2.5 % of the rows).

Event times sit on a 0.5 s grid (every fps used is a multiple of 2), so numeric "when" answers are exact
at the processor's default 2 fps sampling; rows carry ``tolerance`` (seconds) for lenient scoring.
Multiple-choice answers are option letters; rows carry ``choices`` (the option texts, in letter order). The
question asks for the option's text and the assistant turn (the training target) is that text; scorers
map it back to the letter (:mod:`keye.data.synth_answers`, the MMMU rule: a letter or the option's text).

Thinking modes (``modes=True``, ``keye data synth --modes``; off by default, so the default set is unchanged):
each row also gets ``modes``, the assistant target of every Keye thinking mode, written from the scene
itself so every step is exactly right (:func:`mode_targets`), and ``auto_mode``, the mode the auto
label chooses; :func:`mode_rows` expands rows into one SFT row per mode (``<split>_modes.jsonl``):

============ ================== ===============================================================
mode         user prompt ends   assistant target
============ ================== ===============================================================
think        ``/think``         ``<think>TRACE</think>ANSWER``
no_think     ``/no_think``      ``ANSWER``
auto         (no switch)        ``<analysis>/think</analysis><think>TRACE</think>ANSWER`` for the
                                types in :data:`THINK_TYPES`, else ``<analysis>/no_think</analysis>ANSWER``
============ ================== ===============================================================

That auto labelling is ``auto_labels="type"`` (the default); ``auto_labels="mixed"`` instead draws each
sample's auto decision 50/50 from its own seeded generator (:func:`mixed_auto_think`), whatever the type.

TRACE is the clip's dense caption (:func:`describe`: each object with the second it appears, what it
does and when it is gone), followed for the stepwise types by the step that reads the answer off it:
``count`` the total, ``order`` the first of the candidates, ``when_*`` the asked event and its second.
The stepwise types (:data:`THINK_TYPES`) are those whose answer is a count, a comparison or a time read
off that timeline; the others (colour, shape, position, direction, detail, color_change) are one look,
and their auto label answers directly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from keye.data.manifest import write_manifest
from keye.errors import KeyeConfigError

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 230),
    "yellow": (235, 215, 40),
    "purple": (155, 60, 200),
    "orange": (245, 140, 30),
    "white": (235, 235, 235),
}
SHAPES = ("circle", "square", "triangle", "diamond")
DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
BACKGROUND = (24, 24, 28)
SIDES = (112, 168, 224)
FPS_CHOICES = (4, 6, 8)
LETTERS = "ABCDEFGH"
GRID = 0.5  # seconds; event times are multiples of this
SQUARE_HALF = 0.85  # a square's half side, relative to the object's size (keeps areas comparable)

VIDEO_TYPES: dict[str, float] = {
    "color": 1.0,
    "shape": 1.0,
    "count": 1.0,
    "direction": 1.0,
    "order": 1.0,
    "color_change": 1.0,
    "when_appear": 1.0,
    "when_change": 0.7,
    "when_collide": 0.7,
    "when_leave": 0.7,
    "detail": 1.0,
}
IMAGE_TYPES: dict[str, float] = {"color": 1.0, "shape": 1.0, "count": 1.0, "position": 1.0}
# Video question types drawn only when asked for by name (``extra_types``): the default set stays as it was.
EXTRA_VIDEO_TYPES = frozenset({"when_gap", "when_sum", "price_sum"})
SPLIT_CODES = {"train": 0, "test": 1, "warmup": 2}
# Question types whose answer is read off a timeline or a list (a count, a comparison of appearance times,
# the second of an event): the auto label thinks on these and answers the rest directly.
THINK_TYPES = frozenset({"count", "order", "when_appear", "when_change", "when_collide", "when_leave", "when_gap",
                         "when_sum", "price_sum"})
THINKING_MODES = ("think", "no_think", "auto")


@dataclass
class Obj:
    """One shape in a scene. Times are seconds; positions are pixel centres at ``t_appear``; velocity px/s."""

    shape: str
    color: str
    size: float  # half-extent in pixels
    x: float
    y: float
    vx: float = 0.0
    vy: float = 0.0
    t_appear: float = 0.0
    t_vanish: float = math.inf
    t_change: float = math.inf
    new_color: str | None = None
    bounce_at: float = math.inf  # velocity reverses at this time (a collision)

    @property
    def name(self) -> str:
        """'the red circle' style description (colour at appearance)."""
        return f"{self.color} {self.shape}"

    def state(self, t: float) -> tuple[bool, float, float, str]:
        """(visible, x, y, colour name) at time ``t``."""
        if t < self.t_appear - 1e-9 or t >= self.t_vanish - 1e-9:
            return False, 0.0, 0.0, self.color
        dt = t - self.t_appear
        if t >= self.bounce_at:
            d0 = self.bounce_at - self.t_appear
            x = self.x + self.vx * d0 - self.vx * (t - self.bounce_at)
            y = self.y + self.vy * d0 - self.vy * (t - self.bounce_at)
        else:
            x, y = self.x + self.vx * dt, self.y + self.vy * dt
        color = self.new_color if (self.new_color and t >= self.t_change - 1e-9) else self.color
        return True, x, y, color


@dataclass
class Scene:
    """A clip (or an image when ``fps == 0``) plus its question."""

    width: int
    height: int
    fps: int
    duration: float
    objects: list[Obj]
    question_type: str
    question: str
    answer: str
    answer_kind: str
    choices: list[str] | None = None
    tolerance: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def num_frames(self) -> int:
        """Frames in the clip (1 for an image)."""
        return 1 if self.fps == 0 else int(round(self.duration * self.fps))


# --------------------------------------------------------------------------------------------- drawing


def _shape_mask(shape: str, xs: np.ndarray, ys: np.ndarray, cx: float, cy: float, r: float) -> np.ndarray:
    dx, dy = xs - cx, ys - cy
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        s = r * SQUARE_HALF
        return (np.abs(dx) <= s) & (np.abs(dy) <= s)
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= r
    if shape == "triangle":  # apex up, base at cy + r
        frac = (dy + r) / (2 * r)
        return (dy >= -r) & (dy <= r) & (np.abs(dx) <= frac * r)
    raise KeyeConfigError(f"unknown shape {shape!r}")


def shape_pixels(shape: str, x: float, y: float, r: float, width: int, height: int):
    """The pixels a shape of half-extent ``r`` centred at (``x``, ``y``) covers in a ``width`` x ``height``
    frame, as ``(y0, y1, x0, x1, mask)`` (``mask`` bool over rows y0:y1, columns x0:x1; pixel centres are
    tested), or None when the shape lies wholly outside the frame."""
    x0, x1 = max(0, int(x - r) - 1), min(width, int(x + r) + 2)
    y0, y1 = max(0, int(y - r) - 1), min(height, int(y + r) + 2)
    if x0 >= x1 or y0 >= y1:
        return None
    ys, xs = np.mgrid[y0:y1, x0:x1]
    return y0, y1, x0, x1, _shape_mask(shape, xs + 0.5, ys + 0.5, x, y, r)


def render_frame(scene: Scene, t: float) -> np.ndarray:
    """Render the scene at time ``t`` (seconds) as uint8 [H, W, 3]; later objects are drawn on top."""
    frame = np.empty((scene.height, scene.width, 3), dtype=np.uint8)
    frame[:] = BACKGROUND
    for obj in scene.objects:
        vis, x, y, color = obj.state(t)
        if not vis:
            continue
        px = shape_pixels(obj.shape, x, y, obj.size, scene.width, scene.height)
        if px is not None:
            y0, y1, x0, x1, mask = px
            frame[y0:y1, x0:x1][mask] = COLORS[color]
    return frame


def write_video(path: Path, scene: Scene) -> None:
    """Encode the scene as H.264 mp4 (yuv420p, one thread, deterministic) with PyAV."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=scene.fps)
        stream.width, stream.height, stream.pix_fmt = scene.width, scene.height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "18", "threads": "1"}
        stream.codec_context.thread_count = 1
        for i in range(scene.num_frames):
            vf = av.VideoFrame.from_ndarray(render_frame(scene, i / scene.fps), format="rgb24")
            for packet in stream.encode(vf):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_image(path: Path, scene: Scene) -> None:
    """Save the scene's single frame as PNG."""
    from PIL import Image

    Image.fromarray(render_frame(scene, 0.0)).save(path, format="PNG")


# ------------------------------------------------------------------------------------------- scenes


def _mc(rng: np.random.Generator, correct: str, pool: list[str], k: int = 4) -> tuple[list[str], str]:
    others = [p for p in pool if p != correct]
    picks = list(rng.choice(others, size=min(k - 1, len(others)), replace=False))
    opts = [correct] + [str(p) for p in picks]
    rng.shuffle(opts)
    return opts, LETTERS[opts.index(correct)]


def _mc_text(question: str, choices: list[str]) -> str:
    lines = [question, "Options:"] + [f"{LETTERS[i]}. {c}" for i, c in enumerate(choices)]
    return "\n".join(lines) + "\nAnswer with the option's text."


def _grid_time(rng: np.random.Generator, lo: float, hi: float) -> float:
    """A multiple of GRID in [lo, hi] (hi >= lo)."""
    a, b = int(math.ceil(lo / GRID - 1e-9)), int(math.floor(hi / GRID + 1e-9))
    return GRID * int(rng.integers(a, max(a, b) + 1))


def _free_pos(rng: np.random.Generator, w: int, h: int, r: float, taken: list[tuple[float, float, float]]):
    for _ in range(50):
        x, y = rng.uniform(r + 1, w - r - 1), rng.uniform(r + 1, h - r - 1)
        if all((x - a) ** 2 + (y - b) ** 2 > (r + c + 4) ** 2 for a, b, c in taken):
            taken.append((x, y, r))
            return x, y
    taken.append((x, y, r))
    return x, y


def _distinct_objects(rng: np.random.Generator, k: int, avoid: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """k (shape, colour) pairs with all shapes distinct and all colours distinct (k <= 4), no colour in
    ``avoid``."""
    shapes = [str(s) for s in rng.choice(SHAPES, size=k, replace=False)]
    colors = [str(c) for c in rng.choice([c for c in COLORS if c not in avoid], size=k, replace=False)]
    return list(zip(shapes, colors))


@dataclass
class _Draft:
    """A scene being drawn: its frame, the objects and events so far, and the draws they share. The
    question builders below fill it in, each drawing from ``rng`` in its own fixed order (the set is
    reproducible per seed, so that order must never change)."""

    rng: np.random.Generator
    image: bool
    w: int
    h: int
    fps: int
    duration: float
    taken: list[tuple[float, float, float]] = field(default_factory=list)
    objs: list[Obj] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def side(self) -> int:
        return min(self.w, self.h)

    # Object radii span ~3-15% of the frame area. The large end matters for learning, not only for
    # variety: a from-scratch model first learns to look at objects on big ones and only then transfers
    # to small ones (with radii <= side/10 alone a tiny model never leaves the text-only prior).
    @property
    def r_lo(self) -> float:
        return self.side / 10

    @property
    def r_hi(self) -> float:
        return self.side / 4.5

    @property
    def r_crowd(self) -> float:
        return self.side / 7  # scenes with up to 5 objects keep them small enough not to overlap

    def static(self, shape: str, color: str, hi: float | None = None, lo: float | None = None,
               **kw: Any) -> Obj:
        """Add an object of random size at a free spot (``kw``: the :class:`Obj` timing fields)."""
        r = float(self.rng.uniform(lo or self.r_lo, hi or self.r_hi))
        x, y = _free_pos(self.rng, self.w, self.h, r, self.taken)
        o = Obj(shape, color, r, x, y, **kw)
        self.objs.append(o)
        return o

    def appear(self, o: Obj, t: float) -> None:
        """Record that ``o`` appears at second ``t``."""
        self.events.append({"t": t, "event": "appear", "object": o.name})


class _Question(NamedTuple):
    """What a question builder returns (the rest of the scene is in its :class:`_Draft`)."""

    text: str
    answer: str
    kind: str
    choices: list[str] | None = None
    tolerance: float | None = None


def _mc_question(rng: np.random.Generator, question: str, correct: str, pool: list[str]) -> _Question:
    choices, ans = _mc(rng, correct, pool)
    return _Question(_mc_text(question, choices), ans, "mc", choices)


def _when_question(t: float, question: str) -> _Question:
    return _Question(f"At what time (in seconds) {question}? Answer with a number.", f"{t:.1f}", "numeric",
                     tolerance=GRID)


def _q_color_shape(d: _Draft, qtype: str) -> _Question:
    pairs = _distinct_objects(d.rng, int(d.rng.integers(1, 4)))
    for s, c in pairs:
        d.static(s, c)
    s, c = pairs[0]
    if qtype == "color":
        return _mc_question(d.rng, f"What colour is the {s}?", c, list(COLORS))
    return _mc_question(d.rng, f"What shape is the {c} object?", s, list(SHAPES))


def _q_count(d: _Draft, qtype: str) -> _Question:
    rng = d.rng
    n = int(rng.integers(1, 6))
    for _ in range(n):
        s, c = str(rng.choice(SHAPES)), str(rng.choice(list(COLORS)))
        if d.image:
            d.static(s, c, hi=d.r_crowd)
            continue
        t_a = _grid_time(rng, 0, d.duration - 1.0)
        t_v = _grid_time(rng, t_a + 1.0, d.duration) if rng.random() < 0.3 else math.inf
        o = d.static(s, c, hi=d.r_crowd, t_appear=t_a, t_vanish=t_v if t_v < d.duration else math.inf)
        d.appear(o, t_a)
    text = (
        "How many shapes are in the image?"
        if d.image
        else "How many shapes appear in the video in total? Count each shape once."
    ) + " Answer with a number."
    return _Question(text, str(n), "numeric")


def _q_position(d: _Draft, qtype: str) -> _Question:
    rng, w, h = d.rng, d.w, d.h
    (s1, c1), (s2, c2) = _distinct_objects(rng, 2)
    r1, r2 = float(rng.uniform(d.r_lo, d.r_hi)), float(rng.uniform(d.r_lo, d.r_hi))
    xa = rng.uniform(r1 + 1, w / 2 - r1 - 2)
    xb = rng.uniform(w / 2 + r2 + 2, w - r2 - 1)
    left_first = rng.random() < 0.5
    xa, xb = (xa, xb) if left_first else (xb, xa)
    d.objs.append(Obj(s1, c1, r1, xa, rng.uniform(r1 + 1, h - r1 - 1)))
    d.objs.append(Obj(s2, c2, r2, xb, rng.uniform(r2 + 1, h - r2 - 1)))
    choices = ["left", "right"]
    text = _mc_text(f"Is the {c1} {s1} to the left or to the right of the {c2} {s2}?", choices)
    return _Question(text, "A" if left_first else "B", "mc", choices)


def _q_motion(d: _Draft, qtype: str) -> _Question:
    """``direction`` and ``when_leave``: one object moving along an axis, plus a static distractor or none."""
    rng, w, h, duration = d.rng, d.w, d.h, d.duration
    (s, c), *rest = _distinct_objects(rng, int(rng.integers(1, 3)))
    dname = str(rng.choice(list(DIRECTIONS)))
    ux, uy = DIRECTIONS[dname]
    r = float(rng.uniform(d.r_lo, d.r_hi))
    span = w if ux else h
    t_a = _grid_time(rng, 0, max(0.0, duration - 2.0))
    if qtype == "when_leave":
        t_l = _grid_time(rng, t_a + 1.0, duration - GRID)
        start = float(rng.uniform(r + 1, span / 2))  # distance from the side it moves away from
        speed = (span + r - start) / (t_l - t_a)
    else:
        start = float(rng.uniform(r + 1, span / 3))
        speed = float(rng.uniform(0.4, 0.6)) * (span - 2 * r - start) / max(duration - t_a, 1.0)
        t_l = math.inf
    pos_along = start if (ux > 0 or uy > 0) else span - start
    cross = float(rng.uniform(r + 1, (h if ux else w) - r - 1))
    x, y = (pos_along, cross) if ux else (cross, pos_along)
    mover = Obj(s, c, r, x, y, ux * speed, uy * speed, t_appear=t_a, t_vanish=t_l)
    d.objs.append(mover)
    d.taken.append((x, y, r))
    for s2, c2 in rest:  # a static distractor away from the path
        d.static(s2, c2)
    d.appear(mover, t_a)
    if qtype == "direction":
        choices = list(DIRECTIONS)
        text = _mc_text(f"In which direction does the {c} {s} move?", choices)
        return _Question(text, LETTERS[choices.index(dname)], "mc", choices)
    d.events.append({"t": t_l, "event": "leave", "object": mover.name})
    return _when_question(t_l, f"has the {c} {s} completely left the frame")


def _q_order(d: _Draft, qtype: str) -> _Question:
    rng = d.rng
    k = int(rng.integers(2, 4))
    pairs = _distinct_objects(rng, k)
    t0 = _grid_time(rng, 0, max(0.0, d.duration - k * 1.0 - 0.5))
    times = [t0]
    for _ in range(k - 1):
        times.append(times[-1] + GRID * int(rng.integers(1, 3)))  # 0.5 or 1.0 s later
    for (s, c), t in zip(pairs, times):
        d.appear(d.static(s, c, hi=d.r_crowd, t_appear=t), t)
    names = [f"the {c} {s}" for s, c in pairs]
    choices = list(names)
    rng.shuffle(choices)
    return _Question(_mc_text("Which shape appears first?", choices), LETTERS[choices.index(names[0])], "mc",
                     choices)


def _q_change(d: _Draft, qtype: str) -> _Question:
    """``color_change`` and ``when_change``: one object turns another colour mid-clip."""
    rng = d.rng
    (s, c), *rest = _distinct_objects(rng, int(rng.integers(1, 3)))
    new = str(rng.choice([k for k in COLORS if k != c]))
    t_c = _grid_time(rng, GRID, d.duration - GRID)
    o = d.static(s, c, t_change=t_c, new_color=new)
    for s2, c2 in rest:
        d.static(s2, c2)
    d.events.append({"t": t_c, "event": "change", "object": o.name, "to": new})
    if qtype == "color_change":
        return _mc_question(rng, f"The {c} {s} changes colour. What colour does it become?", new,
                            [k for k in COLORS if k != c])
    return _when_question(t_c, f"does the {s} change colour")


def _q_when_collide(d: _Draft, qtype: str) -> _Question:
    rng, w, h, side = d.rng, d.w, d.h, d.side
    (s1, c1), (s2, c2) = _distinct_objects(rng, 2)
    # Capped so both start inside the frame and still move towards the meeting point.
    r1, r2 = float(rng.uniform(d.r_lo, side / 6.5)), float(rng.uniform(d.r_lo, side / 6.5))
    t_c = _grid_time(rng, 1.0, d.duration - GRID)
    y = float(rng.uniform(max(r1, r2) + 1, h - max(r1, r2) - 1))
    meet = float(rng.uniform(w * 0.35, w * 0.65))
    # Horizontal half-extents: the shapes touch when their extents meet at x = meet.
    e1, e2 = r1 * (SQUARE_HALF if s1 == "square" else 1.0), r2 * (SQUARE_HALF if s2 == "square" else 1.0)
    # Each starts inside the frame at t=0 and reaches contact at t_c: left one moves right, right one left.
    v1 = rng.uniform(0.5, 1.0) * (meet - e1 - (r1 + 1)) / t_c
    v2 = rng.uniform(0.5, 1.0) * ((w - r2 - 1) - (meet + e2)) / t_c
    a = Obj(s1, c1, r1, meet - e1 - v1 * t_c, y, v1, 0.0, bounce_at=t_c)
    b = Obj(s2, c2, r2, meet + e2 + v2 * t_c, y, -v2, 0.0, bounce_at=t_c)
    d.objs += [a, b]
    d.events.append({"t": t_c, "event": "collide", "objects": [a.name, b.name]})
    return _when_question(t_c, f"do the {c1} {s1} and the {c2} {s2} touch")


def _q_when_appear(d: _Draft, qtype: str) -> _Question:
    pairs = _distinct_objects(d.rng, int(d.rng.integers(1, 3)))
    t_a = _grid_time(d.rng, GRID, d.duration - 1.0)
    o = d.static(*pairs[0], t_appear=t_a)
    for s2, c2 in pairs[1:]:
        d.static(s2, c2)
    d.appear(o, t_a)
    return _when_question(t_a, f"does the {o.name} appear")


def _q_when_gap(d: _Draft, qtype: str) -> _Question:
    # Two objects appear on whole seconds, the second 1..7 s after the first; both stay. The answer is
    # the difference of two appearance times: a subtraction on top of two "when" readings.
    rng = d.rng
    d.duration = max(d.duration, 3.0)
    pairs = _distinct_objects(rng, 2)
    last = int(d.duration) - 1  # the later object is on screen for at least one second
    t1 = float(rng.integers(0, last))
    t2 = float(rng.integers(int(t1) + 1, last + 1))
    first = d.static(*pairs[0], t_appear=t1)
    second = d.static(*pairs[1], t_appear=t2)
    d.appear(first, t1)
    d.appear(second, t2)
    text = (f"How many seconds after the {first.name} appears does the {second.name} appear? "
            "Answer with a number.")
    return _Question(text, f"{t2 - t1:.1f}", "numeric", tolerance=GRID)


def _q_when_sum(d: _Draft, qtype: str) -> _Question:
    # Three objects appear on whole seconds 0..4 (ties allowed) and stay at least two seconds; the answer
    # adds the three times: two chained additions on top of three "when" readings.
    d.duration = max(d.duration, 6.0)
    times = [float(t) for t in d.rng.integers(0, 5, size=3)]
    for (s_, c_), t_a in zip(_distinct_objects(d.rng, 3), times):
        d.appear(d.static(s_, c_, hi=d.r_crowd, t_appear=t_a), t_a)
    text = "What is the sum of the times (in seconds) at which the three shapes appear? Answer with a number."
    return _Question(text, f"{sum(times):.1f}", "numeric", tolerance=GRID)


def _q_price_sum(d: _Draft, qtype: str) -> _Question:
    # Three shapes (all different) appear on whole seconds 0..2 and stay; the question gives a price for
    # each of the four shapes, drawn per question, and asks what the three cost together. The answer
    # binds what is seen to numbers that change from question to question (no price can be memorised)
    # and adds three of them: one look per shape, then a lookup and two small additions.
    rng = d.rng
    d.duration = max(d.duration, 4.0)
    prices = {s_: int(p_) for s_, p_ in zip(SHAPES, rng.integers(1, 6, size=len(SHAPES)))}
    for (s_, c_), t_a in zip(_distinct_objects(rng, 3), rng.integers(0, 3, size=3)):
        d.appear(d.static(s_, c_, hi=d.r_crowd, t_appear=float(t_a)), float(t_a))
    listing = ", ".join(f"{s_} {p_}" for s_, p_ in prices.items())
    text = f"Prices: {listing}. What do the three shapes in the video cost in total? Answer with a number."
    return _Question(text, str(sum(prices[o.shape] for o in d.objs)), "numeric")


def _q_detail(d: _Draft, qtype: str, detail_cut: bool = False) -> _Question:
    # A tiny shape visible for 1 s among big distractors: the answer is in the high-resolution detail of
    # the few frames that show it. By default it appears alone mid-clip (radius 6 % of the side), which
    # the slow-fast rule leaves to fast frames; with ``detail_cut`` two or three bigger distractors
    # arrive with it, a scene change, so its first frame is a key frame (alone it changes too few
    # patches to start one), and it is a little larger. Each variant keeps its own order of draws.
    rng = d.rng
    if detail_cut:
        t_a = _grid_time(rng, 0, d.duration - 1.0)
        for s2, c2 in _distinct_objects(rng, int(rng.integers(2, 4)), avoid=("white",)):
            d.static(s2, c2, lo=d.side / 6, t_appear=t_a)
    else:
        for s2, c2 in _distinct_objects(rng, int(rng.integers(1, 3)), avoid=("white",)):
            d.static(s2, c2)
    s = str(rng.choice(SHAPES))
    r = max(5.0, d.side * (0.075 if detail_cut else 0.06))
    x, y = _free_pos(rng, d.w, d.h, r, d.taken)
    if not detail_cut:
        t_a = _grid_time(rng, 0, d.duration - 1.0)
    d.objs.append(Obj(s, "white", r, x, y, t_appear=t_a, t_vanish=t_a + 1.0))
    d.events.append({"t": t_a, "event": "appear", "object": "tiny white " + s})
    return _mc_question(rng, "A tiny white shape is shown briefly. What shape is it?", s, list(SHAPES))


_QUESTION_BUILDERS: dict[str, Callable[..., _Question]] = {
    "color": _q_color_shape,
    "shape": _q_color_shape,
    "count": _q_count,
    "position": _q_position,
    "direction": _q_motion,
    "when_leave": _q_motion,
    "order": _q_order,
    "color_change": _q_change,
    "when_change": _q_change,
    "when_collide": _q_when_collide,
    "when_appear": _q_when_appear,
    "when_gap": _q_when_gap,
    "when_sum": _q_when_sum,
    "price_sum": _q_price_sum,
    "detail": _q_detail,
}


def make_scene(rng: np.random.Generator, qtype: str, image: bool, detail_cut: bool = False) -> Scene:
    """Draw one scene (video unless ``image``) with a question of type ``qtype``; see the module table
    (``detail_cut``: the detail scene variant in which the tiny shape arrives with its distractors).
    Raises :class:`KeyeConfigError` for an unknown ``qtype``."""
    w, h = (int(rng.choice(SIDES)), int(rng.choice(SIDES)))
    fps = 0 if image else int(rng.choice(FPS_CHOICES))
    duration = 0.0 if image else GRID * int(rng.integers(4, 17))  # 2 .. 8 s
    build = _QUESTION_BUILDERS.get(qtype)
    if build is None:
        raise KeyeConfigError(f"unknown question type {qtype!r}")
    d = _Draft(rng, image, w, h, fps, duration)
    q = build(d, qtype, detail_cut) if qtype == "detail" else build(d, qtype)
    return Scene(w, h, fps, d.duration, d.objs, qtype, q.text, q.answer, q.kind, q.choices, q.tolerance,
                 d.events)


# ------------------------------------------------------------------------------------------ samples


def _heading(obj: Obj) -> str | None:
    """The direction an object moves in at its appearance (None when it stays put)."""
    if not (obj.vx or obj.vy):
        return None
    if abs(obj.vx) >= abs(obj.vy):
        return "right" if obj.vx > 0 else "left"
    return "down" if obj.vy > 0 else "up"


PLACE_WORDS = ("top left", "top", "top right", "left", "middle", "right", "bottom left", "bottom", "bottom right")


def grid_cell(x: float, y: float, width: int, height: int) -> int:
    """The cell of a 3 x 3 grid over the frame (thirds of each side) that the point (x, y) falls in,
    row-major, 0 = top left; points outside the frame count in the nearest cell."""
    row = min(2, max(0, int(3 * y / height)))
    col = min(2, max(0, int(3 * x / width)))
    return 3 * row + col


def place_word(x: float, y: float, width: int, height: int) -> str:
    """The :func:`grid_cell` of a point as words (:data:`PLACE_WORDS`): ``"top left"``, ``"top"``, ...,
    ``"middle"``, ..., ``"bottom right"``."""
    return PLACE_WORDS[grid_cell(x, y, width, height)]


def describe(scene: Scene, places: bool = False) -> str:
    """A dense caption of the clip: every object once, in order of appearance (then left to right), with
    its colour when it appears and, in videos, the second it appears and what it does: the direction it
    moves in, when it changes colour and to what, when it bounces off another object and when it is gone
    (left the frame or vanished). ``"red circle at 0.0 moving right bounces at 2.5, blue square at 1.5
    turns green at 3.0."`` (images: ``"red circle, blue square."``). It is the perception target of
    :func:`caption_rows` and needs no reasoning, only looking; every event a question can ask about is in
    it, so the captions train the perception behind every question type.

    With ``places`` every object also gets the cell of a 3 x 3 grid it is in when it appears
    (:func:`place_word`) after its name, and a moving object the cell it is last seen in (its last frame
    before it is gone or the clip ends): ``"red circle top left at 0.0 moving right ends top right, blue
    square bottom at 1.5."`` (images: ``"red circle top left, blue square right."``), so the captions
    also ask where things are, which the position and direction questions need."""
    objs = sorted(scene.objects, key=lambda o: (o.t_appear, o.x))

    def name(o: Obj) -> str:
        return f"{o.color} {o.shape}" + (f" {place_word(o.x, o.y, scene.width, scene.height)}" if places else "")

    if not scene.fps:
        return ", ".join(name(o) for o in objs) + "."
    parts = []
    for o in objs:
        words = [f"{name(o)} at {o.t_appear:.1f}"]
        heading = _heading(o)
        if heading:
            words.append(f"moving {heading}")
        if o.new_color and o.t_change < scene.duration:
            words.append(f"turns {o.new_color} at {o.t_change:.1f}")
        if o.bounce_at < scene.duration:
            words.append(f"bounces at {o.bounce_at:.1f}")
        if places and heading:  # where it is last seen: a start and an end place make a direction two looks
            t_end = max(o.t_appear, min(o.t_vanish, scene.duration) - 1.0 / scene.fps)
            _, x_end, y_end, _ = o.state(t_end)
            words.append(f"ends {place_word(x_end, y_end, scene.width, scene.height)}")
        if o.t_vanish < scene.duration:
            words.append(f"gone at {o.t_vanish:.1f}")
        parts.append(" ".join(words))
    return ", ".join(parts) + "."


CAPTION_PROMPT = "List every shape in the {kind} with its colour{times}."


def caption_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One caption row per manifest row that has a ``caption``: same media, the question
    :data:`CAPTION_PROMPT`, the caption as the answer (``question_type`` "caption", ``answer_kind``
    "text"). Training on these first gives a from-scratch model dense, direct supervision of what is in
    the frames (Keye's captioning stage in miniature), which the question-answer rows alone give too
    sparsely for a tiny model to discover."""
    out = []
    for r in rows:
        if "caption" not in r:
            continue
        media = next(c for c in r["messages"][0]["content"] if c.get("type") in ("image", "video"))
        video = media["type"] == "video"
        prompt = CAPTION_PROMPT.format(kind="video" if video else "image",
                                       times=", the second it appears and what it does" if video else "")
        out.append({
            "id": f"{r['id']}-caption",
            "messages": [
                {"role": "user", "content": [dict(media), {"type": "text", "text": prompt}]},
                {"role": "assistant", "content": [{"type": "text", "text": r["caption"]}]},
            ],
            "answer": r["caption"],
            "answer_kind": "text",
            "question_type": "caption",
            "meta": dict(r.get("meta", {})),
        })
    return out


def _conclusion(scene: Scene, target: str) -> str | None:
    """The step that reads a stepwise question's answer off the caption (None for one-look types)."""
    q = scene.question_type
    if q == "count":
        return f"total {len(scene.objects)}"
    if q == "order":
        return f"first {target}"
    if q == "when_sum":  # the three appearance times are in the caption (in this order); add them up
        t = sorted(float(o.t_appear) for o in scene.objects)
        return f"{t[0]:.1f} + {t[1]:.1f} = {t[0] + t[1]:.1f}; {t[0] + t[1]:.1f} + {t[2]:.1f} = {sum(t):.1f}"
    if q == "price_sum":  # each shape of the caption (in its order) with its price, then the running total
        prices = _prices(scene.question)
        objs = sorted(scene.objects, key=lambda o: (o.t_appear, o.x))
        a, b, c = (prices[o.shape] for o in objs)
        listed = ", ".join(f"{o.shape} {prices[o.shape]}" for o in objs)
        return f"{listed}; {a} + {b} = {a + b}; {a + b} + {c} = {a + b + c}"
    if q == "when_gap":  # the two appearance times are in the caption; write the subtraction out
        t1, t2 = sorted(float(o.t_appear) for o in scene.objects)
        return f"{t2:.1f} - {t1:.1f} = {t2 - t1:.1f}"
    ev = next((e for e in scene.events if e["event"] == {"when_appear": "appear", "when_change": "change",
                                                         "when_collide": "collide", "when_leave": "leave"}.get(q)),
              None)
    if ev is None:
        return None
    if ev["event"] == "collide":  # both objects were just named in the caption
        return f"touch at {ev['t']:.1f}"
    verb = {"appear": "appears", "change": "turns", "leave": "gone"}[ev["event"]]
    return f"{ev['object']} {verb} at {ev['t']:.1f}"


def _prices(question: str) -> dict[str, int]:
    """The price list of a ``price_sum`` question (``"Prices: circle 2, square 4, ..."``)."""
    listing = question.split("Prices: ", 1)[1].split(".", 1)[0]
    return {shape: int(price) for shape, price in (item.rsplit(" ", 1) for item in listing.split(", "))}


def reasoning_trace(scene: Scene, target: str, places: bool = False) -> str:
    """The think-mode trace of a scene's question: the dense caption (:func:`describe`, every object with
    the second it appears, what it does and when it is gone) and, for :data:`THINK_TYPES`, the step that
    reads the answer off it (``"; total 3"``, ``"; first the red circle"``, ``"; blue square turns at
    2.5"``, ``"; touch at 1.5"``). ``target`` is the assistant answer (the option text for multiple choice). Everything is
    written from the scene description, so a count in the trace equals the answer and every time in it is
    an event time of the scene. ``places`` writes the caption with places (:func:`describe`)."""
    caption = describe(scene, places).rstrip(".")
    step = _conclusion(scene, target) if scene.question_type in THINK_TYPES else None
    return caption if step is None else f"{caption}; {step}"


def mode_targets(scene: Scene, target: str, auto_think: bool | None = None, places: bool = False) -> dict[str, str]:
    """The assistant target of each thinking mode for a scene's question whose direct answer is
    ``target`` (see the module's modes table): ``{"think", "no_think", "auto"}``. The auto target opens
    with ``<analysis>/think</analysis>`` and thinks when ``auto_think`` (default ``None``: when the
    question type is in :data:`THINK_TYPES`), else opens with ``<analysis>/no_think</analysis>`` and
    answers directly (the analysis names the chosen switch, which :mod:`keye.rewards.format` checks
    against the mode used). ``places``: the trace's caption names where each object is."""
    think = f"<think>{reasoning_trace(scene, target, places)}</think>{target}"
    if auto_think is None:
        auto_think = scene.question_type in THINK_TYPES
    auto = f"<analysis>/think</analysis>{think}" if auto_think else f"<analysis>/no_think</analysis>{target}"
    return {"think": think, "no_think": target, "auto": auto}


def mode_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Expand rows that carry ``modes`` (made with ``modes=True``) into one SFT row per thinking mode:
    id ``<id>-<mode>``, the user prompt with the mode's switch (:func:`keye.processing.chat.apply_mode`:
    ``/think``, ``/no_think``, none for auto), the mode's target as the assistant turn, and ``mode`` set.
    Answer, answer kind, choices, tolerance and question type are kept, so the rows also evaluate.

    Raises:
        KeyeConfigError: a row without ``modes`` (naming its id).
    """
    from keye.processing.chat import apply_mode

    out = []
    for r in rows:
        if "modes" not in r:
            raise KeyeConfigError(f"row {r.get('id')!r} has no 'modes' (generate the set with modes=True)")
        for mode in THINKING_MODES:
            user = apply_mode([r["messages"][0]], mode)[0]
            row = {k: v for k, v in r.items() if k not in ("messages", "modes", "caption")}
            row["id"] = f"{r['id']}-{mode}"
            row["messages"] = [user, {"role": "assistant", "content": [{"type": "text", "text": r["modes"][mode]}]}]
            row["mode"] = mode
            out.append(row)
    return out


def sample_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator that fully determines sample ``index`` of ``split``."""
    return np.random.default_rng([int(seed), SPLIT_CODES[split], int(index)])


AUTO_LABELS = ("type", "mixed")
"""The auto-mode labellings of ``modes=True`` rows: ``"type"`` thinks exactly on :data:`THINK_TYPES`;
``"mixed"`` draws each sample's decision 50/50 (:func:`mixed_auto_think`), whatever its type."""


def mixed_auto_think(seed: int, split: str, index: int) -> bool:
    """The ``auto_labels="mixed"`` decision of sample ``index`` of ``split``: think with probability 1/2,
    from its own generator seeded by ``(seed, split, index)`` and a constant salt, so it is reproducible
    and independent of the sample's scene (which :func:`sample_rng` alone determines, untouched)."""
    return bool(np.random.default_rng([int(seed), SPLIT_CODES[split], int(index), 0xA070]).random() < 0.5)


def _check_auto_labels(auto_labels: str) -> None:
    if auto_labels not in AUTO_LABELS:
        raise KeyeConfigError(f"unknown auto_labels {auto_labels!r} (expected one of {', '.join(AUTO_LABELS)})")


def _weighted(rng: np.random.Generator, table: dict[str, float]) -> str:
    keys = list(table)
    p = np.asarray([table[k] for k in keys], dtype=float)
    return str(keys[int(rng.choice(len(keys), p=p / p.sum()))])


def make_warmup_sample(out_dir: str, split: str, index: int, seed: int, image_fraction: float,
                       places: bool = False) -> dict[str, Any]:
    """A perception warm-up row (split ``"warmup"``): an image of one or two *large* shapes (radius a fifth
    to a third of the side) and its caption as the answer (the :func:`caption_rows` format).

    Large objects fill whole vision tokens, so even an untrained tower gives the decoder a clear signal;
    a tiny model learns to read colours and shapes here first and then transfers it to the small objects
    of the real clips (trained on small objects alone it never starts). ``image_fraction`` is ignored;
    ``places`` writes the caption with places (:func:`describe`).
    """
    rng = sample_rng(seed, split, index)
    w, h = int(rng.choice(SIDES)), int(rng.choice(SIDES))
    side = min(w, h)
    taken: list[tuple[float, float, float]] = []
    objs = []
    for s_, c in _distinct_objects(rng, int(rng.integers(1, 3))):
        r = float(rng.uniform(side / 5, side / 3 if not objs else side / 4))
        x, y = _free_pos(rng, w, h, r, taken)
        objs.append(Obj(s_, c, r, x, y))
    scene = Scene(w, h, 0, 0.0, objs, "caption", "", "", "text", None, None, [])
    rel = Path("media") / split / f"{index:06d}.png"
    dest = Path(out_dir) / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_image(dest, scene)
    caption = describe(scene, places)
    return {
        "id": f"{split}-{index:06d}",
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": str(rel)},
                                         {"type": "text", "text": CAPTION_PROMPT.format(kind="image", times="")}]},
            {"role": "assistant", "content": [{"type": "text", "text": caption}]},
        ],
        "answer": caption,
        "answer_kind": "text",
        "question_type": "caption",
        "meta": {"modality": "image", "width": w, "height": h, "fps": 0, "duration": 0.0, "num_frames": 1,
                 "events": []},
    }


def _image_types(position_weight: float) -> dict[str, float]:
    if not (math.isfinite(position_weight) and position_weight > 0):
        raise KeyeConfigError(f"position_weight must be > 0, got {position_weight}")
    return {**IMAGE_TYPES, "position": float(position_weight)}


def _check_extra_types(extra_types: dict[str, float] | None) -> dict[str, float]:
    extra = dict(extra_types or {})
    for name, weight in extra.items():
        if name not in EXTRA_VIDEO_TYPES:
            raise KeyeConfigError(f"unknown extra question type {name!r} (opt-in types: "
                                  f"{', '.join(sorted(EXTRA_VIDEO_TYPES))})")
        if not (math.isfinite(weight) and weight > 0):
            raise KeyeConfigError(f"extra question type {name!r} needs a weight > 0, got {weight}")
    return extra


def sample_scene(seed: int, split: str, index: int, image_fraction: float = 0.1,
                 extra_types: dict[str, float] | None = None, detail_cut: bool = False,
                 position_weight: float = 1.0) -> Scene:
    """The scene (objects, question, answer) of sample ``index`` of ``split``, exactly as
    :func:`make_sample` draws it with the same arguments, without rendering anything: what a probe needs
    to know about a row beyond its manifest (each object's size and path).

    Raises:
        KeyeConfigError: an unknown extra type, an extra type's weight <= 0, or ``position_weight`` <= 0.
    """
    extra = _check_extra_types(extra_types)
    images = _image_types(position_weight)
    rng = sample_rng(seed, split, index)
    image = bool(rng.random() < image_fraction)
    qtype = _weighted(rng, images if image else {**VIDEO_TYPES, **extra})
    return make_scene(rng, qtype, image, detail_cut)


def make_sample(out_dir: str, split: str, index: int, seed: int, image_fraction: float,
                modes: bool = False, auto_labels: str = "type",
                extra_types: dict[str, float] | None = None, places: bool = False, detail_cut: bool = False,
                position_weight: float = 1.0) -> dict[str, Any]:
    """Render sample ``index`` of ``split`` into ``out_dir/media/<split>/`` and return its manifest row.

    The row's media path is relative to ``out_dir`` (the manifest root). With ``modes`` the row also has
    ``modes`` (:func:`mode_targets`) and ``auto_mode`` ("think" / "no_think", chosen by ``auto_labels``,
    one of :data:`AUTO_LABELS`); the rest is identical. ``extra_types`` adds opt-in video question types
    (:data:`EXTRA_VIDEO_TYPES`) with their weights to the video types' table; without it the sample is
    the default set's. ``places`` writes the caption (and the think traces) with places (:func:`describe`).
    ``detail_cut`` and ``position_weight`` are the opt-in scene options of the module docstring.

    Raises:
        KeyeConfigError: unknown ``auto_labels`` or extra type, an extra type's weight <= 0, or
            ``position_weight`` <= 0.
    """
    _check_auto_labels(auto_labels)
    scene = sample_scene(seed, split, index, image_fraction, extra_types, detail_cut, position_weight)
    image = scene.fps == 0
    sid = f"{split}-{index:06d}"
    rel = Path("media") / split / (f"{index:06d}.png" if image else f"{index:06d}.mp4")
    dest = Path(out_dir) / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    if image:
        write_image(dest, scene)
        media_item: dict[str, Any] = {"type": "image", "image": str(rel)}
    else:
        write_video(dest, scene)
        media_item = {"type": "video", "video": str(rel)}
    # Multiple-choice rows are scored by the option letter (``answer``) but trained, and answered, with the
    # option's text (the MMMU rule accepts either): naming what is seen needs only perception, while a
    # letter needs an in-context lookup from the perceived word to the letter in front of it, which a
    # model of keye-tiny's size does not form in a CPU budget (training/probe_mc.py).
    target = scene.choices[LETTERS.index(scene.answer)] if scene.choices is not None else scene.answer
    row: dict[str, Any] = {
        "id": sid,
        "messages": [
            {"role": "user", "content": [media_item, {"type": "text", "text": scene.question}]},
            {"role": "assistant", "content": [{"type": "text", "text": target}]},
        ],
        "answer": scene.answer,
        "answer_kind": scene.answer_kind,
        "question_type": scene.question_type,
    }
    if scene.choices is not None:
        row["choices"] = scene.choices
    if scene.tolerance is not None:
        row["tolerance"] = scene.tolerance
    row["caption"] = describe(scene, places)
    row["meta"] = {
        "modality": "image" if image else "video",
        "width": scene.width,
        "height": scene.height,
        "fps": scene.fps,
        "duration": scene.duration,
        "num_frames": scene.num_frames,
        "events": scene.events,
    }
    if modes:
        auto_think = (mixed_auto_think(seed, split, index) if auto_labels == "mixed"
                      else scene.question_type in THINK_TYPES)
        row["modes"] = mode_targets(scene, target, auto_think, places)
        row["auto_mode"] = "think" if auto_think else "no_think"
    return row


def _make_star(args: tuple[Any, ...]) -> dict[str, Any]:
    if args[1] == "warmup":
        return make_warmup_sample(*args[:5], places=args[8])
    return make_sample(*args)


def generate_split(
    out_dir: str | os.PathLike[str],
    split: str,
    n: int,
    *,
    seed: int = 0,
    workers: int | None = None,
    image_fraction: float = 0.1,
    progress: bool = True,
    chunksize: int = 8,
    modes: bool = False,
    auto_labels: str = "type",
    extra_types: dict[str, float] | None = None,
    places: bool = False,
    detail_cut: bool = False,
    position_weight: float = 1.0,
) -> Path:
    """Generate ``n`` samples of ``split`` ("train" or "test") and write ``out_dir/<split>.jsonl``, plus
    ``out_dir/<split>_captions.jsonl`` (:func:`caption_rows`: one dense-caption row per sample, same media).
    Split ``"warmup"`` writes :func:`make_warmup_sample` rows (large-object caption images) instead.

    Args:
        workers: process-pool size (default: all CPUs); 0 renders in this process.
        image_fraction: share of image-only samples (0..1).
        progress: show a tqdm bar.
        modes: also give each row its thinking-mode targets (``modes``, ``auto_mode``) and write
            ``out_dir/<split>_modes.jsonl`` (:func:`mode_rows`: three SFT rows per sample). Ignored for
            ``"warmup"``.
        auto_labels: with ``modes``, how the auto rows decide (:data:`AUTO_LABELS`): ``"type"`` (default)
            thinks on :data:`THINK_TYPES` only; ``"mixed"`` draws each sample's decision 50/50
            (:func:`mixed_auto_think`), so a model fine-tuned on the rows takes both decisions on every
            type (a cold start RL can still select from). The think and no_think rows are the same.
        extra_types: opt-in video question types and their weights (:data:`EXTRA_VIDEO_TYPES`, e.g.
            ``{"when_gap": 3.0}``); None (default) draws the default types only.
        places: the captions (and think traces) also name each object's 3 x 3 grid cell
            (:func:`describe`); off by default, so the default set is unchanged.
        detail_cut: the detail scenes' tiny shape arrives with its distractors, in a key frame (module
            docstring); off by default.
        position_weight: the position type's weight among the image types (default 1, the others' weight).

    Returns:
        The manifest path. Rows are in index order whatever the worker count.

    Raises:
        KeyeConfigError: unknown split, ``auto_labels`` or extra type, negative ``n``, ``image_fraction``
            outside [0, 1], or ``position_weight`` <= 0.
    """
    if split not in SPLIT_CODES:
        raise KeyeConfigError(f"unknown split {split!r} (expected one of {', '.join(SPLIT_CODES)})")
    if n < 0 or not 0.0 <= image_fraction <= 1.0:
        raise KeyeConfigError(f"need n >= 0 and 0 <= image_fraction <= 1, got n={n}, {image_fraction}")
    _check_auto_labels(auto_labels)
    extra = _check_extra_types(extra_types) or None
    _image_types(position_weight)
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modes = modes and split != "warmup"
    jobs = [(str(out), split, i, seed, image_fraction, modes, auto_labels, extra, places, detail_cut, position_weight)
            for i in range(n)]
    workers = (os.cpu_count() or 1) if workers is None else workers
    bar: Callable[..., Any] = tqdm if progress else (lambda it, **_: it)
    if workers <= 0 or n <= 1:
        rows = [_make_star(j) for j in bar(jobs, desc=f"synth {split}", unit="clip")]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            rows = list(
                bar(pool.map(_make_star, jobs, chunksize=chunksize), total=n, desc=f"synth {split}", unit="clip")
            )
    path = out / f"{split}.jsonl"
    write_manifest(path, rows)
    if split != "warmup":  # warm-up rows are captions already
        write_manifest(out / f"{split}_captions.jsonl", caption_rows(rows))
    if modes:
        write_manifest(out / f"{split}_modes.jsonl", mode_rows(rows))
    return path


def generate(out_dir: str | os.PathLike[str], *, train: int, test: int, warmup: int = 0,
             **options: Any) -> dict[str, Path]:
    """Generate both splits (and ``warmup`` perception warm-up rows when > 0); returns
    ``{"train": path, "test": path[, "warmup": path]}``. ``options`` are :func:`generate_split`'s keyword
    arguments, the same for every split (``seed``, ``workers``, ``image_fraction``, ``progress``; ``modes``
    adds the thinking-mode targets and ``<split>_modes.jsonl``, their auto rows labelled by ``auto_labels``;
    ``extra_types`` adds opt-in question types; ``places`` names where each object is in the captions;
    ``detail_cut`` and ``position_weight`` are the opt-in scene options); an unknown one raises TypeError."""
    splits = [("train", train), ("test", test)] + ([("warmup", warmup)] if warmup > 0 else [])
    return {split: generate_split(out_dir, split, n, **options) for split, n in splits}
