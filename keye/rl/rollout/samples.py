"""The records that carry a rollout into training, and how they are (re)batched.

A rollout keeps, per prompt, the *exact* processor outputs it generated from (:class:`PromptInputs`: unpadded
``input_ids``, pixel rows, grids, ``second_per_grid_ts``); :func:`collate_samples` re-batches them (left-padded
prompts + right-padded responses) for the training forward, which therefore sees the same pixels and recomputes
the same 3-D positions as the generation did (training.md §8.10). :class:`RolloutEngine` is the interface every
engine implements (:mod:`keye.rl.rollout.engines`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from keye.errors import KeyeInputError
from keye.rl.rollout.masks import lengths_to_mask

_VISION_ROW_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


# ------------------------------------------------------------------------------------------------ records
@dataclass
class RLPrompt:
    """One RL question.

    ``id``: stable question id (replay pool key). ``messages``: the conversation (qwen-vl-utils form) up to
    the last user turn. ``reference`` / ``task``: what the reward checks against. ``mode``: thinking mode
    applied before processing (``"think"``, ``"no_think"``, ``"auto"`` or None = messages as given).
    ``extra``: per-sample reward extras (``choices``, ``instructions``, ...). ``response_prefix``: text forced at
    the start of every response (an explored AutoThink decision, :mod:`keye.rl.algorithms.autothink`): the engine
    decodes after it, and it is part of the sample (its tokens lead ``response_ids`` and are trained, its text
    leads ``text``, its ``rollout_logp`` is 0: the caller, not the model, chose it). ``max_new_tokens`` counts
    the sampled tokens only.
    """

    id: str
    messages: list[dict[str, Any]]
    reference: Any = None
    task: str | None = None
    mode: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    response_prefix: str | None = None


@dataclass
class PromptInputs:
    """The processor outputs of one prompt: ``input_ids`` int [L] (no padding) and its vision rows
    (``pixel_values`` [n, 3, p, p], ``image_grid_thw`` [k, 3], ``pixel_values_videos``, ``video_grid_thw``,
    ``second_per_grid_ts`` [v]); absent modalities are None."""

    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Number of prompt tokens."""
        return int(self.input_ids.shape[0])


