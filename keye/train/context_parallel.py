"""Context parallelism for long packed rows: one row split over the ranks of a context-parallel group.

Layout (:func:`context_parallel_layout`): the world of ``W`` ranks is ``W / N`` context-parallel groups of ``N``
*consecutive* ranks (group = rank // N, rank in group = rank % N). Every rank of a group holds the same
micro-batches; the groups are the data-parallel replicas, so a loader shards its samples over
``layout.num_groups`` replicas and ``layout.group`` is this rank's replica index (the SFT loader:
``keye.data.loader.build_dataloader(group_size=N)``, where the group's first rank reads and sends). Gradients are averaged over the
whole world (DDP / FSDP2 on the default group, i.e. dp x cp flattened, as torchtitan shards), which is exact
because each rank's loss is its slice's summed token loss over the *global* target count.

The split (:class:`ContextParallel`, passed to :meth:`keye.KeyeVL.forward` as ``context_parallel=``) is
Ulysses-style (DeepSpeed-Ulysses, Jacobs et al. 2023):

- the row is padded to a multiple of N and rank ``i`` of the group keeps tokens ``[i L/N, (i+1) L/N)`` of the
  embeddings, of the 3-D mRoPE positions (computed for the whole row first, so they are those of the 1-process
  run) and of the next-token targets (shifted on the whole row first, so no sample's last token predicts the next
  sample's first, whichever rank holds either);
- in every decoder layer one all-to-all turns this rank's [L/N tokens, all heads] q/k/v into [all L tokens,
  H/N heads], the *unchanged* varlen kernel (``keye.model.attention.varlen_attention``: sdpa, or flash-attn's
  varlen with the whole row's ``cu_seqlens``) runs on the whole row for those heads, and a second all-to-all brings
  the output back to [L/N tokens, all heads]. Everything outside attention (norms, projections, MLP, loss) is
  per-token and runs on the slice;
- grouped-query attention with fewer KV heads than N: the KV heads are repeated (``repeat_interleave``, as GQA
  itself shares them) up to ``lcm(Hkv, N)`` heads before the all-to-all, so each rank receives the KV heads its
  query heads read; the repeat's backward sums the copies' gradients;
- the vision tower stays data-parallel: the group's vision items (images; a 1.5 video's frames) are divided into N
  contiguous runs of about equal patch counts, each rank encodes its run, and the features are all-gathered (the
  backward sums each feature's gradient over the group, every rank having used it for its slice).

Why Ulysses rather than ring attention: the attention kernel and packed-sample masking stay exactly the
1-process ones (ring attention needs a kernel that merges partial softmaxes block by block and, with causal
packed rows, per-block masks and load balancing); its two all-to-alls are collectives gloo implements
(``all_to_all_single``), so the CPU tests run the real path; and causal attention costs every rank the same (each
computes whole rows for its heads), where a contiguous ring split idles the early ranks. Its limit: N must
divide the query heads (32 for Keye-VL-8B: N <= 32), and each rank holds the whole row's q/k/v for H/N heads
during attention.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from keye.errors import KeyeConfigError
from keye.model.attention import varlen_attention


@dataclass(frozen=True)
class ContextParallelLayout:
    """Where one rank sits in the (data parallel x context parallel) layout.

    ``size``: ranks per context-parallel group (N, ``train.context_parallel``); ``rank`` / ``world_size``: the
    global rank and world. Groups are consecutive ranks: ranks ``[group * N, (group + 1) * N)``.
    """

    size: int = 1
    rank: int = 0
    world_size: int = 1

    @property
    def group(self) -> int:
        """This rank's context-parallel group, which is also its data-parallel replica index (rank // N)."""
        return self.rank // self.size

    @property
    def num_groups(self) -> int:
        """Number of context-parallel groups = data-parallel replicas (world / N)."""
        return self.world_size // self.size

    @property
    def rank_in_group(self) -> int:
        """This rank's place inside its group (rank % N): which slice of the row it computes."""
        return self.rank % self.size

    @property
    def group_ranks(self) -> list[int]:
        """The global ranks of this rank's group, in slice order."""
        return list(range(self.group * self.size, (self.group + 1) * self.size))

    @property
    def is_group_leader(self) -> bool:
        """True on the first rank of the group (the one that may read data and broadcast it to the others)."""
        return self.rank_in_group == 0

    def all_groups(self) -> list[list[int]]:
        """Every group's ranks, group by group (what ``torch.distributed.new_group`` is called with, on all ranks)."""
        return [list(range(g * self.size, (g + 1) * self.size)) for g in range(self.num_groups)]


def context_parallel_layout(world_size: int, rank: int, size: int) -> ContextParallelLayout:
    """The layout of ``world_size`` ranks in context-parallel groups of ``size`` consecutive ranks.

    Raises:
        KeyeConfigError: ``size`` < 1, or ``world_size`` not a multiple of ``size`` (the message names
            ``train.context_parallel``).
    """
    if size < 1:
        raise KeyeConfigError(f"train.context_parallel must be >= 1, got {size}")
    if world_size % size:
        raise KeyeConfigError(f"train.context_parallel={size} does not divide the world size {world_size}: every "
                              f"context-parallel group is {size} consecutive ranks")
    if not 0 <= rank < world_size:
        raise KeyeConfigError(f"rank {rank} is outside a world of {world_size}")
    return ContextParallelLayout(size=size, rank=rank, world_size=world_size)


