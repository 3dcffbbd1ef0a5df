"""Slow-fast (Keye-VL-1.5): OpenCV-exact HSV, frame classification, budgets, prompt layout."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from keye.processing.slowfast import (
    FAST,
    SLOW,
    TOKEN_PIXELS,
    classify_frames,
    frame_similarity,
    rgb_to_hsv_u8,
    slowfast_sizes,
)
from keye.processing.video import decode_frames, probe_video
from keye.testing.processor import make_test_video


def test_hsv_hand_values():
    px = np.array(
        [[255, 0, 0], [0, 255, 0], [0, 0, 255], [0, 0, 0], [255, 255, 255], [255, 0, 255]], np.uint8
    )
    # OpenCV 8-bit convention: H = degrees / 2, S and V scaled to 255
    expect = [[0, 255, 255], [60, 255, 255], [120, 255, 255], [0, 0, 0], [0, 0, 255], [150, 255, 255]]
    np.testing.assert_array_equal(rgb_to_hsv_u8(px), expect)


def test_hsv_matches_opencv():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (512, 512, 3)).astype(np.uint8)
    img[0, :256] = np.arange(256)[:, None]  # greys
    img[1, :256, 0], img[1, :256, 1], img[1, :256, 2] = 255, np.arange(256), 0  # hue ramp near red
    np.testing.assert_array_equal(rgb_to_hsv_u8(img), cv2.cvtColor(img, cv2.COLOR_RGB2HSV))


def test_similarity_ignores_black_patches_and_detects_change():
    a = np.zeros((56, 56, 3), np.uint8)
    assert frame_similarity(a, a) == 1.0  # all patches excluded -> identical
    b = a.copy()
    b[:28, :28] = (200, 50, 50)  # one of four patches differs; the other three are black in both -> excluded
    assert frame_similarity(a, b) == 0.0
    c = np.full((56, 56, 3), 120, np.uint8)
    d = c.copy()
    d[:28, :28] = (10, 200, 30)
    assert frame_similarity(rgb_to_hsv_u8(c), rgb_to_hsv_u8(d)) == 0.75


def _decode_all(clip):
    probe = probe_video(str(clip.path))
    frames, _, _ = decode_frames(probe, list(range(probe.n_frames)), "pyav")
    return torch.from_numpy(frames).permute(0, 3, 1, 2)


def test_static_clip_one_slow_rest_fast(tmp_path):
    clip = make_test_video(tmp_path / "static.mp4", 24, fps=8, size=(112, 224), pattern="static")
    types = classify_frames(_decode_all(clip))
    assert types[0] == SLOW and (types[1:] == FAST).all()


def test_scene_cuts_start_new_slow_frames(tmp_path):
    clip = make_test_video(
        tmp_path / "cuts.mp4", 30, fps=8, size=(112, 224), pattern="scenes", scene_cuts=[9, 20]
    )
    types = classify_frames(_decode_all(clip))
    assert np.flatnonzero(types == SLOW).tolist() == [0, 9, 20]


def test_threshold_configurable():
    # 168x252 is already a similarity-resolution size (6 x 9 = 54 patches of 28 px): no resize blur.
    base = np.zeros((168, 252, 3), np.uint8)
    base[..., 0], base[..., 1], base[..., 2] = 200, 50, 50
    changed = base.copy()
    changed[:28, :84] = 0  # 3 of 54 patches go black: cosine 0 -> similarity 51/54 = 0.944
    frames = torch.from_numpy(np.stack([base, changed])).permute(0, 3, 1, 2)
    assert classify_frames(frames).tolist() == [SLOW, FAST]  # default threshold 0.9
    assert classify_frames(frames, min_frame_similarity=0.95).tolist() == [SLOW, SLOW]


@pytest.mark.parametrize("n_black,expect", [(4, FAST), (5, SLOW), (6, SLOW)])
def test_similarity_on_the_threshold_is_a_float32_fraction(n_black, expect):
    # 140x280 is already a similarity-resolution size: 5 x 10 = 50 patches, no resize. Blackening k patches
    # makes their cosine 0, so the similarity is (50 - k) / 50. For k = 5 that is 0.9 in float64 (not below
    # the 0.9 threshold: fast) but 0.89999998 as the reference's float32 mean (below: slow).
    base = np.zeros((140, 280, 3), np.uint8)
    base[..., 0], base[..., 1], base[..., 2] = 200, 50, 50
    changed = base.copy()
    for k in range(n_black):
        changed[28 * (k % 5) : 28 * (k % 5 + 1), 28 * k : 28 * (k + 1)] = 0
    frames = torch.from_numpy(np.stack([base, changed])).permute(0, 3, 1, 2)
    assert classify_frames(frames).tolist() == [SLOW, expect]
    assert float(np.float32(45) / np.float32(50)) < 0.9 <= 45 / 50  # the two roundings the test separates


def test_worked_examples_1080p():
    short = slowfast_sizes(60, 60, 1080, 1920)
    assert (short.slow_hw, short.slow_tokens) == ((560, 1008), 720)
    assert (short.fast_hw, short.fast_tokens) == ((308, 532), 209)
    long = slowfast_sizes(300, 900, 1080, 1920)
    assert long.slow_hw == (168, 308) and long.slow_tokens == 66
    assert long.fast_hw == (140, 252) and long.fast_tokens == 45


@pytest.mark.parametrize(
    "n_slow,n_fast", [(1, 0), (5, 200), (64, 64), (300, 900), (700, 600), (1, 1364), (1200, 10)]
)
@pytest.mark.parametrize("hw", [(1080, 1920), (720, 1280), (480, 360), (2160, 3840), (300, 1000)])
def test_budget_search_stops_at_the_first_count_over_budget(n_slow, n_fast, hw):
    # keye-vl-utils 1.5.2: the per-slow-frame count T is the smallest in [48, 768] whose estimate exceeds
    # the 65,536-token budget (or 768 when none does); frames are then sized under T.
    total_tokens = 65536
    s = slowfast_sizes(n_slow, n_fast, *hw)

    def est(t: int) -> int:
        return n_slow * t + n_fast * max(int(0.3 * t), 48)

    t = s.budget_tokens
    assert t == 768 or est(t) > total_tokens
    assert t == 48 or est(t - 1) <= total_tokens
    assert s.slow_tokens <= t and s.fast_tokens <= max(int(0.3 * s.slow_tokens), 48)


def test_budget_cannot_fit_uses_the_floor_size_and_warns(caplog):
    # 20 frames of at least 48 tokens cannot fit 100 tokens; the reference still returns the floor sizes
    with caplog.at_level("WARNING", logger="keye.processing.slowfast"):
        s = slowfast_sizes(10, 10, 720, 1280, total_pixels=100 * TOKEN_PIXELS, item="video 3")
    assert s.budget_tokens == 48 and s.slow_hw == (140, 252) and s.fast_hw == (140, 252)
    assert s.slow_tokens == 45  # smart_resize floors 720x1280 under 48 * 784 pixels: 5 x 9 patches of 28
    assert len(caplog.records) == 1 and "video 3" in caplog.text and "over the total budget" in caplog.text


def test_fast_cap_ignores_the_items_min_pixels():
    # 224x448 with min_pixels 50,000: slow stays 224x448 (128 tokens); the fast cap is
    # max(int(0.3 * 128) * 784, 37,632) = 37,632 (the fixed floor, not the item's 50,000), and smart_resize
    # checks the cap first: 100,352 > 37,632 -> floor(4.90) * 28 x floor(9.80) * 28 = 112 x 252.
    s = slowfast_sizes(2, 6, 224, 448, min_pixels=50_000)
    assert s.slow_hw == (224, 448) and s.fast_hw == (112, 252)


def test_processor_v15_prompt_layout_and_pixels(tmp_path):
    from keye.processing.processor import KeyeProcessor
    from keye.testing.processor import make_tiny_processor_dir

    proc = KeyeProcessor.from_pretrained(make_tiny_processor_dir(tmp_path / "p15", variant="1.5"))
    assert proc.variant == "1.5"
    clip = make_test_video(
        tmp_path / "cuts.mp4", 32, fps=8, size=(224, 448), pattern="scenes", scene_cuts=[16]
    )
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": str(clip.path), "fps": 2.0},
                {"type": "text", "text": "Hi"},
            ],
        }
    ]
    b = proc(msgs)
    meta = b.video_meta[0]
    # 4 s at 2 fps = 8 frames: linspace(0, 31, 8) rounded; the cut at 16 makes frame 4 (index 18) slow again
    assert meta.indices == [0, 4, 9, 13, 18, 22, 27, 31]
    assert meta.frame_types == ["slow", "fast", "fast", "fast", "slow", "fast", "fast", "fast"]
    np.testing.assert_allclose(meta.timestamps, [i / 8 for i in meta.indices], atol=1e-6)
    # by hand: slow keeps 224x448 (128 tokens <= 768); fast max = max(int(128*0.3)*784, 37632) = 37632
    # -> beta = sqrt(100352/37632) -> floor(4.90)*28 x floor(9.80)*28 = 112 x 252
    sizes = slowfast_sizes(2, 6, 224, 448)
    assert sizes.slow_hw == (224, 448) and sizes.fast_hw == (112, 252)
    slow_g, fast_g = [1, 16, 32], [1, 8, 18]
    expect_grids = [slow_g if t == "slow" else fast_g for t in meta.frame_types]
    assert meta.frame_grids == expect_grids
    assert b.video_grid_thw.tolist() == [
        [1, *slow_g[1:]],
        [3, *fast_g[1:]],
        [1, *slow_g[1:]],
        [3, *fast_g[1:]],
    ]
    assert "second_per_grid_ts" not in b
    # prompt: <|vision_start|> then per frame <|frame|> + "t.t" + pads (fast ones wrapped) then <|vision_end|>
    ids = b.input_ids[0].tolist()
    tok = proc.tokenizer
    start = ids.index(tok.convert_tokens_to_ids("<|vision_start|>"))
    end = ids.index(tok.convert_tokens_to_ids("<|vision_end|>"))
    expect = []
    pad = tok.convert_tokens_to_ids("<|video_pad|>")
    for kind, g, ts in zip(meta.frame_types, meta.frame_grids, meta.timestamps):
        expect += [tok.convert_tokens_to_ids("<|frame|>")] + tok(f"{ts:.1f}", add_special_tokens=False)[
            "input_ids"
        ]
        n = g[1] * g[2] // 4
        if kind == "fast":
            expect += (
                [tok.convert_tokens_to_ids("<|fast_start|>")]
                + [pad] * n
                + [tok.convert_tokens_to_ids("<|fast_end|>")]
            )
        else:
            expect += [pad] * n
    assert ids[start + 1 : end] == expect
    assert proc.decode(ids[start + 1 : start + 5], skip_special_tokens=False).startswith("<|frame|>0.0")
    # pixels: frames in temporal order, each resized (bilinear, antialias) to its own size and normalised
    frames, _, _ = decode_frames(probe_video(str(clip.path)), meta.indices, "pyav")
    x = torch.from_numpy(frames).permute(0, 3, 1, 2)
    rows = []
    for j, g in enumerate(meta.frame_grids):
        hw = (g[1] * 14, g[2] * 14)
        f = F.interpolate(x[j : j + 1], size=hw, mode="bilinear", antialias=True).float()
        f = ((f.double() / 255).float() - 0.5) / 0.5
        rows.append(f.reshape(3, g[1], 14, g[2], 14).permute(1, 3, 0, 2, 4).reshape(-1, 3, 14, 14))
    torch.testing.assert_close(b.pixel_values_videos, torch.cat(rows), atol=1e-6, rtol=0)


def test_processor_v15_slow_fast_off(tmp_path):
    from keye.processing.processor import KeyeProcessor
    from keye.testing.processor import make_tiny_processor_dir

    proc = KeyeProcessor.from_pretrained(make_tiny_processor_dir(tmp_path / "p15", variant="1.5"))
    clip = make_test_video(tmp_path / "s.mp4", 16, fps=8, size=(112, 224), pattern="static")
    b = proc([{"role": "user", "content": [{"type": "video", "video": str(clip.path), "slow_fast": False}]}])
    assert set(b.video_meta[0].frame_types) == {"slow"} and len(b.video_grid_thw) == 1


def test_processor_v15_two_videos_numbered_in_order(tmp_path):
    from keye.processing.processor import KeyeProcessor
    from keye.testing.processor import make_tiny_processor_dir

    proc = KeyeProcessor.from_pretrained(make_tiny_processor_dir(tmp_path / "p15", variant="1.5"))
    a = make_test_video(tmp_path / "a.mp4", 16, fps=8, size=(112, 224), pattern="static")
    b = make_test_video(tmp_path / "b.mp4", 24, fps=8, size=(112, 224), pattern="scenes", scene_cuts=[12])
    msgs = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "video", "video": str(a.path)},
                {"type": "text", "text": "and"},
                {"type": "video", "video": str(b.path)},
            ],
        },
    ]
    out = proc(msgs)
    ma, mb = out.video_meta
    assert (ma.index, mb.index) == (0, 1) and len(ma.indices) == 4 and len(mb.indices) == 6
    assert int(out.video_grid_thw[:, 0].sum()) == 10
    per_frame_rows = sum(g[1] * g[2] for g in ma.frame_grids + mb.frame_grids)
    assert out.pixel_values_videos.shape[0] == per_frame_rows
    assert int((out.input_ids == proc.video_token_id).sum()) == ma.tokens + mb.tokens
    assert proc.decode(out.input_ids[0], skip_special_tokens=False).startswith(
        "<|im_start|>system\nBe brief."
    )
