"""SFT throughput and memory on the synthetic video-QA set, through the real recipe (keye.recipes.sft).

  (a) training tokens/s with packed rows (varlen attention, no padding) vs padded batches of the same
      samples; tokens/s counts real tokens only, so padding shows up as lost throughput -> ratio
  (b) peak extra memory of one training step (forward + backward + optimizer) with and without gradient
      checkpointing, each in a fresh process                                           -> ratio

The model is a random Keye-VL-1.5 of keye-tiny's shape with a wider decoder (so activations matter), the
processor is the tiny offline one with keye-tiny's small video frames; the data are 64 synthetic clips.
Medians over the measured steps (the first step, with its warm-up, is dropped). Last line:
``(b) memory ratio plain / gradient checkpointing: X.XXx``
Usage: python benchmarks/sft.py [--steps 12] [--clips 64] [--layers 6] [--quick]
       (``--quick``: 2 steps on 8 clips with a 2-layer decoder)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
from pathlib import Path

import torch
from _memory import PeakRSS

VIDEO_DEFAULTS = {"floor_pixels": 3136, "max_pixels": 25088, "fps": 2.0, "max_frames": 16}


def make_checkpoint(root: Path, layers: int = 6) -> Path:
    """A random Keye-VL 1.5 of keye-tiny's shape with a ``layers``-layer, 384-wide decoder, and the tiny
    processor with small video frames, under ``root / "ckpt"``; returns that folder."""
    from keye.config import TextConfig, VisionConfig, tiny_config
    from keye.model.keye_vl import KeyeVL
    from keye.testing.model import init_unit_scale
    from keye.testing.processor import make_tiny_processor_dir

    d = make_tiny_processor_dir(root / "ckpt", variant="1.5")
    pre = json.loads((d / "preprocessor_config.json").read_text())
    pre["video_defaults"] = VIDEO_DEFAULTS
    (d / "preprocessor_config.json").write_text(json.dumps(pre))
    cfg = tiny_config("1.5", text=TextConfig(vocab_size=576, hidden_size=384, intermediate_size=1024,
                                             num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=2,
                                             head_dim=64, mrope_section=(8, 12, 12)),
                      vision=VisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                          num_attention_heads=4, image_size=112, patch_size=14))
    torch.manual_seed(0)
    init_unit_scale(KeyeVL(cfg)).save_pretrained(d)
    return d


def run_sft(ckpt: Path, manifest: Path, out: Path, steps: int, *extra: str) -> dict:
    from keye.recipes.sft import train
    from keye.sft.config import SFTConfig
    from keye.train.config import load_config

    cfg = load_config(SFTConfig, None, [
        f"model.path={ckpt}", f"data.manifest={manifest}", f"train.max_steps={steps}", "train.lr=1e-3",
        f"checkpoint.out_dir={out}", "checkpoint.export=false", "log.progress=false", "log.tensorboard=false",
        "data.num_workers=0", *extra,
    ])
    train(cfg)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:])}


def _peak_child(ckpt: str, manifest: str, checkpointing: bool, queue, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    from keye.data.loader import build_dataloader
    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor
    from keye.sft.inputs import model_inputs

    model = KeyeVL.from_pretrained(ckpt).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    proc = KeyeProcessor.from_pretrained(ckpt)
    loader = build_dataloader(manifest, proc, batch_tokens=4096, num_workers=0, seed=0)
    batch = next(iter(loader))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = model_inputs(batch, torch.device("cpu"))
    with PeakRSS() as mem:
        out = model(**inputs)
        out.loss.backward()
        opt.step()
    queue.put(mem.extra_mib)


def peak_mib(ckpt: Path, manifest: Path, checkpointing: bool, threads: int = 2) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_peak_child, args=(str(ckpt), str(manifest), checkpointing, q, threads))
    p.start()
    p.join()
    return q.get()


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``); the last line is (b)'s
    ratio."""
    from _quick import parse_args, torch_threads

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="training steps per run (the first is not counted)")
    ap.add_argument("--clips", type=int, default=64, help="synthetic training clips")
    ap.add_argument("--layers", type=int, default=6, help="decoder layers")
    args = parse_args(ap, argv, {"steps": 2, "clips": 8, "layers": 2})
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step is not counted)")
    torch.set_num_threads(torch_threads(args))
    from keye.data.synth import generate

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt = make_checkpoint(root, args.layers)
        manifest = generate(root / "synth", train=args.clips, test=0, seed=0, workers=1, progress=False)["train"]
        packed = run_sft(ckpt, manifest, root / "packed", args.steps, "data.packing=true", "data.batch_tokens=2048")
        padded = run_sft(ckpt, manifest, root / "padded", args.steps, "data.packing=false", "data.batch_tokens=null",
                         "data.batch_size=8")
        print(f"(a) training tokens/s (real tokens): packed {packed['tokens_per_s']:.0f}, "
              f"padded {padded['tokens_per_s']:.0f}")
        print(f"(a) speedup packed vs padded: {packed['tokens_per_s'] / padded['tokens_per_s']:.2f}x")
        plain = peak_mib(ckpt, manifest, False, torch_threads(args))
        ckpt_mem = peak_mib(ckpt, manifest, True, torch_threads(args))
        print(f"(b) peak extra memory of one step: plain {plain:.0f} MiB, gradient checkpointing {ckpt_mem:.0f} MiB")
        print(f"(b) memory ratio plain / gradient checkpointing: {plain / max(ckpt_mem, 1e-3):.2f}x")


if __name__ == "__main__":
    main()
