"""One SFT optimizer step over load-balanced micro-batches, and the DeepSpeed config it runs under.

What one step does: each rank takes ``data.micro_batches`` micro-batches (packed rows by default), the number of
target tokens of the whole global step is summed over micro-batches and ranks, and every micro-batch's summed token
loss is divided by that number. The gradient is therefore the mean over all target tokens of the global batch,
independent of how tokens fall into micro-batches or ranks (not a mean of per-micro-batch means). Every answer of a
multi-answer row counts its own tokens, whichever layout (tree or unshared rows, :mod:`keye.sft.trees`) computes
them.

With context parallelism (``train.context_parallel`` = N, :mod:`keye.train.context_parallel`) the N ranks of a group
hold the same micro-batches and each computes the summed loss of its slice of every packed row: the global target
count is then the sum over ranks divided by N, and the same scale (world / global targets) makes the averaged
gradient the token-mean of the global batch, as without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from keye.sft.config import SFTConfig
from keye.sft.inputs import model_inputs
from keye.sft.trees import target_tokens, tree_loss, trees_of, unshared_batch, use_tree_path
from keye.train import dist as kdist
from keye.train.context_parallel import ContextParallel
from keye.train.dist import deepspeed_settings
from keye.train.loss import DEFAULT_LOSS_CHUNK_TOKENS, LossRequest


def deepspeed_config(cfg: SFTConfig, world_size: int, device_type: str,
                     model_dtype: torch.dtype) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO run of the SFT recipe: ``train.deepspeed_config`` (default
    ``training/deepspeed/<strategy>.json``) with accumulation over ``data.micro_batches`` and clipping
    (``train.grad_clip``), precision ``auto`` resolved from ``model_dtype`` (:func:`keye.train.dist.deepspeed_settings`).

    Raises:
        KeyeConfigError: the file is missing or not JSON (the message names it).
    """
    source = cfg.train.deepspeed_config or f"training/deepspeed/{cfg.train.strategy}.json"
    return deepspeed_settings(source, world_size=world_size, accumulation=cfg.data.micro_batches,
                              grad_clip=cfg.train.grad_clip, dtype=str(model_dtype).removeprefix("torch."),
                              device_type=device_type)


@dataclass
class StepResult:
    """One optimizer step over all ranks: the token-mean ``loss``, the global gradient norm, the target tokens
    the loss is normalised by, the tokens the LLM ran (a tree's prompt once), the manifest rows trained and this
    rank's micro-batches that ran as shared-prefix forests."""

    loss: float
    grad_norm: float
    target_tokens: float
    tokens: float
    samples: float
    tree_micro_batches: int


