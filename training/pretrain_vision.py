"""keye-tiny stage "see": contrastive pretraining of the vision tower on synthetic image / caption pairs.

Before the decoder reads a single caption, the SigLIP tower and the projector of a freshly initialised
keye-tiny are trained CLIP-style (``open_clip``'s :class:`~open_clip.loss.ClipLoss`) to match rendered
images of the synthetic set's shapes with their object lists, so that colour, shape and which colour goes
with which shape are already written in the vision tokens when the language stages start. It is the
order of the Keye reports (a vision encoder pretrained on image-text pairs, then alignment, then
instructions) in miniature, and it is cheap: the tower is small and one image is 16 tokens, so a CPU
pushes a few hundred thousand pairs through it in minutes, where the decoder stages see a few thousand.

The images are drawn like the synthetic clips' frames (``keye.data.synth``: same sides, colours, shapes,
object sizes, the background colour, plus now and then the tiny white shape of the ``detail`` questions)
and resized by the checkpoint's own image processor, at the slow-frame size (at most ``max_pixels``) or at
the fast-frame floor, the two sizes the video processor produces. The text side is a small set encoder
over the objects (colour embedding + shape embedding, an MLP per object, summed), which keeps the
colour-shape binding and ignores the object order. Only ``visual`` and ``mlp_AR`` change; the decoder and
the embeddings are saved as they came.

Usage: python training/pretrain_vision.py --init runs/tiny/init --out runs/tiny_see --steps 300
Writes the checkpoint (and the processor files) to ``--out`` and ``--out``/metrics.json (the curve and the
held-out image -> caption retrieval accuracy).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


def sample_objects(rng: np.random.Generator) -> tuple[int, int, list[Any]]:
    """One random still: ``(width, height, objects)`` with 1-4 shapes of distinct colours and shapes, sized
    like the synthetic clips' objects; a quarter of the stills also show a tiny white shape (the
    ``detail`` questions' size) and a tenth hold one or two large warm-up-sized shapes."""
    from keye.data.synth import SIDES, Obj, _distinct_objects, _free_pos

    w, h = int(rng.choice(SIDES)), int(rng.choice(SIDES))
    side = min(w, h)
    large = rng.random() < 0.1
    k = int(rng.integers(1, 3)) if large else int(rng.integers(1, 5))
    tiny = not large and k < 4 and rng.random() < 0.25
    taken: list[tuple[float, float, float]] = []
    objs: list[Any] = []

    def place(shape: str, color: str, r: float) -> None:
        x, y = _free_pos(rng, w, h, r, taken)
        # _free_pos places the object anyway when the frame is full; an overlapped object would be listed
        # but (partly) hidden, so it is left out.
        if all((x - o.x) ** 2 + (y - o.y) ** 2 > (r + o.size + 1) ** 2 for o in objs):
            objs.append(Obj(shape, color, r, x, y))

    for s, c in _distinct_objects(rng, k, avoid=("white",) if tiny else ()):
        place(s, c, float(rng.uniform(side / 5, side / 3.5)) if large else float(rng.uniform(side / 10, side / 4.5)))
    if tiny:
        place(str(rng.choice(["circle", "square", "triangle", "diamond"])), "white", max(5.0, side * 0.06))
    return w, h, objs


