"""Per-token log-probabilities (and entropies) of response tokens with one forward over prompt + response.

The forward receives exactly the processor outputs of the rollout (``pixel_values``, grids,
``second_per_grid_ts``) and the full sequence with its attention mask, so ``get_rope_index`` recomputes
the rollout's 3-D positions (training.md §8.10): the left-padded prompt keeps its mask, response tokens up to
the first EOS are attended, padding after it is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from keye.errors import KeyeInputError

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
_PIXEL_KEYS = ("pixel_values", "pixel_values_videos")


@dataclass
class LogprobOutput:
    """``logp`` float32 [B, N]: log p(response token) (0 where the response attention is 0);
    ``entropy`` float32 [B, N] or None; ``position_ids`` int [3, B, L + N] used by the forward."""

    logp: torch.Tensor
    entropy: torch.Tensor | None
    position_ids: torch.Tensor | None = None


def model_inputs(batch: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The vision inputs of ``batch`` moved to ``device``; pixels cast to the model ``dtype``.

    ``second_per_grid_ts`` stays float32 (it feeds the float32 position maths) and grids stay int.
    """
    out = {}
    for key in VISION_KEYS:
        v = batch.get(key)
        if v is None:
            continue
        out[key] = v.to(device=device, dtype=dtype) if key in _PIXEL_KEYS else v.to(device)
    return out


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # DDP / torch.compile wrappers keep the real module here; lm_head lives on it.
    while hasattr(model, "module"):
        model = model.module
    return getattr(model, "_orig_mod", model)


DEFAULT_CHUNK_TOKENS = 512
"""Predicting positions per log-softmax chunk: at a 151,936-token vocabulary one chunk's fp32 logits are
~300 MB, and a few such buffers are alive at once (logits, probabilities, their gradient)."""


