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

Three additions make the tower read what the questions need (each measured with the linear probes of
``training/probe_vision.py`` on the tokens, after 300-800 steps from the random init):

- shape twins (``--twin-fraction``): half of each batch comes as pairs of stills that differ only in their
  objects' shapes, hard negatives that colour alone cannot tell apart;
- grid cells in the captions (``--positions``): each object's 3 x 3 cell joins its colour and shape;
- a per-token loss (``--dense-weight``): every merged token is asked, by linear heads, which shape and
  colour it shows (or nothing) and where it sits in the frame.

The contrastive loss alone (twins or not) left shape at 46-50 % (4 classes, majority 28 %) and up / down
at 58-61 %; with the per-token loss at weight 3 and 800 steps the probes read shape 95.7 %, colour 100 %,
left / right 98.0 % and up / down 97.3 %, and held-out 256-way retrieval rose from 45 % to 77 %.

Usage: python training/pretrain_vision.py --init runs/tiny/init --out runs/tiny_see --steps 800 \
           --twin-fraction 0.5 --positions --dense-weight 3
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


def _sibling(name: str) -> Any:
    """A module of training/ (this script runs as a file, from the build or a test, not as a package)."""
    import importlib

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(name)


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


def shape_twin(objs: list[Any], rng: np.random.Generator) -> list[Any]:
    """The same still with every object's shape changed (colours, sizes and places kept; the shapes stay
    distinct among the coloured objects). Put beside the original in one contrastive batch, the pair can
    only be told apart by shape: without such pairs the object lists of a batch differ in their colours
    almost always, and the tower learns colour and little shape (a linear probe on its tokens read shape
    at 46 % against 27 % for the majority class, colour at 100 %). Twins alone did not fix that in 300 steps
    (50 %); the per-token loss (:class:`DenseHeads`) did."""
    from dataclasses import replace as dc_replace

    from keye.data.synth import SHAPES

    coloured = [o for o in objs if o.color != "white"]
    old = [o.shape for o in coloured]
    for _ in range(20):  # a permutation of distinct shapes that changes every object's shape
        new = [str(s) for s in rng.choice(SHAPES, size=len(old), replace=False)]
        if all(a != b for a, b in zip(old, new)):
            break
    it = iter(new)
    out = []
    for o in objs:
        shape = next(it) if o.color != "white" else str(rng.choice([s for s in SHAPES if s != o.shape]))
        out.append(dc_replace(o, shape=shape))
    return out


def cell_of(obj: Any, width: int, height: int) -> int:
    """The object's centre as a cell of a 3 x 3 grid over the frame (row-major, 0 = top left): the cell
    the captions' place words name (:func:`keye.data.synth.grid_cell`)."""
    from keye.data.synth import grid_cell

    return grid_cell(obj.x, obj.y, width, height)


def object_map(width: int, height: int, objs: list[Any]) -> np.ndarray:
    """int [height, width]: which object (index into ``objs``) each pixel shows, -1 for background, drawn
    like :func:`keye.data.synth.render_frame` (later objects on top)."""
    from keye.data.synth import shape_pixels

    out = np.full((height, width), -1, dtype=np.int64)
    for k, o in enumerate(objs):
        px = shape_pixels(o.shape, o.x, o.y, o.size, width, height)
        if px is not None:
            y0, y1, x0, x1, mask = px
            out[y0:y1, x0:x1][mask] = k
    return out


def token_targets(width: int, height: int, objs: list[Any], grid_h: int, grid_w: int, colors: list[str],
                  shapes: list[str], min_cover: float = 0.1) -> np.ndarray:
    """The dense targets of one still's merged vision tokens, int [grid_h * grid_w, 2] in raster order:
    the shape and colour index of the object covering most of the token's region (the frame is resized
    whole, so token (i, j) sees rows ``i * height / grid_h`` to ``(i + 1) * height / grid_h``), or
    ``len(shapes)`` / ``len(colors)`` ("nothing") where no object covers ``min_cover`` of it."""
    idx = object_map(width, height, objs)
    rows = (np.arange(height) * grid_h) // height
    cols = (np.arange(width) * grid_w) // width
    token = rows[:, None] * grid_w + cols[None, :]
    n_tok = grid_h * grid_w
    counts = np.zeros((n_tok, len(objs) + 1), dtype=np.int64)
    np.add.at(counts, (token.ravel(), idx.ravel() + 1), 1)
    area = counts.sum(1)
    best = counts[:, 1:].argmax(1) if objs else np.zeros(n_tok, dtype=np.int64)
    covered = objs and (counts[np.arange(n_tok), best + 1] >= min_cover * area)
    out = np.empty((n_tok, 2), dtype=np.int64)
    out[:, 0], out[:, 1] = len(shapes), len(colors)
    for t in np.flatnonzero(covered):
        o = objs[int(best[t])]
        out[t] = (shapes.index(o.shape), colors.index(o.color))
    return out


