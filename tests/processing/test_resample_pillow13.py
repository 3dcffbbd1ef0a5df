"""keye's numpy resampler against stock Pillow 13.0, which produced the official processor's pixels.

The project venv cannot hold Pillow 13 (gradio pins ``pillow<13``), so ``make install`` puts it in a side
folder, ``<venv>/pillow13``. A subprocess started in isolated mode (``-I``: no PYTHONPATH, no user site,
no cwd) with that folder first on ``sys.path`` resizes a batch of seeded random images; keye's
``resize_uint8`` must equal every result bit for bit. The sweep covers both pass orders of Pillow 13
(vertical first iff ``dH > 0 and dH > 2 * dW``) and their boundary, growth/shrink mixes, thin, tiny,
huge, identity and the golden fixtures' sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keye.errors import KeyeInputError
from keye.processing.resample import _pass, resize_uint8, vertical_pass_first

PILLOW13_DIR = Path(sys.prefix) / "pillow13"
INSTALL_CMD = f"{sys.executable} -m pip install --target {PILLOW13_DIR} pillow==13.0.0  (or: make install)"

# Runs inside the isolated child: argv = [-c, side folder, work folder].
_CHILD = r"""
import json, sys
side, work = sys.argv[1], sys.argv[2]
sys.path.insert(0, side)
import PIL
from PIL import Image
import numpy as np
if PIL.__version__ != "13.0.0" or not PIL.__file__.startswith(side):
    sys.exit(f"expected stock Pillow 13.0.0 from {side}, got {PIL.__version__} at {PIL.__file__}")
with open(work + "/cases.json") as f:
    cases = json.load(f)
for i, (out_w, out_h, resample) in enumerate(cases):
    src = np.load(f"{work}/in_{i}.npy")
    np.save(f"{work}/out_{i}.npy", np.asarray(Image.fromarray(src).resize((out_w, out_h), resample)))
"""

BICUBIC = 3


def _case(in_h, in_w, out_h, out_w, resample=BICUBIC, channels=3):
    mode = "RGB" if channels == 3 else "L"
    name = f"{in_w}x{in_h}->{out_w}x{out_h}-f{resample}-{mode}"
    return name, (in_h, in_w, out_h, out_w, resample, channels)


def _sweep() -> dict[str, tuple[int, int, int, int, int, int]]:
    """Named cases ``(in_h, in_w, out_h, out_w, filter, channels)``; names are Pillow's WxH."""
    shapes = [
        # both shrink, dH <= 2*dW: horizontal first in 13.0
        (90, 150, 84, 140), (60, 100, 50, 80), (300, 400, 200, 300), (120, 64, 110, 40), (400, 300, 7, 5),
        # boundary: dH == 2*dW -> horizontal first, dH == 2*dW + 1 -> vertical first
        (100, 100, 80, 90), (101, 100, 80, 90), (61, 50, 41, 40), (62, 50, 41, 40),
        # both shrink, dH > 2*dW: vertical first
        (200, 150, 100, 140), (64, 64, 32, 60), (300, 400, 7, 5),
        # up in one axis, down in the other
        (80, 50, 40, 90), (50, 80, 70, 40), (20, 120, 28, 100),
        # both up
        (7, 9, 40, 33), (33, 45, 34, 46),
        # thin
        (4, 300, 2, 150), (4, 300, 8, 600), (4, 300, 3, 280), (300, 4, 150, 2), (300, 4, 280, 3),
        (300, 4, 299, 2), (1, 300, 1, 100), (300, 1, 100, 1), (4, 300, 1, 1),
        # aspect ratio beyond 100 (Pillow 12 special-cased it in Python; 13 uses the C rule)
        (1000, 5, 10, 2), (5, 1000, 2, 10), (1000, 5, 900, 4),
        # tiny
        (1, 1, 1, 1), (1, 1, 3, 5), (3, 2, 1, 1), (3, 2, 2, 3), (2, 3, 3, 2), (3, 2, 1, 2), (2, 3, 2, 1),
        # identity and one axis only
        (224, 224, 224, 224), (37, 91, 37, 91), (60, 100, 60, 80), (60, 100, 40, 100), (60, 100, 90, 100),
        # huge
        (1500, 2000, 756, 1008),
        # the golden fixtures' sizes (preview processor images and video)
        (60, 100, 56, 112), (300, 57, 308, 56), (20, 120, 28, 168), (30, 40, 56, 84), (300, 57, 196, 28),
        (56, 84, 56, 84),
    ]
    cases = dict(_case(*s) for s in shapes)
    # random shapes: seeded, so the sweep is the same on every run
    rng = np.random.default_rng(1234)
    for _ in range(40):
        in_h, in_w, out_h, out_w = (int(v) for v in rng.integers(1, 161, 4))
        cases.update([_case(in_h, in_w, out_h, out_w)])
    # single-channel images take Pillow's 8-bit "L" path
    for s in [(90, 150, 84, 140), (101, 100, 80, 90), (30, 40, 56, 84)]:
        cases.update([_case(*s, channels=1)])
    # the other filters share the pass-order rule but not the kernel
    for f in (1, 2, 4, 5, 6, 7):
        for s in [(90, 150, 84, 140), (101, 100, 80, 90), (100, 100, 80, 90), (30, 40, 56, 84),
                  (60, 100, 56, 112), (300, 4, 150, 2), (40, 50, 13, 17)]:
            cases.update([_case(*s, resample=f)])
    # Pillow's Hamming constants are C floats (0.54f, 0.46f); with doubles a few integer weights move
    # by one unit, which flips a pixel only rarely, hence many rows
    for s in [(2000, 48, 2000, 16), (2000, 132, 2000, 82)]:
        cases.update([_case(*s, resample=5)])
    return cases


