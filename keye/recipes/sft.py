"""Supervised fine-tuning of Keye-VL (the recipe behind ``keye train sft`` and ``training/sft.py``).

Launch::

    keye train sft --config training/configs/tiny_synth_stage0.yaml               # one CPU (keye-tiny stage 0)
    torchrun --nproc_per_node 8 -m keye train sft --config training/configs/keye_vl_8b_sft.yaml \\
        model.path=Kwai-Keye/Keye-VL-1_5-8B data.manifest=/data/sft.jsonl

This module is the recipe: :func:`train`, a short loop over the SFT library (:mod:`keye.sft`: the model and its
wrapping, the loader, the optimizer step) and the training floor (:mod:`keye.train`: checkpoints, run log).
What one optimizer step does (the token-mean over the global batch) is :mod:`keye.sft.step`'s docstring.

Precision: with ``model.dtype: bfloat16`` the forward runs in bf16 (autocast) while the trainable weights,
their gradients and AdamW stay in float32 (frozen towers stay bf16); checkpoints keep those float32 weights
(``master.safetensors``) for exact resume, and the official export is bf16. DeepSpeed does the same through
its own bf16 setting.

Loss: with ``train.loss_chunk_tokens`` (default 512) the cross-entropy is computed inside the forward over the
target tokens only, that many rows of ``lm_head`` at a time, recomputed in the backward (:mod:`keye.train.loss`):
the [tokens, vocabulary] logits never exist (about 2.25 MiB per token at Qwen3's vocabulary). ``null`` takes the
full logits, the reference with the same values and gradients. ``train.label_smoothing`` is ``F.cross_entropy``'s.

Multi-answer rows (a manifest row with an ``answers`` list, see :mod:`keye.data.manifest`) are trained
as if each answer were its own row: every answer's tokens count in the token-mean like any sample's.
``train.tree`` chooses how they are computed:
  ``auto`` (default) a micro-batch holding a multi-answer row runs as one shared-prefix forest
           (:mod:`keye.train.tree`): each such row is its prompt once plus one branch per answer, every other
           row a one-branch tree, so the vision tower and every prompt run once; micro-batches without
           multi-answer rows take the ordinary packed (or padded) path unchanged;
  ``on``   every micro-batch runs as a forest;
  ``off``  multi-answer rows are expanded into one ordinary row per answer inside the micro-batch
           (prompt and media repeated) and take the packed path: the unshared reference.
On the same micro-batches all three give the same loss and gradients (in the tree, each distinct token's
loss is computed once and weighted by the number of answers whose target it is) with the same normaliser;
only the work differs. In ``data.batch_tokens`` mode micro-batches are planned with the token count of the
layout that runs (the tree's for ``auto``/``on``, the expanded rows' for ``off``), so ``off`` may put fewer
rows in a micro-batch; ``data.batch_size`` plans do not depend on it.

Stage presets (``train.stage``), from the Keye reports:
  ``align``    cross-modal alignment: projector only (vision tower and LLM frozen);
  ``full``     multi-task pre-training / SFT: everything trainable;
  ``llm_only`` LLM (and projector) trainable, vision tower frozen;
  ``custom``   use ``train.freeze`` as given.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from keye.hub import resolve_model_path
from keye.recipes import common
from keye.sft.config import SFTConfig
from keye.sft.data import build_sft_loader
from keye.sft.inputs import cycle_batches
from keye.sft.model import load_train_model, wrap_for_training
from keye.sft.step import optimizer_step
from keye.train import dist as kdist
from keye.train.checkpoint import Checkpoints, load_checkpoint, save_checkpoint
from keye.train.context_parallel import ContextParallel
from keye.train.metrics import RunLog
from keye.train.models import load_processor
from keye.train.run import start_run

log = logging.getLogger("keye.recipes.sft")


def train(cfg: SFTConfig, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run SFT as configured; returns the run summary (also written to ``summary.json``).

    ``stop_after`` stops after that many optimizer steps *of this invocation* without the final
    save (used to simulate a crash in resume tests).
    """
    info = kdist.init_distributed(cfg.train.device)
    out_dir = start_run(cfg, info)
    tm = load_train_model(cfg, info, resolve_model_path(cfg.model.path))
    processor = load_processor(cfg.model)
    processor.override_preprocessor(cfg.model.preprocessor, where="model.preprocessor")
    # context parallelism: groups of N consecutive ranks share every micro-batch (the loader's data-parallel groups,
    # keye.sft.data.build_sft_loader) and split each packed row between them
    cp = ContextParallel.create(cfg.train.context_parallel, info.rank, info.world_size,
                                num_heads=tm.model.config.text.num_attention_heads)
    loader = build_sft_loader(cfg, processor, tm.model.config, info, out_dir)
    steps_per_epoch = max(1, len(loader) // cfg.data.micro_batches)
    total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
    wrapped, optimizer, scheduler = wrap_for_training(cfg, tm.model, info, total_steps)
    ckpts = Checkpoints(out_dir, cfg.checkpoint.keep_last, info.is_main)

    def save(step: int) -> None:
        ckpts.save(step, lambda path: save_checkpoint(path, wrapped, optimizer, scheduler, loader, state, processor,
                                                      info, cfg.lora.enabled, tm.export_dtype))

    state: dict[str, Any] = {"step": 0, "samples": 0, "tokens": 0, "losses": []}
    if ckpts.latest is not None:
        state = load_checkpoint(ckpts.latest, wrapped, optimizer, scheduler, loader, info, cfg.lora.enabled)
        if info.is_main:
            log.info("resumed from %s at step %d", ckpts.latest, state["step"])
    runlog = RunLog(cfg.log, out_dir, info.is_main, total=total_steps, start_step=state["step"], desc="sft",
                    postfix=lambda row: {"loss": f"{row['loss']:.4f}", "tok_s": f"{row['tokens_per_s']:.0f}"})
    t_start, steps_this_run, tree_micro_batches = time.time(), 0, 0
    batches = cycle_batches(loader)
    while state["step"] < total_steps:
        t0 = time.time()
        mbs = [next(batches) for _ in range(cfg.data.micro_batches)]
        res = optimizer_step(mbs, wrapped, optimizer, info, amp=tm.amp, tree_mode=cfg.train.tree,
                             pad_token_id=loader.pad_token_id, grad_clip=cfg.train.grad_clip, step=state["step"] + 1,
                             loss_chunk_tokens=cfg.train.loss_chunk_tokens, label_smoothing=cfg.train.label_smoothing,
                             context_parallel=cp)
        scheduler.step()
        tree_micro_batches += res.tree_micro_batches
        state["step"] += 1
        state["samples"] += int(res.samples)
        state["tokens"] += int(res.tokens)
        state["losses"].append(res.loss)
        steps_this_run += 1
        dt = time.time() - t0
        runlog.step(state["step"], {"loss": res.loss, "lr": scheduler.get_last_lr()[0], "grad_norm": res.grad_norm,
                                    "tokens_per_s": res.tokens / dt, "target_tokens": res.target_tokens,
                                    "samples": state["samples"], "epoch": mbs[-1].get("epoch", 0)})
        due = bool(cfg.checkpoint.save_every) and state["step"] % cfg.checkpoint.save_every == 0
        if due and state["step"] < total_steps:
            save(state["step"])
        if stop_after is not None and steps_this_run >= stop_after and state["step"] < total_steps:
            break
    runlog.close_progress()
    finished = state["step"] >= total_steps
    if finished:
        save(state["step"])
        if info.is_main and cfg.checkpoint.export:
            ckpts.export_final(state["step"])
    summary = _summary(cfg, state, finished, loader, wrapped, tm, info, time.time() - t_start,
                       int(kdist.all_reduce_sum(tree_micro_batches, info.device)))
    if info.is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        runlog.close()
        if cfg.log.progress:
            print(format_summary(summary, out_dir))
    kdist.barrier()
    return summary


def _summary(cfg: SFTConfig, state: dict[str, Any], finished: bool, loader: Any, wrapped: Any, tm: Any, info: Any,
             seconds: float, tree_micro_batches: int) -> dict[str, Any]:
    """The run summary (``summary.json``)."""
    data = loader.summary()
    losses = state["losses"]
    return {"finished": finished, "steps": state["step"], "samples": state["samples"], "tokens": state["tokens"],
            "skipped_samples": data.get("samples_bad", 0), "final_loss": losses[-1] if losses else None,
            "first_loss": losses[0] if losses else None, "losses": losses, "seconds": seconds,
            "trainable_parameters": sum(p.numel() for p in tm.model.parameters() if p.requires_grad),
            "frozen_towers": tm.frozen, "world_size": info.world_size, "strategy": wrapped.strategy,
            "tree": {"mode": cfg.train.tree, "tree_micro_batches": tree_micro_batches}, "data": data}


def format_summary(s: dict[str, Any], out_dir: Path) -> str:
    """A human-readable end-of-run report."""
    loss = "n/a" if s["final_loss"] is None else f"{s['final_loss']:.4f} (first {s['first_loss']:.4f})"
    return (
        f"SFT {'finished' if s['finished'] else 'stopped'}: {s['steps']} steps, {s['samples']} samples, "
        f"{s['tokens']} tokens, {s['skipped_samples']} skipped samples, final loss {loss}, "
        f"{s['seconds']:.1f}s on {s['world_size']} process(es) [{s['strategy']}]; outputs in {out_dir}"
    )


def main(argv: list[str] | None = None) -> int:
    """``keye train sft --config CFG.yaml [key=value ...]``."""
    return common.main(argv, prog="keye train sft", doc=__doc__, example="train.lr=1e-4", config_cls=SFTConfig,
                       train=train)


def run_from_args(config: str | None, overrides: list[str]) -> int:
    """Load the config (YAML + overrides), run, tear the process group down."""
    return common.run_from_args(SFTConfig, train, config, overrides)


__all__ = ["SFTConfig", "format_summary", "main", "run_from_args", "train"]