class SetTextEncoder(torch.nn.Module):
    """Embeds an object list (colour, shape pairs) as the sum of a per-object MLP of colour + shape."""

    def __init__(self, n_colors: int, n_shapes: int, dim: int, out_dim: int):
        super().__init__()
        self.color = torch.nn.Embedding(n_colors, dim)
        self.shape = torch.nn.Embedding(n_shapes, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        self.out = torch.nn.Linear(dim, out_dim)

    def forward(self, colors: torch.Tensor, shapes: torch.Tensor, owner: torch.Tensor, n: int) -> torch.Tensor:
        """``colors``, ``shapes``, ``owner``: int [n_objects] (owner = caption index); returns [n, out_dim]."""
        per_obj = self.mlp(self.color(colors) + self.shape(shapes))
        pooled = torch.zeros(n, per_obj.shape[-1], dtype=per_obj.dtype).index_add_(0, owner, per_obj)
        return self.out(pooled)


class Batcher:
    """Renders and preprocesses batches of (image, object list) pairs, deterministic in ``seed``."""

    def __init__(self, processor: Any, seed: int, fast_fraction: float = 0.3):
        from keye.data.synth import COLORS, SHAPES
        from keye.processing.image import KeyeImageProcessor

        self.colors, self.shapes = list(COLORS), list(SHAPES)
        cfg = processor.image_processor.config
        floor = int((cfg.video_defaults or {}).get("floor_pixels") or cfg.max_pixels)
        self.slow = processor.image_processor
        self.fast = KeyeImageProcessor(replace(cfg, max_pixels=floor, min_pixels=min(cfg.min_pixels, floor)))
        self.fast_fraction = fast_fraction
        self.rng = np.random.default_rng(seed)

    def batch(self, n: int) -> dict[str, torch.Tensor]:
        """``n`` pairs: pixel_values / grid_thw for the tower, and the objects as index tensors."""
        from keye.data.synth import Scene, render_frame

        pix, grids, colors, shapes, owner = [], [], [], [], []
        for i in range(n):
            w, h, objs = sample_objects(self.rng)
            frame = render_frame(Scene(w, h, 0, 0.0, objs, "caption", "", "", "text"), 0.0)
            proc = self.fast if self.rng.random() < self.fast_fraction else self.slow
            p, g = proc.preprocess_frames(frame[None])
            pix.append(p)
            grids.append(g)
            for o in objs:
                colors.append(self.colors.index(o.color))
                shapes.append(self.shapes.index(o.shape))
                owner.append(i)
        return {"pixel_values": torch.cat(pix), "grid_thw": torch.tensor(grids), "colors": torch.tensor(colors),
                "shapes": torch.tensor(shapes), "owner": torch.tensor(owner), "n": n}


def image_embeddings(model: Any, head: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Tower + projector, then each image's tokens pooled (mean and max) and projected: [n, out_dim]."""
    feats = model.encode_vision(batch["pixel_values"], batch["grid_thw"])
    m2 = model.config.vision.spatial_merge_size ** 2
    counts = [int(t * h * w) // m2 for t, h, w in batch["grid_thw"].tolist()]
    pooled = [torch.cat([f.mean(0), f.amax(0)]) for f in torch.split(feats, counts)]
    return head(torch.stack(pooled))


def retrieval_accuracy(img: torch.Tensor, txt: torch.Tensor) -> tuple[float, float]:
    """Top-1 image -> caption and caption -> image accuracy of a batch of matched embeddings. Captions
    that are identical count as the same answer (an image matches any caption equal to its own)."""
    sim = torch.nn.functional.normalize(img, dim=-1) @ torch.nn.functional.normalize(txt, dim=-1).T
    same = torch.isclose(txt[:, None, :], txt[None, :, :], atol=1e-6).all(-1)
    i2t = same[torch.arange(len(sim)), sim.argmax(1)].float().mean().item()
    t2i = same[sim.argmax(0), torch.arange(len(sim))].float().mean().item()
    return i2t, t2i


def pretrain_vision(init: Path, out: Path, steps: int = 300, batch_size: int = 128, lr: float = 2e-3,
                    eval_every: int = 200, seed: int = 0, progress: bool = True,
                    eval_images: int = 256) -> dict[str, Any]:
    """Train ``visual`` + ``mlp_AR`` of the checkpoint in ``init`` contrastively for ``steps`` steps and save
    the whole checkpoint (processor files copied) to ``out``. Returns the metrics (also written to
    ``out/metrics.json``): the smoothed loss and the held-out ``eval_images``-way image <-> caption
    retrieval accuracy at every evaluation (one held-out batch drawn with another seed)."""
    from open_clip.loss import ClipLoss
    from tqdm import tqdm

    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor

    torch.manual_seed(seed)
    processor = KeyeProcessor.from_pretrained(init)
    model = KeyeVL.from_pretrained(init, torch_dtype="float32")
    model.train()
    hidden = model.config.text.hidden_size
    dim = 128
    head = torch.nn.Linear(2 * hidden, dim)
    text = SetTextEncoder(len(Batcher(processor, 0).colors), len(Batcher(processor, 0).shapes), dim, dim)
    logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    vision_params = list(model.visual.parameters()) + list(model.mlp_AR.parameters())
    params = vision_params + list(head.parameters()) + list(text.parameters()) + [logit_scale]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    loss_fn = ClipLoss()
    train, held = Batcher(processor, seed), Batcher(processor, seed + 1_000_003)
    test_batches = [held.batch(eval_images)]
    metrics: dict[str, Any] = {"steps": steps, "batch_size": batch_size, "lr": lr, "eval_images": eval_images,
                               "curve": []}
    t0 = time.time()

    def evaluate(step: int, loss: float | None) -> None:
        model.eval()
        with torch.no_grad():
            accs = [retrieval_accuracy(image_embeddings(model, head, b), text(b["colors"], b["shapes"], b["owner"],
                                                                             b["n"])) for b in test_batches]
        model.train()
        point = {"step": step, "loss": loss, "image_to_caption": float(np.mean([a[0] for a in accs])),
                 "caption_to_image": float(np.mean([a[1] for a in accs])), "seconds": round(time.time() - t0, 1)}
        metrics["curve"].append(point)
        print(f"see step {step:5d}  loss {loss if loss is None else round(loss, 4)}  held-out retrieval "
              f"({eval_images}-way) image->caption {point['image_to_caption']:.3f} caption->image "
              f"{point['caption_to_image']:.3f}", flush=True)

    evaluate(0, None)
    bar = tqdm(range(steps), desc="stage see (contrastive)", unit="step", disable=not progress)
    running = None
    for step in bar:
        for g in opt.param_groups:  # linear warm-up, cosine to 10 %
            warm = min(1.0, (step + 1) / 50)
            g["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        b = train.batch(batch_size)
        img = torch.nn.functional.normalize(image_embeddings(model, head, b), dim=-1)
        txt = torch.nn.functional.normalize(text(b["colors"], b["shapes"], b["owner"], b["n"]), dim=-1)
        loss = loss_fn(img, txt, logit_scale.exp().clamp(max=100.0))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        bar.set_postfix(loss=f"{running:.3f}")
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            evaluate(step + 1, running)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in init.iterdir():  # tokenizer, processor and chat-template files as they were
        if f.is_file() and not (out / f.name).exists():
            shutil.copyfile(f, out / f.name)
    metrics["seconds"] = round(time.time() - t0, 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", default=str(REPO / "runs/tiny/init"))
    ap.add_argument("--out", default=str(REPO / "runs/tiny_see"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    pretrain_vision(Path(args.init), Path(args.out), args.steps, args.batch_size, args.lr, args.eval_every, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
