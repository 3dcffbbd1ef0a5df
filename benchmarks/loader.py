"""Training loader throughput (samples/s) with 0, 1 and 2 worker processes on synthetic video.

Makes a small synthetic video-QA set (keye.data.synth, 112-224 px, 2-8 s clips), builds the loader with
the tiny offline preview processor (real decoding, resizing, patchify, tokenisation and packing) and
times full epochs after a warm-up batch (so process start-up is excluded). Reports the median over
repeats; the last line is the 2-worker speedup over in-process loading.
Usage: python benchmarks/loader.py [--samples 48] [--repeats 2] [--full]
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


def epoch_rate(manifest: Path, proc: KeyeProcessor, cache: ProbeCache, workers: int) -> float:
    """Samples/s of one epoch, timed from the first batch to the last."""
    dl = build_dataloader(
        manifest, proc, batch_tokens=4096, num_workers=workers, seed=0, world_size=1, rank=0,
        cost_model=CostModel(proc, cache=cache), prefetch_factor=4,
    )
    it = iter(dl)
    first = next(it)
    t0 = time.perf_counter()
    n = 0
    for batch in it:
        n += batch["num_samples"]
    dt = time.perf_counter() - t0
    del first
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="200 samples, 3 repeats")
    args = ap.parse_args()
    n, reps = (200, 3) if args.full else (args.samples, args.repeats)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        manifest = generate_split(root / "synth", "train", n, seed=0, workers=2, image_fraction=0.0, progress=False)
        proc = KeyeProcessor.from_pretrained(make_tiny_processor_dir(root / "proc", "preview"))
        cache = ProbeCache(root / "probe.sqlite")
        rates = {}
        for workers in (0, 1, 2):
            rates[workers] = statistics.median(epoch_rate(manifest, proc, cache, workers) for _ in range(reps))
            print(f"workers={workers}: {rates[workers]:.1f} samples/s (median of {reps} epochs of {n} videos)")
    print(f"speedup 2 workers vs 0: {rates[2] / rates[0]:.2f}x (1 worker: {rates[1] / rates[0]:.2f}x)")


if __name__ == "__main__":
    main()
