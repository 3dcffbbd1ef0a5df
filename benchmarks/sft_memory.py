"""Peak memory of one SFT step, full-logits loss vs the chunked loss (keye.train.loss), at long packed rows.

One packed text row of 8,192 tokens (eight samples of 1,024 tokens, each with a 32-token prompt outside the
loss), a KeyeVL with Qwen3's vocabulary of 151,936 and a small decoder (hidden 128, 2 layers), float32 on CPU.
Each side runs one real SFT step, :func:`keye.sft.step.optimizer_step` (forward, backward, clipping, AdamW), in
a fresh process on the same seeded model and row:

- full: ``train.loss_chunk_tokens: null``, the model's full path (the [L, V] logits and what autograd keeps
  for them, about 2.25 MiB per token at this vocabulary);
- chunked: the default ``train.loss_chunk_tokens``, the loss over the target rows, chunk by chunk, recomputed
  in the backward.

Memory is the peak RSS during the step minus the RSS at its start (sampled by a thread; the optimizer's
states, created by its first step, count on both sides). The step's loss and gradient norm of both sides are
compared (relative 1e-5 and 1e-4); the last line is the memory ratio. Last line:
``sft step peak memory at N tokens full vs chunked: X.XXx less (values equal: yes)``
Usage: python benchmarks/sft_memory.py [--tokens 8192] [--hidden 128] [--vocab 151936] [--chunk 512] [--quick]
       (``--quick``: 1,024 tokens and a 32,000-token vocabulary, both sides still in fresh processes: seconds)
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import time

import torch
from _memory import PeakRSS

SAMPLE_TOKENS, PROMPT_TOKENS = 1024, 32


def build_model(hidden: int, vocab: int, seed: int = 0):
    """A random KeyeVL (tiny vision tower) with a ``hidden``-wide, two-layer decoder and a ``vocab`` head."""
    from keye.config import TextConfig, tiny_config
    from keye.model.keye_vl import KeyeVL

    heads = 4
    half = hidden // heads // 2
    t = half // 4  # Qwen2-VL's split of the rotary frequencies over the t / h / w axes
    text = TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=2, head_dim=hidden // heads,
                      mrope_section=(t, (half - t) // 2, half - t - (half - t) // 2))
    torch.manual_seed(seed)
    return KeyeVL(tiny_config("1.5", text=text)).train()


def build_row(tokens: int, vocab: int, seed: int = 0) -> dict:
    """One packed micro-batch (the loader's collate) of ``tokens`` text tokens: samples of up to 1,024 tokens,
    each with a 32-token prompt outside the loss. Ids stay clear of the tiny config's special ids (< 1,000)."""
    from keye.data.collate import collate_packed

    gen = torch.Generator().manual_seed(seed)
    samples, left = [], tokens
    while left > 0:
        n = min(SAMPLE_TOKENS, left)
        ids = torch.randint(1000, vocab, (1, n), generator=gen)
        labels = ids.clone()
        labels[0, :PROMPT_TOKENS] = -100
        samples.append({"input_ids": ids, "labels": labels})
        left -= n
    return collate_packed(samples)


def one_step(hidden: int, vocab: int, tokens: int, chunk: int | None) -> dict:
    """One SFT optimizer step on the seeded model and row; its peak extra memory, loss, gradient norm, seconds."""
    from keye.sft.config import TrainSection
    from keye.sft.step import optimizer_step
    from keye.train import dist as kdist
    from keye.train.optim import build_optimizer

    model = build_model(hidden, vocab)
    mb = build_row(tokens, vocab)
    optimizer = build_optimizer(model, TrainSection(lr=1e-4))
    wrapped, info = kdist.Wrapped(model, model, "none"), kdist.DistInfo()
    t0 = time.perf_counter()
    with PeakRSS() as mem:
        res = optimizer_step([mb], wrapped, optimizer, info, amp=False, tree_mode="auto", pad_token_id=0,
                             grad_clip=1.0, step=1, loss_chunk_tokens=chunk)
    return {"mib": mem.extra_mib, "loss": res.loss, "grad_norm": res.grad_norm, "seconds": time.perf_counter() - t0}


def _child(args, queue, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    queue.put(one_step(*args))


def run_side(hidden: int, vocab: int, tokens: int, chunk: int | None, threads: int = 2) -> dict:
    """:func:`one_step` in a fresh (spawned) process with ``threads`` torch threads, so that neither side sees the
    other's allocations."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=((hidden, vocab, tokens, chunk), q, threads))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"the {'full' if chunk is None else 'chunked'} side died (exit code {p.exitcode}; "
                           "a negative code is a signal, e.g. -9 when the machine ran out of memory)")
    return q.get()


def compare(full: dict, chunked: dict) -> bool:
    """Whether both sides took the same step: losses within 1e-5 and gradient norms within 1e-4 (relative)."""
    return (math.isclose(full["loss"], chunked["loss"], rel_tol=1e-5)
            and math.isclose(full["grad_norm"], chunked["grad_norm"], rel_tol=1e-4))


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``); the last line is the ratio."""
    from _quick import parse_args, torch_threads

    from keye.train.loss import DEFAULT_LOSS_CHUNK_TOKENS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=DEFAULT_LOSS_CHUNK_TOKENS)
    args = parse_args(ap, argv, {"tokens": 1024, "vocab": 32000})
    tokens = args.tokens
    sides = {"full": run_side(args.hidden, args.vocab, tokens, None, torch_threads(args)),
             "chunked": run_side(args.hidden, args.vocab, tokens, args.chunk, torch_threads(args))}
    for name, r in sides.items():
        print(f"{name}: peak extra memory {r['mib']:.0f} MiB, loss {r['loss']:.6f}, grad norm {r['grad_norm']:.6f}, "
              f"{r['seconds']:.1f} s", flush=True)
    equal = compare(sides["full"], sides["chunked"])
    ratio = sides["full"]["mib"] / max(sides["chunked"]["mib"], 1e-3)
    print(f"{tokens} tokens in one packed row, hidden {args.hidden}, vocabulary {args.vocab}, chunk {args.chunk}")
    print(f"sft step peak memory at {tokens} tokens full vs chunked: {ratio:.2f}x less "
          f"(values equal: {'yes' if equal else 'no'})")


if __name__ == "__main__":
    main()
