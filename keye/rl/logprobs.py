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


def _chunk_stats(h: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias, temperature: float, entropy: bool):
    logits = torch.nn.functional.linear(h, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = logits.logsumexp(dim=-1)
    logp = logits.gather(-1, labels[:, None]).squeeze(-1) - lse
    if not entropy:
        return logp, torch.zeros_like(logp)
    probs = (logits - lse[:, None]).exp()
    return logp, lse - (probs * logits).sum(dim=-1)


def _stray_placeholders(core, responses: torch.Tensor, resp_att: torch.Tensor) -> torch.Tensor | None:
    """bool [B, N] of attended response tokens that are image/video placeholder ids, or None if there are none."""
    ids = [getattr(core.config, k, None) for k in ("image_token_id", "video_token_id")]
    ids = torch.tensor([i for i in ids if i is not None], dtype=responses.dtype, device=responses.device)
    if not ids.numel():
        return None
    stray = torch.isin(responses, ids) & resp_att.bool()
    return stray if bool(stray.any()) else None


def _text_placeholder_inputs(core, ids, att, prompt_len, stray, vision) -> dict:
    """Forward inputs for responses that contain sampled ``<|image_pad|>`` / ``<|video_pad|>`` ids.

    During decoding such a token is an ordinary text token: its own embedding, the next text position.
    The full-sequence forward would instead count it as a vision placeholder (feature scatter and 3-D
    positions). So positions are computed with those ids masked to a text id, and the embeddings are the
    prompt's (with vision features) plus the raw token embeddings of the response, exactly as decoded.
    """
    text_ids = ids.clone()
    text_ids[:, prompt_len:][stray] = 0  # any non-placeholder id: only "is it vision" matters here
    vis = {k: v for k, v in vision.items()}
    pos, _ = core.get_rope_index(text_ids, vis.get("image_grid_thw"), vis.get("video_grid_thw"),
                                 vis.get("second_per_grid_ts"), att)
    prompt_emb = core.embed(text_ids[:, :prompt_len], vis.get("pixel_values"), vis.get("image_grid_thw"),
                            vis.get("pixel_values_videos"), vis.get("video_grid_thw"))
    resp_emb = core.model.embed_tokens(ids[:, prompt_len:])
    return dict(input_ids=ids, attention_mask=att, position_ids=pos,
                inputs_embeds=torch.cat([prompt_emb, resp_emb], dim=1))


def token_logprobs(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    responses: torch.Tensor,
    response_attention: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
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
        chunk_size: response positions per log-softmax chunk (memory ~ chunk * vocab floats; with
            gradients each chunk is recomputed in backward). None takes the forward's logits directly
            (needed when ``lm_head`` cannot be called outside the forward, e.g. FSDP-sharded).
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
        fwd = _text_placeholder_inputs(core, ids, att, prompt_len, stray, vision)
    if chunk_size is None:
        out = model(logits_to_keep=n + 1, **fwd)
        logits = out.logits[:, :-1].float()
        if temperature != 1.0:
            logits = logits / temperature
        lse = logits.logsumexp(dim=-1)
        logp = logits.gather(-1, labels[..., None]).squeeze(-1) - lse
        ent = None
        if with_entropy:
            ent = lse - (logits.softmax(dim=-1) * logits).sum(dim=-1)
    else:
        if chunk_size < 1:
            raise KeyeInputError(f"chunk_size must be >= 1 or None, got {chunk_size}")
        out = model(logits_to_keep=1, output_hidden_states=True, **fwd)
        hidden = out.hidden_states[:, prompt_len - 1 : prompt_len + n - 1].reshape(b * n, -1)
        flat_labels = labels.reshape(-1)
        weight, bias = core.lm_head.weight, core.lm_head.bias
        pieces_lp, pieces_ent = [], []
        for s in range(0, b * n, chunk_size):
            h, y = hidden[s : s + chunk_size], flat_labels[s : s + chunk_size]
            if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
                lp, en = checkpoint(_chunk_stats, h, y, weight, bias, temperature, with_entropy, use_reentrant=False)
            else:
                lp, en = _chunk_stats(h, y, weight, bias, temperature, with_entropy)
            pieces_lp.append(lp)
            pieces_ent.append(en)
        logp = torch.cat(pieces_lp).view(b, n)
        ent = torch.cat(pieces_ent).view(b, n) if with_entropy else None
    keep = resp_att.to(device).bool()
    logp = torch.where(keep, logp, torch.zeros_like(logp))
    if ent is not None:
        ent = torch.where(keep, ent, torch.zeros_like(ent))
    return LogprobOutput(logp, ent, out.position_ids)