def _chunk_stats(h: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, head, temperature: float,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(h).float()
    if temperature != 1.0:
        logits = logits / temperature
    logsm = logits.log_softmax(dim=-1)
    logp = logsm[rows, labels]
    if not with_entropy:
        return logp, logsm.new_zeros(logsm.shape[0])
    # -sum p log p rather than lse - sum p z: no cancellation between two large terms
    return logp, -(logsm.exp() * logsm).sum(dim=-1)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    z = F.linear(h, weight, bias).float()  # a fresh tensor, so the in-place ops below touch nothing else
    return z.div_(temperature) if temperature != 1.0 else z


class _LinearLogprobs(torch.autograd.Function):
    """``lm_head`` + log-softmax + entropy over row chunks with a hand-written backward.

    Per chunk the forward keeps only the log-sum-exp and entropy of each row; the backward recomputes the
    chunk's logits ``z`` (``p = softmax(z)``, ``H = -sum p log p``) and forms the logit gradient in place:
    ``d logp[y] / dz = onehot(y) - p`` and ``dH / dz = -p * (log p + H)``, divided by the temperature, then
    accumulates ``dW += g^T h`` into one buffer. At most two [chunk, vocab] float32 buffers are alive.
    Inputs: ``s_rows`` / ``s_labels`` sorted by row, ``bounds[c]:bounds[c + 1]`` the pairs of chunk c.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, s_rows, s_labels, bounds, size, temperature, with_entropy):
        m = hidden.shape[0]
        lse = torch.empty(m, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(m, dtype=torch.float32, device=hidden.device)
        logp = torch.empty(s_rows.numel(), dtype=torch.float32, device=hidden.device)
        for c, start in enumerate(range(0, m, size)):
            z = _logits(hidden[start : start + size], weight, bias, temperature)
            lse[start : start + size] = z.logsumexp(dim=-1)
            z.sub_(lse[start : start + size, None])  # z now holds log p
            lo, hi = bounds[c], bounds[c + 1]
            logp[lo:hi] = z[s_rows[lo:hi] - start, s_labels[lo:hi]]
            if with_entropy:
                ent[start : start + size] = -z.exp().mul_(z).sum(dim=-1)
            del z
        ctx.save_for_backward(hidden, weight, bias, s_rows, s_labels, lse, ent)
        ctx.bounds, ctx.size, ctx.temperature, ctx.with_entropy = bounds, size, temperature, with_entropy
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, s_rows, s_labels, lse, ent = ctx.saved_tensors
        size, temperature = ctx.size, ctx.temperature
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # low-precision weights: sum the chunks' weight gradients in float32 (one rounding at the end, as a
        # single full-batch matmul would have)
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        if g_lp is None:
            g_lp = lse.new_zeros(s_rows.numel())
        for c, start in enumerate(range(0, hidden.shape[0], size)):
            h = hidden[start : start + size]
            n = h.shape[0]
            g = _logits(h, weight, bias, temperature).sub_(lse[start : start + size, None])  # log p
            p = g.exp()
            if ctx.with_entropy and g_ent is not None:
                g.add_(ent[start : start + size, None]).mul_(p).mul_(-g_ent[start : start + size, None])
            else:
                g.zero_()
            lo, hi = ctx.bounds[c], ctx.bounds[c + 1]
            local, gl = s_rows[lo:hi] - start, g_lp[lo:hi].float()
            per_row = torch.zeros(n, dtype=torch.float32, device=g.device).index_add_(0, local, gl)
            g.sub_(p.mul_(per_row[:, None]))
            del p
            g.index_put_((local, s_labels[lo:hi]), gl, accumulate=True)
            if temperature != 1.0:
                g.div_(temperature)
            g = g.to(weight.dtype)
            if grad_h is not None:
                grad_h[start : start + n] = g @ weight
            if grad_w is not None and weight.dtype == torch.float32:
                grad_w.addmm_(g.t(), h)
            elif grad_w is not None:
                grad_w += (g.t() @ h).float()
            if grad_b is not None:
                grad_b += g.sum(dim=0)
            del g
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    labels: torch.Tensor,
    head: torch.nn.Module,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``log softmax(head(hidden[rows[k]]) / T)[labels[k]]`` and per-row entropies, computed
    ``chunk_size`` hidden rows at a time so that no ``[rows, vocab]`` tensor of the whole input exists.

    Nothing of vocabulary width is kept for the backward: it recomputes each chunk's logits. For an
    ``nn.Linear`` head this is one fused autograd function (:class:`_LinearLogprobs`: two [chunk, vocab]
    buffers at a time, the weight gradient accumulated in place); any other head runs each chunk under
    :func:`torch.utils.checkpoint.checkpoint`. Values and gradients equal the full computation up to
    float32 rounding (tested to 1e-5).

    Args:
        hidden: [M, D] predicting positions (any dtype; logits are taken in float32 after ``head``).
        rows: int [K] row of ``hidden`` predicting target k (rows may repeat, as in a prefix tree where
            one token predicts several children, or be absent). labels: int [K] target token ids.
        head: the output projection (``lm_head``), called on [c, D] slices.
        chunk_size: rows of ``hidden`` per chunk; None computes all rows at once.
    Returns:
        ``(logp, entropy)``: float32 [K] in the order of ``rows``; float32 [M] entropy of each row's tempered
        distribution, or None without ``with_entropy``.
    """
    if chunk_size is not None and chunk_size < 1:
        raise KeyeInputError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if rows.dim() != 1 or rows.shape != labels.shape:
        raise KeyeInputError(f"rows and labels must both be [K], got {tuple(rows.shape)} and {tuple(labels.shape)}")
    m = hidden.shape[0]
    rows, labels = rows.to(hidden.device).long(), labels.to(hidden.device).long()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= m):
        raise KeyeInputError(f"rows must index the {m} hidden rows, got values in [{int(rows.min())}, {int(rows.max())}]")
    if m == 0:  # no predicting rows (so no targets either)
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    size = m if chunk_size is None else chunk_size
    # pairs sorted by row, so each chunk's targets are one contiguous slice
    order = torch.argsort(rows, stable=True)
    s_rows, s_labels = rows[order], labels[order]
    bounds = torch.searchsorted(s_rows, torch.arange(0, m + size, size, device=rows.device).clamp(max=m)).tolist()
    if type(head) is torch.nn.Linear:
        logp, ent = _LinearLogprobs.apply(hidden, head.weight, head.bias, s_rows, s_labels, bounds, size,
                                          float(temperature), with_entropy)
        return logp[torch.argsort(order)], (ent if with_entropy else None)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    pieces_lp, pieces_ent = [], []
    for c, h in enumerate(hidden.split(size)):
        lo, hi = bounds[c], bounds[c + 1]
        local = s_rows[lo:hi] - c * size
        args = (h, local, s_labels[lo:hi], head, temperature, with_entropy)
        lp, ent = checkpoint(_chunk_stats, *args, use_reentrant=False) if grad else _chunk_stats(*args)
        pieces_lp.append(lp)
        pieces_ent.append(ent)
    logp = torch.cat(pieces_lp)[torch.argsort(order)]
    return logp, (torch.cat(pieces_ent) if with_entropy else None)


