"""Distributed plumbing shared by the recipes: process group setup from torchrun's environment,
model wrapping (none / DDP / FSDP2 / DeepSpeed ZeRO) and small collective helpers.

The same YAML runs on one CPU or many GPUs: with no ``WORLD_SIZE`` in the environment everything is
single-process; under ``torchrun`` the backend is NCCL on GPUs and gloo on CPUs.
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from keye.errors import KeyeConfigError


@dataclass
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto") -> DistInfo:
    """Initialise the default process group when launched by torchrun; pick this rank's device.

    ``device``: ``"auto"`` (CUDA if available, else CPU), ``"cpu"`` or ``"cuda"``.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda and not torch.cuda.is_available():
        raise KeyeConfigError("device=cuda requested but no CUDA device is available")
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    else:
        # Training drives some weights and gradients into the denormal range; x86 CPUs then fall back to
        # microcode and a step can take 10x longer (seen on keye-tiny after ~100 SFT steps). Flushing them
        # to zero changes nothing a float32 model can represent meaningfully.
        torch.set_flush_denormal(True)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=dev)


def cleanup() -> None:
    """Tear the process group down (required before exit for clean gloo/NCCL shutdown).

    Called from a ``finally`` block while an exception propagates, it skips the barrier: the other ranks
    may be waiting in a collective this rank will never join, and waiting for them would hang the whole
    job until the collective timeout instead of failing it now."""
    if dist.is_initialized():
        if sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(value: float | int, device: torch.device) -> float:
    """Sum a Python number over all ranks (identity when not distributed)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def reduce_sums(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum a dict of floats over ranks (same keys on every rank; identity in one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def all_max(value: int, device: torch.device) -> int:
    """The largest ``value`` over ranks (collective; identity in one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def all_gather(obj: Any) -> list[Any]:
    """``obj`` of every rank in rank order (collective); ``[obj]`` without an initialised process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send a picklable object from ``src`` to every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class Wrapped:
    """A model wrapped for the chosen strategy, with a uniform training interface.

    Attributes:
        module: what to call for forward (DDP/FSDP/DeepSpeed engine or the model itself).
        model: the underlying :class:`~keye.KeyeVL` (for saving, generation, parameter access).
        strategy: ``none``, ``ddp``, ``fsdp2``, ``zero2`` or ``zero3``.
    """

    def __init__(self, module, model, strategy, optimizer=None, engine=None):
        self.module, self.model, self.strategy = module, model, strategy
        self.optimizer, self.engine = optimizer, engine

    @property
    def is_deepspeed(self) -> bool:
        return self.engine is not None

    def no_sync(self, last_micro_batch: bool):
        """Skip the gradient all-reduce on all but the last micro-batch of an accumulation step."""
        if self.strategy == "ddp" and not last_micro_batch:
            return self.module.no_sync()
        if self.strategy == "fsdp2":
            self.module.set_requires_gradient_sync(last_micro_batch)
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` as given: the caller scales it (DeepSpeed does not divide it by its
        gradient accumulation steps; it still averages gradients over ranks, as DDP and FSDP do)."""
        if self.engine is not None:
            self.engine.backward(loss, scale_wrt_gas=False)
        else:
            loss.backward()


def wrap_model(
    model: nn.Module,
    strategy: str,
    info: DistInfo,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    deepspeed_config: dict | None = None,
) -> Wrapped:
    """Wrap ``model`` for ``strategy``.

    With FSDP2 the decoder and vision layers are sharded one by one, then the root; build the
    optimizer *after* wrapping (parameters become DTensors). DeepSpeed takes the already built
    torch ``optimizer`` (so parameter groups, per-tower learning rates and an LR scheduler attached
    to it behave as in every other strategy) and wraps it in its ZeRO optimizer.
    """
    model.to(info.device)
    if strategy == "none" or (strategy in ("ddp", "fsdp2") and not info.distributed):
        return Wrapped(model, model, "none")
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [info.local_rank] if info.device.type == "cuda" else None
        # Frozen towers (alignment stage) leave parameters without gradients; tell DDP.
        ddp = DDP(model, device_ids=ids, find_unused_parameters=False)
        return Wrapped(ddp, model, "ddp")
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        for layer in model.visual.vision_model.encoder.layers:
            fully_shard(layer)
        fully_shard(model)
        return Wrapped(model, model, "fsdp2")
    if strategy in ("zero2", "zero3"):
        try:
            import deepspeed
        except ImportError as err:
            raise KeyeConfigError(f"strategy={strategy} needs deepspeed (pip install 'keye[train]'): {err}") from None
        if deepspeed_config is None:
            raise KeyeConfigError(f"strategy={strategy} needs a DeepSpeed config (training/deepspeed/*.json)")
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config)
        return Wrapped(engine, model, strategy, optimizer=ds_optimizer, engine=engine)
    raise KeyeConfigError(f"unknown strategy {strategy!r}; use none, ddp, fsdp2, zero2 or zero3")


def full_state_dict(wrapped: Wrapped) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict on CPU; complete on rank 0, may be empty elsewhere."""
    model = wrapped.model
    if wrapped.strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if wrapped.strategy == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (what every run does before building its parts)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def deepspeed_settings(source: str | dict[str, Any], *, world_size: int, accumulation: int, grad_clip: float,
                       dtype: str, device_type: str) -> dict[str, Any]:
    """A DeepSpeed config for one ZeRO run: ``source`` (a JSON file path, or a dict that is copied) with one
    sample per micro-batch, ``accumulation`` micro-batches per step, the global batch and clipping filled in.

    ``"enabled": "auto"`` in the ``bf16`` / ``fp16`` sections (the HF-Trainer convention the shipped configs
    use) is resolved from ``dtype`` (the model's dtype name): DeepSpeed itself reads the string as *disabled*,
    which for a bf16 model means no bf16 engine and no float32 master weights. Off the GPU the ``bf16`` section
    is dropped.

    Raises:
        KeyeConfigError: the file is missing or not JSON (the message names it).
    """
    import json
    from pathlib import Path

    if isinstance(source, dict):
        ds = json.loads(json.dumps(source))
    else:
        try:
            ds = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise KeyeConfigError(f"{source}: cannot read the DeepSpeed config ({err})") from None
    ds["train_micro_batch_size_per_gpu"] = 1
    ds["gradient_accumulation_steps"] = accumulation
    ds["train_batch_size"] = accumulation * world_size
    ds["gradient_clipping"] = grad_clip
    for section, name in (("bf16", "bfloat16"), ("fp16", "float16")):
        if isinstance(ds.get(section), dict) and ds[section].get("enabled") == "auto":
            ds[section]["enabled"] = dtype == name
    if device_type != "cuda":
        ds.pop("bf16", None)
    return ds
