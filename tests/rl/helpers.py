"""Helpers several RL test modules use: RL samples from a real rollout with replay, random test images."""

from __future__ import annotations

import numpy as np
import torch

from keye.rl import ReplayEntry, ReplayPool, add_replay, assign_advantages, fill_logprobs
from keye.rl.rollout.engines import LocalRollout
from keye.rl.rollout.samples import RLPrompt
from keye.rl.rollout.settings import SamplingSettings


def rl_samples(model, processor):
    """Two prompts (an image, a text) with three sampled answers each, two replay slots per group (one filled),
    random rewards, advantages and old log-probs: a batch ready for the update."""
    prompts = [
        RLPrompt("img", [{"role": "user", "content": [{"type": "image", "image": image(4)},
                                                      {"type": "text", "text": "describe"}]}], mode="think"),
        RLPrompt("txt", [{"role": "user", "content": "say hi"}], mode="no_think"),
    ]
    stops = list(range(0, 480, 4)) + [482]
    fresh = LocalRollout(model, processor, SamplingSettings(max_new_tokens=6), seed=2, eos_token_id=stops).generate(prompts, 3)
    pool = ReplayPool()
    pool.add(ReplayEntry("img", "replayed answer", None, metadata={"mode": "think"}))
    enc = lambda t: processor.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    samples = add_replay(fresh, pool, 2, encode=enc, eos_id=482, max_response_len=8)
    gen = torch.Generator().manual_seed(0)
    for s in samples:
        s.reward = float(torch.rand((), generator=gen))
    assign_advantages(samples)
    fill_logprobs(model, samples, pad_id=processor.pad_token_id, micro_batch_size=3)
    return samples


def image(seed: int, h: int = 56, w: int = 84) -> np.ndarray:
    """A random RGB test image."""
    return np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