@dataclass
class LogprobRequest:
    """What :meth:`keye.KeyeVL.forward` should score instead of returning logits.

    ``index`` int [U]: flat positions into the forward's hidden states viewed as [B * L, D] (the predicting
    positions); ``rows`` int [K]: which of those U rows predicts target k; ``labels`` int [K]: target ids.
    The forward returns ``token_logp`` float32 [K] and ``token_entropy`` float32 [U] (with ``with_entropy``).
    Computing this inside the forward matters for sharded models: FSDP2 and ZeRO-3 gather ``lm_head`` only
    while the forward runs.
    """

    index: torch.Tensor
    rows: torch.Tensor
    labels: torch.Tensor
    temperature: float = 1.0
    chunk_size: int | None = DEFAULT_CHUNK_TOKENS
    with_entropy: bool = False

    def compute(self, hidden: torch.Tensor, head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs / entropies from the forward's final hidden states [B, L, D] and its ``lm_head``."""
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.index.to(hidden.device))
        return chunked_token_logprobs(h, self.rows, self.labels, head, temperature=self.temperature,
                                      with_entropy=self.with_entropy, chunk_size=self.chunk_size)


def _stray_placeholders(core, responses: torch.Tensor, resp_att: torch.Tensor) -> torch.Tensor | None:
    """bool [B, N] of attended response tokens that are image/video placeholder ids, or None if there are none."""
    ids = [getattr(core.config, k, None) for k in ("image_token_id", "video_token_id")]
    ids = torch.tensor([i for i in ids if i is not None], dtype=responses.dtype, device=responses.device)
    if not ids.numel():
        return None
    stray = torch.isin(responses, ids) & resp_att.bool()
    return stray if bool(stray.any()) else None


