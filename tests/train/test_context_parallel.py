"""Context parallelism (train.context_parallel, keye.train.context_parallel): a packed row split over a group of
ranks equals the 1-process run.

The distributed checks are the jobs of ONE 2-process gloo launch (tests/train/_dist_context_parallel.py):
the forward/backward of a long packed row (a 1.5 video and two text samples) against the same model's 1-process
forward, and SFT runs (DDP; FSDP2 stopped after its step-2 checkpoint and resumed) against a 1-process run of
the recipe. The split arithmetic and the config checks run in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from keye.errors import KeyeConfigError
from keye.model.weights import iter_tensors
from keye.recipes.sft import train
from keye.sft.config import SFTConfig
from keye.train.config import load_config
from keye.train.context_parallel import (
    ContextParallel,
    context_parallel_layout,
    kv_repeats,
    split_items,
)
from tests.torchrun import job_args, torchrun

REPO = Path(__file__).resolve().parents[2]
# Packed rows of up to 1280 tokens hold several video samples; lr 1e-3 keeps AdamW's first steps away from the
# sign flips that a rounding-level change of a near-zero gradient causes at larger rates (the updates, ~3e-3,
# are still 300x the tolerance).
SFT = ("data.batch_tokens=1280", "data.micro_batches=2", "train.max_steps=3", "train.lr=1e-3", "train.warmup_steps=1",
       "train.tree=off", "log.progress=false", "log.tensorboard=false", "checkpoint.export=true",
       "checkpoint.save_every=2", "checkpoint.keep_last=1")


def _overrides(tiny_ckpt, synth_set, *extra) -> list[str]:
    return [f"model.path={tiny_ckpt}", f"data.manifest={synth_set['train']}", *SFT, *extra]


@pytest.fixture(scope="module")
def launch(tiny_ckpt, synth_set, tmp_path_factory) -> Path:
    """Every 2-process job of this module in one torchrun launch; returns its folder."""
    root = tmp_path_factory.mktemp("cp")
    cp = ("train.context_parallel=2", "train.device=cpu")
    jobs = [["model", root / "model.json", 2],
            ["sft", root / "ddp", "ddp", *_overrides(tiny_ckpt, synth_set, *cp)],
            ["sft", root / "fsdp2", "fsdp2", *_overrides(tiny_ckpt, synth_set, *cp), "stop_after=2"],
            ["sft", root / "fsdp2", "fsdp2", *_overrides(tiny_ckpt, synth_set, *cp)]]
    torchrun(job_args(REPO / "tests/train/_dist_context_parallel.py", jobs), nproc=2,
             env={"KEYE_LOG_LEVEL": "WARNING"}, timeout=600)
    return root


@pytest.mark.slow
def test_split_row_loss_and_gradients_equal_one_process(launch):
    """Loss, target count and every parameter's gradient (vision tower included) of a video + two text samples
    row split over 2 ranks equal the 1-process forward's, for GQA KV heads split and repeated (1 KV head), a row
    padded to an even length, the chunked and the full-logits loss, gradient checkpointing, and a one-frame video
    that leaves a rank without vision items; and the parameters after three AdamW steps of two such rows a step
    equal the 1-process ones within 1e-5."""
    cases = json.loads((launch / "model.json").read_text())
    steps = cases.pop("three_steps_two_micro_batches")
    assert steps["update_max"] > 1e-3 and steps["param_max_diff"] <= 1e-5, steps
    assert set(cases) == {"kv2_even", "kv1_repeated_padded", "full_logits_checkpointing", "one_frame_dummy_rank"}
    assert cases["kv2_even"]["length"] % 2 == 0 and cases["kv1_repeated_padded"]["length"] % 2 == 1
    for name, c in cases.items():
        assert c["targets"] == c["ref_targets"] > 0, name
        assert abs(c["loss"] - c["ref_loss"]) <= 1e-5 * abs(c["ref_loss"]), name
        assert c["grad_rel_diff"] <= 1e-5, name
        assert c["vision_grads"] > 0, name


def _params(run: Path) -> dict[str, torch.Tensor]:
    return {name: h.get_tensor(name) for name, _, h in iter_tensors(run / "final")}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_context_parallel_equals_one_process(launch, tiny_ckpt, synth_set, tmp_path):
    """SFT with train.context_parallel=2 on 2 gloo processes (DDP; FSDP2 killed after step 2 and resumed), 2
    micro-batches a step: the same losses, gradient norms and, after 3 steps, parameters (within 1e-5) as the
    1-process run."""
    ref = train(load_config(SFTConfig, None, [*_overrides(tiny_ckpt, synth_set), f"checkpoint.out_dir={tmp_path}"]))
    want, base = _params(tmp_path), {n: h.get_tensor(n) for n, _, h in iter_tensors(tiny_ckpt)}
    assert all(float((want[k] - base[k]).abs().max()) > 1e-3 for k in want), "the reference barely trained"
    want_metrics = _metrics(tmp_path)
    for name in ("ddp", "fsdp2"):
        run = launch / name
        summary = json.loads((run / "summary.json").read_text())
        assert summary["finished"] and summary["steps"] == 3, name
        assert summary["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
        assert (summary["samples"], summary["tokens"]) == (ref["samples"], ref["tokens"]), name
        got_metrics = _metrics(run)
        assert [m["target_tokens"] for m in got_metrics] == [m["target_tokens"] for m in want_metrics], name
        assert [m["grad_norm"] for m in got_metrics] == pytest.approx([m["grad_norm"] for m in want_metrics],
                                                                      rel=1e-5), name
        got = _params(run)
        worst = max(float((got[k] - want[k]).abs().max()) for k in want)
        assert worst <= 1e-5, (name, worst)
    assert len(_metrics(launch / "fsdp2")) == 3  # stopped after 2 steps, resumed for the third


# ------------------------------------------------------------------------------------------ in-process checks
def test_layout_groups_consecutive_ranks():
    """Groups are consecutive ranks; the group index is the data-parallel replica."""
    lay = context_parallel_layout(8, 5, 4)
    assert (lay.group, lay.num_groups, lay.rank_in_group, lay.group_ranks) == (1, 2, 1, [4, 5, 6, 7])
    assert lay.all_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(KeyeConfigError, match="does not divide the world size 6"):
        context_parallel_layout(6, 0, 4)
    with pytest.raises(KeyeConfigError, match="must divide the decoder's 6 attention heads"):
        ContextParallel.create(4, 0, 4, num_heads=6)
    assert ContextParallel.create(1, 0, 1, num_heads=6) is None


def test_split_items_and_kv_repeats():
    """Vision items go to contiguous runs of about equal patch counts; KV heads repeat to lcm(Hkv, N)."""
    assert split_items([16] * 5, 2) == [(0, 2), (2, 5)]
    assert split_items([64, 4, 4, 4], 2) == [(0, 1), (1, 4)]
    assert split_items([16], 2) == [(0, 0), (0, 1)]  # one frame: the first rank encodes a dummy
    runs = split_items([3, 1, 4, 1, 5, 9, 2, 6], 4)
    assert runs[0][0] == 0 and runs[-1][1] == 8 and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    assert (kv_repeats(8, 4), kv_repeats(2, 4), kv_repeats(1, 2), kv_repeats(4, 8), kv_repeats(6, 4)) == (1, 2, 2, 2, 2)


def test_split_row_slices_the_padded_row():
    """The ranks' slices of embeddings, positions and targets concatenate to the row padded to a multiple of N:
    padding has no target, and the target of a slice's last token is the next slice's first token's label."""
    length, n = 11, 4
    embeds = torch.arange(length * 2, dtype=torch.float32).view(1, length, 2)
    pos = torch.arange(length).view(1, 1, length).expand(3, 1, length)
    labels = torch.arange(100, 100 + length).view(1, length)
    targets = labels[:, 1:]
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    parts = [ContextParallel(context_parallel_layout(n, r, n), None).split_row(embeds, pos, targets, cu, "sdpa")
             for r in range(n)]
    e = torch.cat([p[0] for p in parts], dim=1)
    t = torch.cat([p[2] for p in parts], dim=1)
    assert e.shape == (1, 12, 2) and torch.equal(e[:, :length], embeds) and not e[:, length:].any()
    assert torch.equal(torch.cat([p[1] for p in parts], dim=2)[:, :, :length], pos)
    assert t[0].tolist() == list(range(101, 111)) + [-100, -100]
    assert parts[1][3].keywords["cu_seqlens"].tolist() == [0, 5, 11, 12]  # the padding is its own segment


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.context_parallel=2", "train.strategy=zero3"], "needs train.strategy ddp or fsdp2"),
    (["train.context_parallel=2", "train.strategy=none"], "needs train.strategy ddp or fsdp2"),
    (["train.context_parallel=2", "train.strategy=ddp", "train.tree=on"], "cannot run shared-prefix trees"),
    (["train.context_parallel=2", "train.strategy=ddp", "data.packing=false"], "splits packed rows"),
    (["train.context_parallel=2", "train.strategy=ddp", "data.batch_tokens=null", "data.batch_size=2"],
     "splits packed rows"),
    (["train.context_parallel=0"], "must be >= 1"),
])
def test_config_refuses_what_context_parallelism_cannot_run(overrides, message):
    with pytest.raises(KeyeConfigError, match=message):
        load_config(SFTConfig, None, overrides)