@dataclass
class RolloutSample:
    """One response of a group.

    ``group``: index of its prompt in the rollout call (the group id of the advantage). ``response_ids``:
    int64 [n] generated tokens up to and including the first EOS (nothing after). ``finished``: ended
    with an EOS (False = cut at ``max_new_tokens``). ``source``: ``"rollout"`` or ``"replay"``.
    ``valid``: False for a missing replay slot (no tokens, excluded from advantages and loss).
    ``rollout_logp``: float32 [n] log-probs of the sampled tokens under the distribution the engine actually
    sampled from (tempered and top-k / top-p filtered), when the engine reports them (None otherwise, and for
    replayed samples): the behaviour policy of the truncated importance-sampling correction. ``reward`` /
    ``passed`` / ``advantage``: filled by scoring and :func:`keye.rl.algorithms.advantages.sample_advantages`;
    ``old_logp`` / ``ref_logp``: float32 [n] filled by :func:`keye.rl.algorithms.update.fill_logprobs` (behaviour and
    reference policy).
    """

    prompt: RLPrompt
    group: int
    inputs: PromptInputs
    response_ids: torch.Tensor
    text: str
    finished: bool
    source: str = "rollout"
    valid: bool = True
    rollout_logp: torch.Tensor | None = None
    reward: float | None = None
    passed: bool | None = None
    advantage: float | None = None
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Response tokens that enter the loss (0 for an invalid sample)."""
        return int(self.response_ids.numel()) if self.valid else 0


# ------------------------------------------------------------------------------------- splitting batches
def _rows_for_tokens(grids: torch.Tensor | None, n_tokens: int, start: int, merge: int, where: str) -> int:
    """How many consecutive grid rows from ``start`` account for ``n_tokens`` placeholder tokens."""
    end, got = start, 0
    while got < n_tokens:
        if grids is None or end >= grids.shape[0]:
            raise KeyeInputError(f"{where}: {n_tokens} placeholders but the grids run out after {got}")
        t, h, w = (int(v) for v in grids[end])
        got += t * h * w // (merge * merge)
        end += 1
    if got != n_tokens:
        raise KeyeInputError(f"{where}: {n_tokens} placeholders do not match whole grid rows ({got} tokens)")
    return end


def split_batch(batch: Mapping[str, torch.Tensor], image_token_id: int, video_token_id: int,
                merge_size: int = 2) -> list[PromptInputs]:
    """Split a processor batch (any padding side) into one :class:`PromptInputs` per row.

    Vision rows are assigned to batch rows in order by counting each row's ``<|image_pad|>`` /
    ``<|video_pad|>`` tokens (``t*h*w / merge_size**2`` per grid row), which is how the processor numbered
    them. Raises :class:`KeyeInputError` if the counts and grids disagree.
    """
    ids, att = batch["input_ids"], batch.get("attention_mask")
    out: list[PromptInputs] = []
    # per kind: its placeholder id, grid / pixel keys, and the next grid row and pixel row to hand out
    kinds = [[image_token_id, "image_grid_thw", "pixel_values", "images", 0, 0],
             [video_token_id, "video_grid_thw", "pixel_values_videos", "videos", 0, 0]]
    secs = batch.get("second_per_grid_ts")
    for b in range(ids.shape[0]):
        row = ids[b] if att is None else ids[b][att[b].bool()]
        item = PromptInputs(row.clone())
        for kind in kinds:
            token, grid_key, pix_key, what, at_row, at_px = kind
            n = int((row == token).sum())
            if not n:
                continue
            end = _rows_for_tokens(batch.get(grid_key), n, at_row, merge_size, f"row {b} {what}")
            grids = batch[grid_key][at_row:end]
            n_px = int(grids.prod(dim=1).sum())
            setattr(item, pix_key, batch[pix_key][at_px : at_px + n_px])
            setattr(item, grid_key, grids)
            if grid_key == "video_grid_thw" and secs is not None:
                item.second_per_grid_ts = secs[at_row:end]
            kind[4], kind[5] = end, at_px + n_px
        out.append(item)
    return out


def collate_prompts(prompts: Sequence[PromptInputs], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad prompts into a generation batch: ``input_ids`` / ``attention_mask`` int64 [B, L] plus the
    vision rows concatenated in row order (the order ``get_rope_index`` consumes them)."""
    if not prompts:
        raise KeyeInputError("cannot collate an empty list of prompts")
    length = max(p.length for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    att = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, length - p.length :] = p.input_ids
        att[i, length - p.length :] = 1
    out: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": att}
    for key in _VISION_ROW_KEYS:
        parts = [getattr(p, key) for p in prompts if getattr(p, key) is not None]
        if parts:
            out[key] = torch.cat(parts)
    return out


