"""Per-rank peak memory of one SFT step on a long packed row, context parallel 2 vs 1 (keye.train.context_parallel).

One packed row of 16,384 tokens: a Keye-VL-1.5 video sample (32 frames of 16 x 16 patches, 64 tokens each, and a
2,048-token answer) followed by text samples of up to 4,096 tokens (the row of :func:`keye.testing.long_row.
long_video_row`), a KeyeVL with the tiny vision tower and a small decoder (hidden 256, 4 layers, 8 query / 4 KV
heads), float32 on CPU. Each side runs one real SFT step, :func:`keye.sft.step.optimizer_step` (forward,
backward, clipping, AdamW, the chunked loss), in fresh processes (a gloo group set up from torchrun's environment
variables) on the same seeded model and row:

- context parallel 1: one process, the whole row;
- context parallel 2: two gloo processes under DDP with ``context_parallel`` = 2: each holds half the row through
  the decoder (Ulysses all-to-all over the heads in attention) and encodes half the frames.

Memory is, per rank, the peak RSS during the step minus the RSS at its start (sampled by a thread, as
``benchmarks/sft_memory.py``); the context-parallel side's figure is its larger rank's. Each side runs
``--repeats`` times (fresh processes each time) and the medians are compared; both sides' losses and gradient
norms are compared (relative 1e-5 and 1e-4). Last line:
``sft step peak memory per rank at 16384 tokens, context parallel 2 vs 1: X.XXx less``
Usage: python benchmarks/context_parallel.py [--tokens 16384] [--hidden 256] [--layers 4] [--repeats 3] [--quick]
       (``--quick``: 1,024 tokens, 4 frames, one repeat: seconds; the figure is not meaningful)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUICK = {"tokens": 1024, "frames": 4, "answer": 128, "repeats": 1, "hidden": 64, "layers": 2}


def build_model(hidden: int, layers: int, seed: int = 0):
    """A seeded KeyeVL-1.5 (tiny vision tower) with a ``hidden``-wide decoder of ``layers`` layers, 8 / 4 heads."""
    import torch

    from keye.config import TextConfig, tiny_config
    from keye.model.keye_vl import KeyeVL

    heads = 8
    half = hidden // heads // 2
    t = half // 4
    text = TextConfig(vocab_size=520, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=4, head_dim=hidden // heads,
                      mrope_section=(t, (half - t) // 2, half - t - (half - t) // 2))
    torch.manual_seed(seed)
    return KeyeVL(tiny_config("1.5", text=text)).train()


def build_row(config, tokens: int, frames: int, answer: int) -> dict:
    """The packed micro-batch: the video sample, then text samples of up to 4,096 tokens filling ``tokens``."""
    from keye.testing.long_row import long_video_row

    video = 12 + frames * (1 + 64) + answer
    left, text = tokens - video, []
    while left > 0:
        text.append(min(4096, left))
        left -= text[-1]
    return long_video_row(config, frames=frames, frame_grid=(16, 16), text_lens=tuple(text), answer=answer)


def worker(args: argparse.Namespace) -> None:
    """One rank of one side: the step on this rank, its peak extra memory, loss and gradient norm to ``--out``."""
    import torch
    from _memory import PeakRSS

    from keye.sft.config import TrainSection
    from keye.sft.step import optimizer_step
    from keye.train import dist as kdist
    from keye.train.context_parallel import ContextParallel
    from keye.train.optim import build_optimizer

    info = kdist.init_distributed("cpu")
    try:
        torch.set_num_threads(max(1, 2 // info.world_size))
        model = build_model(args.hidden, args.layers)
        model.always_run_vision = info.distributed
        mb = build_row(model.config, args.tokens, args.frames, args.answer)
        cp = ContextParallel.create(info.world_size, info.rank, info.world_size,
                                    num_heads=model.config.text.num_attention_heads)
        wrapped = kdist.wrap_model(model, "ddp" if info.distributed else "none", info)
        optimizer = build_optimizer(model, TrainSection(lr=1e-4))
        kdist.barrier()
        t0 = time.perf_counter()
        with PeakRSS() as mem:
            res = optimizer_step([mb], wrapped, optimizer, info, amp=False, tree_mode="off", pad_token_id=0,
                                 grad_clip=1.0, step=1, context_parallel=cp)
        result = {"mib": mem.extra_mib, "loss": res.loss, "grad_norm": res.grad_norm,
                  "seconds": time.perf_counter() - t0, "tokens": mb["num_tokens"]}
        Path(args.out, f"rank{info.rank}.json").write_text(json.dumps(result))
    finally:
        kdist.cleanup()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_side(args: argparse.Namespace, cp: int) -> dict:
    """One step with ``cp`` ranks in fresh processes (started directly with torchrun's environment variables, which
    spares a launcher process); the largest rank's memory and rank 0's values."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--worker", f"--out={out}", f"--tokens={args.tokens}",
               f"--hidden={args.hidden}", f"--layers={args.layers}", f"--frames={args.frames}",
               f"--answer={args.answer}"]
        base = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // cp)), "KEYE_LOG_LEVEL": "WARNING",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(cp)}
        logs = [Path(out, f"rank{r}.log") for r in range(cp)]  # files, not pipes: a full pipe would stall a rank
        procs = []
        for r, log in enumerate(logs):
            with open(log, "w") as f:
                procs.append(subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=f,
                                              stdout=subprocess.DEVNULL))
        failed = [(r, p.wait()) for r, p in enumerate(procs)]
        failed = [(r, code) for r, code in failed if code != 0]
        if failed:
            r, code = failed[0]
            raise RuntimeError(f"context parallel {cp} side: rank {r} failed (exit {code}; -9: out of memory):\n"
                               f"{logs[r].read_text()[-4000:]}")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(cp)]
    return {**ranks[0], "mib": max(r["mib"] for r in ranks), "per_rank": [round(r["mib"]) for r in ranks]}


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``); the last line is the ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--answer", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes (seconds): figures not meaningful")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return
    sides = {}
    for cp in (1, 2):
        runs = [run_side(args, cp) for _ in range(args.repeats)]
        sides[cp] = {**runs[0], "mib": statistics.median(r["mib"] for r in runs),
                     "seconds": statistics.median(r["seconds"] for r in runs)}
        print(f"context parallel {cp}: peak extra memory per rank {sides[cp]['mib']:.0f} MiB (median of "
              f"{args.repeats}; ranks of the first run {sides[cp]['per_rank']} MiB), loss {sides[cp]['loss']:.6f}, "
              f"grad norm {sides[cp]['grad_norm']:.6f}, {sides[cp]['seconds']:.1f} s", flush=True)
    equal = (math.isclose(sides[1]["loss"], sides[2]["loss"], rel_tol=1e-5)
             and math.isclose(sides[1]["grad_norm"], sides[2]["grad_norm"], rel_tol=1e-4))
    tokens = sides[1]["tokens"]
    print(f"{tokens} tokens in one packed row (a {args.frames}-frame video and text), hidden {args.hidden}, "
          f"{args.layers} layers; values equal: {'yes' if equal else 'no'}")
    ratio = sides[1]["mib"] / max(sides[2]["mib"], 1e-3)
    print(f"sft step peak memory per rank at {tokens} tokens, context parallel 2 vs 1: {ratio:.2f}x less")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