def optimizer_step(mbs: Sequence[dict[str, Any]], wrapped: kdist.Wrapped, optimizer: torch.optim.Optimizer,
                   info: kdist.DistInfo, *, amp: bool, tree_mode: str, pad_token_id: int, grad_clip: float,
                   step: int, loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
                   label_smoothing: float = 0.0, context_parallel: ContextParallel | None = None) -> StepResult:
    """Forward and backward every micro-batch of ``mbs`` (this rank's), then one optimizer step (collective).

    The loss is computed inside the forward over the target tokens only, ``loss_chunk_tokens`` rows of the
    vocabulary head at a time (:class:`keye.train.loss.LossRequest`; None: from the full logits, the reference),
    with ``label_smoothing``; both layouts (packed / padded rows, shared-prefix trees) take the same settings.

    DDP, FSDP and ZeRO average gradients over ranks; each micro-batch's summed loss is multiplied by
    ``world / global target tokens`` to undo that, so the gradient is sum(token losses) / global target tokens.
    Under DeepSpeed its engine counts micro-batches itself (``gradient_accumulation_steps = data.micro_batches``)
    and applies the update at its accumulation boundary; elsewhere the trainable gradients are clipped to
    ``grad_clip`` and AdamW steps. The scheduler is the caller's.

    ``context_parallel``: this rank's context-parallel group (every rank of it passes the same ``mbs``, packed rows
    only); counts of targets, tokens and samples are then divided by the group size.

    Raises:
        KeyeInputError: with ``context_parallel``, a micro-batch that is not one packed row or needs the tree path.
        RuntimeError: DeepSpeed took another number of optimizer steps than one (its accumulation boundary is out
            of step with ``data.micro_batches``).
    """
    cp = 1 if context_parallel is None else context_parallel.size
    # every rank of a context-parallel group holds the same micro-batches: each is counted cp times
    global_targets = kdist.all_reduce_sum(sum(target_tokens(mb) for mb in mbs), info.device) / cp
    scale = info.world_size / max(global_targets, 1.0)
    use_ds = wrapped.is_deepspeed
    ds_steps_before = wrapped.engine.global_steps if use_ds else 0
    loss_sum, local_tokens, trees = 0.0, 0, 0
    loss_kwargs = {"loss_request": LossRequest(loss_chunk_tokens)} if loss_chunk_tokens is not None else {}
    for i, mb in enumerate(mbs):
        with wrapped.no_sync(i == len(mbs) - 1):
            with torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=amp):
                if context_parallel is not None:
                    mb_loss = _context_parallel_loss(wrapped, mb, info, context_parallel, tree_mode, pad_token_id,
                                                     loss_kwargs, label_smoothing)
                    local_tokens += int(mb["num_tokens"])
                elif use_tree_path(mb, tree_mode):
                    mb_loss = tree_loss(wrapped.module, mb, info.device, chunk_tokens=loss_chunk_tokens,
                                        label_smoothing=label_smoothing)
                    trees += 1
                    local_tokens += int(mb["num_tokens"])
                else:
                    batch = unshared_batch(mb, pad_token_id) if trees_of(mb) else mb
                    mb_loss = wrapped.module(**model_inputs(batch, info.device), loss_reduction="sum",
                                             label_smoothing=label_smoothing, **loss_kwargs).loss
                    local_tokens += int(batch["num_tokens"])
            wrapped.backward(mb_loss * scale)
            if use_ds:
                # DeepSpeed's step() must run after every backward; it updates only at its accumulation boundary
                wrapped.engine.step()
        loss_sum += float(mb_loss.detach())
    if use_ds:
        if wrapped.engine.global_steps != ds_steps_before + 1:
            taken = wrapped.engine.global_steps - ds_steps_before
            raise RuntimeError(f"DeepSpeed took {taken} optimizer steps in training step {step}, expected 1: its "
                               f"accumulation boundary is out of step with data.micro_batches={len(mbs)}")
        grad_norm = float(wrapped.engine.get_global_grad_norm() or 0.0)
    else:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(
            [p for p in wrapped.model.parameters() if p.requires_grad], grad_clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=kdist.all_reduce_sum(loss_sum, info.device) / max(global_targets, 1.0), grad_norm=grad_norm,
                      target_tokens=global_targets, tokens=kdist.all_reduce_sum(local_tokens, info.device) / cp,
                      samples=kdist.all_reduce_sum(sum(int(mb["num_samples"]) for mb in mbs), info.device) / cp,
                      tree_micro_batches=trees)


def _context_parallel_loss(wrapped: kdist.Wrapped, mb: dict[str, Any], info: kdist.DistInfo, cp: ContextParallel,
                           tree_mode: str, pad_token_id: int, loss_kwargs: dict[str, Any],
                           label_smoothing: float) -> torch.Tensor:
    """This rank's summed token loss over its slice of the micro-batch's packed row."""
    from keye.errors import KeyeInputError

    if trees_of(mb) and tree_mode != "off":
        raise KeyeInputError("a micro-batch holds multi-answer rows, which train.context_parallel > 1 cannot run as "
                             "shared-prefix trees: set train.tree: off")
    batch = unshared_batch(mb, pad_token_id) if trees_of(mb) else mb
    inputs = model_inputs(batch, info.device)
    if "seq_lens" not in inputs:
        raise KeyeInputError("train.context_parallel > 1 needs packed rows (one row per micro-batch with seq_lens: "
                             "data.packing: true, data.batch_tokens)")
    return wrapped.module(**inputs, loss_reduction="sum", label_smoothing=label_smoothing, context_parallel=cp,
                          **loss_kwargs).loss


__all__ = ["StepResult", "deepspeed_config", "optimizer_step"]
