"""Shared-prefix ("tree") batches: compute a multimodal prompt once for a whole RL group.

In GRPO every prompt is repeated G (+M replayed) times; for video the prompt (thousands of vision
tokens, plus the vision tower) dominates the cost. A :class:`TreeBatch` serialises a group - or any
set of sequences that share prefixes (multi-turn rollouts, partial rollouts) - as **one row**: the
prefix tree (trie) of the sequences with every distinct (prefix, token) stored once, nodes in order of
first appearance. Each serialised token keeps its parent (``parent``), attends only to its own
root-to-token path (see :mod:`keye.train.tree_attention`) and carries the 3-D mRoPE position it has in
its standalone sequence, so every token's hidden state, logits and log-prob are *the same function
of the parameters* as in the unshared batch. The vision tower runs once per tree.

API (what the RL recipe calls)::

    tree = build_group_tree(model.config, prompt_ids, responses, vision)      # one GRPO group
    tree = build_tree(model.config, sequences, loss_masks, vision)            # any trie
    tree = concat_trees([tree_a, tree_b])                                     # several groups, one row
    logp, mask = tree_logprobs(model, tree)                                   # [n_branches, T_max]
    logp, mask, ent = tree_logprobs(model, tree, entropy=True)
    logp, mask = branch_logprobs(model, prompt_ids, responses, vision)        # unshared reference

Design note: why per-branch rows give exact gradients
------------------------------------------------------
``tree_logprobs`` computes the log-prob of every distinct tree token once and then *gathers* them
into the unshared layout ``[n_branches, T_max]`` (row b = the loss tokens of sequence b, in order).
Because attention sets and positions are per-path, ``logp_tree[b, t]`` equals ``logp_unshared[b, t]``
as a function of the parameters. For any loss ``L(logp)`` computed from the rows exactly as it would
be from the unshared batch, the chain rule gives

    dL/dθ = Σ_{b,t} (∂L/∂logp[b,t]) · ∂logp[b,t]/∂θ,

identical in both layouts. Autograd's backward of the gather is an index-add: each tree token
receives the **sum over the branches that contain it** of that branch's upstream gradient, and the
shared prefix activations (keys/values, vision features) receive the sum of all branch gradients
through attention. This is Tree Training's "gradient restoration" done by autograd:

- token-mean over all tokens, sequence-mean of token-means, or sum-then-mean over branches: the
  per-branch weight (1/Σ_b N_b, 1/(B·N_b), 1/B) is applied in the row layout, so a shared token's
  effective weight becomes docs/training.md §4's n_t/ΣN_b, (1/B)Σ_{b∋t} 1/N_b or n_t/B automatically;
- GSPO: the sequence ratio exp(mean_t(logp - old)) is formed per row, clipped per row;
- PPO/GRPO clipping with mixed-sign advantages (docs/training.md §4): each row applies its own advantage and
  its own min/max/dual clip to the *same* ratio value; only the resulting per-token gradient
  coefficients are summed. Folding branches into one net advantage before clipping would be
  wrong; gathering never does that.

The loss **normaliser must count tokens per branch, as in the unshared batch**: use
``mask.sum()`` (or per-row ``mask.sum(-1)``) of the returned mask, never the number of distinct tree
tokens. Tokens with ``mask == False`` hold 0 and must be excluded from the loss.

Where sharing happens: the prompt (and its vision features) always; identical response prefixes
(e.g. a common opening) and duplicate responses too, which is exactly where branches with advantages
of different signs meet on the same token - the case the row layout keeps exact.

Usage for the policy update and for the old/reference log-prob passes is the same call (wrap the
latter in ``torch.no_grad()``); rows line up with ``responses`` / ``sequences`` in the given order.

Contract for shared content: :func:`build_tree` cannot see pixels, so sequences whose token ids agree
up to a point share that prefix, vision placeholders included. Sequences of *different* prompts (other
images or videos) belong in separate trees, joined for one forward with :func:`concat_trees`, which
never shares across trees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from keye.errors import KeyeInputError
from keye.model.rope import get_rope_index
from keye.train.logprobs import DEFAULT_CHUNK_TOKENS, LogprobRequest

__all__ = [
    "VisionInputs",
    "TreeBatch",
    "build_tree",
    "build_group_tree",
    "concat_trees",
    "tree_logprobs",
    "branch_logprobs",
    "sequence_logprobs",
]


@dataclass
class VisionInputs:
    """The pixel inputs of a prompt or tree, exactly as :meth:`keye.KeyeVL.forward` takes them.

    Items are numbered in order of appearance of their placeholder blocks in the token row
    (for a tree: in serialised order, which is the order of first appearance when the sequences are
    read one after another).
    """

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None

    def as_kwargs(self) -> dict[str, torch.Tensor | None]:
        """Keyword arguments for ``KeyeVL.forward``."""
        return {
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "pixel_values_videos": self.pixel_values_videos,
            "video_grid_thw": self.video_grid_thw,
            "second_per_grid_ts": self.second_per_grid_ts,
        }

    def to(self, device: torch.device | str) -> VisionInputs:
        """A copy with every tensor on ``device``."""
        return VisionInputs(**{k: None if v is None else v.to(device) for k, v in self.as_kwargs().items()})


@dataclass
class TreeBatch:
    """A prefix tree of token sequences serialised as one row.

    Sizes: N serialised tokens, S nodes, B branches (= input sequences), T = max loss tokens per branch.

    Attributes:
        input_ids: int64 [1, N], distinct (prefix, token) pairs in order of first appearance.
        position_ids: int64 [3, 1, N]; token i's mRoPE ids in its standalone sequence.
        parent: int64 [N], serialised index of the token before i on its path (-1 for a first token).
        node_start, node_end: int64 [S]; node s is the span [start, end) of consecutive tokens, each the
            parent of the next; every token of a node sees all tokens of its ancestor nodes and the
            tokens of its own node up to itself.
        node_parent: int64 [S], parent node (-1 for a root); parents come before children.
        node_depth: int64 [S], number of ancestor nodes.
        token_node: int64 [N], the node of each token.
        paths: B int64 tensors, the serialised indices of sequence b's tokens (its root-to-leaf path).
        target_index: int64 [B, T], serialised index of branch b's t-th loss token (0 where padded).
        pred_index: int64 [B, T], serialised index of the token whose logits predict it (0 where padded).
        loss_mask: bool [B, T].
        vision: the pixel inputs of the serialised row.
        seq_lens: length of each input sequence (the unshared token count is their sum).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent: torch.Tensor
    node_start: torch.Tensor
    node_end: torch.Tensor
    node_parent: torch.Tensor
    node_depth: torch.Tensor
    token_node: torch.Tensor
    paths: list[torch.Tensor]
    target_index: torch.Tensor
    pred_index: torch.Tensor
    loss_mask: torch.Tensor
    vision: VisionInputs = field(default_factory=VisionInputs)
    seq_lens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """N, the serialised length."""
        return int(self.input_ids.shape[1])

    @property
    def num_branches(self) -> int:
        """B, the number of input sequences."""
        return len(self.paths)

    @property
    def unshared_tokens(self) -> int:
        """Tokens the same sequences take unshared (sum of their lengths); / ``num_tokens`` = the saving."""
        return sum(self.seq_lens)

    @property
    def num_nodes(self) -> int:
        """S, the number of trie nodes."""
        return int(self.node_start.shape[0])

    def dense_mask(self) -> torch.Tensor:
        """bool [N, N], True where query i may attend key j (j is on i's path, j <= i).

        O(N^2) memory: for the reference kernel and tests only.
        """
        n, s = self.num_tokens, self.num_nodes
        anc = torch.eye(s, dtype=torch.bool)
        for node in range(s):  # parents come first, so their rows are complete
            p = int(self.node_parent[node])
            if p >= 0:
                anc[node] |= anc[p]
        tn = self.token_node
        mask = anc[tn][:, tn]  # node-level: key node is an ancestor-or-self of the query node
        same = tn[:, None] == tn[None, :]
        idx = torch.arange(n)
        return mask & ~(same & (idx[None, :] > idx[:, None]))

    def to(self, device: torch.device | str) -> TreeBatch:
        """A copy with every tensor on ``device``."""
        kw: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            val = getattr(self, name)
            if torch.is_tensor(val):
                val = val.to(device)
            elif name == "paths":
                val = [p.to(device) for p in val]
            elif name == "vision":
                val = val.to(device)
            kw[name] = val
        return TreeBatch(**kw)


