"""Broadcast weight sync (``rl.ray.weight_sync: broadcast``): a process group of learner rank 0 and the rollout
workers (NCCL on GPUs, gloo on CPUs) and the wire format of the shards sent through it."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch


# ---------------------------------------------------------------------------------- broadcast weight sync
def open_sync_group(addr: str, port: int, rank: int, world: int, backend: str, timeout_s: float) -> tuple[Any, Any]:
    """A process group of its own (not the default one: learner ranks already have theirs) for the weight
    broadcast: learner rank 0 is rank 0 and hosts the rendezvous store at ``addr:port``, rollout worker ``k`` is
    rank ``k + 1``. ``backend`` ``nccl`` (GPU tensors) or ``gloo`` (CPU tensors). Returns (store, group); keep
    both alive while the group is used. Every member must call it at the same time."""
    import datetime

    from torch import distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout)
    cls = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
    return store, cls(store, rank, world, timeout)


def _bcast(group: Any, t: torch.Tensor) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([t], opts).wait()


def broadcast_shards(group: Any, shards: Iterator[dict[str, torch.Tensor]], device: torch.device) -> int:
    """Send weight shards from rank 0 of ``group``: per shard a JSON header (names, dtypes, shapes) and one
    byte buffer per dtype (every tensor of that dtype, flattened and concatenated), then an empty header.
    Returns the number of tensors sent. The receivers run :func:`receive_shards`."""
    sent = 0
    for shard in shards:
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, t in shard.items():
            by_dtype.setdefault(t.dtype, []).append(name)
        header = [[str(dt).removeprefix("torch."), [[n, list(shard[n].shape)] for n in names]]
                  for dt, names in by_dtype.items()]
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(device)
        _bcast(group, torch.tensor([raw.numel()], dtype=torch.long, device=device))
        _bcast(group, raw)
        for names in by_dtype.values():
            flat = torch.cat([shard[n].detach().to(device).reshape(-1) for n in names])
            _bcast(group, flat.view(torch.uint8))
            sent += len(names)
    _bcast(group, torch.zeros(1, dtype=torch.long, device=device))
    return sent


def receive_shards(group: Any, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """The shards :func:`broadcast_shards` sends, one at a time (consume to the end: the sender waits for
    every receiver in each collective)."""
    while True:
        size = torch.zeros(1, dtype=torch.long, device=device)
        _bcast(group, size)
        if int(size.item()) == 0:
            return
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        _bcast(group, raw)
        shard: dict[str, torch.Tensor] = {}
        for dt, entries in json.loads(raw.cpu().numpy().tobytes().decode()):
            numels = [int(np.prod(shape, dtype=np.int64)) for _, shape in entries]
            flat = torch.empty(sum(numels), dtype=getattr(torch, dt), device=device)
            _bcast(group, flat.view(torch.uint8))  # received in place through the byte view
            for (name, shape), piece in zip(entries, flat.split(numels)):
                shard[name] = piece.view(shape)
        yield shard


# --------------------------------------------------------------------------------------------- build
def broadcast_backend(weight_sync: str, learner_devices: Sequence[str], rollout_gpus: float) -> str | None:
    """The weight-broadcast backend for ``rl.ray.weight_sync``: None (object store), ``nccl`` (learner rank 0 and
    the rollout workers on GPUs) or ``gloo`` (CPU tensors). ``auto`` broadcasts only when every learner and
    rollout worker has a GPU."""
    on_gpus = all(d.startswith("cuda") for d in learner_devices) and rollout_gpus > 0
    if weight_sync == "object_store" or (weight_sync == "auto" and not on_gpus):
        return None
    return "nccl" if on_gpus else "gloo"
