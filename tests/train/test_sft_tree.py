"""SFT on multi-answer rows through shared-prefix ("tree") batches.

The reference is always the unshared computation built *independently* of the tree code: a second
manifest with one ordinary row per answer, run through the plain processor, ``collate_packed`` and the
model's own packed loss (``loss_reduction="sum"``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from keye import KeyeProcessor, KeyeVL
from keye.cli import main
from keye.data.collate import collate_packed, collate_padded
from keye.data.manifest import check_manifest, read_manifest
from keye.data.probe import ProbeCache
from keye.recipes.sft import train
from keye.sft.config import SFTConfig
from keye.sft.inputs import model_inputs
from keye.sft.trees import TreeSampleProcessor, target_tokens, tree_loss, unshared_batch, use_tree_path
from keye.testing.model import save_tiny_checkpoint
from keye.testing.processor import make_test_video, make_tiny_processor_dir
from keye.train.config import load_config
from tests.torchrun import torchrun

REPO = Path(__file__).resolve().parents[2]
IMAGE_ANSWERS = ["The circle is red.", "The circle is red and small.", "Red."]
VIDEO_ANSWERS = ["A square moves left.", "A square moves right, then stops.", "Left."]


@pytest.fixture(autouse=True)
def _one_thread():
    # The models are tiny: one thread is fastest, and it keeps these tests quick when other jobs share the
    # cores (spinning OpenMP workers of an oversubscribed pool slow a step down tens of times).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _user(kind: str | None, text: str) -> dict:
    content = [{"type": "text", "text": text}]
    if kind == "image":
        content.insert(0, {"type": "image", "image": "pic.png"})
    elif kind == "video":
        content.insert(0, {"type": "video", "video": "clip.mp4", "fps": 2.0})
    return {"role": "user", "content": content}


def _reply(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sft_tree_media")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(d / "pic.png")
    make_test_video(d / "clip.mp4", 8, fps=4.0, size=(56, 84))
    return d


@pytest.fixture(scope="module")
def manifests(media_dir) -> dict[str, Path]:
    """Multi-answer rows (image, video; 3 answers each) + an ordinary row, and the same as one row per answer."""
    multi = [
        {"id": "img", "messages": [_user("image", "What colour is the circle?")], "answers": IMAGE_ANSWERS},
        {"id": "vid", "messages": [_user("video", "Where does the square go?")], "answers": VIDEO_ANSWERS},
        {"id": "txt", "messages": [_user(None, "Say hi."), _reply("Hi there.")]},
    ]
    expanded = [{"id": f"img-{k}", "messages": [_user("image", "What colour is the circle?"), _reply(a)]}
                for k, a in enumerate(IMAGE_ANSWERS)]
    expanded += [{"id": f"vid-{k}", "messages": [_user("video", "Where does the square go?"), _reply(a)]}
                 for k, a in enumerate(VIDEO_ANSWERS)]
    expanded += [multi[2]]
    return {"multi": _write(media_dir / "multi.jsonl", multi), "expanded": _write(media_dir / "expanded.jsonl", expanded)}


@pytest.fixture(scope="module", params=["1.5", "preview"])
def model_and_processor(request, tiny_ckpt, tmp_path_factory):
    """A tiny fp32 KeyeVL in train mode and its processor (1.5: slow/fast video with timestamps; preview:
    one video block with ``second_per_grid_ts``)."""
    ckpt = tiny_ckpt
    if request.param == "preview":
        ckpt = tmp_path_factory.mktemp("tiny_preview")
        make_tiny_processor_dir(ckpt, variant="preview")
        save_tiny_checkpoint(ckpt, "preview", seed=0)
    model = KeyeVL.from_pretrained(ckpt, torch_dtype="float32").train()
    return model, KeyeProcessor.from_pretrained(ckpt)


def _batches(manifests, processor, config, collate=collate_packed):
    tree_proc = TreeSampleProcessor(processor, config)
    shared = collate([tree_proc([s.messages]) for s in read_manifest(manifests["multi"]).samples])
    ref = collate([dict(processor([s.messages], for_training=True)) for s in read_manifest(manifests["expanded"]).samples])
    return shared, ref


def _loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_tree_loss_and_gradients_equal_one_row_per_answer(manifests, model_and_processor):
    model, processor = model_and_processor
    shared, ref = _batches(manifests, processor, model.config)

    # Layout: 3 trees (3 + 3 + 1 branches); the prompts (and their pixels) once.
    assert [t.num_branches for t in shared["tree"]] == [3, 3, 1]
    assert use_tree_path(shared, "auto") and use_tree_path(shared, "on") and not use_tree_path(shared, "off")
    assert shared["num_tokens"] < ref["num_tokens"]
    assert shared["pixel_values"].shape[0] * 3 == ref["pixel_values"].shape[0]
    # The normaliser counts every answer's tokens, as the unshared batch does.
    assert target_tokens(shared) == ref["num_label_tokens"] > 0

    # train.tree=off: the expansion is exactly the processor + collate output of one row per answer.
    expanded = unshared_batch(shared, pad_token_id=0)
    assert expanded.keys() - {"tree"} == ref.keys()
    for key in ref:
        if torch.is_tensor(ref[key]):  # ids, labels, seq_lens, pixels, grids (and preview's second_per_grid_ts)
            assert torch.equal(expanded[key], ref[key]), key

    calls = []
    hook = model.visual.register_forward_hook(lambda *_: calls.append(1))
    try:
        loss_t, g_t = _loss_and_grads(model, lambda: tree_loss(model, shared, torch.device("cpu")))
        assert len(calls) == 1  # the vision tower once for the whole forest
        loss_r, g_r = _loss_and_grads(model, lambda: model(**model_inputs(ref, torch.device("cpu")),
                                                           loss_reduction="sum").loss)
    finally:
        hook.remove()
    assert loss_t == pytest.approx(loss_r, rel=1e-5)
    assert g_t.keys() == g_r.keys() and any(n.startswith("visual.") for n in g_r)
    for name in g_r:
        scale = max(1.0, float(g_r[name].abs().max()))
        torch.testing.assert_close(g_t[name], g_r[name], rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_padded_expansion_media_once_and_dummy(manifests, model_and_processor, monkeypatch):
    import keye.processing.processor as kproc

    model, processor = model_and_processor
    decoded = []
    fetch = kproc.fetch_video
    monkeypatch.setattr(kproc, "fetch_video", lambda *a, **k: decoded.append(1) or fetch(*a, **k))
    shared, ref = _batches(manifests, processor, model.config, collate=lambda o: collate_padded(o, 7))
    assert len(decoded) == 1 + 3  # the multi-answer row's video once; the reference decodes it per answer
    assert "_process_video" not in vars(processor)  # the per-row memo is gone afterwards
    expanded = unshared_batch(shared, pad_token_id=7)
    for key in ("input_ids", "labels", "attention_mask", "pixel_values", "pixel_values_videos"):
        assert torch.equal(expanded[key], ref[key]), key
    # A micro-batch whose samples all failed to load (the loader's zero-loss stand-in) never takes the tree path.
    shared["num_samples"], shared["num_label_tokens"] = 0, 0
    assert not use_tree_path(shared, "on") and target_tokens(shared) == 0


def test_manifest_schema_and_check(media_dir, manifests, tiny_ckpt, tmp_path, capsys):
    man = read_manifest(manifests["multi"])
    assert not man.bad_rows
    img, vid, txt = man.samples
    assert img.answers == IMAGE_ANSWERS and txt.answers is None
    assert [c[-1]["content"][0]["text"] for c in vid.conversations()] == VIDEO_ANSWERS
    assert img.messages[-1]["content"][0]["text"] == IMAGE_ANSWERS[0]  # ordinary view: the first answer
    bad = _write(media_dir / "bad.jsonl", [
        {"id": "a", "messages": [_user(None, "q")], "answers": "just one"},
        {"id": "b", "messages": [_user(None, "q")], "answers": []},
        {"id": "c", "messages": [_user(None, "q")], "answers": ["ok", 3]},
        {"id": "d", "messages": [_user(None, "q"), _reply("x")], "answers": ["y", "z"]},
        {"id": "e", "messages": [_user(None, "q")], "answers": ["y", "z"]},
    ])
    cache = ProbeCache(tmp_path / "probe.sqlite")
    report = check_manifest(bad, cache=cache)
    assert report.summary["valid"] == 1 and [(b.line, b.id) for b in report.bad_rows] == [
        (1, "a"), (2, "b"), (3, "c"), (4, "d")]
    reasons = [b.reason for b in report.bad_rows]
    assert "non-empty list" in reasons[0] and "non-empty list" in reasons[1]
    assert "answers[1]" in reasons[2] and "must end with a user turn" in reasons[3]
    # keye data check (the real entry point) accepts multi-answer rows, names the malformed ones, and counts a
    # multi-answer row as its tree: prompt once, so fewer tokens than one row per answer.
    args = ["--processor", str(tiny_ckpt), "--cache", str(tmp_path / "probe.sqlite")]
    assert main(["data", "check", str(bad), *args]) == 1
    assert "line 3 (c): answers[1] must be a non-empty string, got 3" in capsys.readouterr().out
    assert main(["data", "check", str(manifests["multi"]), "--json", *args]) == 0
    ok = json.loads(capsys.readouterr().out)["summary"]
    assert main(["data", "check", str(manifests["expanded"]), "--json", *args]) == 0
    unshared = json.loads(capsys.readouterr().out)["summary"]
    assert ok["valid"] == 3 and ok["bad"] == 0 and ok["tokens_exact"]
    assert ok["tokens"] < unshared["tokens"]


@pytest.fixture(scope="module")
def run_manifest(media_dir) -> Path:
    return _write(media_dir / "run.jsonl", [
        {"id": "img", "messages": [_user("image", "What colour is the circle?")], "answers": IMAGE_ANSWERS},
        {"id": "vid", "messages": [_user("video", "Where does the square go?")], "answers": VIDEO_ANSWERS},
        {"id": "txt", "messages": [_user(None, "Say hi."), _reply("Hi there.")]},
        {"id": "img1", "messages": [_user("image", "Name the shape."), _reply("A circle.")]},
    ])


def _run_args(tiny_ckpt, manifest) -> list[str]:
    return [f"model.path={tiny_ckpt}", f"data.manifest={manifest}", "data.batch_tokens=null", "data.batch_size=1",
            "train.lr=3e-3", "train.max_steps=4", "train.schedule=constant", "checkpoint.export=false",
            "log.progress=false", "log.tensorboard=false", "train.device=cpu"]


def test_short_run_tree_equals_unshared_and_learns(tiny_ckpt, run_manifest, tmp_path):
    def run(mode: str, workers: int = 0) -> dict:
        return train(load_config(SFTConfig, None, [
            *_run_args(tiny_ckpt, run_manifest), "data.micro_batches=2", f"data.num_workers={workers}",
            f"train.tree={mode}", f"checkpoint.out_dir={tmp_path / mode}"]))

    # batch_size mode plans the same micro-batches whatever the token estimates, so the runs see the same
    # rows step by step: 2 steps per epoch, one row per micro-batch, 2 epochs. The "on" run loads in a worker.
    auto, on, off = run("auto"), run("on", workers=1), run("off")
    assert [r["tree"]["tree_micro_batches"] for r in (auto, on, off)] == [4, 8, 0]  # auto: multi-answer rows only
    assert auto["samples"] == off["samples"] == 8
    np.testing.assert_allclose(auto["losses"], off["losses"], rtol=1e-5)
    np.testing.assert_allclose(on["losses"], off["losses"], rtol=1e-5)
    assert sum(auto["losses"][2:]) < 0.8 * sum(auto["losses"][:2])  # second epoch clearly below the first
    assert auto["tokens"] < 0.5 * off["tokens"]  # prompts (and the vision tower) once per row


@pytest.mark.slow
def test_ddp_tree_run_matches_one_process(tiny_ckpt, run_manifest, tmp_path):
    """Two DDP ranks (one row each per step; a rank may take the tree path while the other takes the packed
    one) equal one process with two micro-batches: the normaliser counts every answer on every rank."""
    one = train(load_config(SFTConfig, None, [*_run_args(tiny_ckpt, run_manifest), "data.micro_batches=2",
                                              f"checkpoint.out_dir={tmp_path / 'one'}"]))
    torchrun([REPO / "tests/train/_dist_sft.py", tmp_path / "ddp", "ddp", *_run_args(tiny_ckpt, run_manifest),
              "data.micro_batches=1"], env={"KEYE_LOG_LEVEL": "WARNING"}, timeout=600)
    two = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert two["world_size"] == 2 and two["strategy"] == "ddp"
    assert two["tree"]["tree_micro_batches"] == one["tree"]["tree_micro_batches"] == 4
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
