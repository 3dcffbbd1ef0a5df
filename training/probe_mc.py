"""Probes behind keye-tiny's multiple-choice ceiling: can a small model map what it knows to an option letter?

Three short training runs from a checkpoint (keye-tiny by default), each on cached packed batches of the
synthetic set, reporting held-out accuracy of the *first answer token* every ``--eval-every`` steps:

``lookup``  text only, no pixels: an option list followed by several "Which option is <text>?" turns,
            answered with the letter (``B``). Reported per turn next to the *elimination* baseline (a model
            that only avoids letters it already gave scores 1/4, 1/3, 1/2, 1 on the turns of a 4-option
            row): accuracy above that baseline on the first turn is the in-context lookup itself.
``mc``      the synthetic colour / shape questions exactly as the set asks them (option letters).
``open``    the same questions and clips, answered with the option's word (``red``): what the model
            perceives, without the lookup. Also scored with blank pixels (the perception control).

Usage:
  python training/probe_mc.py lookup --steps 300 --lr 2e-3
  python training/probe_mc.py mc --steps 200
  python training/probe_mc.py open --steps 200
Writes ``<out>/<probe>.json`` (the curve) and prints one line per evaluation.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
LETTERS = "ABCD"
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white"]
SHAPES = ["circle", "square", "triangle", "diamond"]
DIRECTIONS = ["left", "right", "up", "down"]


def lookup_rows(n: int, seed: int, tag: str) -> list[dict[str, Any]]:
    """``n`` text-only rows: one option list (2-4 options drawn like the synthetic set's), then one
    "Which option is X?" turn per option in random order, each answered with that option's letter."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.35:
            opts = rng.sample(COLOURS, 4)
        elif kind < 0.6:
            opts = rng.sample(SHAPES, 4)
        elif kind < 0.75:
            opts = rng.sample(DIRECTIONS, 4)
        else:
            k = rng.choice([2, 3, 4])
            opts = [f"the {c} {s}" for c, s in zip(rng.sample(COLOURS, k), rng.sample(SHAPES, k))]
        order = list(range(len(opts)))
        rng.shuffle(order)
        head = "Options:\n" + "\n".join(f"{LETTERS[j]}. {o}" for j, o in enumerate(opts)) + "\n"
        messages = []
        for turn, j in enumerate(order):
            q = f"Which option is {opts[j]}? Answer with the option's letter."
            messages.append({"role": "user", "content": [{"type": "text", "text": (head if turn == 0 else "") + q}]})
            messages.append({"role": "assistant", "content": [{"type": "text", "text": LETTERS[j]}]})
        rows.append({"id": f"lookup-{tag}-{i:06d}", "messages": messages, "answer": LETTERS[order[0]]})
    return rows


def elimination_baseline(rows: list[dict[str, Any]]) -> list[float]:
    """Per-turn accuracy of a model that picks uniformly among the letters it has not given yet."""
    by_turn: dict[int, list[float]] = {}
    for r in rows:
        n = len(r["messages"]) // 2
        for t in range(n):
            by_turn.setdefault(t, []).append(1.0 / (n - t))
    return [sum(v) / len(v) for _, v in sorted(by_turn.items())]


def question_rows(manifest: Path, open_answer: bool) -> list[dict[str, Any]]:
    """The colour and shape questions of a synthetic manifest, asked for the option's letter and answered
    with it (the set itself asks for the option's text); with ``open_answer`` the option list is dropped
    and the target is the option's word instead."""
    rows = []
    for line in manifest.read_text().splitlines():
        r = json.loads(line)
        if r.get("question_type") not in ("color", "shape"):
            continue
        prompt = r["messages"][0]["content"][1]["text"].splitlines()
        r["messages"][0]["content"][1]["text"] = "\n".join(prompt[:-1] + ["Answer with the option's letter."])
        r["messages"][1]["content"][0]["text"] = r["answer"]
        if open_answer:
            word = r["choices"][LETTERS.index(r["answer"])]
            text = r["messages"][0]["content"][1]["text"].split("\n")[0] + " Answer with one word."
            r["messages"][0]["content"][1]["text"] = text
            r["messages"][1]["content"][0]["text"] = word
            r["answer"], r["id"] = word, r["id"] + "-open"
        rows.append(r)
    return rows


def cached_batches(rows: list[dict[str, Any]], path: Path, processor: Any, root: Path, batch_tokens: int,
                   shuffle: bool) -> list[dict[str, Any]]:
    from keye.data.loader import build_dataloader
    from keye.sft.inputs import MODEL_INPUT_KEYS

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loader = build_dataloader(path, processor, root=root, batch_tokens=batch_tokens, num_workers=0,
                              shuffle=shuffle, seed=0)
    keep = (*MODEL_INPUT_KEYS, "cu_seqlens")
    return [{k: v for k, v in b.items() if k in keep} for b in loader]


def first_token_accuracy(model: Any, batches: list[dict[str, Any]], blank: bool = False) -> list[tuple[int, int]]:
    """(correct, total) of the first token of every assistant turn, indexed by the turn's number in its
    sample (0 = first answer)."""
    from keye.sft.inputs import MODEL_INPUT_KEYS

    stats: list[list[int]] = []
    model.eval()
    with torch.no_grad():
        for b in batches:
            inputs = {k: v for k, v in b.items() if k in MODEL_INPUT_KEYS}
            if blank:  # a uniform mid-grey frame in the processor's normalised space
                for k in ("pixel_values", "pixel_values_videos"):
                    if inputs.get(k) is not None:
                        inputs[k] = torch.zeros_like(inputs[k])
            pred = model(**inputs).logits[0, :-1].argmax(-1)
            labels = b["labels"][0]
            tgt, prev = labels[1:], labels[:-1]
            starts = ((tgt != -100) & (prev == -100)).nonzero().flatten().tolist()
            bounds = b["cu_seqlens"].tolist()
            turn, sample = 0, -1
            for pos in starts:
                s = bisect.bisect_right(bounds, pos + 1) - 1  # the packed sample holding target pos + 1
                turn = turn + 1 if s == sample else 0
                sample = s
                while len(stats) <= turn:
                    stats.append([0, 0])
                stats[turn][0] += int(pred[pos] == tgt[pos])
                stats[turn][1] += 1
    model.train()
    return [(c, n) for c, n in stats]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe", choices=["lookup", "mc", "open"])
    ap.add_argument("--model", default="keye-tiny", help="starting checkpoint (dir or keye-tiny)")
    ap.add_argument("--synth", default=str(REPO / "data/synth"), help="the synthetic set (mc / open)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--train-rows", type=int, default=12000, help="lookup rows to train on")
    ap.add_argument("--test-rows", type=int, default=200, help="held-out lookup rows")
    ap.add_argument("--out", default=str(REPO / "runs/probe_mc"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor
    from keye.tiny import resolve_model_path

    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = resolve_model_path(args.model)
    processor = KeyeProcessor.from_pretrained(path)
    synth = Path(args.synth)
    if args.probe == "lookup":
        train_rows = lookup_rows(args.train_rows, args.seed, "train")
        test_rows = lookup_rows(args.test_rows, args.seed + 1, "test")
        baseline = elimination_baseline(test_rows)
    else:
        train_rows = question_rows(synth / "train.jsonl", args.probe == "open")
        test_rows = question_rows(synth / "test.jsonl", args.probe == "open")
        baseline = None
    t0 = time.time()
    train = cached_batches(train_rows, out / f"{args.probe}_train.jsonl", processor, synth, args.batch_tokens, True)
    test = cached_batches(test_rows, out / f"{args.probe}_test.jsonl", processor, synth, args.batch_tokens, False)
    print(f"{args.probe}: {len(train_rows)} train rows ({len(train)} batches), {len(test_rows)} held out, "
          f"cached in {time.time() - t0:.0f}s", flush=True)

    model = KeyeVL.from_pretrained(path, torch_dtype="float32")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    from keye.sft.inputs import MODEL_INPUT_KEYS

    curve: list[dict[str, Any]] = []

    def evaluate(step: int) -> None:
        per_turn = first_token_accuracy(model, test)
        point: dict[str, Any] = {"step": step, "per_turn": [c / n for c, n in per_turn],
                                 "first_answer": per_turn[0][0] / per_turn[0][1]}
        if baseline is not None:
            point["elimination_baseline"] = baseline
        elif args.probe in ("mc", "open"):
            blank = first_token_accuracy(model, test, blank=True)
            point["blank"] = blank[0][0] / blank[0][1]
        curve.append(point)
        extra = (f"  elimination baseline {[round(x, 3) for x in baseline]}" if baseline is not None
                 else f"  blank {point['blank']:.3f}")
        print(f"step {step:4d}  first answer {point['first_answer']:.3f}  per turn "
              f"{[round(x, 3) for x in point['per_turn']]}{extra}", flush=True)

    evaluate(0)
    step, rng = 0, random.Random(args.seed)
    while step < args.steps:
        rng.shuffle(train)
        for b in train:
            if step >= args.steps:
                break
            for g in opt.param_groups:  # 30-step linear warm-up, then constant
                g["lr"] = args.lr * min(1.0, (step + 1) / 30)
            loss = model(**{k: v for k, v in b.items() if k in MODEL_INPUT_KEYS}).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                evaluate(step)
    report = {"probe": args.probe, "model": str(args.model), "steps": args.steps, "lr": args.lr, "curve": curve}
    (out / f"{args.probe}.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