def token_logprobs(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    responses: torch.Tensor,
    response_attention: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
) -> LogprobOutput:
    """Log-probs of ``responses`` given the prompt ``batch``, one forward, gradients kept if enabled.

    Args:
        model: a :class:`keye.KeyeVL` (or a DDP wrapper of one).
        batch: the *prompt* batch: ``input_ids`` / ``attention_mask`` int [B, L] (left-padded, as the
            rollout used them) plus the vision keys of the processor output.
        responses: int [B, N] response tokens, right-padded.
        response_attention: bool/int [B, N], 1 on real response tokens (first EOS included); default all.
        temperature: the sampling temperature of the rollout (logits are divided by it, as the
            sampling distribution was).
        chunk_size: attended response positions per log-softmax chunk (memory ~ chunk * vocab floats; with
            gradients each chunk is recomputed in backward, see :func:`chunked_token_logprobs`). None takes
            the forward's full logits (needed when ``lm_head`` cannot be called outside the forward, e.g.
            FSDP-sharded; materialises [B, N, vocab] float32).
        with_entropy: also return per-token entropy of the tempered distribution.
    Returns:
        :class:`LogprobOutput` (values at unattended response positions are 0).

    A response that contains sampled ``<|image_pad|>`` / ``<|video_pad|>`` ids is scored as it was decoded
    (those tokens as text); keep them out of the loss with ``exclude_ids``.
    """
    input_ids = batch["input_ids"]
    prompt_mask = batch.get("attention_mask")
    if prompt_mask is None:
        prompt_mask = torch.ones_like(input_ids)
    if responses.dim() != 2 or responses.shape[0] != input_ids.shape[0]:
        raise KeyeInputError(
            f"responses must be [B={input_ids.shape[0]}, N], got {tuple(responses.shape)}"
        )
    if temperature <= 0:
        raise KeyeInputError(f"temperature must be > 0, got {temperature}")
    b, n = responses.shape
    resp_att = torch.ones_like(responses) if response_attention is None else response_attention.to(prompt_mask.dtype)
    if resp_att.shape != responses.shape:
        raise KeyeInputError(f"response_attention has shape {tuple(resp_att.shape)}, responses {tuple(responses.shape)}")
    core = _unwrap(model)
    device = core.lm_head.weight.device
    ids = torch.cat([input_ids.to(device), responses.to(device=device, dtype=input_ids.dtype)], dim=1)
    att = torch.cat([prompt_mask.to(device), resp_att.to(device)], dim=1)
    prompt_len = input_ids.shape[1]
    if prompt_len == 0:
        raise KeyeInputError("the prompt batch is empty (L = 0): the first response token has no context")
    vision = model_inputs(batch, device, core.lm_head.weight.dtype)
    if n == 0:
        z = torch.zeros(b, 0, device=device)
        return LogprobOutput(z, z.clone() if with_entropy else None, None)
    labels = responses.to(device).long()
    fwd: dict = dict(input_ids=ids, attention_mask=att, **vision)
    stray = _stray_placeholders(core, responses.to(device), resp_att.to(device))
    if stray is not None:
        # sampled placeholder ids were text during decoding: own embedding, text positions
        fwd["text_token_mask"] = torch.cat([torch.zeros_like(input_ids, dtype=torch.bool, device=device), stray], 1)
    keep = resp_att.to(device).bool()
    if chunk_size is None:
        out = model(logits_to_keep=n + 1, **fwd)
        logits = out.logits[:, :-1].float()
        if temperature != 1.0:
            logits = logits / temperature
        logsm = logits.log_softmax(dim=-1)
        logp = logsm.gather(-1, labels[..., None]).squeeze(-1)
        ent = -(logsm.exp() * logsm).sum(dim=-1) if with_entropy else None
    else:
        if chunk_size < 1:
            raise KeyeInputError(f"chunk_size must be >= 1 or None, got {chunk_size}")
        # only attended response positions: padding after the EOS costs no vocabulary-wide work
        total = ids.shape[1]
        bi, ji = keep.nonzero(as_tuple=True)
        index = bi * total + (prompt_len - 1) + ji
        request = LogprobRequest(index, torch.arange(index.numel(), device=device), labels[keep], temperature,
                                 chunk_size, with_entropy)
        out = model(logprob_request=request, **fwd)
        lp, en = out.token_logp, out.token_entropy
        logp = torch.zeros(b, n, device=device, dtype=lp.dtype).masked_scatter(keep, lp)
        ent = torch.zeros(b, n, device=device, dtype=lp.dtype).masked_scatter(keep, en) if with_entropy else None
    logp = torch.where(keep, logp, torch.zeros_like(logp))
    if ent is not None:
        ent = torch.where(keep, ent, torch.zeros_like(ent))
    return LogprobOutput(logp, ent, out.position_ids)
