"""Decoding overlapped with compute: training steps/s with 2 prefetching loader workers vs decoding in the
training process, on video rows.

Makes a small synthetic video-QA set (keye.data.synth, 112-224 px, 2-8 s clips), builds the loader with the
tiny offline preview processor (real decoding, resizing, patchify, tokenisation and packing) and runs a stand-in
training step after each micro-batch: an accelerator step, during which the training process's CPU waits
(modelled as a sleep, so the figure does not depend on how many idle cores this machine has), as long as
decoding one micro-batch in this process (measured first), so perfect overlap would double the steps/s. With
``num_workers=0`` decoding and the step alternate in one process; with 2 workers the next micro-batches are
decoded in worker processes (``prefetch_factor`` 4) while the step runs. Times one epoch after a warm-up
batch (process start-up excluded); medians over ``--repeats``. The last line is the ratio.
Usage: python benchmarks/loader.py [--samples 48] [--repeats 2] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from keye.data.cost import CostModel
from keye.data.loader import build_dataloader
from keye.data.probe import ProbeCache
from keye.data.synth import generate_split
from keye.processing.processor import KeyeProcessor
from keye.testing.processor import make_tiny_processor_dir


def _loader(manifest: Path, proc: KeyeProcessor, cache: ProbeCache, workers: int):
    return build_dataloader(manifest, proc, batch_tokens=4096, num_workers=workers, seed=0, world_size=1, rank=0,
                            cost_model=CostModel(proc, cache=cache), prefetch_factor=4)


class Step:
    """A stand-in accelerator step: the training process waits ``seconds`` (its CPU is free meanwhile)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self) -> None:
        time.sleep(self.seconds)


def decode_time(manifest: Path, proc: KeyeProcessor, cache: ProbeCache) -> float:
    """Median seconds to produce one micro-batch in the training process (no step)."""
    it = iter(_loader(manifest, proc, cache, 0))
    next(it)
    times = []
    while True:
        t0 = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def steps_per_s(manifest: Path, proc: KeyeProcessor, cache: ProbeCache, workers: int, step: Step) -> float:
    """Micro-batches (each followed by one step) per second over one epoch, after the first batch."""
    it = iter(_loader(manifest, proc, cache, workers))
    next(it)
    t0 = time.perf_counter()
    n = 0
    for _ in it:
        step()
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="6 videos, one repeat (checks the script runs)")
    args = ap.parse_args()
    n, reps = (6, 1) if args.quick else (args.samples, args.repeats)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        manifest = generate_split(root / "synth", "train", n, seed=0, workers=2, image_fraction=0.0, progress=False)
        proc = KeyeProcessor.from_pretrained(make_tiny_processor_dir(root / "proc", "preview"))
        cache = ProbeCache(root / "probe.sqlite")
        decode = decode_time(manifest, proc, cache)
        step = Step(decode)
        print(f"decoding one micro-batch in the training process: {decode * 1e3:.0f} ms; step set to the same")
        rates = {}
        for workers in (0, 2):
            rates[workers] = statistics.median(steps_per_s(manifest, proc, cache, workers, step) for _ in range(reps))
            print(f"workers={workers}: {rates[workers]:.2f} steps/s (median of {reps} epochs of {n} videos)")
    print(f"steps/s on video rows, 2 prefetching workers vs decoding in the training process: "
          f"{rates[2] / rates[0]:.2f}x (ideal 2.00x: decoding as long as the step)")


if __name__ == "__main__":
    main()
