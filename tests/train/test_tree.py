"""Tree (shared-prefix) batches: log-probs and gradients equal the unshared computation.

Every expected value here is computed independently by the unshared path: each full sequence runs
alone through ``KeyeVL.forward`` with its own vision inputs and ``get_rope_index`` positions.
"""

from __future__ import annotations

import pytest
import torch

from keye.errors import KeyeInputError
from keye.testing.model import make_tiny_model
from keye.train.tree import (
    VisionInputs,
    branch_logprobs,
    build_group_tree,
    build_tree,
    concat_trees,
    sequence_logprobs,
    tree_logprobs,
)
from keye.train.tree_attention import TreeAttention, reference_tree_attention

BOS, VS, VE, IMG, VID = 480, 489, 490, 492, 493
EPS_LOW, EPS_HIGH, DUAL_C = 0.2, 0.28, 3.0

# Responses of different lengths that share prefixes (10 11 ..., 30 31 ...), an exact duplicate
# (r6 == r0) and a one-token response; advantages have mixed signs on the shared tokens.
RESPONSES = [
    [10, 11, 12, 13, 14, 15],
    [10, 11, 12, 20, 21],
    [30, 31, 32, 33, 34, 35, 36, 37],
    [10, 11, 40],
    [30, 31, 50, 51],
    [60],
    [10, 11, 12, 13, 14, 15],
]
ADVANTAGES = torch.tensor([1.2, -0.8, 0.5, -1.1, 0.9, -0.3, -0.6])


@pytest.fixture(scope="module")
def models():
    return {v: make_tiny_model(v, seed=3) for v in ("preview", "1.5")}


def _image(seed: int, grid=(1, 4, 6)) -> tuple[torch.Tensor, torch.Tensor, int]:
    t, h, w = grid
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t * h * w, 3, 14, 14, generator=gen), torch.tensor([list(grid)]), t * h * w // 4


def _prompt(kind: str) -> tuple[list[int], VisionInputs]:
    if kind == "image":
        pv, grid, n = _image(1)
        vis = VisionInputs(pixel_values=pv, image_grid_thw=grid)
        return [BOS, 5, 6, VS] + [IMG] * n + [VE, 7, 8, 9], vis
    # 3 frames of 4x4 patches: one preview block of 12 tokens with time positions 0, 1, 2 (x0.7s x 2 tps),
    # or three per-frame 1.5 blocks.
    pv, grid, n = _image(2, (3, 4, 4))
    vis = VisionInputs(pixel_values_videos=pv, video_grid_thw=grid, second_per_grid_ts=torch.tensor([0.7]))
    return [BOS, 5, VS] + [VID] * n + [VE, 7, 8], vis


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_equal(g_tree: dict, g_ref: dict) -> None:
    assert g_tree.keys() == g_ref.keys()
    for name in g_ref:
        scale = max(1.0, float(g_ref[name].abs().max()))
        torch.testing.assert_close(g_tree[name], g_ref[name], rtol=1e-5, atol=1e-5 * scale, msg=name)


