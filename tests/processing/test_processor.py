"""Tokenizer fixture, chat template, thinking modes, labels, padding and the golden prompt layouts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from keye.errors import KeyeConfigError, KeyeInputError
from keye.processing.chat import (
    OFFICIAL_CHAT_TEMPLATE,
    ChatTemplate,
    apply_mode,
    assistant_spans,
    parse_response,
)
from keye.processing.processor import KeyeBatch, KeyeProcessor
from keye.testing.processor import make_tiny_processor_dir
from tests.paths import GOLDEN_PREVIEW as GOLDEN

IMG = GOLDEN / "images"


@pytest.fixture(scope="module")
def proc(tmp_path_factory) -> KeyeProcessor:
    return KeyeProcessor.from_pretrained(make_tiny_processor_dir(tmp_path_factory.mktemp("tiny")))


def _img(name: str) -> dict:
    return {"type": "image", "image": str(IMG / name)}


def _user(*content) -> list[dict]:
    return [{"role": "user", "content": list(content)}]


# ----------------------------------------------------------------------------------------------------------
# tokenizer fixture


def test_tiny_tokenizer_ids_match_golden(proc):
    tok = proc.tokenizer
    golden = json.loads((GOLDEN / "cases.json").read_text())["special_token_ids"]
    for name, tid in golden.items():
        assert tok.convert_tokens_to_ids(name) == tid
    # §11.1 offsets from <|endoftext|> (151643): <think> 151667 -> 504, </think> -> 505, clip_time_end -> 511
    assert tok.convert_tokens_to_ids(["<think>", "</think>", "<|clip_time_end|>"]) == [504, 505, 511]
    assert len(tok) == 512 and proc.pad_token_id == 480 and tok.eos_token_id == 482
    ids = tok("Describe the video in detail, 2024 frames.", add_special_tokens=False)["input_ids"]
    assert max(ids) < 480
    assert len(tok("12345", add_special_tokens=False)["input_ids"]) == 5  # digits split one by one


def test_tiny_tokenizer_v15_markers(tmp_path):
    p = KeyeProcessor.from_pretrained(make_tiny_processor_dir(tmp_path, variant="1.5"))
    assert p.variant == "1.5"
    assert [p.token_ids[n] for n in ("<|frame|>", "<|fast_start|>", "<|fast_end|>")] == [512, 513, 514]
    assert len(p.tokenizer) == 515
    with pytest.raises(KeyeConfigError, match="does not fit|model vocab"):
        make_tiny_processor_dir(tmp_path / "x", variant="1.5", vocab_size=512)


def test_decode_keeps_think_drops_special(proc):
    ids = proc.tokenizer("<|im_start|>assistant\n<think>a</think>b<|im_end|>", add_special_tokens=False)[
        "input_ids"
    ]
    assert proc.decode(ids) == "assistant\n<think>a</think>b"
    assert proc.batch_decode(torch.tensor([ids, ids]))[1] == "assistant\n<think>a</think>b"


# ----------------------------------------------------------------------------------------------------------
# chat template and modes


def test_template_is_the_official_one():
    assert json.loads((GOLDEN / "chat_template.json").read_text())["chat_template"] == OFFICIAL_CHAT_TEMPLATE


def test_render_by_hand():
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "x"},
                {"type": "video", "video": "y"},
                {"type": "text", "text": "Hi"},
            ],
        },
        {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "More"},
    ]
    out = ChatTemplate().render(msgs, add_generation_prompt=True, add_vision_id=True)
    assert out == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>"
        "Video 1: <|vision_start|><|video_pad|><|vision_end|>Hi<|im_end|>\n"
        "<|im_start|>assistant\nYo<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n"
    )
    sys_first = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert (
        ChatTemplate().render(sys_first, False)
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    )


def test_modes():
    msgs = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "a"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "q1"},
                {"type": "image", "image": "x"},
                {"type": "text", "text": "q2 /think"},
            ],
        },
    ]
    assert apply_mode(msgs, "no_think")[2]["content"][2]["text"] == "q2/no_think"
    assert apply_mode(msgs, "think")[2]["content"][2]["text"] == "q2/think"
    assert apply_mode(msgs, "auto")[2]["content"][2]["text"] == "q2"
    assert apply_mode(msgs, None) is msgs
    assert apply_mode([{"role": "user", "content": "hi"}], "think")[0]["content"] == "hi/think"
    assert msgs[2]["content"][2]["text"] == "q2 /think"  # the caller's messages are not modified


@pytest.mark.parametrize(
    "text,analysis,think,answer,boxed,mode",
    [
        (
            "<think>\nstep 1\n</think>\n\nThe answer is \\boxed{42}.",
            None,
            "step 1",
            "The answer is \\boxed{42}.",
            "42",
            "think",
        ),
        ("<think>\n\n</think>\n\nB", None, "", "B", None, "no_think"),
        ("Plain answer", None, None, "Plain answer", None, "no_think"),
        (
            "<analysis>Easy, /no_think is better.</analysis>C",
            "Easy, /no_think is better.",
            None,
            "C",
            None,
            "auto_no_think",
        ),
        (
            "<analysis>Hard.</analysis><think>work</think><answer>\\boxed{\\frac{1}{2}}</answer>",
            "Hard.",
            "work",
            "\\boxed{\\frac{1}{2}}",
            "\\frac{1}{2}",
            "auto_think",
        ),
        ("<think>a</think><answer>x</answer> then <answer>y</answer>", None, "a", "y", None, "think"),
        (
            "reasoning without open tag</think>final",
            None,
            "reasoning without open tag",
            "final",
            None,
            "think",
        ),
        (
            "<think>t</think>\\boxed{a{b}c} done<|im_end|><|endoftext|>",
            None,
            "t",
            "\\boxed{a{b}c} done",
            "a{b}c",
            "think",
        ),
    ],
)
def test_parse_response(text, analysis, think, answer, boxed, mode):
    r = parse_response(text)
    assert (r.analysis, r.think, r.answer, r.boxed, r.mode) == (analysis, think, answer, boxed, mode)


def test_assistant_spans():
    s = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>assistant\n"
    ((a, b),) = assistant_spans(s)
    assert s[a:b] == "A1<|im_end|>"


# ----------------------------------------------------------------------------------------------------------
# processor outputs


def test_image_pixels_through_messages_match_golden(proc):
    golden = load_file(str(GOLDEN / "processor.safetensors"))
    b = proc(_user(_img("img1_100x60.png"), {"type": "text", "text": "What is this?"}))
    assert isinstance(b, KeyeBatch) and all(isinstance(v, torch.Tensor) for v in b.values())
    torch.testing.assert_close(b.pixel_values, golden["img1/pixel_values"], atol=1e-6, rtol=0)
    assert b.image_grid_thw.tolist() == [[1, 4, 8]]
    assert (b.input_ids == 492).sum() == 8
    assert b.image_meta[0].tokens == 8 and b.image_meta[0].original_hw == (60, 100)


def _skeleton(ids: torch.Tensor, mask: torch.Tensor | None = None) -> list[int]:
    ids = ids if mask is None else ids[mask.bool()]
    return [i for i in ids.tolist() if i >= 480]


@pytest.mark.parametrize("case", ["image_text", "video_text", "image_video", "multi_image", "batch_left_pad"])
def test_prompt_layout_matches_golden(proc, case):
    inputs = load_file(str(GOLDEN / "inputs.safetensors"))
    golden_px = load_file(str(GOLDEN / "processor.safetensors"))
    video = np.load(IMG / "video_6x56x84.npy")
    t = {"type": "text", "text": "describe"}
    convs = {
        "image_text": [_user(_img("img1_100x60.png"), t)],
        "video_text": [_user({"type": "video", "video": video, "fps": 2.0}, t)],
        "image_video": [
            _user(t, _img("img3_57x300.png"), t, {"type": "video", "video": video, "fps": 1.0}, t)
        ],
        "multi_image": [_user(_img("img2_224x224.png"), t, _img("img1_100x60.png"), t)],
        "batch_left_pad": [_user(_img("img1_100x60.png"), t), _user(t, _img("img3_57x300.png"), t)],
    }[case]
    b = proc(convs if len(convs) > 1 else convs[0])
    mask = inputs.get(f"{case}/attention_mask")
    for row in range(b.input_ids.shape[0]):
        gm = None if mask is None else mask[row]
        assert _skeleton(b.input_ids[row], b.attention_mask[row]) == _skeleton(
            inputs[f"{case}/input_ids"][row], gm
        )
    if f"{case}/image_grid_thw" in inputs:
        assert torch.equal(b.image_grid_thw, inputs[f"{case}/image_grid_thw"])
    if f"{case}/video_grid_thw" in inputs:
        assert torch.equal(b.video_grid_thw, inputs[f"{case}/video_grid_thw"])
        torch.testing.assert_close(b.second_per_grid_ts, inputs[f"{case}/second_per_grid_ts"])
        torch.testing.assert_close(
            b.pixel_values_videos, golden_px["video/pixel_values_videos"], atol=1e-6, rtol=0
        )
    if case == "batch_left_pad":  # images numbered across the batch: row 0's image first
        expect = torch.cat([golden_px["img1/pixel_values"], golden_px["img3/pixel_values"]])
        torch.testing.assert_close(b.pixel_values, expect, atol=1e-6, rtol=0)
        assert [m.row for m in b.image_meta] == [0, 1]


def test_generation_left_padding(proc):
    b = proc(
        [
            _user({"type": "text", "text": "hi"}),
            _user({"type": "text", "text": "a much longer question here"}),
        ]
    )
    short = int(b.attention_mask[0].sum())
    n = b.input_ids.shape[1]
    assert b.attention_mask[0, : n - short].sum() == 0 and (b.input_ids[0, : n - short] == 480).all()
    suffix = proc.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert (
        b.input_ids[0, -len(suffix) :].tolist() == suffix
        and b.input_ids[1, -len(suffix) :].tolist() == suffix
    )
    assert "labels" not in b


def test_training_labels_cover_only_assistant_turns(proc):
    conv1 = [
        {"role": "user", "content": [_img("img1_100x60.png"), {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "<think>\nlook\n</think>\n\nA cat."},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Nothing else."}]},
    ]
    conv2 = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    b = proc([conv1, conv2], for_training=True, mode="think")
    assert b.attention_mask[1, -1] == 0  # right padded
    for row, expected in [
        (0, ["<think>\nlook\n</think>\n\nA cat.<|im_end|>", "Nothing else.<|im_end|>"]),
        (1, ["y<|im_end|>"]),
    ]:
        lab = b.labels[row]
        # contiguous labelled runs decode to exactly the assistant turns (+ closing <|im_end|>)
        runs, cur = [], []
        for tid, lt in zip(b.input_ids[row].tolist(), lab.tolist()):
            if lt != -100:
                assert lt == tid
                cur.append(tid)
            elif cur:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
        assert [proc.decode(r, skip_special_tokens=False) for r in runs] == expected
    assert (b.labels[b.input_ids == 492] == -100).all()
    # the mode switch is written into the last user turn, not into the labels
    assert "And?/think" in proc.decode(b.input_ids[0], skip_special_tokens=False)


def test_batch_to_and_attribute_access(proc):
    b = proc(
        _user(_img("img5_small_40x30.png"), {"type": "video", "video": np.zeros((2, 28, 28, 3), np.uint8)})
    )
    b.to("cpu", dtype=torch.bfloat16)
    assert b.pixel_values.dtype == b.pixel_values_videos.dtype == torch.bfloat16
    assert b.second_per_grid_ts.dtype == torch.float32
    assert b.input_ids.dtype == torch.long


def test_per_item_image_options(proc):
    img = Image.new("RGB", (1000, 750), (10, 20, 30))
    b = proc(_user({"type": "image", "image": img, "max_pixels": 28 * 28 * 16}))
    assert b.image_grid_thw.tolist() == [[1, 6, 8]]  # 112 x 84 (hand: beta = sqrt(750000/12544))
    b = proc(_user({"type": "image", "image": img, "resized_height": 280, "resized_width": 420}))
    assert b.image_grid_thw.tolist() == [[1, 20, 30]]


def test_variant_detection_and_save(tmp_path, proc):
    d = proc.save_pretrained(tmp_path / "saved")
    again = KeyeProcessor.from_pretrained(d)
    msgs = _user(_img("img2_224x224.png"), {"type": "text", "text": "hello"})
    assert torch.equal(again(msgs).input_ids, proc(msgs).input_ids)
    (d / "config.json").write_text(json.dumps({"architectures": ["KeyeVL1_5ForConditionalGeneration"]}))
    assert KeyeProcessor.detect_variant(d) == "1.5"
    with pytest.raises(KeyeConfigError, match="variant"):
        KeyeProcessor.detect_variant(d, "preview")
    (d / "config.json").unlink()
    assert KeyeProcessor.detect_variant(d) == "preview"  # processor_class KeyeProcessor


def test_hub_offline_error_is_clear(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KeyeConfigError, match="offline"):
        KeyeProcessor.from_pretrained("Kwai-Keye/Keye-VL-1_5-8B")
    with pytest.raises(KeyeConfigError, match="does not exist"):
        KeyeProcessor.from_pretrained("/no/such/dir")


def test_http_sources(tmp_path, proc):
    import functools
    import http.server
    import threading

    from keye.testing.processor import make_test_video

    shutil_img = tmp_path / "a.png"
    Image.open(IMG / "img1_100x60.png").save(shutil_img)
    make_test_video(tmp_path / "v.mp4", 20, fps=10, size=(64, 128))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        b = proc(
            _user(
                {"type": "image", "image": f"{base}/a.png"},
                {"type": "video", "video": f"{base}/v.mp4", "fps": 2.0},
            )
        )
        local = proc(
            _user(_img("img1_100x60.png"), {"type": "video", "video": str(tmp_path / "v.mp4"), "fps": 2.0})
        )
        assert torch.equal(b.pixel_values, local.pixel_values)
        assert torch.equal(b.pixel_values_videos, local.pixel_values_videos)
        with pytest.raises(KeyeInputError, match="cannot download"):
            proc(_user({"type": "image", "image": f"{base}/missing.png"}))
    finally:
        server.shutdown()


def test_batch_pickles_with_meta(proc):
    import pickle

    b = proc(_user(_img("img1_100x60.png")))
    again = pickle.loads(pickle.dumps(b))
    assert torch.equal(again.input_ids, b.input_ids) and again.image_meta == b.image_meta
