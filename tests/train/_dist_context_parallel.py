"""Context-parallel jobs under torchrun (used by tests/train/test_context_parallel.py).

Args: ``--``-separated jobs, run in turn in one process group:

- ``model OUT.json CP``: the forward/backward of one long packed row (a 1.5 video and two text samples,
  :func:`keye.testing.long_row.long_video_row`) with ``context_parallel=CP`` against the same model's
  1-process forward on every rank, for several cases (GQA heads, padding, chunked / full loss, gradient
  checkpointing), and three AdamW steps of 2 such rows a step; rank 0 writes each case's loss and worst relative
  gradient difference, and the parameter difference after the steps, to ``OUT.json``.
- ``sft OUT_DIR STRATEGY [key=value ...] [stop_after=N]``: an SFT run (``keye.recipes.sft.train``), as
  ``tests/train/_dist_sft.py`` runs them.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from keye.train import dist as kdist


def _jobs(argv: list[str]) -> list[list[str]]:
    jobs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--":
            jobs.append([])
        else:
            jobs[-1].append(arg)
    return [j for j in jobs if j]


def _case(cp, *, kv_heads: int, text_lens: tuple[int, ...], chunk: int | None, checkpointing: bool,
          frames: int = 5) -> dict:
    """One forward/backward with and without context parallelism; differences relative to the reference."""
    from keye.config import tiny_config
    from keye.model.keye_vl import KeyeVL
    from keye.testing.long_row import long_video_row
    from keye.testing.model import init_unit_scale
    from keye.train.loss import LossRequest

    base = tiny_config("1.5")
    config = tiny_config("1.5", text=dataclasses.replace(base.text, num_key_value_heads=kv_heads))
    torch.manual_seed(0)
    model = init_unit_scale(KeyeVL(config), 0).train()
    model.always_run_vision = True
    if checkpointing:
        model.gradient_checkpointing_enable()
    row = long_video_row(config, frames=frames, text_lens=text_lens)
    inputs = {k: row[k] for k in ("input_ids", "labels", "seq_lens", "pixel_values_videos", "video_grid_thw")}
    extra = {} if chunk is None else {"loss_request": LossRequest(chunk)}

    def run(**kw):
        model.zero_grad(set_to_none=True)
        out = model(**inputs, loss_reduction="sum", **extra, **kw)
        out.loss.backward()
        return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    ref, ref_grads = run()
    out, grads = run(context_parallel=cp)
    loss, count = out.loss.detach().clone(), torch.tensor(float(out.num_target_tokens))
    dist.all_reduce(loss, group=cp.group)
    dist.all_reduce(count, group=cp.group)
    for g in grads.values():
        dist.all_reduce(g, group=cp.group)
    assert set(grads) == set(ref_grads), sorted(set(ref_grads) ^ set(grads))
    worst = max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in ref_grads.items())
    return {"length": row["num_tokens"], "loss": float(loss), "ref_loss": float(ref.loss.detach()),
            "targets": float(count), "ref_targets": float(ref.num_target_tokens), "grad_rel_diff": worst,
            "vision_grads": sum(1 for n in grads if n.startswith("visual."))}


def _three_steps(cp) -> dict:
    """Three AdamW steps of 2 micro-batches (long rows of seeds 0 and 1) with and without the split: the largest
    parameter difference after them, and the largest update (the comparison is not vacuous)."""
    from keye.config import tiny_config
    from keye.model.keye_vl import KeyeVL
    from keye.testing.long_row import long_video_row
    from keye.testing.model import init_unit_scale
    from keye.train.loss import LossRequest

    config = tiny_config("1.5")
    rows = [long_video_row(config, frames=5, text_lens=(40, 24 + seed), seed=seed) for seed in (0, 1)]
    keys = ("input_ids", "labels", "seq_lens", "pixel_values_videos", "video_grid_thw")
    total = float(sum(r["num_label_tokens"] for r in rows))
    params = {}
    for split in (None, cp):
        torch.manual_seed(0)
        model = init_unit_scale(KeyeVL(config), 0).train()
        model.always_run_vision = True
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            for row in rows:  # the step's loss is the token mean over both micro-batches
                kw = {} if split is None else {"context_parallel": split}
                out = model(**{k: row[k] for k in keys}, loss_reduction="sum", loss_request=LossRequest(), **kw)
                (out.loss / total).backward()
            if split is not None:
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=cp.group)
            opt.step()
            opt.zero_grad(set_to_none=True)
        params[split is None] = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)
    start = {n: p.detach() for n, p in init_unit_scale(KeyeVL(config), 0).named_parameters()}
    ref, got = params[True], params[False]
    return {"param_max_diff": max(float((got[n] - ref[n]).abs().max()) for n in ref),
            "update_max": max(float((ref[n] - start[n]).abs().max()) for n in ref)}


def _model_job(out_path: str, size: str) -> None:
    from keye.train.context_parallel import ContextParallel

    cp = ContextParallel.create(int(size), dist.get_rank(), dist.get_world_size(), num_heads=4)
    cases = {
        "kv2_even": dict(kv_heads=2, text_lens=(40, 25), chunk=512, checkpointing=False),
        "kv1_repeated_padded": dict(kv_heads=1, text_lens=(40, 24), chunk=512, checkpointing=False),
        "full_logits_checkpointing": dict(kv_heads=2, text_lens=(33, 24), chunk=None, checkpointing=True),
        "one_frame_dummy_rank": dict(kv_heads=2, text_lens=(30, 20), chunk=512, checkpointing=False, frames=1),
    }
    results = {name: _case(cp, **kw) for name, kw in cases.items()}
    results["three_steps_two_micro_batches"] = _three_steps(cp)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))


def _sft_job(out_dir: str, strategy: str, *overrides: str) -> None:
    from keye.recipes.sft import train
    from keye.sft.config import SFTConfig
    from keye.train.config import load_config

    stop = [int(o.split("=", 1)[1]) for o in overrides if o.startswith("stop_after=")]
    rest = [o for o in overrides if not o.startswith("stop_after=")]
    cfg = load_config(SFTConfig, None, [f"checkpoint.out_dir={out_dir}", f"train.strategy={strategy}", *rest])
    train(cfg, stop_after=stop[-1] if stop else None)


if __name__ == "__main__":
    try:
        kdist.init_distributed("cpu")
        for kind, *args in _jobs(sys.argv[1:]):
            {"model": _model_job, "sft": _sft_job}[kind](*args)
    finally:
        kdist.cleanup()
