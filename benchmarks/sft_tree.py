"""SFT step time on multi-answer rows: shared-prefix forest vs one row per answer (CPU).

A micro-batch of ``--rows`` multi-answer rows, each a 2,048-token video prompt (mostly video
placeholders) with B = 4 answers of 96 tokens, built exactly as the SFT loader builds it
(:class:`keye.sft.trees.TreeSampleProcessor` layout joined by ``collate_packed``), on the random
benchmark-size Keye-VL of ``benchmarks/tree.py``. One "step" is forward + summed token loss + backward:

- unshared (``train.tree=off``): :func:`keye.sft.trees.unshared_batch` expands every answer into its own
  packed row (prompt and video repeated B times) and the model's packed loss runs on it;
- tree (``train.tree=auto``): :func:`keye.sft.trees.tree_loss`, one forest row, every prompt and the
  vision tower once.

Both give the same loss and gradients (checked here). Reports medians of ``--repeats`` interleaved runs
after a warm-up; the last line is the speedup. Last line:
``speedup tree vs unshared (SFT forward+backward, one micro-batch): X.XXx``

Usage: ``.venv/bin/python benchmarks/sft_tree.py [--repeats 3] [--rows 2] [--answers 4] [--quick]``
(``--quick``: one run of 1 row, a 256-token prompt and 2 answers of 16 tokens)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tree import make_group, make_model

from keye.data.collate import collate_packed
from keye.sft.inputs import model_inputs
from keye.sft.trees import target_tokens, tree_loss, unshared_batch
from keye.train.tree import build_tree

CPU = torch.device("cpu")


def make_micro_batch(model, rows: int, answers: int, prompt_len: int, answer_len: int) -> dict:
    """The loader's micro-batch for ``rows`` multi-answer rows (different videos and answers per row)."""
    outs = []
    for r in range(rows):
        prompt, responses, vis = make_group(model.config.variant, prompt_len, answers, answer_len, seed=r)
        seqs = [prompt + a for a in responses]
        masks = [[False] * len(prompt) + [True] * len(a) for a in responses]
        grids = type(vis)(video_grid_thw=vis.video_grid_thw, second_per_grid_ts=vis.second_per_grid_ts)
        tree = build_tree(model.config, seqs, masks, grids)
        out = {"input_ids": tree.input_ids, "labels": torch.full_like(tree.input_ids, -100), "tree": [tree],
               "pixel_values_videos": vis.pixel_values_videos, "video_grid_thw": vis.video_grid_thw}
        if vis.second_per_grid_ts is not None:
            out["second_per_grid_ts"] = vis.second_per_grid_ts
        outs.append(out)
    return collate_packed(outs)


def timed_step(model, loss_fn) -> tuple[float, float, torch.Tensor]:
    """Seconds for forward + loss + backward, the loss, and the lm-head + patch-embedding gradients."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = loss_fn()
    loss.backward()
    dt = time.perf_counter() - t0
    patch = model.visual.vision_model.embeddings.patch_embedding.weight.grad
    return dt, float(loss.detach()), torch.cat([model.lm_head.weight.grad.reshape(-1), patch.reshape(-1)]).clone()


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``) and print medians; the last
    line is the tree-vs-unshared speedup."""
    from _quick import parse_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (median reported)")
    parser.add_argument("--variant", choices=("preview", "1.5"), default="1.5")
    parser.add_argument("--rows", type=int, default=2, help="multi-answer rows in the micro-batch")
    parser.add_argument("--answers", type=int, default=4, help="answers per row")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--answer-len", type=int, default=96)
    args = parse_args(parser, argv, {"repeats": 1, "rows": 1, "answers": 2, "prompt_len": 256, "answer_len": 16})

    model = make_model(args.variant)
    mb = make_micro_batch(model, args.rows, args.answers, args.prompt_len, args.answer_len)
    expanded = unshared_batch(mb, pad_token_id=0)
    print(
        f"model: {model.num_parameters() / 1e6:.1f}M params ({args.variant}), threads {torch.get_num_threads()}; "
        f"{args.rows} rows x ({args.prompt_len}-token video prompt + {args.answers} answers x {args.answer_len} tokens)"
    )
    print(
        f"tokens per step: unshared {expanded['num_tokens']}, tree {mb['num_tokens']} "
        f"({expanded['num_tokens'] / mb['num_tokens']:.2f}x fewer); target tokens {target_tokens(mb)} in both"
    )
    # both sides through the full-vocabulary head (the chunked loss, benchmarks/sft_memory.py, is another claim):
    # the difference measured here is the shared prefix alone
    methods = {
        "unshared": lambda: model(**model_inputs(expanded, CPU), loss_reduction="sum").loss,
        "tree": lambda: tree_loss(model, mb, CPU, chunk_tokens=None),
    }
    timed_step(model, methods["tree"])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in methods}
    losses: dict[str, float] = {}
    grads: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):  # interleaved, so that load from other processes hits both methods alike
        for name, fn in methods.items():
            dt, losses[name], grads[name] = timed_step(model, fn)
            times[name].append(dt)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"{name:>10}: median {medians[name]:.3f} s over {args.repeats} runs ({', '.join(f'{t:.2f}' for t in ts)})")
    rel_loss = abs(losses["tree"] - losses["unshared"]) / abs(losses["unshared"])
    rel_grad = float((grads["tree"] - grads["unshared"]).abs().max() / grads["unshared"].abs().max())
    print(f"tree vs unshared: loss {rel_loss:.1e} relative, gradients (lm head + patch embedding) {rel_grad:.1e} relative")
    if rel_loss > 1e-5 or rel_grad > 1e-4:
        raise SystemExit("the tree step differs from the unshared computation")
    print(f"speedup tree vs unshared (SFT forward+backward, one micro-batch): {medians['unshared'] / medians['tree']:.2f}x")


if __name__ == "__main__":
    main()
