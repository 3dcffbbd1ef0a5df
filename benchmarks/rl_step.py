"""Time of one RLEP step on CPU, split into rollout, scoring, old log-probs and update.

A small random Keye-VL (4-layer 256-wide decoder, 4-layer vision tower) with the tiny offline processor,
a few synthetic prompts (half with an image), G fresh rollouts + M replayed answers per prompt, the rule
reward, token-mean clip-higher + dual-clip loss, one optimizer step. Phases are timed separately; each
figure is the median over the timed steps (after one warm-up step).

The last line compares the gradient computation with micro-batching (``--micro`` sequences per forward,
accumulated with the global token count; identical gradients) against one forward/backward over the whole
mini-batch, measured in the same run on the same samples (optimizer step excluded from both). Last line:
``gradient time, micro-batches of N vs one batch: X.XXx``

Usage: python benchmarks/rl_step.py [--steps 2] [--full] [--quick]
       (``--quick``: one timed step of 2 prompts x (2 + 1) answers)
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import numpy as np
import torch

from keye.config import TextConfig, VisionConfig, tiny_config
from keye.processing.processor import KeyeProcessor
from keye.rl import (
    LocalRollout,
    ReplayEntry,
    ReplayPool,
    RewardScorer,
    RLPrompt,
    accumulate_policy_gradients,
    add_replay,
    assign_advantages,
    fill_logprobs,
    set_scores,
)
from keye.rl.rollout.settings import SamplingSettings
from keye.testing.model import init_unit_scale
from keye.testing.processor import make_tiny_processor_dir


def build_model(full: bool):
    from keye.model.keye_vl import KeyeVL

    hidden, layers = (512, 8) if full else (256, 4)
    cfg = tiny_config(
        text=TextConfig(vocab_size=512, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                        mrope_section=(hidden // 64, 3 * hidden // 128, 3 * hidden // 128)),
        vision=VisionConfig(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                            image_size=112, patch_size=14),
    )
    torch.manual_seed(0)
    return init_unit_scale(KeyeVL(cfg), 0)


def make_prompts(n: int) -> list[RLPrompt]:
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(n):
        a, b = int(rng.integers(1, 50)), int(rng.integers(1, 50))
        text = f"what is {a} plus {b}?"
        content = [{"type": "text", "text": text}]
        if i % 2 == 0:
            img = rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)
            content = [{"type": "image", "image": img}] + content
        prompts.append(RLPrompt(f"q{i}", [{"role": "user", "content": content}], reference=str(a + b),
                                task="numeric", mode="think" if i % 2 else "no_think"))
    return prompts


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``); the last line is the ratio."""
    from _quick import parse_args, torch_threads

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--group", type=int, default=4, help="G fresh rollouts per prompt")
    parser.add_argument("--replay", type=int, default=2, help="M replayed answers per prompt")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--micro", type=int, default=4, help="sequences per micro-batch in the update")
    parser.add_argument("--full", action="store_true", help="a larger model and more steps")
    # the replayed answers are up to 24 tokens long: --new-tokens stays, since they must fit it
    args = parse_args(parser, argv, {"steps": 1, "prompts": 2, "group": 2, "replay": 1, "micro": 2})
    if args.full:
        args.steps = max(args.steps, 5)
    torch.set_num_threads(torch_threads(args))

    processor = KeyeProcessor.from_pretrained(make_tiny_processor_dir(tempfile.mkdtemp()))
    model = build_model(args.full)
    prompts = make_prompts(args.prompts)
    pool = ReplayPool(seed=0)
    for p in prompts:
        for k in range(3):
            answer = f"<think>adding step {k}</think>The answer is {p.reference}"
            pool.add(ReplayEntry(p.id, answer, None, 1.0, {"mode": p.mode}))
    engine = LocalRollout(model, processor, SamplingSettings(max_new_tokens=args.new_tokens, max_batch_size=64), seed=0)
    scorer = RewardScorer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    pad = processor.pad_token_id
    encode = lambda t: processor.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    loss_kwargs = dict(eps_low=0.2, eps_high=0.28, dual_clip=10.0, loss_agg="token-mean")
    rng = random.Random(0)
    phases: dict[str, list[float]] = {k: [] for k in ("rollout", "scoring", "old_logprob", "update", "grads_micro", "update_1batch")}
    tokens = []

    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        fresh = engine.generate(prompts, args.group)
        t1 = time.perf_counter()
        samples = add_replay(fresh, pool, args.replay, encode=encode, eos_id=482, max_response_len=args.new_tokens,
                             rng=rng)
        set_scores(samples, scorer(samples))
        assign_advantages(samples)
        t2 = time.perf_counter()
        fill_logprobs(model, samples, pad_id=pad, micro_batch_size=args.micro)
        t3 = time.perf_counter()
        model.train()
        # baseline: the same gradients from one forward/backward over the whole mini-batch (no step taken)
        opt.zero_grad()
        accumulate_policy_gradients(model, samples, pad_id=pad, micro_batch_size=len(samples), loss_kwargs=loss_kwargs)
        t4 = time.perf_counter()
        opt.zero_grad()
        accumulate_policy_gradients(model, samples, pad_id=pad, micro_batch_size=args.micro, loss_kwargs=loss_kwargs)
        t5 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        t6 = time.perf_counter()
        model.eval()
        if step == 0:
            continue  # warm-up
        phases["rollout"].append(t1 - t0)
        phases["scoring"].append(t2 - t1)
        phases["old_logprob"].append(t3 - t2)
        phases["update_1batch"].append(t4 - t3)
        phases["update"].append(t6 - t4)
        phases["grads_micro"].append(t5 - t4)
        tokens.append(sum(s.num_tokens for s in samples))

    med = {k: statistics.median(v) for k, v in phases.items()}
    step_time = med["rollout"] + med["scoring"] + med["old_logprob"] + med["update"]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f}M params; {args.prompts} prompts x (G={args.group} + M={args.replay}), "
          f"{args.new_tokens} new tokens max; median of {args.steps} steps")
    print(f"response tokens per step: {statistics.median(tokens):.0f}")
    for k in ("rollout", "scoring", "old_logprob", "update"):
        print(f"{k:12s} {med[k]:7.3f} s  ({100 * med[k] / step_time:5.1f}% of the step)")
    print(f"{'step':12s} {step_time:7.3f} s")
    print(f"gradients, micro-batches of {args.micro}: {med['grads_micro']:.3f} s; one batch of "
          f"{args.prompts * (args.group + args.replay)} (baseline): {med['update_1batch']:.3f} s")
    print(f"gradient time, micro-batches of {args.micro} vs one batch: {med['grads_micro'] / med['update_1batch']:.2f}x")


if __name__ == "__main__":
    main()