SWEEP = _sweep()


def _image(name: str) -> np.ndarray:
    in_h, in_w, _, _, _, channels = SWEEP[name]
    seed = sorted(SWEEP).index(name)
    shape = (in_h, in_w, 3) if channels == 3 else (in_h, in_w)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


@pytest.fixture(scope="module")
def pillow13(tmp_path_factory) -> dict[str, np.ndarray]:
    """Every sweep case resized by stock Pillow 13.0 in one isolated subprocess."""
    if not (PILLOW13_DIR / "PIL").is_dir():
        msg = f"stock Pillow 13.0 is not side-installed at {PILLOW13_DIR}; install it with: {INSTALL_CMD}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    work = tmp_path_factory.mktemp("pillow13")
    names = sorted(SWEEP)
    for i, name in enumerate(names):
        np.save(work / f"in_{i}.npy", _image(name))
    (work / "cases.json").write_text(json.dumps([[SWEEP[n][3], SWEEP[n][2], SWEEP[n][4]] for n in names]))
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _CHILD, str(PILLOW13_DIR), str(work)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"Pillow 13 subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return {name: np.load(work / f"out_{i}.npy") for i, name in enumerate(names)}


@pytest.mark.parametrize("name", sorted(SWEEP))
def test_resize_equals_pillow13(pillow13, name):
    _, _, out_h, out_w, resample, _ = SWEEP[name]
    ref = pillow13[name]
    ours = resize_uint8(_image(name), out_h, out_w, resample)
    assert ours.shape == ref.shape and ours.dtype == np.uint8
    diff = int(np.abs(ours.astype(np.int16) - ref.astype(np.int16)).max())
    assert diff == 0, f"{name}: max |keye - Pillow 13| = {diff} uint8 levels"


def test_sweep_covers_both_pass_orders_and_each_matters():
    # Without cases where the two orders give different pixels the sweep could not catch a wrong rule.
    vert = horiz = 0
    for name, (in_h, in_w, out_h, out_w, resample, _) in SWEEP.items():
        if out_h == in_h or out_w == in_w or resample != BICUBIC or in_h * in_w > 100_000:
            continue
        img = _image(name)
        v_first = _pass(_pass(img, out_h, 0, resample), out_w, 1, resample)
        h_first = _pass(_pass(img, out_w, 1, resample), out_h, 0, resample)
        if not np.array_equal(v_first, h_first):
            if vertical_pass_first(in_h, in_w, out_h, out_w):
                vert += 1
            else:
                horiz += 1
    assert vert >= 5 and horiz >= 5, (vert, horiz)


@pytest.mark.parametrize(
    ("in_hw", "out_hw", "expected"),
    [
        ((100, 100), (80, 90), False),  # dH = 20 == 2 * dW
        ((101, 100), (80, 90), True),  # dH = 21 > 2 * dW
        ((90, 150), (84, 140), False),  # height shrinks, but less than twice the width's shrink
        ((60, 100), (56, 112), True),  # width grows: any height shrink goes first
        ((50, 80), (70, 40), False),  # height grows
        ((60, 100), (60, 80), False),  # height unchanged
    ],
)
def test_vertical_pass_first_rule(in_hw, out_hw, expected):
    assert vertical_pass_first(*in_hw, *out_hw) is expected


@pytest.mark.parametrize(
    ("img", "size", "resample", "match"),
    [
        (np.zeros((4, 4, 3), np.float32), (2, 2), 3, "uint8"),
        (np.zeros((2, 4, 4, 3), np.uint8), (2, 2), 3, r"\[H, W\]"),
        ([[0, 1], [2, 3]], (2, 2), 3, "list"),
        (np.zeros((0, 4), np.uint8), (2, 2), 3, "empty"),
        (np.zeros((4, 4), np.uint8), (0, 2), 3, "cannot resize to 2x0"),
        (np.zeros((4, 4), np.uint8), (2, 2), 0, "filter id 0"),
    ],
)
def test_resize_rejects_bad_input(img, size, resample, match):
    with pytest.raises(KeyeInputError, match=match):
        resize_uint8(img, *size, resample)