# ------------------------------------------------------------------------------------- building
def _config_of(model_or_config: Any) -> Any:
    return getattr(model_or_config, "config", model_or_config)


def _as_list(x: Any, what: str, item: int) -> list[int]:
    if torch.is_tensor(x):
        if x.dim() != 1:
            raise KeyeInputError(
                f"{what} must be a 1-D sequence of token ids, got shape {list(x.shape)}", item=item
            )
        return [int(v) for v in x.tolist()]
    try:
        return [int(v) for v in x]
    except (TypeError, ValueError) as err:
        raise KeyeInputError(f"{what} must be a sequence of integer token ids ({err})", item=item) from None


def _vision_items(cfg: Any, ids: np.ndarray, vision: VisionInputs) -> list[dict[str, Any]]:
    """Walk the serialised row and assign each placeholder block its grid row, in order.

    Returns one dict per item: kind ('image'/'video'), start, count, grid (t, h, w) and seconds
    (preview videos) - 1.5 videos are split into per-frame items, as the model's rope does.
    """
    m = cfg.vision.spatial_merge_size
    images = (
        []
        if vision.image_grid_thw is None
        else [tuple(int(v) for v in r) for r in vision.image_grid_thw.tolist()]
    )
    videos: list[tuple[int, int, int]] = []
    seconds: list[float | None] = []
    if vision.video_grid_thw is not None:
        rows = [tuple(int(v) for v in r) for r in vision.video_grid_thw.tolist()]
        if cfg.variant == "1.5":
            for t, h, w in rows:
                videos.extend([(1, h, w)] * t)
            seconds = [None] * len(videos)
        else:
            videos = rows
            if vision.second_per_grid_ts is None:
                seconds = [1.0] * len(rows)
            else:
                seconds = [float(s) for s in torch.as_tensor(vision.second_per_grid_ts).reshape(-1).tolist()]
                if len(seconds) != len(rows):
                    raise KeyeInputError(
                        f"second_per_grid_ts has {len(seconds)} entries but video_grid_thw has {len(rows)} videos"
                    )
    items: list[dict[str, Any]] = []
    queues = {
        cfg.image_token_id: ("image", images, [None] * len(images)),
        cfg.video_token_id: ("video", videos, seconds),
    }
    used = {cfg.image_token_id: 0, cfg.video_token_id: 0}
    vis = np.flatnonzero((ids == cfg.image_token_id) | (ids == cfg.video_token_id))
    k, covered = 0, 0
    while k < len(vis):
        j = int(vis[k])
        if j < covered:
            k += 1
            continue
        tok = int(ids[j])
        kind, grids, secs = queues[tok]
        if used[tok] >= len(grids):
            raise KeyeInputError(
                f"the tree has more {kind} placeholder blocks than {kind} grid rows ({len(grids)})"
            )
        t, h, w = grids[used[tok]]
        count = t * (h // m) * (w // m)
        if j + count > len(ids) or not np.all(ids[j : j + count] == tok):
            raise KeyeInputError(
                f"{kind} placeholder run at serialised token {j} is shorter than its grid {[t, h, w]}"
            )
        items.append(
            {"kind": kind, "start": j, "count": count, "grid": (t, h, w), "seconds": secs[used[tok]]}
        )
        used[tok] += 1
        covered = j + count
    for tok, (kind, grids, _) in queues.items():
        if used[tok] != len(grids):
            raise KeyeInputError(
                f"{len(grids)} {kind} grid rows given but the tree has {used[tok]} {kind} blocks"
            )
    return items


def build_tree(
    config: Any,
    sequences: Sequence[Sequence[int] | torch.Tensor],
    loss_masks: Sequence[Sequence[bool] | torch.Tensor],
    vision: VisionInputs | None = None,
) -> TreeBatch:
    """Build the prefix tree of ``sequences`` (shared prefixes stored once).

    Args:
        config: a :class:`~keye.KeyeVLConfig` or a model with ``.config`` (token ids, merge size,
            variant and tokens_per_second are used for the 3-D positions).
        sequences: B full token sequences (placeholders expanded), e.g. prompt + response, or
            prompt + turn 1 + tool output + turn 2.
        loss_masks: B boolean masks of the same lengths; True marks tokens whose log-prob is wanted
            (row b of :func:`tree_logprobs` holds them in order). The first token cannot be one.
        vision: the pixel inputs of the *distinct* vision items, numbered in order of first
            appearance when the sequences are read in the given order.
    Returns:
        The :class:`TreeBatch`; every token's position equals its position in its standalone sequence.
    Raises:
        KeyeInputError: empty input, length mismatch, a loss on a first token, or placeholders and
            grids that disagree (also when a vision block is cut by a branch point).
    """
    cfg = _config_of(config)
    vision = vision or VisionInputs()
    seqs, masks = _checked_inputs(sequences, loss_masks)
    tokens, parent, children, paths = _trie(seqs)
    n = len(tokens)
    # Nodes: maximal runs where each token is the only child of the previous one *and* directly
    # follows it; a branch point therefore always ends its node (children see whole ancestor nodes).
    starts, node_parent, token_node = [], [], np.empty(n, dtype=np.int64)
    for i in range(n):
        if i == 0 or parent[i] != i - 1 or len(children[i - 1]) > 1:
            starts.append(i)
            node_parent.append(-1 if parent[i] < 0 else int(token_node[parent[i]]))
        token_node[i] = len(starts) - 1
    depth: list[int] = []
    for p in node_parent:
        depth.append(0 if p < 0 else depth[p] + 1)
    ids_np = np.asarray(tokens, dtype=np.int64)
    pos = _tree_positions(cfg, seqs, paths, token_node, _vision_items(cfg, ids_np, vision))
    parent_t = torch.tensor(parent, dtype=torch.long)
    target, pred, lmask = _loss_layout(paths, masks, parent_t)
    return TreeBatch(
        input_ids=torch.from_numpy(ids_np)[None], position_ids=torch.from_numpy(pos)[:, None], parent=parent_t,
        node_start=torch.tensor(starts, dtype=torch.long), node_end=torch.tensor(starts[1:] + [n], dtype=torch.long),
        node_parent=torch.tensor(node_parent, dtype=torch.long), node_depth=torch.tensor(depth, dtype=torch.long),
        token_node=torch.from_numpy(token_node), paths=[torch.tensor(p, dtype=torch.long) for p in paths],
        target_index=target, pred_index=pred, loss_mask=lmask, vision=vision, seq_lens=[len(s) for s in seqs],
    )


def _checked_inputs(sequences: Sequence[Sequence[int] | torch.Tensor],
                    loss_masks: Sequence[Sequence[bool] | torch.Tensor]) -> tuple[list[list[int]], list[list[bool]]]:
    """The sequences and loss masks as lists, checked (:func:`build_tree`'s Raises)."""
    if len(sequences) == 0:
        raise KeyeInputError("a tree needs at least one sequence")
    if len(loss_masks) != len(sequences):
        raise KeyeInputError(f"{len(sequences)} sequences but {len(loss_masks)} loss masks")
    seqs = [_as_list(s, "sequence", b) for b, s in enumerate(sequences)]
    masks = []
    for b, (s, mk) in enumerate(zip(seqs, loss_masks)):
        mk = [bool(v) for v in (mk.tolist() if torch.is_tensor(mk) else mk)]
        if len(mk) != len(s):
            raise KeyeInputError(f"loss mask has {len(mk)} entries but the sequence has {len(s)} tokens", item=b)
        if not s:
            raise KeyeInputError("empty sequence", item=b)
        if mk[0]:
            raise KeyeInputError("the first token of a sequence has no predictor and cannot be a loss token", item=b)
        masks.append(mk)
    return seqs, masks


def _trie(seqs: list[list[int]]) -> tuple[list[int], list[int], list[dict[int, int]], list[list[int]]]:
    """The token-level trie of ``seqs``: tokens in serialised order (creation order = first appearance, parents
    first), each token's parent (-1: a root), its children by token id, and each sequence's path of tokens."""
    tokens: list[int] = []
    parent: list[int] = []
    children: list[dict[int, int]] = []
    roots: dict[int, int] = {}
    paths: list[list[int]] = []
    for s in seqs:
        cur, path = -1, []
        for tok in s:
            ch = roots if cur < 0 else children[cur]
            nxt = ch.get(tok)
            if nxt is None:
                nxt = len(tokens)
                tokens.append(tok)
                parent.append(cur)
                children.append({})
                ch[tok] = nxt
            path.append(nxt)
            cur = nxt
        paths.append(path)
    return tokens, parent, children, paths


def _tree_positions(cfg: Any, seqs: list[list[int]], paths: list[list[int]], token_node: np.ndarray,
                    items: list[dict[str, Any]]) -> np.ndarray:
    """int64 [3, N] 3-D positions of the tree's tokens: each sequence's own (standalone) positions scattered to its
    path; shared tokens must agree, and no vision block may be cut by a branch point."""
    for it in items:
        a, z = it["start"], it["start"] + it["count"] - 1
        if token_node[a] != token_node[z]:
            raise KeyeInputError(
                f"{it['kind']} block at serialised tokens [{a}, {z}] is split by a branch point; sequences must "
                "not diverge or end inside a vision block"
            )
    item_node = [int(token_node[it["start"]]) for it in items]
    pos = np.full((3, len(token_node)), -1, dtype=np.int64)
    for b, (s, path) in enumerate(zip(seqs, paths)):
        on_path = set(int(token_node[i]) for i in path)
        mine = [it for it, nd in zip(items, item_node) if nd in on_path]
        img = [it["grid"] for it in mine if it["kind"] == "image"]
        vid = [it for it in mine if it["kind"] == "video"]
        p, _ = get_rope_index(
            torch.tensor([s], dtype=torch.long), image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
            spatial_merge_size=cfg.vision.spatial_merge_size, variant=cfg.variant,
            tokens_per_second=cfg.vision.tokens_per_second,
            image_grid_thw=torch.tensor(img, dtype=torch.long) if img else None,
            video_grid_thw=torch.tensor([it["grid"] for it in vid], dtype=torch.long) if vid else None,
            second_per_grid_ts=(torch.tensor([it["seconds"] for it in vid], dtype=torch.float32)
                                if vid and cfg.variant != "1.5" else None),
        )
        p = p[:, 0].numpy()
        idx = np.asarray(path, dtype=np.int64)
        prev = pos[:, idx]
        seen = prev[0] >= 0
        if not np.array_equal(prev[:, seen], p[:, seen]):
            raise KeyeInputError("shared tokens got different positions in two sequences (vision items differ?)", item=b)
        pos[:, idx] = p
    return pos


def _loss_layout(paths: list[list[int]], masks: list[list[bool]],
                 parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The [B, T] loss layout: each row's target tokens (tree indices) in order, their predictors (parents) and
    which slots are real."""
    t_max = max(1, max(sum(mk) for mk in masks))
    target = torch.zeros(len(paths), t_max, dtype=torch.long)
    pred = torch.zeros(len(paths), t_max, dtype=torch.long)
    lmask = torch.zeros(len(paths), t_max, dtype=torch.bool)
    for b, (path, mk) in enumerate(zip(paths, masks)):
        sel = torch.tensor([i for i, m_ in zip(path, mk) if m_], dtype=torch.long)
        k = sel.numel()
        target[b, :k] = sel
        pred[b, :k] = parent[sel]
        lmask[b, :k] = True
    return target, pred, lmask


def build_group_tree(
    config: Any,
    prompt_ids: Sequence[int] | torch.Tensor,
    responses: Sequence[Sequence[int] | torch.Tensor],
    vision: VisionInputs | None = None,
) -> TreeBatch:
    """The tree of one RL group: a multimodal prompt and its G responses (fresh and replayed).

    Args:
        config: model config (or model).
        prompt_ids: the prompt's token ids (placeholders expanded), 1-D.
        responses: G token-id lists; all their tokens are loss tokens (pass responses already cut
            after the first EOS). Empty responses give an all-False mask row. Identical response
            prefixes are shared too.
        vision: the prompt's pixel inputs.
    Returns:
        A :class:`TreeBatch` with B = G branches; row b of :func:`tree_logprobs` is response b.
    """
    prompt = _as_list(prompt_ids, "prompt", 0)
    if not prompt:
        raise KeyeInputError("the prompt is empty")
    resp = [_as_list(r, "response", b) for b, r in enumerate(responses)]
    if not resp:
        raise KeyeInputError("a group needs at least one response")
    seqs = [prompt + r for r in resp]
    masks = [[False] * len(prompt) + [True] * len(r) for r in resp]
    return build_tree(config, seqs, masks, vision)


def _cat_optional(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    kept = [x for x in parts if x is not None]
    return torch.cat(kept) if kept else None


def concat_trees(trees: Sequence[TreeBatch]) -> TreeBatch:
    """Several trees (e.g. the groups of one micro-batch) as one row: a forest.

    No token attends across trees (each keeps its own roots); branches are numbered tree by tree
    (rows of :func:`tree_logprobs` are tree 0's branches, then tree 1's, ...), padded to the longest
    row; vision inputs are concatenated in tree order, so the vision tower runs once for all of them.
    Positions are kept (each tree's are already standalone).
    """
    if not trees:
        raise KeyeInputError("concat_trees needs at least one tree")
    t_max = max(t.loss_mask.shape[1] for t in trees)
    offset = 0
    node_offset = 0
    parts: dict[str, list[Any]] = {
        k: [] for k in ("parent", "start", "end", "nparent", "tnode", "tgt", "pred", "mask")
    }
    paths: list[torch.Tensor] = []
    for t in trees:
        pad = t_max - t.loss_mask.shape[1]
        parts["parent"].append(torch.where(t.parent >= 0, t.parent + offset, t.parent))
        parts["start"].append(t.node_start + offset)
        parts["end"].append(t.node_end + offset)
        parts["nparent"].append(torch.where(t.node_parent >= 0, t.node_parent + node_offset, t.node_parent))
        parts["tnode"].append(t.token_node + node_offset)
        parts["tgt"].append(F.pad(torch.where(t.loss_mask, t.target_index + offset, 0), (0, pad)))
        parts["pred"].append(F.pad(torch.where(t.loss_mask, t.pred_index + offset, 0), (0, pad)))
        parts["mask"].append(F.pad(t.loss_mask, (0, pad)))
        paths.extend(p + offset for p in t.paths)
        offset += t.num_tokens
        node_offset += t.num_nodes
    seconds = None
    if any(t.vision.second_per_grid_ts is not None for t in trees):
        # Preview default of 1.0 s per temporal step for trees whose videos carry no timing.
        seconds = torch.cat(
            [
                torch.as_tensor(t.vision.second_per_grid_ts, dtype=torch.float32).reshape(-1)
                if t.vision.second_per_grid_ts is not None
                else torch.ones(0 if t.vision.video_grid_thw is None else t.vision.video_grid_thw.shape[0])
                for t in trees
            ]
        )
    vision = VisionInputs(
        pixel_values=_cat_optional([t.vision.pixel_values for t in trees]),
        image_grid_thw=_cat_optional([t.vision.image_grid_thw for t in trees]),
        pixel_values_videos=_cat_optional([t.vision.pixel_values_videos for t in trees]),
        video_grid_thw=_cat_optional([t.vision.video_grid_thw for t in trees]),
        second_per_grid_ts=seconds,
    )
    return TreeBatch(
        input_ids=torch.cat([t.input_ids for t in trees], dim=1),
        position_ids=torch.cat([t.position_ids for t in trees], dim=2),
        parent=torch.cat(parts["parent"]),
        node_start=torch.cat(parts["start"]),
        node_end=torch.cat(parts["end"]),
        node_parent=torch.cat(parts["nparent"]),
        node_depth=torch.cat([t.node_depth for t in trees]),
        token_node=torch.cat(parts["tnode"]),
        paths=paths,
        target_index=torch.cat(parts["tgt"]),
        pred_index=torch.cat(parts["pred"]),
        loss_mask=torch.cat(parts["mask"]),
        vision=vision,
        seq_lens=[n for t in trees for n in t.seq_lens],
    )


# ------------------------------------------------------------------------------------ log-probs
def tree_logprobs(
    model: Any,
    tree: TreeBatch,
    *,
    kernel: str = "efficient",
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_size: int | None = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-branch log-probs of the loss tokens from ONE forward over the tree (vision tower once).

    Args:
        model: a :class:`~keye.KeyeVL` (train or eval mode; gradients flow when enabled).
        tree: from :func:`build_group_tree` / :func:`build_tree` (moved to the model's device here).
        kernel: ``"efficient"`` (shared prefix attention computed once, no dense mask; see
            :class:`keye.train.tree_attention.TreeAttention`) or ``"reference"`` (dense tree mask + SDPA).
        temperature: logits are divided by it before the softmax (the rollout temperature).
        entropy: also return the entropy of each predicted distribution.
        chunk_size: distinct predicting positions per log-softmax chunk (see
            :func:`keye.train.logprobs.chunked_token_logprobs`; None: all at once).
    Returns:
        ``(logp, mask)`` or ``(logp, mask, entropy)``: logp float32 [B, T], row b = log-probs of branch
        b's loss tokens in order (0 where ``mask`` is False); mask bool [B, T]; entropy float32 [B, T].
        Any per-branch loss on these rows has exactly the gradient of the unshared computation
        (see the module docstring); normalise by ``mask.sum()``-style counts.
    """
    from keye.train.tree_attention import TreeAttention, reference_tree_attention

    if kernel not in ("efficient", "reference"):
        raise KeyeInputError(f"unknown tree attention kernel {kernel!r}; use 'efficient' or 'reference'")
    if temperature <= 0:
        raise KeyeInputError(f"temperature must be > 0, got {temperature}")
    device = model.device
    tree = tree.to(device)
    if kernel == "efficient":
        override = TreeAttention(tree)
    else:
        override = reference_tree_attention(tree.dense_mask().to(device))
    mask = tree.loss_mask
    flat_pred = tree.pred_index[mask]
    flat_tgt = tree.input_ids[0, tree.target_index[mask]]
    # each distinct predicting position is scored once (one token may predict several children), in
    # chunks recomputed in the backward: no [K, vocab] tensor is kept (chunked_token_logprobs)
    uniq, inv = torch.unique(flat_pred, return_inverse=True)
    request = LogprobRequest(uniq, inv, flat_tgt, temperature, chunk_size, entropy)
    out = model(
        tree.input_ids,
        position_ids=tree.position_ids,
        attention_override=override,
        logprob_request=request,
        **tree.vision.as_kwargs(),
    )
    logp_flat = out.token_logp
    ent_flat = out.token_entropy[inv] if entropy else None
    logp = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_scatter(mask, logp_flat)
    if not entropy:
        return logp, mask
    ent = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_scatter(mask, ent_flat)
    return logp, mask, ent


def sequence_logprobs(
    model: Any,
    sequences: Sequence[Sequence[int] | torch.Tensor],
    loss_masks: Sequence[Sequence[bool] | torch.Tensor],
    visions: Sequence[VisionInputs | None] | None = None,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_size: int | None = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unshared reference: each sequence runs alone (its own vision tower pass and positions).

    Args:
        sequences / loss_masks: as for :func:`build_tree`.
        visions: per-sequence pixel inputs (None entries for text-only sequences).
        temperature / entropy / chunk_size: as for :func:`tree_logprobs`.
    Returns:
        Same layout as :func:`tree_logprobs` (row b = sequence b's loss tokens).
    """
    visions = list(visions) if visions is not None else [None] * len(sequences)
    if len(visions) != len(sequences):
        raise KeyeInputError(f"{len(sequences)} sequences but {len(visions)} vision inputs")
    seqs = [_as_list(s, "sequence", b) for b, s in enumerate(sequences)]
    masks = [
        torch.as_tensor([bool(v) for v in (m.tolist() if torch.is_tensor(m) else m)]) for m in loss_masks
    ]
    for b, (s, mk) in enumerate(zip(seqs, masks)):
        if mk.numel() != len(s):
            raise KeyeInputError(
                f"loss mask has {mk.numel()} entries but the sequence has {len(s)} tokens", item=b
            )
        if len(s) and bool(mk[0]):
            raise KeyeInputError("the first token of a sequence cannot be a loss token", item=b)
    device = model.device
    t_max = max(1, max(int(mk.sum()) for mk in masks))
    rows, ent_rows = [], []
    for s, mk, vis in zip(seqs, masks, visions):
        vis = (vis or VisionInputs()).to(device)
        ids = torch.tensor([s], dtype=torch.long, device=device)
        tgt_pos = torch.nonzero(mk, as_tuple=False).reshape(-1).to(device)
        pred = tgt_pos - 1
        request = LogprobRequest(pred, torch.arange(pred.numel(), device=device), ids[0, tgt_pos], temperature,
                                 chunk_size, entropy)
        out = model(ids, **vis.as_kwargs(), logprob_request=request)
        logp, ent = out.token_logp, out.token_entropy
        rows.append(F.pad(logp, (0, t_max - logp.numel())))
        if entropy:
            ent_rows.append(F.pad(ent, (0, t_max - ent.numel())))
    mask = torch.zeros(len(seqs), t_max, dtype=torch.bool, device=device)
    for b, mk in enumerate(masks):
        mask[b, : int(mk.sum())] = True
    if entropy:
        return torch.stack(rows), mask, torch.stack(ent_rows)
    return torch.stack(rows), mask


def branch_logprobs(
    model: Any,
    prompt_ids: Sequence[int] | torch.Tensor,
    responses: Sequence[Sequence[int] | torch.Tensor],
    vision: VisionInputs | None = None,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_size: int | None = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unshared reference for a group: prompt + response b runs as its own sequence, G times.

    Same arguments and result layout as :func:`build_group_tree` + :func:`tree_logprobs`; the
    vision tower runs once per response. Used by the tests and as the benchmark baseline.
    """
    prompt = _as_list(prompt_ids, "prompt", 0)
    resp = [_as_list(r, "response", b) for b, r in enumerate(responses)]
    seqs = [prompt + r for r in resp]
    masks = [[False] * len(prompt) + [True] * len(r) for r in resp]
    return sequence_logprobs(
        model, seqs, masks, [vision] * len(seqs), temperature=temperature, entropy=entropy, chunk_size=chunk_size
    )
