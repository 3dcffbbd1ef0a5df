"""Response masks for RL losses (training.md §8.6).

Layout of :meth:`keye.KeyeVL.generate` output: ``[B, L + N]`` = the left-padded prompt (``L`` columns,
the processor's ``input_ids``) followed by ``N`` generated columns; a row that produced an EOS holds
``pad_token_id`` in every later column. The loss covers response tokens only: never the prompt (and so
never its image/video placeholders), never padding, always the first EOS, nothing after it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from keye.errors import KeyeInputError


def _as_ids(ids: int | Iterable[int] | None) -> list[int]:
    if ids is None:
        return []
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def split_response(sequences: torch.Tensor, prompt: int | torch.Tensor) -> torch.Tensor:
    """The generated columns ``sequences[:, L:]`` where ``L`` is an int or ``attention_mask.shape[1]``."""
    prompt_len = prompt if isinstance(prompt, int) else int(prompt.shape[1])
    if sequences.dim() != 2 or not 0 <= prompt_len <= sequences.shape[1]:
        raise KeyeInputError(
            f"sequences must be [B, L + N] with L = {prompt_len} prompt columns, got {tuple(sequences.shape)}"
        )
    return sequences[:, prompt_len:]


def response_lengths(responses: torch.Tensor, eos_ids: int | Iterable[int], pad_id: int | None = None) -> torch.Tensor:
    """Number of real tokens of each response row, the first EOS included.

    Args:
        responses: int [B, N] generated tokens (right-padded).
        eos_ids: one or several EOS ids; a row stops at the first of any of them.
        pad_id: for a row *without* EOS (truncated at ``max_new_tokens`` and then right-padded when
            responses of different lengths were stacked) trailing ``pad_id`` tokens are padding. Pad ids
            before the last non-pad token, or before an EOS, are real sampled tokens and count.
    Returns:
        int64 [B] lengths in [0, N].
    """
    if responses.dim() != 2:
        raise KeyeInputError(f"responses must be [B, N], got {tuple(responses.shape)}")
    b, n = responses.shape
    cols = torch.arange(n, device=responses.device).expand(b, n)
    eos = torch.tensor(_as_ids(eos_ids), dtype=responses.dtype, device=responses.device)
    is_eos = torch.isin(responses, eos) if eos.numel() else torch.zeros_like(responses, dtype=torch.bool)
    big = torch.full_like(cols, n)
    first_eos = torch.where(is_eos, cols, big).min(dim=1).values
    if pad_id is None:
        no_eos_len = torch.full((b,), n, dtype=torch.long, device=responses.device)
    else:
        not_pad = responses != pad_id
        last = torch.where(not_pad, cols, torch.full_like(cols, -1)).max(dim=1).values
        no_eos_len = last + 1
    return torch.where(first_eos < n, first_eos + 1, no_eos_len).long()


def response_mask(
    sequences: torch.Tensor,
    prompt: int | torch.Tensor,
    eos_ids: int | Iterable[int],
    pad_id: int | None = None,
    exclude_ids: Iterable[int] = (),
) -> torch.Tensor:
    """Loss mask over the generated columns of ``generate`` output.

    Args:
        sequences: int [B, L + N] from ``model.generate(**batch, ...)``.
        prompt: the prompt length ``L`` or the prompt ``attention_mask`` [B, L].
        eos_ids / pad_id: see :func:`response_lengths`.
        exclude_ids: token ids never trained on even inside the response (e.g. ``<|image_pad|>`` and
            ``<|video_pad|>`` if a policy ever emits them: their embeddings are overwritten by vision
            features in a forward that carries pixels).
    Returns:
        bool [B, N]: True on response tokens up to and including the first EOS.
    """
    responses = split_response(sequences, prompt)
    lengths = response_lengths(responses, eos_ids, pad_id)
    mask = torch.arange(responses.shape[1], device=responses.device)[None, :] < lengths[:, None]
    excl = _as_ids(exclude_ids)
    if excl:
        mask &= ~torch.isin(responses, torch.tensor(excl, dtype=responses.dtype, device=responses.device))
    return mask


def lengths_to_mask(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """bool [B, n] with ``mask[b, t] = t < lengths[b]`` (attention mask of right-padded responses)."""
    return torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]
