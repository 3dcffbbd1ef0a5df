"""End to end: messages -> KeyeProcessor -> tiny KeyeVL forward and generate (image, video, both, batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from keye.processing.processor import KeyeProcessor
from keye.testing.processor import make_test_video, make_tiny_processor_dir
from tests.paths import GOLDEN_PREVIEW as GOLDEN

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def preview(tmp_path_factory):
    from keye.model.keye_vl import KeyeVL

    d = tmp_path_factory.mktemp("e2e")
    model = KeyeVL.from_pretrained(GOLDEN, torch_dtype="float32").eval()
    proc = KeyeProcessor.from_pretrained(make_tiny_processor_dir(d / "proc"))
    clip = make_test_video(d / "clip.mp4", 30, fps=10, size=(64, 128))
    return model, proc, clip


@pytest.fixture(scope="module")
def v15(tmp_path_factory):
    from keye.config import tiny_config
    from keye.model.keye_vl import KeyeVL

    d = tmp_path_factory.mktemp("e2e15")
    torch.manual_seed(0)
    model = KeyeVL(tiny_config("1.5")).float().eval()
    proc = KeyeProcessor.from_pretrained(make_tiny_processor_dir(d / "proc", variant="1.5", vocab_size=520))
    clip = make_test_video(d / "cuts.mp4", 24, fps=8, size=(112, 224), pattern="scenes", scene_cuts=[12])
    return model, proc, clip


def _img(name: str) -> dict:
    return {"type": "image", "image": str(GOLDEN / "images" / name)}


def _conv(*content) -> list[dict]:
    return [{"role": "user", "content": [*content, {"type": "text", "text": "What is shown?"}]}]


def _last_logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits[:, -1].float()


def test_image_features_reach_the_model_like_the_golden(preview):
    model, proc, _ = preview
    golden = load_file(str(GOLDEN / "expected.safetensors"))
    b = proc(_conv(_img("img1_100x60.png")))
    with torch.no_grad():
        feats = model.encode_vision(b["pixel_values"], b["image_grid_thw"])
    torch.testing.assert_close(feats.float(), golden["image_text/image_projector_out"], atol=5e-5, rtol=0)


@pytest.mark.parametrize("kind", ["image", "video", "both"])
def test_forward_and_generate(preview, kind):
    model, proc, clip = preview
    video = {"type": "video", "video": str(clip.path), "fps": 2.0}
    content = {
        "image": [_img("img2_224x224.png")],
        "video": [video],
        "both": [_img("img3_57x300.png"), video],
    }[kind]
    b = proc(_conv(*content), mode="no_think")
    with torch.no_grad():
        out = model(**b)
    assert out.logits.shape == (1, b.input_ids.shape[1], 512) and torch.isfinite(out.logits).all()
    seq = model.generate(**b, max_new_tokens=4, do_sample=False)
    assert seq.shape == (1, b.input_ids.shape[1] + 4) and torch.equal(
        seq[:, : b.input_ids.shape[1]], b.input_ids
    )
    assert isinstance(proc.decode(seq[0, b.input_ids.shape[1] :]), str)


def test_mixed_batch_equals_rows_alone(preview):
    model, proc, clip = preview
    convs = [
        [{"role": "user", "content": "Only text here, a slightly longer prompt."}],
        _conv(_img("img1_100x60.png"), {"type": "video", "video": str(clip.path), "fps": 1.0}),
        _conv(_img("img5_small_40x30.png"), _img("img4_thin_120x20.png")),
    ]
    batch = proc(convs)
    assert [m.row for m in batch.image_meta] == [1, 2, 2] and [m.row for m in batch.video_meta] == [1]
    together = _last_logits(model, batch)
    seqs = model.generate(**batch, max_new_tokens=3, do_sample=False)[:, batch.input_ids.shape[1] :]
    for r, conv in enumerate(convs):
        alone = proc(conv)
        torch.testing.assert_close(together[r], _last_logits(model, alone)[0], atol=1e-4, rtol=0)
        new = model.generate(**alone, max_new_tokens=3, do_sample=False)[:, alone.input_ids.shape[1] :]
        assert torch.equal(seqs[r], new[0])


def test_training_batch_gives_a_loss(preview):
    model, proc, _ = preview
    conv = _conv(_img("img1_100x60.png")) + [
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nA bar."}
    ]
    b = proc([conv, conv[:1] + [{"role": "assistant", "content": "No."}]], for_training=True)
    out = model(**b)
    assert out.loss is not None and torch.isfinite(out.loss)


def test_v15_slow_fast_video_forward_and_generate(v15):
    model, proc, clip = v15
    b = proc(_conv({"type": "video", "video": str(clip.path), "fps": 2.0}), mode="think")
    meta = b.video_meta[0]
    assert meta.frame_types.count("slow") == 2  # frame 0 and the first frame after the cut
    assert int(b.video_grid_thw[:, 0].sum()) == len(meta.indices)
    assert int((b.input_ids == proc.video_token_id).sum()) == meta.tokens
    with torch.no_grad():
        out = model(**b)
    assert torch.isfinite(out.logits).all()
    seq = model.generate(**b, max_new_tokens=3, do_sample=False)
    assert seq.shape[1] == b.input_ids.shape[1] + 3


def test_v15_batch_video_and_image_rows(v15):
    model, proc, clip = v15
    convs = [_conv(_img("img2_224x224.png")), _conv({"type": "video", "video": str(clip.path)})]
    batch = proc(convs)
    together = _last_logits(model, batch)
    for r, conv in enumerate(convs):
        torch.testing.assert_close(together[r], _last_logits(model, proc(conv))[0], atol=1e-4, rtol=0)
    frames = np.asarray(batch.video_meta[0].indices)
    assert (np.diff(frames) > 0).all()


def test_packed_training_batch_matches_padded(preview):
    model, proc, clip = preview
    convs = [
        _conv(_img("img1_100x60.png")) + [{"role": "assistant", "content": "A red bar."}],
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        ],
        _conv({"type": "video", "video": str(clip.path), "fps": 1.0})
        + [{"role": "assistant", "content": "Digits."}],
    ]
    padded = proc(convs, for_training=True)
    packed = proc(convs, for_training=True, packing=True)
    assert packed.input_ids.shape == (1, int(padded.attention_mask.sum()))
    assert packed.seq_lens.tolist() == padded.attention_mask.sum(1).tolist()
    assert torch.equal(packed.labels[0], padded.labels[padded.attention_mask.bool()])
    with torch.no_grad():
        a = model(**padded, loss_reduction="sum").loss
        b = model(**packed, loss_reduction="sum").loss
    torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-5)
