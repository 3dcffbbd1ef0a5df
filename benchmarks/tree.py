"""RL update time for one GRPO group: shared-prefix tree batch vs unshared sequences (CPU).

One group = a 2,048-token video prompt (mostly video placeholders) and G = 8 responses of 128
tokens. An "update" is the policy forward (log-probs of all response tokens), a clipped PPO/GRPO
token-mean loss with mixed-sign advantages, and the backward pass, on a small random Keye-VL
(hidden 256, 4 decoder layers, vision hidden 192) where the 2-layer test model would be meaningless.

- unshared: each prompt + response runs as its own sequence (:func:`keye.train.tree.branch_logprobs`),
  so the vision tower and the 2,048 prompt tokens are computed G times (the usual RL batch);
- tree: one serialised row, prompt once (:func:`keye.train.tree.tree_logprobs`, efficient kernel).

Both compute the same loss and the same gradients (checked here to 1e-4 relative on the lm head and
the vision patch embedding).
Reports the median of ``--repeats`` timed runs after one warm-up update; the last line is the speedup.
Last line: ``speedup tree vs unshared (forward+backward, one group): X.XXx``

Usage: ``.venv/bin/python benchmarks/tree.py [--repeats 3] [--variant 1.5] [--full] [--quick]``
(``--quick``: one run of a 256-token prompt and G = 2 responses of 16 tokens)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from keye.config import TextConfig, VisionConfig, tiny_config
from keye.testing.model import init_unit_scale
from keye.train.tree import VisionInputs, branch_logprobs, build_group_tree, tree_logprobs


def make_model(variant: str):
    """A random Keye-VL of benchmark size (about 6M parameters), float32, train mode."""
    from keye.model.keye_vl import KeyeVL

    text = TextConfig(
        vocab_size=512 if variant == "preview" else 520,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        mrope_section=(8, 12, 12),
        max_position_embeddings=40960,
    )
    vision = VisionConfig(
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=3,
        image_size=112,
        patch_size=14,
    )
    torch.manual_seed(0)
    model = KeyeVL(tiny_config(variant, text=text, vision=vision))
    return init_unit_scale(model, 0).train()


def make_group(variant: str, prompt_len: int, group: int, response_len: int, seed: int = 0):
    """Prompt ids with a video of 100-token frames (20x20 patches), its pixels, and G responses."""
    gen = torch.Generator().manual_seed(seed)
    per_frame = 100
    frames = (prompt_len - 48) // per_frame
    head = [480, 5, 6, 7, 489]
    tail = [490] + torch.randint(
        0, 480, (prompt_len - len(head) - 1 - frames * per_frame,), generator=gen
    ).tolist()
    prompt = head + [493] * (frames * per_frame) + tail
    assert len(prompt) == prompt_len
    vis = VisionInputs(
        pixel_values_videos=torch.randn(frames * 400, 3, 14, 14, generator=gen),
        video_grid_thw=torch.tensor([[frames, 20, 20]]),
        second_per_grid_ts=torch.tensor([0.5]) if variant == "preview" else None,
    )
    responses = []
    for b in range(group):  # distinct first tokens: only the prompt is shared
        responses.append([b] + torch.randint(0, 480, (response_len - 1,), generator=gen).tolist())
    return prompt, responses, vis


def ppo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_c=10.0):
    """Token-mean clipped PPO/GRPO loss with dual clip (the RLEP recipe's objective)."""
    ratio = torch.exp(logp - old)
    a = adv[:, None].expand_as(logp)
    loss = -torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
    loss = torch.where(a < 0, torch.min(loss, -dual_c * a), loss)
    return (loss * mask).sum() / mask.sum()


def timed_update(model, logprob_fn, old, adv) -> tuple[float, torch.Tensor]:
    """Seconds for forward + loss + backward, and the lm-head and patch-embedding gradients (flattened)."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    logp, mask = logprob_fn()
    ppo_loss(logp, old, adv, mask).backward()
    dt = time.perf_counter() - t0
    patch = model.visual.vision_model.embeddings.patch_embedding.weight.grad
    return dt, torch.cat([model.lm_head.weight.grad.reshape(-1), patch.reshape(-1)]).detach().clone()


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``) and print medians; the last
    line is the tree-vs-unshared speedup."""
    from _quick import parse_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (median reported)")
    parser.add_argument("--variant", choices=("preview", "1.5"), default="1.5")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument(
        "--full", action="store_true", help="5 repeats and also the reference (dense mask) kernel"
    )
    args = parse_args(parser, argv, {"repeats": 1, "group": 2, "prompt_len": 256, "response_len": 16})
    repeats = max(args.repeats, 5) if args.full else args.repeats

    model = make_model(args.variant)
    prompt, responses, vis = make_group(args.variant, args.prompt_len, args.group, args.response_len)
    t0 = time.perf_counter()
    tree = build_group_tree(model.config, prompt, responses, vis)
    build_s = time.perf_counter() - t0
    unshared_tokens = tree.unshared_tokens
    print(
        f"model: {model.num_parameters() / 1e6:.1f}M params ({args.variant}), threads {torch.get_num_threads()}; "
        f"group: prompt {args.prompt_len} tokens (video {vis.video_grid_thw.tolist()}), "
        f"G={args.group} x {args.response_len} response tokens"
    )
    print(
        f"tokens per update: unshared {unshared_tokens}, tree {tree.num_tokens} ({unshared_tokens / tree.num_tokens:.2f}x fewer); "
        f"building the tree took {build_s * 1e3:.0f} ms (once per group, not in the timings)"
    )

    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(args.group, generator=gen)
    with torch.no_grad():
        ref_logp, mask = tree_logprobs(model, tree)
    old = ref_logp + (torch.rand(ref_logp.shape, generator=gen) - 0.5) * 0.6 * mask

    methods = {
        "unshared": lambda: branch_logprobs(model, prompt, responses, vis),
        "tree": lambda: tree_logprobs(model, tree),
    }
    if args.full:
        methods["tree (reference kernel)"] = lambda: tree_logprobs(model, tree, kernel="reference")
    grads: dict[str, torch.Tensor] = {}
    times: dict[str, list[float]] = {name: [] for name in methods}
    timed_update(model, methods["tree"], old, adv)  # warm-up (same kernels as the timed runs of both)
    for _ in range(repeats):  # interleaved, so that load from other processes hits both methods alike
        for name, fn in methods.items():
            dt, grads[name] = timed_update(model, fn, old, adv)
            times[name].append(dt)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(
            f"{name:>24}: median {medians[name]:.3f} s over {repeats} runs ({', '.join(f'{t:.2f}' for t in ts)})"
        )
    g_ref = grads["unshared"]
    for name, g in grads.items():
        if name == "unshared":
            continue
        rel = float((g - g_ref).abs().max() / g_ref.abs().max())
        print(
            f"{name:>24}: max gradient difference vs unshared (lm head + patch embedding) {rel:.1e} relative"
        )
        if rel > 1e-4:
            raise SystemExit(f"{name} gradients differ from the unshared computation (relative {rel:.1e})")
    best = min(times["unshared"]) / min(times["tree"])
    print(f"(fastest runs only: {best:.2f}x; timings on a shared CPU vary with its load)")
    print(
        f"speedup tree vs unshared (forward+backward, one group): {medians['unshared'] / medians['tree']:.2f}x"
    )


if __name__ == "__main__":
    main()
