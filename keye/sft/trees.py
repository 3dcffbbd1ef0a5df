"""Multi-answer SFT rows as shared-prefix trees (``train.tree``): the loader's processor and cost model for
them, and the loss of a micro-batch computed as ONE forest forward (or the unshared reference layout).

A manifest row with an ``answers`` list is trained as if each answer were its own row; the tree computes the
prompt (and its media) once. :func:`target_tokens` counts every answer's own tokens, so the token-mean loss
does not depend on the layout (training.md §4).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from keye.errors import KeyeInputError
from keye.sft.inputs import IGNORE_INDEX, VISION_KEYS
from keye.train.loss import DEFAULT_LOSS_CHUNK_TOKENS, LossRequest


@contextmanager
def _media_once(processor: Any):
    """While active, ``processor`` decodes each image / video item once and reuses it.

    Every answer of a multi-answer row is rendered by the processor as an ordinary conversation, so its
    tokens are exactly those of the expanded row; the conversations share the prompt's media items, in the
    same order, and decoding is deterministic, so the per-item results are memoised by (item number, item)
    for the duration of one row. A processor without these per-item steps simply decodes once per answer:
    slower, equally correct.
    """
    names = ("_process_image", "_process_video")
    own = getattr(processor, "__dict__", None)
    if own is None or any(n in own for n in names) or not all(callable(getattr(processor, n, None)) for n in names):
        yield
        return
    for name in names:
        method, cache = getattr(processor, name), {}

        def memo(content, row, index, _method=method, _cache=cache):
            key = (index, repr(sorted(content.items())))
            if key not in _cache:
                _cache[key] = _method(content, row, index)
            return _cache[key]

        setattr(processor, name, memo)  # instance attribute shadows the method; removed below
    try:
        yield
    finally:
        for name in names:
            delattr(processor, name)


class TreeSampleProcessor:
    """The processor the SFT loader uses when a manifest has multi-answer rows (or ``train.tree=on``).

    Called like :class:`~keye.processing.processor.KeyeProcessor` with one conversation per call (as the
    loader does). Every row becomes one sample carrying its prefix tree under ``"tree"`` (a one-item
    list, so the collate functions join them into a per-sample list):

    * an ordinary row: the processor's output unchanged plus its one-branch tree (so the micro-batch can
      still take the packed path as is);
    * a multi-answer row: each answer is processed as its own conversation (media decoded once), and the
      B token sequences with their label masks go to :func:`keye.train.tree.build_tree`: ``input_ids`` is
      the serialised tree [1, N] (prompt once), ``labels`` are all -100 (the targets live in the tree, and
      only :func:`tree_loss` / :func:`unshared_batch` read them), the pixel tensors are the prompt's, once.

    Tree vision inputs hold the grids (and preview ``second_per_grid_ts``) but no pixels: the pixels stay in
    the sample's top-level tensors, which the collate functions concatenate in sample order.

    Args:
        processor: the wrapped :class:`~keye.processing.processor.KeyeProcessor` (other attributes, e.g.
            ``tokenizer``, are delegated to it).
        config: the model's :class:`~keye.KeyeVLConfig` (token ids, merge size, variant: tree positions).
    """

    def __init__(self, processor: Any, config: Any):
        self.processor = processor
        self.config = config

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("processor", "config"):  # unpickling: no recursion
            raise AttributeError(name)
        return getattr(self.processor, name)

    def __call__(self, messages: list, return_tensors: str | None = "pt", for_training: bool = True,
                 **kwargs: Any) -> dict[str, Any]:
        """One sample dict for the collate functions (see the class docstring); ``kwargs`` go to the processor."""
        from keye.data.manifest import expand_answers
        from keye.train.tree import VisionInputs, build_tree

        convs = messages if messages and isinstance(messages[0], list) else [messages]
        if len(convs) != 1:
            raise KeyeInputError(f"TreeSampleProcessor takes one conversation per call, got {len(convs)}")
        branches = expand_answers(convs[0])
        with _media_once(self.processor):
            outs = [dict(self.processor([c], return_tensors=return_tensors, for_training=for_training, **kwargs))
                    for c in branches]
        first = outs[0]
        for b, o in enumerate(outs[1:], start=1):
            for key in ("image_grid_thw", "video_grid_thw"):
                if (first.get(key) is None) != (o.get(key) is None) or (
                        first.get(key) is not None and not torch.equal(first[key], o[key])):
                    raise KeyeInputError(f"answer {b} got other {key} than answer 0 for the same prompt")
        grids = VisionInputs(image_grid_thw=first.get("image_grid_thw"), video_grid_thw=first.get("video_grid_thw"),
                             second_per_grid_ts=first.get("second_per_grid_ts"))
        tree = build_tree(self.config, [o["input_ids"][0] for o in outs],
                          [o["labels"][0] != IGNORE_INDEX for o in outs], grids)
        out = {k: v for k, v in first.items() if k in VISION_KEYS}
        if len(outs) == 1:
            out.update(input_ids=first["input_ids"], labels=first["labels"])
        else:
            out.update(input_ids=tree.input_ids, labels=torch.full_like(tree.input_ids, IGNORE_INDEX))
        out["attention_mask"] = torch.ones_like(out["input_ids"])
        out["tree"] = [tree]
        return out


class TreeCostModel:
    """Cost model for the SFT loader with multi-answer rows: :func:`keye.data.manifest.estimate_cost` over
    ``base`` (a :class:`~keye.data.cost.CostModel`), the tree's cost (``shared=True``) or the expanded rows'."""

    def __init__(self, base: Any, shared: bool):
        self.base, self.shared = base, shared

    def estimate(self, sample: Any) -> Any:
        from keye.data.manifest import estimate_cost

        return estimate_cost(self.base, sample, shared=self.shared)


def trees_of(mb: dict[str, Any]) -> list[Any] | None:
    """The per-sample trees of a micro-batch, or None (plain loader, or every sample failed to load)."""
    trees = mb.get("tree")
    return trees if trees and int(mb.get("num_samples", 0)) > 0 else None


def has_multi_answer(mb: dict[str, Any]) -> bool:
    """Whether the micro-batch holds a row with two or more answers."""
    return any(t.num_branches > 1 for t in trees_of(mb) or [])


def use_tree_path(mb: dict[str, Any], mode: str) -> bool:
    """Whether ``mb`` runs as a shared-prefix forest under ``train.tree = mode``."""
    if trees_of(mb) is None or mode == "off":
        return False
    return mode == "on" or has_multi_answer(mb)


def target_tokens(mb: dict[str, Any]) -> int:
    """Loss tokens of a micro-batch counted as in the unshared computation (every answer's own tokens)."""
    trees = trees_of(mb)
    if trees is None:
        return int(mb["num_label_tokens"])
    return sum(int(t.loss_mask.sum()) for t in trees)


def _split_vision(mb: dict[str, Any], trees: list[Any]) -> list[dict[str, torch.Tensor]]:
    """Each sample's own slice of the micro-batch's vision tensors (samples own consecutive grid rows; a
    grid row [t, h, w] owns t*h*w pixel rows; preview videos have one ``second_per_grid_ts`` per row)."""
    at = dict.fromkeys(VISION_KEYS, 0)
    out = []
    for t in trees:
        own: dict[str, torch.Tensor] = {}
        for grid_key, pix_key in (("image_grid_thw", "pixel_values"), ("video_grid_thw", "pixel_values_videos")):
            grid = getattr(t.vision, grid_key)
            if grid is None or grid.shape[0] == 0:
                continue
            rows, pix = grid.shape[0], int(grid.prod(-1).sum())
            own[grid_key] = mb[grid_key][at[grid_key] : at[grid_key] + rows]
            own[pix_key] = mb[pix_key][at[pix_key] : at[pix_key] + pix]
            at[grid_key] += rows
            at[pix_key] += pix
            if grid_key == "video_grid_thw" and mb.get("second_per_grid_ts") is not None:
                own["second_per_grid_ts"] = mb["second_per_grid_ts"][at["second_per_grid_ts"] : at["second_per_grid_ts"] + rows]
                at["second_per_grid_ts"] += rows
        out.append(own)
    return out


def unshared_batch(mb: dict[str, Any], pad_token_id: int) -> dict[str, Any]:
    """The micro-batch with every multi-answer row expanded into one ordinary row per answer.

    Each answer's row is its tree path (prompt + answer tokens) with labels on its own loss tokens and its
    own copy of the prompt's pixels, joined by the collate function the loader used (packed row or padded
    batch): exactly what the processor and collate produce for a manifest with one row per answer. A
    micro-batch without multi-answer rows is returned as is.
    """
    from keye.data.collate import collate_packed, collate_padded

    if not has_multi_answer(mb):
        return mb
    trees = trees_of(mb)
    outs = []
    for tree, vision in zip(trees, _split_vision(mb, trees)):
        ids = tree.input_ids[0]
        for b, path in enumerate(tree.paths):
            seq = ids[path]
            is_target = torch.isin(path, tree.target_index[b][tree.loss_mask[b]])
            outs.append({"input_ids": seq[None], "labels": torch.where(is_target, seq, IGNORE_INDEX)[None], **vision})
    batch = collate_packed(outs) if "cu_seqlens" in mb else collate_padded(outs, pad_token_id)
    batch["num_samples"] = mb["num_samples"]  # rows of the manifest, as in the shared layout
    return batch


def tree_loss(module: Any, mb: dict[str, Any], device: torch.device, *,
              chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS, label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed next-token cross-entropy of every branch's target tokens, from ONE forest forward.

    The micro-batch's per-sample trees are joined by :func:`keye.train.tree.concat_trees` (no attention
    across trees) and run with :class:`keye.train.tree_attention.TreeAttention` and per-path positions, so
    each distinct tree token's logits equal those of its unshared sequence. Each distinct target token's
    loss is computed once and weighted by the number of branches (answers) whose target it is, so the sum
    (and its gradient) equals the unshared batch's summed token loss; divide by :func:`target_tokens`
    summed over the global batch for the token mean (docs/training.md §4: weight n_t / Σ_b N_b).

    Args:
        module: what to call for the forward (the model, or its DDP / FSDP / DeepSpeed wrapper).
        mb: a loader micro-batch with ``tree`` entries (see :class:`TreeSampleProcessor`).
        chunk_tokens: the distinct targets' predicting rows go through the head this many at a time, inside the
            forward (:class:`keye.train.loss.LossRequest`, no full logits); None: the full-logits reference.
        label_smoothing: as ``F.cross_entropy``'s (the packed path's ``train.label_smoothing``).
    Returns:
        A float32 scalar with gradient.
    """
    from keye.train.tree import VisionInputs, concat_trees
    from keye.train.tree_attention import TreeAttention

    forest = concat_trees(trees_of(mb))
    forest.vision = VisionInputs(**{k: mb.get(k) for k in VISION_KEYS})  # pixels, in the same sample order
    forest = forest.to(device)
    targets, weight = torch.unique(forest.target_index[forest.loss_mask], return_counts=True)
    rows, ids = forest.parent[targets], forest.input_ids[0, targets]
    kwargs = dict(position_ids=forest.position_ids, attention_override=TreeAttention(forest), **forest.vision.as_kwargs())
    if chunk_tokens is not None:
        # The head stays inside the wrapped forward (sharded and data-parallel wrappers require it), and only the
        # distinct targets' predicting rows go through it (the forest is one row, so a row is its flat index).
        request = LossRequest(chunk_tokens, index=rows, targets=ids, weights=weight)
        return module(forest.input_ids, loss_request=request, label_smoothing=label_smoothing, loss_reduction="sum",
                      **kwargs).loss
    # Full logits (logits_to_keep=0) as the packed full path computes them: the reference.
    out = module(forest.input_ids, **kwargs)
    logits = out.logits[0].index_select(0, rows).float()
    token_loss = F.cross_entropy(logits, ids, reduction="none", label_smoothing=label_smoothing)
    return (token_loss * weight.to(token_loss.dtype)).sum()