def _ppo_token_loss(logp, old_logp, adv, mask):
    """GRPO/DAPO token loss: clip-higher, dual clip for A < 0, token-mean over all response tokens."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None].expand_as(logp)
    clipped = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    loss = -torch.min(ratio * a, clipped * a)
    loss = torch.where(a < 0, torch.min(loss, -DUAL_C * a), loss)  # = -max(min(r A, clip(r) A), c A)
    return (loss * mask).sum() / mask.sum()


def _run_loss(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    return float(loss.detach()), _grads(model)


@pytest.mark.parametrize("variant", ["preview", "1.5"])
@pytest.mark.parametrize("kind", ["image", "video"])
def test_group_tree_matches_unshared_with_clipped_ppo(models, variant, kind):
    model = models[variant]
    prompt, vis = _prompt(kind)
    tree = build_group_tree(model.config, prompt, RESPONSES, vis)
    assert tree.unshared_tokens == sum(len(prompt) + len(r) for r in RESPONSES)
    # the prompt once, then the distinct response tokens (shared prefixes 10 11 [12 13 14 15], 30 31 once)
    assert tree.num_tokens == len(prompt) + len({tuple(r[: i + 1]) for r in RESPONSES for i in range(len(r))})

    calls = []
    hook = model.visual.register_forward_hook(lambda *_: calls.append(1))
    try:
        logp_u, mask_u = branch_logprobs(model, prompt, RESPONSES, vis)
        assert len(calls) == len(RESPONSES)
        calls.clear()
        logp_t, mask_t = tree_logprobs(model, tree)
        assert len(calls) == 1  # vision tower once per group
    finally:
        hook.remove()

    assert torch.equal(mask_t, mask_u)
    assert mask_t.sum(1).tolist() == [len(r) for r in RESPONSES]
    torch.testing.assert_close(logp_t, logp_u, rtol=0, atol=1e-5)
    assert bool((logp_t[~mask_t] == 0).all())

    # Old log-probs shifted per token so that both clip bounds and the dual clip are active.
    gen = torch.Generator().manual_seed(7)
    old = (logp_u.detach() + (torch.rand(logp_u.shape, generator=gen) * 3.0 - 1.5)) * mask_u
    ratio = torch.exp(logp_u.detach() - old)
    a = ADVANTAGES[:, None].expand_as(ratio)
    assert bool(((a > 0) & (ratio > 1 + EPS_HIGH) & mask_u).any())
    assert bool(((a < 0) & (ratio < 1 - EPS_LOW) & mask_u).any())
    assert bool(((a < 0) & (ratio > DUAL_C) & mask_u).any())
    assert bool(((ratio > 1 - EPS_LOW) & (ratio < 1 + EPS_HIGH) & mask_u).any())  # and some unclipped

    loss_u, g_u = _run_loss(
        model,
        lambda: _ppo_token_loss(branch_logprobs(model, prompt, RESPONSES, vis)[0], old, ADVANTAGES, mask_u),
    )
    loss_t, g_t = _run_loss(
        model, lambda: _ppo_token_loss(tree_logprobs(model, tree)[0], old, ADVANTAGES, mask_t)
    )
    assert abs(loss_t - loss_u) <= 1e-5 * max(1.0, abs(loss_u))
    assert any(name.startswith("visual.") for name in g_t)  # gradients reach the vision tower
    _assert_grads_equal(g_t, g_u)


@pytest.mark.parametrize("variant", ["preview", "1.5"])
@pytest.mark.parametrize("kind", ["image", "video"])
def test_branch_positions_equal_standalone(models, variant, kind):
    model = models[variant]
    prompt, vis = _prompt(kind)
    tree = build_group_tree(model.config, prompt, RESPONSES, vis)
    for b, resp in enumerate(RESPONSES):
        seq = torch.tensor([prompt + resp])
        want, _ = model.get_rope_index(seq, vis.image_grid_thw, vis.video_grid_thw, vis.second_per_grid_ts)
        path = tree.paths[b]
        assert torch.equal(tree.input_ids[0, path], seq[0])
        assert torch.equal(tree.position_ids[:, 0, path], want[:, 0])
    # Sibling branches are serialised after each other, yet restart at the same positions.
    first = [int(tree.paths[b][len(prompt)]) for b in (0, 2, 5)]
    assert len(set(first)) == 3
    assert len({tuple(tree.position_ids[:, 0, i].tolist()) for i in first}) == 1


def _two_turn_trie():
    """Multi-turn sequences with a second image in turn 2, different lengths and a strict prefix."""
    pv1, g1, n1 = _image(11, (1, 4, 4))
    pv2, g2, n2 = _image(12, (1, 2, 4))
    turn1 = [BOS, 5, 6, VS] + [IMG] * n1 + [VE, 7]
    a1 = [100, 101, 102, 103]
    user2 = [8, 9, VS] + [IMG] * n2 + [VE, 41, 42]
    a2x = [200, 201, 202, 203, 204, 205]
    a2y = [200, 201, 250]
    a1b = [100, 120, 121, 122, 123, 124, 125]
    seqs = [turn1 + a1 + user2 + a2x, turn1 + a1 + user2 + a2y, turn1 + a1b, turn1 + a1 + user2 + a2x[:3]]

    def mask(*parts):  # (tokens, is_loss) pieces
        return [flag for toks, flag in parts for _ in toks]

    masks = [
        mask((turn1, False), (a1, True), (user2, False), (a2x, True)),
        mask((turn1, False), (a1, True), (user2, False), (a2y, True)),
        mask((turn1, False), (a1b, True)),
        mask((turn1, False), (a1, True), (user2, False), (a2x[:3], True)),
    ]
    both = VisionInputs(pixel_values=torch.cat([pv1, pv2]), image_grid_thw=torch.cat([g1, g2]))
    only1 = VisionInputs(pixel_values=pv1, image_grid_thw=g1)
    visions = [both, both, only1, both]
    return seqs, masks, both, visions


@pytest.mark.parametrize("variant", ["preview", "1.5"])
def test_two_turn_trie_matches_unshared_gspo(models, variant):
    model = models[variant]
    seqs, masks, tree_vis, visions = _two_turn_trie()
    assert [sum(m) for m in masks] == [10, 7, 7, 7]
    tree = build_tree(model.config, seqs, masks, tree_vis)
    assert int(tree.node_depth.max()) >= 2  # a real trie, not one prefix and leaves

    for b, seq in enumerate(seqs):
        v = visions[b]
        want, _ = model.get_rope_index(torch.tensor([seq]), v.image_grid_thw, None, None)
        assert torch.equal(tree.position_ids[:, 0, tree.paths[b]], want[:, 0])

    logp_u, mask_u = sequence_logprobs(model, seqs, masks, visions)
    logp_t, mask_t = tree_logprobs(model, tree)
    logp_r, _ = tree_logprobs(model, tree, kernel="reference")
    assert torch.equal(mask_t, mask_u)
    torch.testing.assert_close(logp_t, logp_u, rtol=0, atol=1e-5)
    torch.testing.assert_close(logp_r, logp_t, rtol=0, atol=1e-5)

    adv = torch.tensor([0.7, -1.3, 0.4, -0.2])
    gen = torch.Generator().manual_seed(5)
    old = (logp_u.detach() + (torch.rand(logp_u.shape, generator=gen) - 0.5) * 0.2) * mask_u

    def gspo(logp, mask):
        # sequence ratio from the per-sequence token-mean, clipped per sequence, mean over sequences
        n = mask.sum(1)
        s = torch.exp(((logp - old) * mask).sum(1) / n)
        loss = -torch.min(s * adv, torch.clamp(s, 1 - 0.03, 1 + 0.04) * adv)
        return loss.mean()

    def seq_mean_token_mean(logp, mask):
        return -((logp * mask).sum(1) / mask.sum(1) * adv).mean()

    for objective in (gspo, seq_mean_token_mean):
        _, g_u = _run_loss(
            model, lambda f=objective: f(sequence_logprobs(model, seqs, masks, visions)[0], mask_u)
        )
        _, g_t = _run_loss(model, lambda f=objective: f(tree_logprobs(model, tree)[0], mask_t))
        _assert_grads_equal(g_t, g_u)


def test_reference_and_efficient_kernels_agree_on_random_qkv(models):
    """Outputs and q/k/v gradients of both kernels, GQA (4 query heads on 2 kv heads)."""
    seqs, masks, vis, _ = _two_turn_trie()
    seqs = seqs + [
        seqs[0][:3] + [77, 78, 79, 80],
        [1, 2, 3],
        [1, 2, 4, 5],
    ]  # a short branch and a second root
    masks = masks + [[False] * 7, [False] * 3, [False] * 4]
    tree = build_tree(models["preview"].config, seqs, masks, vis)
    gen = torch.Generator().manual_seed(0)
    n = tree.num_tokens
    q0, k0, v0 = (torch.randn(1, h, n, 16, generator=gen) for h in (4, 2, 2))
    outs = []
    # max_block_elems=200 forces query chunks of the cross blocks and one node per own block.
    kernels = (
        reference_tree_attention(tree.dense_mask()),
        TreeAttention(tree),
        TreeAttention(tree, max_block_elems=200),
    )
    for kernel in kernels:
        q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
        out = kernel(q, k, v, layer_idx=0, scale=0.25)
        (out * torch.cos(torch.arange(out.numel()).view_as(out) * 0.1)).sum().backward()
        outs.append((out.detach(), q.grad, k.grad, v.grad))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_dense_mask_is_exactly_each_path(models):
    seqs, masks, vis, _ = _two_turn_trie()
    tree = build_tree(models["preview"].config, seqs, masks, vis)
    dense = tree.dense_mask()
    seen = torch.zeros(tree.num_tokens, dtype=torch.bool)
    for path in tree.paths:
        for j, i in enumerate(path.tolist()):
            row = torch.zeros(tree.num_tokens, dtype=torch.bool)
            row[path[: j + 1]] = True
            assert torch.equal(dense[i], row)
            assert int(tree.parent[i]) == (int(path[j - 1]) if j else -1)
            seen[i] = True
    assert bool(seen.all())  # every serialised token lies on some path


def test_entropy_temperature_and_text_forest(models):
    """Text-only sequences with no common first token (two roots), entropy and temperature."""
    model = models["1.5"]
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 8, 9, 10], [1, 2, 6]]
    masks = [
        [False, False, True, True, True],
        [False, True, True, True],
        [False, False, True, True],
        [False] * 3,
    ]
    tree = build_tree(model.config, seqs, masks)
    assert int((tree.node_parent < 0).sum()) == 2
    lt, mt, et = tree_logprobs(model, tree, entropy=True, temperature=0.7)
    lu, mu, eu = sequence_logprobs(model, seqs, masks, entropy=True, temperature=0.7)
    assert torch.equal(mt, mu) and not bool(mt[3].any())
    torch.testing.assert_close(lt, lu, rtol=0, atol=1e-5)
    torch.testing.assert_close(et, eu, rtol=0, atol=1e-5)
    assert bool((et[mt] > 0).all())


def test_bad_inputs_raise_typed_errors(models):
    cfg = models["preview"].config
    prompt, vis = _prompt("image")
    with pytest.raises(KeyeInputError, match="first token"):
        build_tree(cfg, [[1, 2]], [[True, False]])
    with pytest.raises(KeyeInputError, match="loss mask"):
        build_tree(cfg, [[1, 2]], [[False]])
    with pytest.raises(KeyeInputError, match="grid rows"):
        build_group_tree(cfg, prompt, [[1]], VisionInputs(pixel_values=vis.pixel_values))
    with pytest.raises(KeyeInputError, match="shorter than its grid"):
        build_group_tree(cfg, prompt[:6] + [7], [[1]], vis)
    # two sequences that diverge inside an image block
    cut = prompt.index(IMG) + 2
    with pytest.raises(KeyeInputError, match="split by a branch point"):
        build_tree(cfg, [prompt, prompt[:cut] + [7, 8]], [[False] * len(prompt), [False] * (cut + 2)], vis)
    with pytest.raises(KeyeInputError, match="kernel"):
        tree_logprobs(models["preview"], build_group_tree(cfg, prompt, [[1]], vis), kernel="flash")
    with pytest.raises(KeyeInputError, match="at least one response"):
        build_group_tree(cfg, prompt, [], vis)


def test_partial_attention_gradcheck():
    """The hand-written backward of the LSE-returning block attention (masked, GQA, lse used)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    blocked = torch.rand(2, 1, 1, 3, 5, generator=gen) < 0.4
    blocked[..., 0] = False  # every query row keeps a key

    def f(q, k, v):
        out, lse = TreeAttention._partial(q, k, v, 0.5, blocked)
        return out, torch.sin(lse)

    assert torch.autograd.gradcheck(f, (q, k, v))
    out, lse = TreeAttention._partial(q, k, v, 0.5, blocked)
    s = torch.einsum("gkrqd,gkld->gkrql", q, k) * 0.5
    s = s.masked_fill(blocked, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    torch.testing.assert_close(out, torch.einsum("gkrql,gkld->gkrqd", torch.softmax(s, -1), v))


def test_concat_trees_is_a_forest_of_groups(models):
    """Two groups (image and video prompts) in one row: rows equal each group alone, vision once."""
    model = models["preview"]
    (p1, v1), (p2, v2) = _prompt("image"), _prompt("video")
    r1, r2 = RESPONSES[:3], RESPONSES[3:]
    forest = concat_trees(
        [build_group_tree(model.config, p1, r1, v1), build_group_tree(model.config, p2, r2, v2)]
    )
    assert int((forest.node_parent < 0).sum()) == 2
    calls = []
    hook = model.visual.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            model.embed(
                forest.input_ids,
                **{k: v for k, v in forest.vision.as_kwargs().items() if k != "second_per_grid_ts"},
            )
        per_forward = len(calls)  # tower passes of one forward with an image and a video (1 or 2)
        calls.clear()
        logp, mask = tree_logprobs(model, forest)
    finally:
        hook.remove()
    assert len(calls) == per_forward <= 2  # the tower runs for the whole micro-batch at once, not per group
    want1, m1 = branch_logprobs(model, p1, r1, v1)
    want2, m2 = branch_logprobs(model, p2, r2, v2)
    t = logp.shape[1]
    want = torch.cat([torch.nn.functional.pad(w, (0, t - w.shape[1])) for w in (want1, want2)])
    wmask = torch.cat([torch.nn.functional.pad(m, (0, t - m.shape[1])) for m in (m1, m2)])
    assert torch.equal(mask, wmask)
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-5)