def collate_samples(
    samples: Sequence[RolloutSample], pad_id: int, exclude_ids: Sequence[int] = ()
) -> dict[str, torch.Tensor]:
    """Batch samples for the training forward (:func:`keye.train.logprobs.token_logprobs`).

    Returns the :func:`collate_prompts` keys plus ``responses`` int64 [B, N] (right-padded with ``pad_id``),
    ``response_attention`` bool [B, N] (real tokens), ``response_mask`` bool [B, N] (loss mask: real tokens
    minus ``exclude_ids``; all False for invalid samples), ``group_ids`` int64 [B], ``valid`` bool [B],
    ``is_replay`` bool [B], ``rollout_logp`` float32 [B, N] (the engine's log-probs; 0 on padding and in rows
    without them) with ``has_rollout_logp`` bool [B] (False for replayed, invalid or engine-unscored samples:
    :func:`keye.rl.algorithms.losses.policy_loss` gives those rows importance weight 1); when every sample has them,
    ``advantages`` float32 [B] and ``old_logp`` / ``ref_logp`` float32 [B, N] (0 on padding).

    Raises:
        KeyeInputError: a sample's ``rollout_logp`` is shorter than its response.
    """
    batch = collate_prompts([s.inputs for s in samples], pad_id)
    n = max((int(s.response_ids.numel()) for s in samples), default=0)
    resp = torch.full((len(samples), n), pad_id, dtype=torch.long)
    lengths = torch.zeros(len(samples), dtype=torch.long)
    for i, s in enumerate(samples):
        k = int(s.response_ids.numel()) if s.valid else 0
        resp[i, :k] = s.response_ids[:k]
        lengths[i] = k
    attn = lengths_to_mask(lengths, n)
    mask = attn.clone()
    if exclude_ids:
        mask &= ~torch.isin(resp, torch.tensor(list(exclude_ids), dtype=torch.long))
    batch.update(
        responses=resp,
        response_attention=attn,
        response_mask=mask,
        group_ids=torch.tensor([s.group for s in samples], dtype=torch.long),
        valid=torch.tensor([s.valid for s in samples], dtype=torch.bool),
        is_replay=torch.tensor([s.source == "replay" for s in samples], dtype=torch.bool),
    )
    rollout = torch.zeros(len(samples), n, dtype=torch.float32)
    has_rollout = torch.zeros(len(samples), dtype=torch.bool)
    for i, s in enumerate(samples):
        if s.rollout_logp is None or not s.valid or s.source == "replay":
            continue
        k = int(lengths[i])
        if s.rollout_logp.numel() < k:
            raise KeyeInputError(f"sample {i} (prompt {s.prompt.id!r}): rollout_logp has {s.rollout_logp.numel()} "
                                 f"values for {k} response tokens")
        rollout[i, :k] = s.rollout_logp[:k].float()
        has_rollout[i] = True
    batch.update(rollout_logp=rollout, has_rollout_logp=has_rollout)
    if all(s.advantage is not None for s in samples):
        batch["advantages"] = torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32)
    for key in ("old_logp", "ref_logp"):
        if all(getattr(s, key) is not None or not s.valid for s in samples):
            values = torch.zeros(len(samples), n, dtype=torch.float32)
            for i, s in enumerate(samples):
                k = int(lengths[i])
                if k:
                    values[i, :k] = getattr(s, key)[:k].float()
            batch[key] = values
    return batch


# ---------------------------------------------------------------------------------------------- engines
@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that samples ``n`` responses for each prompt.

    ``generate(prompts, n)`` returns ``len(prompts) * n`` :class:`RolloutSample` ordered prompt by prompt
    (sample ``j`` of prompt ``i`` at index ``i * n + j``, ``group == i``).
    """

    def generate(self, prompts: Sequence[RLPrompt], n: int) -> list[RolloutSample]:
        """``n`` samples per prompt, prompt by prompt."""
        ...


def prefix_ids(processor: Any, prompt: RLPrompt) -> torch.Tensor | None:
    """The token ids (int64 [k]) of ``prompt.response_prefix`` under ``processor``'s tokenizer, or None.

    Raises:
        KeyeInputError: a prefix that tokenizes to nothing (naming the prompt).
    """
    if prompt.response_prefix is None:
        return None
    ids = processor.tokenizer(prompt.response_prefix, add_special_tokens=False)["input_ids"]
    if not ids:
        raise KeyeInputError(f"prompt {prompt.id!r}: response_prefix {prompt.response_prefix!r} has no tokens")
    return torch.tensor(ids, dtype=torch.long)


def group_size_check(samples: Sequence[RolloutSample], n_prompts: int, n: int) -> None:
    """Raise :class:`KeyeInputError` unless ``samples`` hold exactly ``n`` samples per group 0..n_prompts-1."""
    counts = [0] * n_prompts
    for s in samples:
        if not 0 <= s.group < n_prompts:
            raise KeyeInputError(f"sample group {s.group} is outside 0..{n_prompts - 1}")
        counts[s.group] += 1
    bad = [i for i, c in enumerate(counts) if c != n]
    if bad:
        raise KeyeInputError(f"groups {bad[:5]} do not have {n} samples (counts {[counts[i] for i in bad[:5]]})")
