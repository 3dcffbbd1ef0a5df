"""Parity with the official Keye-VL-8B-Preview implementation on the golden tiny fixtures."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from keye import KeyeVL

ATOL = 5e-5


@pytest.fixture(scope="module")
def golden(golden_preview_dir):
    cases = json.loads((golden_preview_dir / "cases.json").read_text())
    return {
        "dir": golden_preview_dir,
        "cases": cases,
        "inputs": load_file(str(golden_preview_dir / "inputs.safetensors")),
        "expected": load_file(str(golden_preview_dir / "expected.safetensors")),
        "processor": load_file(str(golden_preview_dir / "processor.safetensors")),
    }


@pytest.fixture(scope="module")
def model(golden_preview_dir):
    return KeyeVL.from_pretrained(golden_preview_dir, torch_dtype="float32")


def _kwargs(case, golden):
    inp, proc = golden["inputs"], golden["processor"]
    kw = {}
    for name, src in case["inputs"].items():
        if isinstance(src, dict):
            kw[name] = torch.cat([proc[k] for k in src["concat_from_processor"]])
        elif src is not None and "all ones" not in src:
            kw[name] = inp[src]
    if case.get("fps") is not None and "video_grid_thw" in kw and "second_per_grid_ts" not in kw:
        key = f"{case['name']}/second_per_grid_ts"
        if key in inp:
            kw["second_per_grid_ts"] = inp[key]
    return kw


def _model_cases():
    from tests.paths import GOLDEN_PREVIEW

    path = GOLDEN_PREVIEW / "cases.json"
    return [c["name"] for c in json.loads(path.read_text())["model_cases"]]


@pytest.mark.parametrize("name", _model_cases())
def test_model_case(name, golden, model):
    case = next(c for c in golden["cases"]["model_cases"] if c["name"] == name)
    exp = golden["expected"]
    kw = _kwargs(case, golden)
    with torch.no_grad():
        out = model(**kw)
    mask = kw.get("attention_mask")
    torch.testing.assert_close(out.position_ids, exp[f"{name}/position_ids"], rtol=0, atol=0)
    torch.testing.assert_close(out.rope_deltas, exp[f"{name}/rope_deltas"], rtol=0, atol=0)
    logits, ref = out.logits, exp[f"{name}/logits"]
    if mask is not None:
        sel = mask.bool()
        logits, ref = logits[sel], ref[sel]
    assert (logits - ref).abs().max().item() <= ATOL
    for kind, pix, grid in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")):
        if pix not in kw:
            continue
        grids = [tuple(r) for r in kw[grid].tolist()]
        with torch.no_grad():
            tower = model.visual(kw[pix], grids)
            proj = model.encode_vision(kw[pix], kw[grid], is_video=kind == "video")
        assert (tower - exp[f"{name}/{kind}_tower_out"]).abs().max().item() <= ATOL
        assert (proj - exp[f"{name}/{kind}_projector_out"]).abs().max().item() <= ATOL


def test_generation(golden, model):
    case = golden["cases"]["generation_case"]
    exp = golden["expected"]
    kw = _kwargs(case, golden)
    kw["attention_mask"] = torch.ones_like(kw["input_ids"])
    gk = case["generate_kwargs"]
    seqs, step_logits = model.generate(
        **kw, max_new_tokens=gk["max_new_tokens"], do_sample=False, eos_token_id=gk["eos_token_id"],
        pad_token_id=gk["pad_token_id"], return_step_logits=True,
    )
    assert seqs.tolist() == exp["generate/sequences"].tolist()
    assert seqs[:, kw["input_ids"].shape[1]:].tolist() == exp["generate/new_tokens"].tolist()
    assert (step_logits - exp["generate/step_logits"]).abs().max().item() <= ATOL


@pytest.mark.parametrize("idx", range(3))
def test_rope_index_case(idx, golden, model):
    case = golden["cases"]["rope_index_cases"][idx]
    inp, exp = golden["inputs"], golden["expected"]
    args = {k: (inp[v] if v is not None else None) for k, v in case["inputs"].items()}
    pos, deltas = model.get_rope_index(
        args["input_ids"], args.get("image_grid_thw"), args.get("video_grid_thw"),
        args.get("second_per_grid_ts"), args.get("attention_mask"),
    )
    assert pos.tolist() == exp[case["expected"]["position_ids"]].tolist()
    assert deltas.tolist() == exp[case["expected"]["rope_deltas"]].tolist()
    assert deltas.reshape(-1).tolist() == case["rope_deltas"]
