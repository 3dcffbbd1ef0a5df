"""The cost model's token counts equal the processor's real output on synthetic media (both variants)."""

from __future__ import annotations

from pathlib import Path

import pytest

from keye.data.cost import CostModel, ModelDims, llm_flops, vision_flops
from keye.data.manifest import read_manifest, write_manifest
from keye.data.probe import ProbeCache
from keye.errors import KeyeInputError


def _check_all(processor, manifest, cache):
    cm = CostModel(processor, cache=cache)
    for s in manifest.samples:
        c = cm.estimate(s)
        out = processor([s.messages], return_tensors="pt", for_training=True)
        assert c.tokens == out["input_ids"].shape[1], s.id
        pv = out.get("pixel_values_videos") if s.modality == "video" else out.get("pixel_values")
        assert c.patches == pv.shape[0], s.id
        assert c.flops > 0 and c.vision_flops > 0


def test_tokens_exact_preview(synth_dir: Path, tiny_processor, cache: ProbeCache):
    man = read_manifest(synth_dir / "train.jsonl")
    _check_all(tiny_processor, man, cache)


def test_tokens_exact_15_slowfast(synth_dir: Path, tiny_processor_15, cache: ProbeCache):
    man = read_manifest(synth_dir / "train.jsonl")
    man.samples = man.samples[:12]
    _check_all(tiny_processor_15, man, cache)
    # Second pass is served from the cache (no decoding) and gives the same numbers.
    cm = CostModel(tiny_processor_15, cache=cache)
    assert [cm.estimate(s) for s in man.samples] == [CostModel(tiny_processor_15, cache=cache).estimate(s) for s in man.samples]


def test_tokens_exact_with_item_options_and_text(synth_dir: Path, tiny_processor, cache: ProbeCache, tmp_path):
    man = read_manifest(synth_dir / "train.jsonl")
    vid = next(s for s in man.samples if s.modality == "video").media[0].path
    img = next(s for s in man.samples if s.modality == "image").media[0].path
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "video", "video": vid, "fps": 4.0, "max_pixels": 20000}]},
                      {"role": "assistant", "content": "ok"}]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "image", "image": img, "min_pixels": 50000},
                                                   {"type": "image", "image": img},
                                                   {"type": "text", "text": "two images /think"}]},
                      {"role": "assistant", "content": "<think>x</think>same"}]},
        {"messages": [{"role": "user", "content": "only text here, 123"}, {"role": "assistant", "content": "fine"}]},
    ]
    write_manifest(tmp_path / "m.jsonl", rows)
    extra = read_manifest(tmp_path / "m.jsonl")
    cm = CostModel(tiny_processor, cache=cache)
    for s in extra.samples:
        out = tiny_processor([s.messages], return_tensors="pt", for_training=True)
        assert cm.estimate(s).tokens == out["input_ids"].shape[1]


def test_bad_media_raise_typed(tmp_path: Path, tiny_processor, cache: ProbeCache):
    (tmp_path / "junk.mp4").write_bytes(b"nope" * 50)
    write_manifest(
        tmp_path / "m.jsonl",
        [{"messages": [{"role": "user", "content": [{"type": "video", "video": "junk.mp4"}]}]},
         {"messages": [{"role": "user", "content": [{"type": "image", "image": "missing.png"}]}]}],
    )
    cm = CostModel(tiny_processor, cache=cache)
    for s in read_manifest(tmp_path / "m.jsonl").samples:
        with pytest.raises(KeyeInputError):
            cm.estimate(s)


def test_flops_formulas_by_hand():
    dims = ModelDims(vision_layers=1, vision_hidden=2, vision_mlp=3, patch_size=1, merge_size=1,
                     llm_layers=1, llm_hidden=2, llm_mlp=3, llm_heads=1, llm_kv_heads=1, llm_head_dim=2,
                     vocab_size=5)
    # One segment of 4 patches: embed 2*4*3*2=48; layer 8*4*4 + 4*16*2 + 4*4*2*3 = 128+128+96 = 352;
    # projector (merge 1, 4 tokens): 2*4*(2*2 + 2*2) = 64.
    assert vision_flops([4], dims) == 48 + 352 + 64
    # S=3: qkv 2*3*2*(1+2)*2=72, o 2*3*1*2*2=24, mlp 6*3*2*3=108, attn 2*9*1*2=36 -> 240; head 2*3*2*5=60.
    assert llm_flops(3, dims) == 240 + 60
    # Attention grows quadratically: one 2N segment costs more than two N segments.
    big = ModelDims()
    assert vision_flops([2048], big) > vision_flops([1024, 1024], big)


def test_tokens_exact_with_checkpoint_video_defaults(synth_dir: Path, cache: ProbeCache, tmp_path):
    """A checkpoint's video_defaults (small-frame floor, frame cap) reach the estimate exactly."""
    import json

    from keye.processing.processor import KeyeProcessor
    from keye.testing.processor import make_tiny_processor_dir

    d = make_tiny_processor_dir(tmp_path / "proc", "1.5")
    pre = json.loads((d / "preprocessor_config.json").read_text())
    pre["video_defaults"] = {"floor_pixels": 3136, "max_pixels": 25088, "max_frames": 6}
    (d / "preprocessor_config.json").write_text(json.dumps(pre))
    proc = KeyeProcessor.from_pretrained(d)
    man = read_manifest(synth_dir / "train.jsonl")
    man.samples = [s for s in man.samples if s.modality == "video"][:6]
    _check_all(proc, man, cache)
