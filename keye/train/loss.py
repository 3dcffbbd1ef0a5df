"""Next-token cross-entropy without the full-vocabulary logits: the SFT loss computed chunk by chunk.

The plain loss (``KeyeVL.forward`` with ``labels``) materialises ``lm_head(hidden)`` for every position, [L, V]
float32 logits plus the copies autograd keeps for the backward (about 2.25 MiB per token at Qwen3's vocabulary
of 151,936). Here only the positions that predict a target go through the head, ``chunk`` rows at a time: the
forward keeps one log-sum-exp per row, the backward recomputes each chunk's logits and forms their gradient in
place, so at most two [chunk, V] float32 buffers exist at once. Values and gradients equal the full computation
up to float32 rounding (``F.cross_entropy`` with the same ``label_smoothing``; tests/train/test_chunked_loss.py).

:class:`LossRequest` carries this into :meth:`keye.KeyeVL.forward` (``loss_request=``), as
:class:`keye.train.logprobs.LogprobRequest` does for the RL log-probs: under FSDP2 / ZeRO-3 the head is
gathered only while the forward runs, so the loss must be computed there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from keye.errors import KeyeInputError
from keye.train.logprobs import DEFAULT_CHUNK_TOKENS

IGNORE_INDEX = -100

DEFAULT_LOSS_CHUNK_TOKENS = DEFAULT_CHUNK_TOKENS
"""Target rows per chunk: one chunk's float32 logits at a 151,936-token vocabulary are ~300 MB; the forward holds
one such buffer, the backward two (the logits' gradient and its cast for the matmuls under autocast)."""


def _compute_dtype(device_type: str, weight: torch.Tensor) -> torch.dtype:
    # Under autocast the full path's lm_head runs in the autocast dtype; the recomputation in the backward (which
    # autograd runs outside autocast) must use the same one, or the recomputed softmax would not match the
    # forward's log-sum-exp.
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 logits of one chunk (``weight`` / ``bias`` already in the compute dtype); a fresh tensor."""
    z = F.linear(h.to(weight.dtype), weight, bias)
    return z.float() if z.dtype != torch.float32 else z


class _LinearCrossEntropy(torch.autograd.Function):
    """``sum_r w_r * CE(head(h_r), y_r)`` over row chunks with a hand-written backward.

    With label smoothing ``e`` a row's loss is ``(1 - e) * (lse - z_y) + e * (lse - mean(z))`` (what
    ``F.cross_entropy(label_smoothing=e)`` computes), so its logit gradient is ``p - (1 - e) onehot(y) - e / V``.
    The forward keeps the log-sum-exp of each row; the backward recomputes each chunk's logits ``z`` in place
    into that gradient, then ``dh = g W`` and ``dW += g^T h`` (summed in float32).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_weights, size, smoothing):
        n = hidden.shape[0]
        cdt = _compute_dtype(hidden.device.type, weight)
        w_c = weight.to(cdt)
        b_c = bias.to(cdt) if bias is not None else None
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, size):
            z = _chunk_logits(hidden[start : start + size], w_c, b_c)
            t = targets[start : start + size]
            l_c = z.logsumexp(dim=-1)
            lse[start : start + size] = l_c
            row = l_c - z.gather(1, t[:, None]).squeeze(1)
            if smoothing:
                row = (1.0 - smoothing) * row + smoothing * (l_c - z.mean(dim=-1))
            if row_weights is not None:
                row = row * row_weights[start : start + size]
            total += row.sum()
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, row_weights, lse)
        ctx.size, ctx.smoothing, ctx.cdt = size, smoothing, cdt
        return total

    @staticmethod
    def backward(ctx, g_total):
        hidden, weight, bias, targets, row_weights, lse = ctx.saved_tensors
        size, smoothing, cdt = ctx.size, ctx.smoothing, ctx.cdt
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # one float32 sum over the chunks, rounded once at the end (as one full-batch matmul would be)
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b and bias is not None else None
        w_c = weight.to(cdt)
        b_c = bias.to(cdt) if bias is not None else None
        vocab, scale = weight.shape[0], g_total.float()
        for start in range(0, hidden.shape[0], size):
            h = hidden[start : start + size]
            m = h.shape[0]
            g = _chunk_logits(h, w_c, b_c).sub_(lse[start : start + size, None]).exp_()  # p
            if smoothing:
                g.sub_(smoothing / vocab)
            rows = torch.arange(m, device=g.device)
            g.index_put_((rows, targets[start : start + size]), g.new_full((m,), -(1.0 - smoothing)), accumulate=True)
            if row_weights is not None:
                g.mul_((row_weights[start : start + size] * scale)[:, None])
            else:
                g.mul_(scale)
            g_c = g.to(cdt)
            del g
            if grad_h is not None:
                grad_h[start : start + m] = g_c @ w_c
            if grad_w is not None:
                if g_c.dtype == torch.float32:
                    grad_w.addmm_(g_c.t(), h.float())
                else:
                    grad_w += (g_c.t() @ h.to(cdt)).float()
            if grad_b is not None:
                grad_b += g_c.float().sum(dim=0)
            del g_c
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: torch.nn.Module,
    *,
    weights: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    chunk_size: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy ``sum_r w_r * CE(head(hidden[r]), targets[r])`` over the rows whose target is not
    ``ignore_index``, computed ``chunk_size`` rows at a time and recomputed in the backward.

    Equals ``F.cross_entropy(head(hidden).float(), targets, reduction="sum", ignore_index=ignore_index,
    label_smoothing=label_smoothing)`` (times the weights) up to float32 rounding, values and gradients with
    respect to ``hidden`` and the head's weight and bias, without ever holding more than ``chunk_size x vocab``
    logits. Rows that predict nothing never go through the head.

    Args:
        hidden: [N, D] hidden states (any float dtype; under autocast the head runs in the autocast dtype, as
            the full path's would, and the logits are taken in float32).
        targets: int [N] target ids, ``ignore_index`` where a row has no loss.
        head: the output projection, an ``nn.Linear`` (``lm_head``).
        weights: optional float [N] weight per row, >= 0 (a shared-prefix tree counts a distinct target once per
            answer whose target it is).
        label_smoothing: in [0, 1), as ``F.cross_entropy``'s.
        chunk_size: rows per chunk; None takes all target rows in one chunk.
    Returns:
        ``(loss, count)``: a float32 scalar (connected to ``hidden`` and the head even with no target, so that
        every rank's backward reaches the same parameters) and the number of target rows (int), or with
        ``weights`` the target rows' weights summed (float).
    Raises:
        KeyeInputError: shapes that do not match, a head that is not an ``nn.Linear``, a chunk size < 1 or a
            label smoothing outside [0, 1).
    """
    if chunk_size is not None and chunk_size < 1:
        raise KeyeInputError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if not 0.0 <= label_smoothing < 1.0:
        raise KeyeInputError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if not isinstance(head, torch.nn.Linear):
        raise KeyeInputError(f"the chunked loss needs an nn.Linear head, got {type(head).__name__}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise KeyeInputError(f"hidden must be [N, D] and targets [N], got {tuple(hidden.shape)} and "
                             f"{tuple(targets.shape)}")
    if weights is not None and weights.shape != targets.shape:
        raise KeyeInputError(f"weights must be [N] like targets, got {tuple(weights.shape)}")
    targets = targets.to(hidden.device).long()
    keep = (targets != ignore_index).nonzero().squeeze(1)
    vocab = head.weight.shape[0]
    if keep.numel() and (int(targets[keep].min()) < 0 or int(targets[keep].max()) >= vocab):
        raise KeyeInputError(f"targets must be token ids in [0, {vocab}) or {ignore_index}")
    h = hidden.index_select(0, keep)
    t = targets.index_select(0, keep)
    w = weights.to(device=hidden.device, dtype=torch.float32).index_select(0, keep) if weights is not None else None
    size = max(1, keep.numel()) if chunk_size is None else chunk_size
    loss = _LinearCrossEntropy.apply(h, head.weight, head.bias, t, w, size, float(label_smoothing))
    return loss, (float(w.sum()) if w is not None else int(keep.numel()))


@dataclass
class LossRequest:
    """What :meth:`keye.KeyeVL.forward` computes as its ``loss`` instead of the full-logits cross-entropy.

    Without ``index`` the loss is the ordinary next-token loss of the forward's ``labels`` (packed rows and
    ``loss_reduction`` as the full path). With ``index`` (int [K], flat positions into the hidden states viewed as
    [B * L, D]), ``targets`` (int [K]) and optional ``weights`` (float [K]) it is ``sum_k weights[k] * CE`` of
    those positions (a shared-prefix tree's distinct targets) and the forward needs no ``labels``. The forward
    returns no full ``logits`` (only the last ``logits_to_keep`` positions when asked). ``chunk_tokens``: rows per
    chunk (None: all target rows at once, still only those rows).
    """

    chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS
    index: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def compute(self, hidden: torch.Tensor, head: torch.nn.Module, shifted: torch.Tensor | None,
                label_smoothing: float = 0.0) -> tuple[torch.Tensor, int]:
        """``(summed loss, target count)`` from the forward's final hidden states [B, L, D] and its ``lm_head``;
        ``shifted``: int [B, L - 1], the forward's labels shifted (``keye.model.keye_vl.shifted_targets``: -100
        where no loss, and at the last token of each packed sample), None without labels."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.index is not None:
            if self.targets is None:
                raise KeyeInputError("a LossRequest with index needs targets")
            h = flat.index_select(0, self.index.to(flat.device))
            return chunked_cross_entropy(h, self.targets, head, weights=self.weights, label_smoothing=label_smoothing,
                                         chunk_size=self.chunk_tokens)
        if shifted is None:
            raise KeyeInputError("the forward got a loss_request without labels (or an explicit index)")
        # position t of row b predicts shifted[b, t]: only the rows with a target are gathered for the head
        rows, cols = (shifted != IGNORE_INDEX).nonzero(as_tuple=True)
        index = rows * hidden.shape[1] + cols
        h = flat.index_select(0, index.to(flat.device))
        return chunked_cross_entropy(h, shifted[rows, cols], head, label_smoothing=label_smoothing,
                                     chunk_size=self.chunk_tokens)


__all__ = ["DEFAULT_LOSS_CHUNK_TOKENS", "IGNORE_INDEX", "LossRequest", "chunked_cross_entropy"]
