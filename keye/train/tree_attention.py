"""Attention kernels for tree batches (passed to ``KeyeVL.forward(attention_override=...)``).

A token of a :class:`~keye.train.tree.TreeBatch` attends to every token of its ancestor nodes and to
the tokens of its own node up to itself. Two kernels:

- :func:`reference_tree_attention`: the dense boolean [N, N] tree mask and SDPA. Simple, O(N^2)
  memory; the correctness reference.
- :class:`TreeAttention`: no dense mask. Root nodes (the shared prompt) run plain causal SDPA once.
  Every other token's attention is split into partial attentions, one per ancestor node (full, no
  mask) plus one over its own node (causal), merged exactly by log-sum-exp:

      out_i = Σ_blocks exp(lse_block,i - lse_i) · out_block,i,   lse_i = logsumexp_blocks(lse_block,i).

  Partial attentions are grouped by *key* node: all descendants of node a query a's keys in one
  matmul against a slice (a view) of k/v, so the prefix keys are never copied per branch; own-node
  blocks of many branches are batched with padding (bucketed by length). GQA heads are folded into the
  query length, so k/v are not repeated either. The scores are O(Σ_a |a|·|descendants(a)|): for one
  prefix P and G branches of length T that is G·T·P (+ G·T² + P²/2 inside SDPA) instead of the dense
  (P + G·T)² mask. General tries (multi-turn, partial rollouts, shared response prefixes) take the
  same path; the number of matmuls is the number of inner nodes plus the number of length buckets.

Both kernels are differentiable (plain autograd ops) and assume batch size 1 (one serialised row).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from keye.errors import KeyeInputError

__all__ = ["reference_tree_attention", "TreeAttention"]


def reference_tree_attention(mask: torch.Tensor) -> Callable[..., torch.Tensor]:
    """Attention override using a dense boolean mask (True = may attend).

    Args:
        mask: bool [N, N], e.g. :meth:`TreeBatch.dense_mask`.
    Returns:
        ``f(q, k, v, *, layer_idx, scale)`` with q [1, Hq, N, d], k/v [1, Hkv, N, d] -> [1, Hq, N, d].
    """

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer_idx: int, scale: float
    ) -> torch.Tensor:
        del layer_idx
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale)

    return attend


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TreeAttention:
    """Efficient tree attention for one :class:`~keye.train.tree.TreeBatch` (index plans built once).

    Call as ``attn(q, k, v, layer_idx=..., scale=...)`` with q [1, Hq, N, d] and k, v [1, Hkv, N, d]
    (Hq a multiple of Hkv); returns [1, Hq, N, d]. Softmax statistics and the merge are in float32
    (float64 for float64 inputs).

    Args:
        tree: the :class:`~keye.train.tree.TreeBatch` (on the device of q/k/v).
        max_block_elems: bound on the score elements (heads x queries x keys) of one partial
            attention; larger blocks are split over queries (cross blocks) or nodes (own blocks), so
            transient memory is about 3 x 4 x max_block_elems bytes in forward and backward. A single
            own node longer than sqrt(max_block_elems / Hq) still runs as one block.
    """

    def __init__(self, tree, *, max_block_elems: int = 1 << 27):
        self.max_block_elems = int(max_block_elems)
        device = tree.input_ids.device
        starts = tree.node_start.tolist()
        ends = tree.node_end.tolist()
        parents = tree.node_parent.tolist()
        depth = tree.node_depth.tolist()
        n_nodes = len(starts)
        self.n = tree.num_tokens
        self.roots = [(starts[s], ends[s]) for s in range(n_nodes) if parents[s] < 0]
        nonroot = [s for s in range(n_nodes) if parents[s] >= 0]
        self.slots = 1 + (max(depth) if depth else 0)

        # Serialised indices of non-root tokens, and each one's row in the merge buffers.
        r_index = [i for s in nonroot for i in range(starts[s], ends[s])]
        rpos = {i: r for r, i in enumerate(r_index)}
        self.r_index = torch.tensor(r_index, dtype=torch.long, device=device)
        order = [i for a, b in self.roots for i in range(a, b)] + r_index
        self.perm = None
        if order != list(range(self.n)):
            inv = torch.empty(self.n, dtype=torch.long)
            inv[torch.tensor(order, dtype=torch.long)] = torch.arange(self.n)
            self.perm = inv.to(device)

        rows: list[torch.Tensor] = []
        slot_ids: list[torch.Tensor] = []
        # Own-node causal blocks, batched per length bucket.
        self.own: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        buckets: dict[int, list[int]] = {}
        for s in nonroot:
            buckets.setdefault(_bucket(ends[s] - starts[s]), []).append(s)
        for nodes in buckets.values():
            length = max(ends[s] - starts[s] for s in nodes)
            idx = torch.zeros(len(nodes), length, dtype=torch.long)
            valid = torch.zeros(len(nodes), length, dtype=torch.bool)
            for g, s in enumerate(nodes):
                m = ends[s] - starts[s]
                idx[g, :m] = torch.arange(starts[s], ends[s])
                idx[g, m:] = starts[s]  # any real token; padded queries are dropped, padded keys masked
                valid[g, :m] = True
            causal = torch.ones(length, length, dtype=torch.bool).tril()
            blocked = ~(causal[None] & valid[:, None, :])  # [g, Lq, Lk], True = may not attend
            self.own.append((idx.to(device), valid.to(device), blocked[:, None, None].to(device)))
            rows.append(torch.tensor([rpos[int(i)] for i in idx[valid].tolist()], dtype=torch.long))
            slot_ids.append(torch.tensor([depth[s] for s in nodes for _ in range(ends[s] - starts[s])]))
        # Cross blocks: all strict descendants of node a attend to a's whole span.
        desc: list[list[int]] = [[] for _ in range(n_nodes)]
        for s in reversed(range(n_nodes)):  # children come after parents
            p = parents[s]
            if p >= 0:
                desc[p].extend(range(starts[s], ends[s]))
                desc[p].extend(desc[s])
        self.cross: list[tuple[int, int, torch.Tensor]] = []
        for a in range(n_nodes):
            if desc[a]:
                d_idx = sorted(desc[a])
                self.cross.append((starts[a], ends[a], torch.tensor(d_idx, dtype=torch.long, device=device)))
                rows.append(torch.tensor([rpos[i] for i in d_idx], dtype=torch.long))
                slot_ids.append(torch.full((len(d_idx),), depth[a], dtype=torch.long))
        self.rows = torch.cat(rows).to(device) if rows else torch.zeros(0, dtype=torch.long, device=device)
        self.slot_ids = (
            torch.cat(slot_ids).to(device) if slot_ids else torch.zeros(0, dtype=torch.long, device=device)
        )

    @staticmethod
    def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
        """Attention of q [g, Hkv, rep, Lq, d] to k, v [g, Hkv, Lk, d].

        ``mask`` is True where attention is *not* allowed, shaped [g, 1, 1, Lq, Lk] (broadcast over heads).
        Returns out [g, Hkv, rep, Lq, d] (v's dtype) and lse [g, Hkv, rep, Lq] in at least float32.
        """
        return _PartialAttention.apply(q, k, v, scale, mask)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer_idx: int, scale: float
    ) -> torch.Tensor:
        del layer_idx
        if q.shape[0] != 1 or q.shape[2] != self.n:
            raise KeyeInputError(
                f"tree attention expects one row of {self.n} tokens, got q of shape {list(q.shape)}"
            )
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[3]
        rep = hq // hkv
        q0, k0, v0 = q[0], k[0], v[0]  # [H, N, d]
        pieces = []
        for a, b in self.roots:
            pieces.append(
                F.scaled_dot_product_attention(
                    q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale, enable_gqa=rep > 1
                )[0]
            )
        if self.r_index.numel():
            outs, lses = [], []
            # Pieces are produced in the order of self.rows / self.slot_ids (chunks keep that order).
            for idx_all, valid_all, blocked_all in self.own:
                length = idx_all.shape[1]
                step = max(1, self.max_block_elems // (hq * length * length))
                for c in range(0, idx_all.shape[0], step):
                    idx, valid, blocked = (
                        idx_all[c : c + step],
                        valid_all[c : c + step],
                        blocked_all[c : c + step],
                    )
                    g = idx.shape[0]
                    qb = q0[:, idx].view(hkv, rep, g, length, d).permute(2, 0, 1, 3, 4)
                    kb = k0[:, idx].permute(1, 0, 2, 3)
                    vb = v0[:, idx].permute(1, 0, 2, 3)
                    o, lse = self._partial(qb, kb, vb, scale, blocked)
                    # -> [tokens, Hq, d] / [tokens, Hq] for the valid query rows
                    outs.append(o.reshape(g, hq, length, d).permute(0, 2, 1, 3)[valid])
                    lses.append(lse.reshape(g, hq, length).permute(0, 2, 1)[valid])
            for a, b, d_all in self.cross:
                step = max(1, self.max_block_elems // (hq * (b - a)))
                for c in range(0, d_all.numel(), step):
                    d_idx = d_all[c : c + step]
                    qd = q0[:, d_idx].view(1, hkv, rep, -1, d)
                    o, lse = self._partial(qd, k0[None, :, a:b], v0[None, :, a:b], scale, None)
                    outs.append(o.reshape(hq, -1, d).transpose(0, 1))
                    lses.append(lse.reshape(hq, -1).transpose(0, 1))
            r = self.r_index.numel()
            acc = torch.promote_types(q.dtype, torch.float32)
            lse_all = torch.full((r, self.slots, hq), float("-inf"), dtype=acc, device=q.device)
            lse_all = lse_all.index_put((self.rows, self.slot_ids), torch.cat(lses))
            out_all = q.new_zeros(r, self.slots, hq, d, dtype=acc)
            out_all = out_all.index_put((self.rows, self.slot_ids), torch.cat(outs).to(acc))
            w = torch.softmax(lse_all, dim=1)
            merged = (w[..., None] * out_all).sum(1).to(q.dtype)  # [R, Hq, d]
            pieces.append(merged.transpose(0, 1))
        out = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        if self.perm is not None:
            out = out.index_select(1, self.perm)
        return out[None]


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _PartialAttention(torch.autograd.Function):
    """Softmax attention that also returns the log-sum-exp of each query row, differentiably.

    Forward: s = scale·q kᵀ (at least float32, masked to -inf), lse = logsumexp(s), p = exp(s - lse), out = p v.
    Backward (flash-attention style, p recomputed instead of stored, so memory is O(out)):
    dv = pᵀ dout, dp = dout vᵀ, ds = p ⊙ (dp - rowsum(dout ⊙ out) + dlse), dq = scale·ds k,
    dk = scale·dsᵀ q. Written as one Function so that the large score matrix goes through a few
    in-place passes rather than a dozen autograd nodes.
    """

    @staticmethod
    def _scores(qf, k, scale, mask, shape5):
        s = _at_least_fp32(torch.matmul(qf, k.transpose(-1, -2))).mul_(scale)
        if mask is not None:
            s.view(shape5).masked_fill_(mask, float("-inf"))
        return s

    @staticmethod
    def forward(ctx, q, k, v, scale, mask):
        g, hkv, rep, lq, d = q.shape
        qf = q.reshape(g, hkv, rep * lq, d)
        shape5 = (g, hkv, rep, lq, k.shape[-2])
        s = _PartialAttention._scores(qf, k, scale, mask, shape5)
        lse = torch.logsumexp(s, dim=-1)
        p = s.sub_(lse[..., None]).exp_()
        out = torch.matmul(p.to(v.dtype), v)
        ctx.save_for_backward(qf, k, v, out, lse, mask)
        ctx.scale, ctx.shape5 = scale, shape5
        return out.view(g, hkv, rep, lq, d), lse.view(g, hkv, rep, lq)

    @staticmethod
    def backward(ctx, dout, dlse):
        qf, k, v, out, lse, mask = ctx.saved_tensors
        g, hkv, rep, lq, _ = ctx.shape5
        d = qf.shape[-1]
        p = _PartialAttention._scores(qf, k, ctx.scale, mask, ctx.shape5).sub_(lse[..., None]).exp_()
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.reshape(out.shape)
        dv = torch.matmul(p.to(v.dtype).transpose(-1, -2), dout)
        dp = _at_least_fp32(torch.matmul(dout, v.transpose(-1, -2)))
        row = (_at_least_fp32(dout) * _at_least_fp32(out)).sum(-1)
        if dlse is not None:
            row = row - dlse.reshape(row.shape)
        ds = dp.sub_(row[..., None]).mul_(p).mul_(ctx.scale).to(qf.dtype)
        dq = torch.matmul(ds, k).view(g, hkv, rep, lq, d)
        dk = torch.matmul(ds.transpose(-1, -2), qf)
        return dq, dk, dv, None, None