def _random_trie(gen: torch.Generator, n_seq: int) -> tuple[list[list[int]], list[list[bool]]]:
    """Sequences that each continue a random prefix of an earlier one (or start fresh)."""
    seqs: list[list[int]] = []
    for _ in range(n_seq):
        base: list[int] = []
        if seqs and float(torch.rand((), generator=gen)) < 0.85:
            src = seqs[int(torch.randint(len(seqs), (), generator=gen))]
            base = src[: int(torch.randint(1, len(src) + 1, (), generator=gen))]
        extra = int(torch.randint(0 if base else 2, 7, (), generator=gen))
        seqs.append(base + torch.randint(0, 479, (extra,), generator=gen).tolist())
    masks = [[i > 0 and bool(torch.rand((), generator=gen) < 0.7) for i in range(len(s))] for s in seqs]
    return seqs, masks


@pytest.mark.parametrize("seed", range(4))
def test_random_tries_match_unshared(models, seed):
    """Random branching, duplicates, prefixes of other sequences and several roots."""
    model = models["preview"]
    seqs, masks = _random_trie(torch.Generator().manual_seed(seed), 7)
    tree = build_tree(model.config, seqs, masks)
    want, wmask = sequence_logprobs(model, seqs, masks)
    for kernel in ("efficient", "reference"):
        logp, mask = tree_logprobs(model, tree, kernel=kernel)
        assert torch.equal(mask, wmask)
        torch.testing.assert_close(logp, want, rtol=0, atol=1e-5)


def test_gradient_checkpointing_keeps_tree_gradients():
    model = make_tiny_model("1.5", seed=4).train()
    prompt, vis = _prompt("image")
    tree = build_group_tree(model.config, prompt, RESPONSES, vis)

    def loss():
        logp, mask = tree_logprobs(model, tree)
        return -(logp * ADVANTAGES[:, None] * mask).sum() / mask.sum()

    _, plain = _run_loss(model, loss)
    model.gradient_checkpointing_enable()
    _, ckpt = _run_loss(model, loss)
    _assert_grads_equal(ckpt, plain)