class DenseHeads(torch.nn.Module):
    """Linear read-outs of every merged vision token (the LLM's input): the shape and the colour under it
    (or nothing) and where the token sits in the frame (row, column in [0, 1]). Linear, so what they learn
    to read is linearly there for the LLM too."""

    def __init__(self, hidden: int, n_colors: int, n_shapes: int):
        super().__init__()
        self.shape = torch.nn.Linear(hidden, n_shapes + 1)
        self.color = torch.nn.Linear(hidden, n_colors + 1)
        self.place = torch.nn.Linear(hidden, 2)

    def loss(self, feats: torch.Tensor, targets: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
        """Shape + colour cross-entropy over all tokens, plus 10x the squared error of the place."""
        ce = torch.nn.functional.cross_entropy
        return (ce(self.shape(feats), targets[:, 0]) + ce(self.color(feats), targets[:, 1])
                + 10.0 * torch.nn.functional.mse_loss(self.place(feats), places))


def token_places(grid_h: int, grid_w: int) -> np.ndarray:
    """float [grid_h * grid_w, 2]: each merged token's centre (row, column) as a fraction of the frame."""
    r, c = np.meshgrid((np.arange(grid_h) + 0.5) / grid_h, (np.arange(grid_w) + 0.5) / grid_w, indexing="ij")
    return np.stack([r.ravel(), c.ravel()], 1).astype(np.float32)


class SetTextEncoder(torch.nn.Module):
    """Embeds an object list (colour, shape pairs, and with ``positions`` each object's 3 x 3 grid cell) as
    the sum of a per-object MLP of colour + shape (+ cell)."""

    def __init__(self, n_colors: int, n_shapes: int, dim: int, out_dim: int, positions: bool = False):
        super().__init__()
        self.color = torch.nn.Embedding(n_colors, dim)
        self.shape = torch.nn.Embedding(n_shapes, dim)
        self.cell = torch.nn.Embedding(9, dim) if positions else None
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        self.out = torch.nn.Linear(dim, out_dim)

    def forward(self, colors: torch.Tensor, shapes: torch.Tensor, owner: torch.Tensor, n: int,
                cells: torch.Tensor | None = None) -> torch.Tensor:
        """``colors``, ``shapes``, ``owner`` (caption index), ``cells`` (grid cell, used when the encoder
        has ``positions``): int [n_objects]; returns [n, out_dim]."""
        x = self.color(colors) + self.shape(shapes)
        if self.cell is not None:
            if cells is None:
                raise ValueError("this encoder embeds positions: pass cells")
            x = x + self.cell(cells)
        per_obj = self.mlp(x)
        pooled = torch.zeros(n, per_obj.shape[-1], dtype=per_obj.dtype).index_add_(0, owner, per_obj)
        return self.out(pooled)


class Batcher:
    """Renders and preprocesses batches of (image, object list) pairs, deterministic in ``seed``."""

    def __init__(self, processor: Any, seed: int, fast_fraction: float = 0.3, twin_fraction: float = 0.0):
        from keye.data.synth import COLORS, SHAPES
        from keye.processing.image import KeyeImageProcessor

        self.colors, self.shapes = list(COLORS), list(SHAPES)
        cfg = processor.image_processor.config
        floor = int((cfg.video_defaults or {}).get("floor_pixels") or cfg.max_pixels)
        self.slow = processor.image_processor
        self.fast = KeyeImageProcessor(replace(cfg, max_pixels=floor, min_pixels=min(cfg.min_pixels, floor)))
        self.fast_fraction = fast_fraction
        self.twin_fraction = twin_fraction
        self.rng = np.random.default_rng(seed)

    def batch(self, n: int) -> dict[str, torch.Tensor]:
        """``n`` pairs: pixel_values / grid_thw for the tower, and the objects as index tensors (colour,
        shape, 3 x 3 grid cell, owning image), and the dense targets of every merged token in placeholder
        order (``dense``: :func:`token_targets`; ``places``: :func:`token_places`). With ``twin_fraction`` that share of the images comes as
        :func:`shape_twin` pairs (an image right after its twin, at the same resolution)."""
        from keye.data.synth import Scene, render_frame

        stills: list[tuple[int, int, list[Any], Any]] = []
        while len(stills) < n:
            w, h, objs = sample_objects(self.rng)
            proc = self.fast if self.rng.random() < self.fast_fraction else self.slow
            stills.append((w, h, objs, proc))
            if len(stills) < n and objs and self.rng.random() < self.twin_fraction / (2 - self.twin_fraction):
                stills.append((w, h, shape_twin(objs, self.rng), proc))
        pix, grids, colors, shapes, cells, owner, dense, places = [], [], [], [], [], [], [], []
        for i, (w, h, objs, proc) in enumerate(stills):
            frame = render_frame(Scene(w, h, 0, 0.0, objs, "caption", "", "", "text"), 0.0)
            p, g = proc.preprocess_frames(frame[None])
            pix.append(p)
            grids.append(g)
            gh, gw = g[1] // 2, g[2] // 2
            dense.append(token_targets(w, h, objs, gh, gw, self.colors, self.shapes))
            places.append(token_places(gh, gw))
            for o in objs:
                colors.append(self.colors.index(o.color))
                shapes.append(self.shapes.index(o.shape))
                cells.append(cell_of(o, w, h))
                owner.append(i)
        return {"pixel_values": torch.cat(pix), "grid_thw": torch.tensor(grids), "colors": torch.tensor(colors),
                "shapes": torch.tensor(shapes), "cells": torch.tensor(cells), "owner": torch.tensor(owner), "n": n,
                "dense": torch.from_numpy(np.concatenate(dense)), "places": torch.from_numpy(np.concatenate(places))}


def image_embeddings(model: Any, head: torch.nn.Module, batch: dict[str, Any],
                     feats: torch.Tensor | None = None) -> torch.Tensor:
    """Tower + projector (unless the merged tokens ``feats`` are given), then each image's tokens pooled
    (mean and max) and projected: [n, out_dim]."""
    if feats is None:
        feats = model.encode_vision(batch["pixel_values"], batch["grid_thw"])
    pool = _sibling("probe_vision").pool_tokens
    return head(pool(feats, batch["grid_thw"], model.config.vision.spatial_merge_size))


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
                    eval_images: int = 256, twin_fraction: float = 0.0, positions: bool = False,
                    probe_images: int = 1200, dense_weight: float = 0.0) -> dict[str, Any]:
    """Train ``visual`` + ``mlp_AR`` of the checkpoint in ``init`` contrastively for ``steps`` steps and save
    the whole checkpoint (processor files copied) to ``out``. Returns the metrics (also written to
    ``out/metrics.json``): the smoothed loss and the held-out ``eval_images``-way image <-> caption
    retrieval accuracy at every evaluation (one held-out batch drawn with another seed, with the same
    ``twin_fraction``), and unless ``probe_images`` is 0 the linear probes of
    :func:`probe_vision.probe_tokens` on that many stills through the trained tower (what its tokens say
    about shape, colour and place).

    ``twin_fraction`` (0..1) is the share of each batch that comes as shape twins (:func:`shape_twin`), the
    hard negatives that make the tower see shape; ``positions`` adds each object's 3 x 3 grid cell to the
    caption side, so the tokens must also say where an object is (left / right and, which the LLM's
    rotary positions alone gave the earlier keye-tiny too weakly to use, up / down).

    ``dense_weight`` > 0 adds :class:`DenseHeads`' loss, times that weight, to the contrastive one: every
    merged token is asked which shape and colour it shows and where it sits. The contrastive loss alone
    leaves shape nearly unread (probe 46-50 % after 300 steps, twins or not); told per token, the same
    tower reads it (probe ~90 % after ~500 steps of 64 stills)."""
    if not 0.0 <= twin_fraction <= 1.0:
        raise ValueError(f"twin_fraction must be in [0, 1], got {twin_fraction}")
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
    text = SetTextEncoder(len(Batcher(processor, 0).colors), len(Batcher(processor, 0).shapes), dim, dim,
                          positions=positions)
    logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    vision_params = list(model.visual.parameters()) + list(model.mlp_AR.parameters())
    dense = DenseHeads(hidden, len(text.color.weight), len(text.shape.weight))
    params = vision_params + list(head.parameters()) + list(text.parameters()) + [logit_scale]
    if dense_weight > 0:
        params += list(dense.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    loss_fn = ClipLoss()
    train = Batcher(processor, seed, twin_fraction=twin_fraction)
    held = Batcher(processor, seed + 1_000_003, twin_fraction=twin_fraction)
    test_batches = [held.batch(eval_images)]
    metrics: dict[str, Any] = {"steps": steps, "batch_size": batch_size, "lr": lr, "eval_images": eval_images,
                               "twin_fraction": twin_fraction, "positions": positions, "dense_weight": dense_weight,
                               "curve": []}
    t0 = time.time()

    def evaluate(step: int, loss: float | None) -> None:
        model.eval()
        with torch.no_grad():
            accs = [retrieval_accuracy(image_embeddings(model, head, b), caption_embeddings(b))
                    for b in test_batches]
        model.train()
        point = {"step": step, "loss": loss, "image_to_caption": float(np.mean([a[0] for a in accs])),
                 "caption_to_image": float(np.mean([a[1] for a in accs])), "seconds": round(time.time() - t0, 1)}
        metrics["curve"].append(point)
        print(f"see step {step:5d}  loss {loss if loss is None else round(loss, 4)}  held-out retrieval "
              f"({eval_images}-way) image->caption {point['image_to_caption']:.3f} caption->image "
              f"{point['caption_to_image']:.3f}", flush=True)

    def caption_embeddings(b: dict[str, Any]) -> torch.Tensor:
        return text(b["colors"], b["shapes"], b["owner"], b["n"], b["cells"])

    evaluate(0, None)
    bar = tqdm(range(steps), desc="stage see (contrastive)", unit="step", disable=not progress)
    running = None
    for step in bar:
        for g in opt.param_groups:  # linear warm-up, cosine to 10 %
            warm = min(1.0, (step + 1) / 50)
            g["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        b = train.batch(batch_size)
        feats = model.encode_vision(b["pixel_values"], b["grid_thw"])
        img = torch.nn.functional.normalize(image_embeddings(model, head, b, feats), dim=-1)
        txt = torch.nn.functional.normalize(caption_embeddings(b), dim=-1)
        loss = loss_fn(img, txt, logit_scale.exp().clamp(max=100.0))
        if dense_weight > 0:
            loss = loss + dense_weight * dense.loss(feats, b["dense"], b["places"])
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
    if probe_images:
        model.eval()
        metrics["probe"] = _sibling("probe_vision").probe_tokens(model, processor, n=probe_images, seed=seed)
        print("see probe (held-out linear probe accuracy on the tower's tokens): "
              + ", ".join(f"{k} {100 * v['accuracy']:.1f} %" for k, v in metrics["probe"].items()), flush=True)
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
    ap.add_argument("--twin-fraction", type=float, default=0.0, help="share of each batch in shape-twin pairs")
    ap.add_argument("--positions", action="store_true", help="captions also give each object's 3x3 grid cell")
    ap.add_argument("--dense-weight", type=float, default=0.0,
                    help="weight of the per-token shape / colour / place loss (0: contrastive only)")
    ap.add_argument("--probe-images", type=int, default=1200, help="stills for the linear probes after training "
                    "(0: skip them)")
    args = ap.parse_args(argv)
    pretrain_vision(Path(args.init), Path(args.out), args.steps, args.batch_size, args.lr, args.eval_every, args.seed,
                    twin_fraction=args.twin_fraction, positions=args.positions,
                    probe_images=args.probe_images, dense_weight=args.dense_weight)
    return 0


if __name__ == "__main__":
    sys.exit(main())
