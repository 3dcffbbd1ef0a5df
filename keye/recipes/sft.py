"""Supervised fine-tuning of Keye-VL (the recipe behind ``keye train sft`` and ``training/sft.py``).

Launch::

    keye train sft --config training/configs/tiny_synth_stage0.yaml               # one CPU (keye-tiny stage 0)
    torchrun --nproc_per_node 8 -m keye train sft --config training/configs/keye_vl_8b_sft.yaml \\
        model.path=Kwai-Keye/Keye-VL-1_5-8B data.manifest=/data/sft.jsonl

What one optimizer step does: each rank takes ``data.micro_batches`` load-balanced micro-batches
(packed rows by default), the number of target tokens of the whole global step is summed over
micro-batches and ranks, and every micro-batch's summed token loss is divided by that number. The
gradient is therefore the mean over all target tokens of the global batch, independent of how tokens
fall into micro-batches or ranks (not a mean of per-micro-batch means).

Precision: with ``model.dtype: bfloat16`` the forward runs in bf16 (autocast) while the trainable weights,
their gradients and AdamW stay in float32 (frozen towers stay bf16); checkpoints keep those float32 weights
(``master.safetensors``) for exact resume, and the official export is bf16. DeepSpeed does the same through
its own bf16 setting.

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
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keye.sft.config import SFTConfig
from keye.sft.step import cycle_batches, deepspeed_config, model_inputs
from keye.sft.trees import (
    TreeCostModel,
    TreeSampleProcessor,
    _trees,
    target_tokens,
    tree_loss,
    unshared_batch,
    use_tree_path,
)
from keye.tiny import resolve_model_path
from keye.train import dist as kdist
from keye.train.checkpoint import list_checkpoints, load_checkpoint, prune_checkpoints, save_checkpoint
from keye.train.config import dump_config, load_config, to_dict
from keye.train.lora import apply_lora
from keye.train.metrics import MetricsWriter
from keye.train.optim import apply_freezing, lr_lambda, param_groups

log = logging.getLogger("keye.train")


def train(cfg: SFTConfig, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run SFT as configured; returns the run summary (also written to ``summary.json``).

    ``stop_after`` stops after that many optimizer steps *of this invocation* without the final
    save (used to simulate a crash in resume tests).
    """
    from keye.data.cost import CostModel
    from keye.data.loader import build_dataloader
    from keye.data.manifest import read_manifest
    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor

    info = kdist.init_distributed(cfg.train.device)
    out_dir = Path(cfg.checkpoint.out_dir)
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out_dir / "config.yaml")
    kdist.barrier()
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)

    model_path = resolve_model_path(cfg.model.path)
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if info.device.type == "cuda" else "float32"
    model = KeyeVL.from_pretrained(model_path, torch_dtype=dtype, attn_implementation=cfg.model.attn_implementation)
    processor = KeyeProcessor.from_pretrained(resolve_model_path(cfg.model.processor or cfg.model.path))
    processor.override_preprocessor(cfg.model.preprocessor, where="model.preprocessor")
    model.train()
    # Data-parallel/sharded ranks must run identical modules even when a micro-batch has no pixels.
    model.always_run_vision = info.distributed
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    frozen = apply_freezing(model, cfg.train)
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora)
    # bf16 training: compute in bf16 (autocast) but keep the trainable weights in float32. AdamW's step is
    # ~lr per element, far below bf16's resolution of a weight at SFT learning rates (1e-5 vs ~1e-4 for a
    # weight of 0.02), so pure bf16 weights would silently drop most updates. Frozen weights stay in bf16;
    # DeepSpeed keeps its own float32 master weights (its bf16 setting).
    export_dtype = next(model.parameters()).dtype
    amp = export_dtype == torch.bfloat16 and cfg.train.strategy not in ("zero2", "zero3")
    if amp:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    else:
        export_dtype = None

    manifest = read_manifest(cfg.data.manifest, cfg.data.root)
    tree_mode = cfg.train.tree
    loader_processor, cost_model = processor, None
    if tree_mode == "on" or any(s.answers is not None for s in manifest.samples):
        # Rows carry their prefix trees; micro-batches are planned with the cost of the layout that runs.
        loader_processor = TreeSampleProcessor(processor, model.config)
        cost_model = TreeCostModel(CostModel.from_processor(processor, mode=cfg.data.processor_kwargs.get("mode")),
                                   shared=tree_mode != "off")
    loader = build_dataloader(
        manifest, loader_processor, batch_tokens=cfg.data.batch_tokens,
        batch_size=cfg.data.batch_size, micro_batches=cfg.data.micro_batches, world_size=info.world_size,
        rank=info.rank, seed=cfg.train.seed, num_workers=cfg.data.num_workers, packing=cfg.data.packing,
        max_bad_fraction=cfg.data.max_bad_fraction, processor_kwargs=cfg.data.processor_kwargs,
        bad_log=(out_dir / "bad_samples.jsonl") if info.is_main else None, cost_model=cost_model,
    )
    steps_per_epoch = max(1, len(loader) // cfg.data.micro_batches)
    total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch

    def make_optimizer():
        return torch.optim.AdamW(param_groups(model, cfg.train), lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                 weight_decay=cfg.train.weight_decay)

    ds_cfg = None
    if cfg.train.strategy in ("zero2", "zero3"):
        ds_cfg = deepspeed_config(cfg, info.world_size, info.device.type, next(model.parameters()).dtype)
    if cfg.train.strategy == "fsdp2":
        wrapped = kdist.wrap_model(model, cfg.train.strategy, info)
        optimizer = make_optimizer()
    else:
        model.to(info.device)
        optimizer = make_optimizer()
        wrapped = kdist.wrap_model(model, cfg.train.strategy, info, optimizer=optimizer, deepspeed_config=ds_cfg)
    # The LR schedule drives the torch optimizer's param groups (DeepSpeed's ZeRO optimizer shares them).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train, total_steps))

    state = {"step": 0, "samples": 0, "tokens": 0, "losses": []}
    ckpts = list_checkpoints(out_dir)
    if ckpts:
        state = load_checkpoint(ckpts[-1], wrapped, optimizer, scheduler, loader, info, cfg.lora.enabled)
        if info.is_main:
            log.info("resumed from %s at step %d", ckpts[-1], state["step"])

    metrics = MetricsWriter(out_dir, info.is_main, cfg.log.tensorboard)
    bar = None
    if info.is_main and cfg.log.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=state["step"], desc="sft", dynamic_ncols=True)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    t_start = time.time()
    batches = cycle_batches(loader)
    steps_this_run = 0
    tree_micro_batches = 0
    use_ds = wrapped.is_deepspeed
    while state["step"] < total_steps:
        t0 = time.time()
        mbs = [next(batches) for _ in range(cfg.data.micro_batches)]
        # Every answer of a multi-answer row counts its own tokens, whichever layout computes them.
        local_targets = sum(target_tokens(mb) for mb in mbs)
        global_targets = kdist.all_reduce_sum(local_targets, info.device)
        # DDP, FSDP and ZeRO average gradients over ranks; undo that so the result is
        # sum(token losses) / global target tokens (Wrapped.backward keeps DeepSpeed from also dividing by
        # its accumulation steps).
        scale = info.world_size / max(global_targets, 1.0)
        loss_sum = 0.0
        local_tokens = 0
        ds_steps_before = wrapped.engine.global_steps if use_ds else 0
        for i, mb in enumerate(mbs):
            last = i == len(mbs) - 1
            with wrapped.no_sync(last):
                with torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=amp):
                    if use_tree_path(mb, tree_mode):
                        mb_loss = tree_loss(wrapped.module, mb, info.device)
                        tree_micro_batches += 1
                        local_tokens += int(mb["num_tokens"])
                    else:
                        batch = unshared_batch(mb, loader.pad_token_id) if _trees(mb) else mb
                        inputs = model_inputs(batch, info.device)
                        mb_loss = wrapped.module(**inputs, loss_reduction="sum").loss
                        local_tokens += int(batch["num_tokens"])
                wrapped.backward(mb_loss * scale)
                if use_ds:
                    # DeepSpeed counts micro-batches itself (gradient_accumulation_steps = micro_batches): its
                    # step() must run after every backward, and applies the update (reduction, clipping,
                    # optimizer) only at its own accumulation boundary, the last micro-batch.
                    wrapped.engine.step()
            loss_sum += float(mb_loss.detach())
        if use_ds:
            if wrapped.engine.global_steps != ds_steps_before + 1:
                taken = wrapped.engine.global_steps - ds_steps_before
                raise RuntimeError(f"DeepSpeed took {taken} optimizer steps in training step "
                                   f"{state['step'] + 1}, expected 1: its accumulation boundary is out of "
                                   f"step with data.micro_batches={cfg.data.micro_batches}")
            grad_norm = float(wrapped.engine.get_global_grad_norm() or 0.0)
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], cfg.train.grad_clip))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss = kdist.all_reduce_sum(loss_sum, info.device) / max(global_targets, 1.0)
        tokens = kdist.all_reduce_sum(local_tokens, info.device)  # tokens the LLM ran (a tree's once)
        samples = kdist.all_reduce_sum(sum(int(mb["num_samples"]) for mb in mbs), info.device)
        state["step"] += 1
        state["samples"] += int(samples)
        state["tokens"] += int(tokens)
        state["losses"].append(loss)
        steps_this_run += 1
        dt = time.time() - t0
        row = {"loss": loss, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm, "tokens_per_s": tokens / dt,
               "target_tokens": global_targets, "samples": state["samples"], "epoch": mbs[-1].get("epoch", 0)}
        if state["step"] % cfg.log.every == 0:
            metrics.write(state["step"], row)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens / dt:.0f}")
            bar.update(1)
        if stop_after is not None and steps_this_run >= stop_after and state["step"] < total_steps:
            if cfg.checkpoint.save_every and state["step"] % cfg.checkpoint.save_every == 0:
                save_checkpoint(out_dir / f"step_{state['step']:08d}", wrapped, optimizer, scheduler, loader, state,
                                processor, info, cfg.lora.enabled, export_dtype)
            break
        if cfg.checkpoint.save_every and state["step"] % cfg.checkpoint.save_every == 0 and state["step"] < total_steps:
            save_checkpoint(out_dir / f"step_{state['step']:08d}", wrapped, optimizer, scheduler, loader, state,
                            processor, info, cfg.lora.enabled, export_dtype)
            if info.is_main:
                prune_checkpoints(out_dir, cfg.checkpoint.keep_last)
    if bar is not None:
        bar.close()
    finished = state["step"] >= total_steps
    if finished:
        save_checkpoint(out_dir / f"step_{state['step']:08d}", wrapped, optimizer, scheduler, loader, state,
                        processor, info, cfg.lora.enabled, export_dtype)
        if info.is_main:
            prune_checkpoints(out_dir, cfg.checkpoint.keep_last)
            if cfg.checkpoint.export:
                final = out_dir / "final"
                shutil.rmtree(final, ignore_errors=True)
                shutil.copytree(out_dir / f"step_{state['step']:08d}" / "model", final)
    data_summary = loader.summary()
    tree_micro_batches = int(kdist.all_reduce_sum(tree_micro_batches, info.device))  # all ranks
    summary = {
        "finished": finished,
        "steps": state["step"],
        "samples": state["samples"],
        "tokens": state["tokens"],
        "skipped_samples": data_summary.get("samples_bad", 0),
        "final_loss": state["losses"][-1] if state["losses"] else None,
        "first_loss": state["losses"][0] if state["losses"] else None,
        "losses": state["losses"],
        "seconds": time.time() - t_start,
        "trainable_parameters": n_trainable,
        "frozen_towers": frozen,
        "world_size": info.world_size,
        "strategy": wrapped.strategy,
        "tree": {"mode": tree_mode, "tree_micro_batches": tree_micro_batches},
        "data": data_summary,
    }
    if info.is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        metrics.close()
        if cfg.log.progress:
            print(format_summary(summary, out_dir))
    kdist.barrier()
    return summary


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
    import argparse

    ap = argparse.ArgumentParser(prog="keye train sft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML recipe config")
    ap.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. train.lr=1e-4")
    args = ap.parse_args(argv)
    return run_from_args(args.config, args.overrides)


def run_from_args(config: str | None, overrides: list[str]) -> int:
    logging.basicConfig(level=os.environ.get("KEYE_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(SFTConfig, config, overrides)
    try:
        train(cfg)
    finally:
        kdist.cleanup()
    return 0


__all__ = ["SFTConfig", "TreeCostModel", "TreeSampleProcessor", "deepspeed_config", "main", "target_tokens",
           "to_dict", "train", "tree_loss", "unshared_batch", "use_tree_path"]