def _staged(x: torch.Tensor, group: Any) -> bool:
    # gloo moves CPU tensors only (all-to-all, all-gather): CUDA tensors go through host memory, which lets several
    # ranks share one GPU (NCCL refuses that) - how scripts/gpu_check.py runs the path on a single GPU
    return x.is_cuda and dist.get_backend(group) == "gloo"


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-to-all of ``x`` [N, ...]: row ``j`` goes to the group's ``j``-th rank; row ``j`` of the result came from
    it."""
    staged = _staged(x, group)
    y = x.cpu().contiguous() if staged else x.contiguous()
    out = torch.empty_like(y)
    dist.all_to_all_single(out, y, group=group)
    return out.to(x.device) if staged else out


def _all_gather(x: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every group rank's ``x`` (same shape everywhere), in rank order."""
    staged = _staged(x, group)
    y = x.cpu().contiguous() if staged else x.contiguous()
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, y, group=group)
    return [p.to(x.device) for p in parts] if staged else parts


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``x`` over the group (a new tensor; summed in float32 when staged through gloo)."""
    if _staged(x, group):
        y = x.float().cpu()
        dist.all_reduce(y, group=group)
        return y.to(device=x.device, dtype=x.dtype)
    y = x.contiguous().clone()
    dist.all_reduce(y, group=group)
    return y


class _SeqToHeads(torch.autograd.Function):
    """[L/N, N, h, d] (this rank's tokens, heads grouped by the rank that attends with them) -> [L, h, d] (the
    whole row, this rank's h heads). The backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = x.shape[1]
        return _all_to_all(x.transpose(0, 1), group).reshape(n * x.shape[0], *x.shape[2:])

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[L, h, d] -> [L/N, N, h, d], the inverse of :class:`_SeqToHeads` (no autograd)."""
    n = dist.get_world_size(group)
    return _all_to_all(x.reshape(n, x.shape[0] // n, *x.shape[1:]), group).transpose(0, 1)


class _HeadsToSeq(torch.autograd.Function):
    """[L, h, d] -> [L/N, N, h, d]: attention outputs back to this rank's tokens (backward: :class:`_SeqToHeads`)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[1]
        return _all_to_all(grad.transpose(0, 1), ctx.group).reshape(n * grad.shape[0], *grad.shape[2:]), None


class _GatherRows(torch.autograd.Function):
    """Concatenate every group rank's rows [n_i, D] in rank order (``counts``: every n_i); the backward sums the
    gradient over the group (each rank used all rows) and keeps this rank's."""

    @staticmethod
    def forward(ctx, x, counts, rank, group):
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        width = max(counts)
        padded = x.new_zeros(width, *x.shape[1:])
        padded[: x.shape[0]] = x
        return torch.cat([p[:c] for p, c in zip(_all_gather(padded, group), counts)])

    @staticmethod
    def backward(ctx, grad):
        grad = _all_reduce(grad, ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None, None


def split_items(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous item ranges ``[(start, end)] * parts`` with about equal total ``sizes`` (an item goes to the part
    its middle falls in); a part may be empty when there are fewer items than parts."""
    total = sum(sizes)
    owner, before = [], 0
    for s in sizes:
        owner.append(min(parts - 1, int(parts * (before + s / 2) / total)) if total else 0)
        before += s
    return [(sum(1 for o in owner if o < p), sum(1 for o in owner if o <= p)) for p in range(parts)]


def kv_repeats(num_kv_heads: int, size: int) -> int:
    """How many times each KV head is repeated so that N = ``size`` ranks can each take whole KV heads:
    ``lcm(Hkv, N) / Hkv`` (1 when N divides Hkv)."""
    return math.lcm(num_kv_heads, size) // num_kv_heads


class ContextParallel:
    """This rank's part of a context-parallel group; pass it as ``KeyeVL.forward(context_parallel=...)``.

    ``layout``: the :class:`ContextParallelLayout`; ``group``: the torch process group of this rank's context-parallel
    group (:meth:`create` makes every group). The forward calls :meth:`encode_vision` for the vision items and
    :meth:`split_row` once embeddings and positions of the whole row exist.
    """

    def __init__(self, layout: ContextParallelLayout, group: Any):
        self.layout, self.group = layout, group
        self.size, self.index = layout.size, layout.rank_in_group

    @classmethod
    def create(cls, size: int, rank: int, world_size: int, *, num_heads: int | None = None) -> ContextParallel | None:
        """The context-parallel groups of ``size`` consecutive ranks (collective: every rank calls it); None when
        ``size`` is 1. ``num_heads``: the decoder's query heads, which ``size`` must divide.

        Raises:
            KeyeConfigError: ``size`` does not divide the world or the heads (the message names
                ``train.context_parallel``), or ``size`` > 1 without an initialised process group.
        """
        layout = context_parallel_layout(world_size, rank, size)
        if size == 1:
            return None
        if num_heads is not None and num_heads % size:
            raise KeyeConfigError(f"train.context_parallel={size} must divide the decoder's {num_heads} attention "
                                  f"heads (each rank attends with heads/{size} of them over the whole row)")
        if not dist.is_initialized():
            raise KeyeConfigError(f"train.context_parallel={size} needs {size} processes (torchrun)")
        mine = None
        for ranks in layout.all_groups():
            g = dist.new_group(ranks)  # every rank creates every group, in the same order
            if rank in ranks:
                mine = g
        return cls(layout, mine)

    # ------------------------------------------------------------------------------------------- vision
    def encode_vision(self, encode: Callable[[torch.Tensor, list], torch.Tensor], pixels: torch.Tensor,
                      grids: list[tuple[int, int, int]], merge_size: int) -> torch.Tensor:
        """Every item's features ([sum t*h*w / merge_size^2, D], item order) with this rank encoding only its run
        of the items: ``encode(pixels [patches, ...], grids)`` is the tower + projector. A rank whose run is empty
        encodes one dummy item with weight 0, so every rank runs the same modules (DDP / FSDP2)."""
        patches = [t * h * w for t, h, w in grids]
        start, end = split_items(patches, self.size)[self.index]
        lo, hi = sum(patches[:start]), sum(patches[:end])
        m2 = merge_size * merge_size
        counts = [sum(patches[a:b]) // m2 for a, b in split_items(patches, self.size)]
        dummy = None
        if end > start:
            local = encode(pixels[lo:hi], list(grids[start:end]))
        else:
            one = (1, merge_size, merge_size)
            dummy = encode(pixels.new_zeros(m2, *pixels.shape[1:]), [one])
            local = dummy[:0]
        feats = _GatherRows.apply(local, counts, self.index, self.group)
        return feats if dummy is None else feats + 0.0 * dummy.sum()

    # ---------------------------------------------------------------------------------------------- row
    def split_row(self, embeds: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor | None,
                  cu_seqlens: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                   Callable[..., torch.Tensor]]:
        """This rank's slice of a packed row and the attention that spans the group.

        Args:
            embeds: [1, L, D] the whole row's input embeddings; position_ids: int [3, 1, L] its mRoPE positions.
            targets: int [1, L - 1] the next-token targets (``shifted_targets``: -100 for none), or None.
            cu_seqlens: int [S + 1] the packed samples' boundaries (0 .. L).
            backend: the decoder's attention kernel (``sdpa`` / ``eager`` / ``flash_attention_2``).
        Returns:
            ``(embeds [1, L'/N, D], positions [3, 1, L'/N], targets [1, L'/N] or None, attention)``: L' is L padded
            to a multiple of N (padding: zero embeddings at position 0, no target, its own attention segment);
            position ``t`` of the slice predicts ``targets[:, t]``; ``attention`` is the forward's
            ``attention_override``.
        """
        n = self.size
        length = embeds.shape[1]
        padded = -(-length // n) * n
        pad = padded - length
        if pad:
            embeds = torch.cat([embeds, embeds.new_zeros(1, pad, embeds.shape[2])], dim=1)
            position_ids = torch.cat([position_ids, position_ids.new_zeros(3, 1, pad)], dim=2)
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([padded])])
        if targets is not None:
            targets = torch.cat([targets, targets.new_full((1, pad + 1), -100)], dim=1)
        local = padded // n
        sl = slice(self.index * local, (self.index + 1) * local)
        attention = functools.partial(self._attention, cu_seqlens=cu_seqlens, backend=backend)
        return (embeds[:, sl], position_ids[:, :, sl], None if targets is None else targets[:, sl], attention)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer_idx: int, scale: float,
                   cu_seqlens: torch.Tensor, backend: str) -> torch.Tensor:
        """Causal varlen attention over the whole row for this rank's heads (q [1, Hq, L/N, d], k/v [1, Hkv, L/N,
        d] -> [1, Hq, L/N, d]); one all-to-all each way."""
        del layer_idx
        n = self.size
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[3]
        q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))  # [L/N, H, d]
        rep = kv_repeats(hkv, n)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        hk = hkv * rep // n
        local = q.shape[0]
        # one exchange for q, k and v: per destination rank its query heads then its key and value heads
        qkv = torch.cat([q.reshape(local, n, hq // n, d), k.reshape(local, n, hk, d), v.reshape(local, n, hk, d)],
                        dim=2)
        full = _SeqToHeads.apply(qkv, self.group)  # [L, hq/n + 2 hk, d]
        qf, kf, vf = (x.contiguous() for x in full.split([hq // n, hk, hk], dim=1))
        out = varlen_attention(qf, kf, vf, cu_seqlens, scale=scale, causal=True, backend=backend)
        out = _HeadsToSeq.apply(out.contiguous(), self.group)  # [L/N, N, hq/n, d]
        return out.reshape(local, hq, d).transpose(0, 1)[None]


__all__ = ["ContextParallel", "ContextParallelLayout", "context_parallel_layout", "kv_repeats", "split_items"]
