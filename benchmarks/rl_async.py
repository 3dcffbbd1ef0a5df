"""RL throughput of asynchronous (SeamlessFlow-style) vs synchronous rollouts.

Part (a), measured on this machine: :func:`keye.recipes.rlep.train` (``rl.mode=async``) on keye-tiny with a local Ray
cluster (the rollout worker, a :class:`keye.rl.rollout.stream_worker.StreamWorker`, in a Ray actor with one torch
thread; the learner group of one rank, ``rl.ray.learners=1``, in another with one torch thread), synchronous
(``rl.max_staleness=0`` and the barrier update: only the batch of the current weights is generated, and nothing is
generated while the learner trains) vs asynchronous (``rl.max_staleness`` ``--staleness`` and the streaming update:
the next batch is generated during the update, unfinished answers continue under the new weights, and each group's
gradient is computed as soon as it is complete). Both run the same code, prompts, seeds and answer lengths; the
lengths are long-tailed: :class:`keye.rl.rollout.stream_worker.AnswerLengths` (``--a-mu``, ``--a-sigma``, capped at
``--a-max-tokens``) forces each answer's length (EOS masked until then). Throughput is trained answers per second
over the updates after ``--a-warmup`` (worker start-up and first batches excluded), the median of ``--a-repeats``
runs of each mode, run alternately. Without ``data/synth/train.jsonl`` (a fresh clone) the prompts are generated.

Part (b), the simulated cluster: first measures keye-tiny's costs on this machine (one decode step of
``model.generate`` at batch 1 and 16, prefill per prompt token, forward + backward per training token and
one AdamW step, copying the weights into a second model as the weight sync), then feeds them to the
discrete-event model of :mod:`keye.rl.distributed.simulate`: ``--gpus`` devices each costing what keye-tiny costs
here, ``--prompts`` x ``--group`` answers per update with lognormal lengths (``--mu``, ``--sigma``, capped at
``--max-tokens``), synchronous RL (all devices generate, then all train, then sync) vs asynchronous RL with
staleness ``--staleness`` (the best of colocated and tag-shared placements), with the barrier update and with the
streaming update. Answers in flight when new weights arrive pay a second prefill (prompt + the tokens they have, at
the measured prefill cost). Each device decodes at most ``prompts * group / gpus`` answers at once, so the
synchronous loop starts the whole batch at once. Two cost models: the measured CPU costs (a decode step grows with
the number of answers decoded), and GPU-like decoding (a step costs the same for any number of answers, priced at
the measured full-batch cost: memory-bound decoding, as a large model on a GPU), which is not measured here. Each
simulated ratio is shown with its ceiling (:func:`keye.rl.distributed.simulate.ceiling`), the most any schedule
with that staleness and update could reach on that workload.

Costs are measured on one CPU thread: with two threads on a shared machine the decode step time varied
twenty-fold between runs, with one it varied by about a quarter.

A sweep follows unless ``--no-sweep``: sigma (the tail) x staleness, both cost models, barrier -> streaming.
Then one line with the simulated staleness-1 streaming figure under both cost models, each beside its ceiling,
and the measured runs. The last line gives the measured ratio and the simulated one (staleness ``--staleness``,
the streaming update, re-prefill charged, GPU-like decoding). Last line:
``rl throughput async vs sync: measured X.XXx, simulated 64 GPUs Y.YYx``
(with ``--no-measured``: ``rl throughput async vs sync: simulated 64 GPUs Y.YYx (...)``).

Usage: python benchmarks/rl_async.py [--gpus 64] [--mu 6.0] [--sigma 1.0] [--max-tokens 4096] [--no-sweep]
       [--a-steps 12] [--a-repeats 3] [--a-update streaming] [--no-measured] [--quick]
       (about 10 minutes on 2 cores; ``--quick``: 8 simulated devices, one short run per mode, no sweep, about
       30 s, most of it starting Ray and its actors)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

import keye
from keye.rl.distributed.simulate import ClusterConfig, ceiling, compare


def _best_of(fn, repeats: int = 5) -> float:
    """Fastest of ``repeats`` timings of ``fn()`` (the machine is shared: the minimum is the least
    disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_costs(decode_steps: int = 24, wide: int = 16, train_rows: int = 4, train_len: int = 128,
                  repeats: int = 5) -> dict[str, float]:
    """keye-tiny's costs on this machine (seconds, each the best of ``repeats`` timings): ``decode_step_s`` +
    ``decode_token_s`` * n for one decode step of n answers (fitted through batches 1 and ``wide``),
    ``prefill_token_s`` per prompt token, ``train_token_s`` per trained token (forward + backward),
    ``train_step_s`` per AdamW step, ``sync_s`` per full weight copy."""
    model, processor = keye.load_tiny()
    model.eval()

    def batch(n: int, words: int):
        msgs = [[{"role": "user", "content": [{"type": "text", "text": "how many apples are left " * words}]}]]
        return processor(msgs * n, return_tensors="pt")

    def gen(b, new_tokens: int):
        # eos_token_id=[]: never stop early, so exactly new_tokens steps run
        model.generate(**b, max_new_tokens=new_tokens, do_sample=True, eos_token_id=[],
                       generator=torch.Generator().manual_seed(0))

    per_step = {}
    for n in (1, wide):
        b = batch(n, 4)
        gen(b, 2)  # warm-up
        per_step[n] = (_best_of(lambda b=b: gen(b, 1 + decode_steps), repeats)
                      - _best_of(lambda b=b: gen(b, 1), repeats)) / decode_steps
    # timing noise can make the difference negative: a cost below zero is not a cost
    decode_token_s = max(0.0, (per_step[wide] - per_step[1]) / (wide - 1))
    decode_step_s = max(1e-6, per_step[1] - decode_token_s)

    short, long = batch(1, 4), batch(1, 64)
    n_short, n_long = short["input_ids"].shape[1], long["input_ids"].shape[1]
    prefill_token_s = max(0.0, (_best_of(lambda: gen(long, 1), repeats) - _best_of(lambda: gen(short, 1), repeats))
                          / (n_long - n_short))

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    # text tokens only (random ids would include vision placeholders); each row a different shift
    text = processor.tokenizer("the farmer counts the apples in each basket and writes the total " * 40,
                               add_special_tokens=False)["input_ids"]
    ids = torch.tensor([text[r : r + train_len] for r in range(train_rows)], dtype=torch.long)

    def fwd_bwd():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()

    def opt_step():
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # warm-up: the first passes allocate and are several times slower
        fwd_bwd()
        opt_step()
    train_token_s = _best_of(fwd_bwd, repeats) / ids.numel()
    steps = []
    for _ in range(repeats):  # each timed AdamW step needs fresh gradients
        fwd_bwd()
        steps.append(_best_of(opt_step, 1))
    train_step_s = min(steps)
    model.eval()

    twin = copy.deepcopy(model)
    sync_s = _best_of(lambda: twin.load_state_dict(model.state_dict()), repeats)
    return {"decode_step_s": decode_step_s, "decode_token_s": decode_token_s, "prefill_token_s": prefill_token_s,
            "train_token_s": train_token_s, "train_step_s": train_step_s, "sync_s": sync_s}


DEFAULT_MANIFEST = "data/synth/train.jsonl"


def synth_manifest(manifest: str, into: Path, rows: int, log=print) -> str:
    """``manifest`` when it exists; when it is the default ``data/synth/train.jsonl`` and missing (a fresh
    clone), ``rows`` synthetic training prompts generated under ``into`` for this run: the same rows that
    ``keye data synth --out data/synth --train N --test 8`` writes first (a sample depends only on the seed, 0,
    and its index). Any other missing path raises SystemExit naming it."""
    if Path(manifest).is_file():
        return manifest
    if manifest != DEFAULT_MANIFEST:
        raise SystemExit(f"{manifest}: manifest file not found")
    from keye.data.synth import generate_split

    log(f"  {manifest} not found: generating {rows} synthetic prompts for this run "
        f"(`keye data synth --out data/synth --train {rows} --test 8` keeps a copy)")
    return str(generate_split(into / "synth", "train", rows, seed=0, workers=0, progress=False))


def measure_async_vs_sync(*, steps: int = 12, warmup: int = 3, repeats: int = 3, prompts: int = 4, group: int = 4,
                          mu: float = 3.5, sigma: float = 1.0, max_tokens: int = 160, staleness: int = 1,
                          manifest: str = DEFAULT_MANIFEST, limit: int = 64, seed: int = 0,
                          async_update: str = "streaming", log=print) -> dict[str, list[float]]:
    """Samples/s of the asynchronous RL loop on keye-tiny, synchronous (``max_staleness=0``) and asynchronous
    (``staleness``), ``repeats`` runs each, alternating; returns ``{"sync": [...], "async": [...]}``.

    Each run: ``steps`` updates of ``prompts`` x ``group`` answers whose lengths are forced by
    :class:`keye.rl.rollout.stream_worker.AnswerLengths` (``mu``, ``sigma``, ``max_tokens``; the same lengths in every
    run), the first ``warmup`` updates not timed. Uses one local Ray cluster for all runs (2 CPUs: one for the
    learner actor, one for the rollout actor, each with one torch thread; the driver only schedules and
    scores). The prompts are the first ``limit`` rows of ``manifest``, generated when it is the default one
    and missing (:func:`synth_manifest`). ``async_update`` is the asynchronous runs' ``rl.update`` (``streaming``, or
    ``barrier`` to separate the streaming update's share of the gain); the synchronous runs use ``barrier``."""
    import ray

    from keye.recipes.rlep import train
    from keye.rl.config import RLEPConfig
    from keye.rl.rollout.stream_worker import AnswerLengths
    from keye.train.config import load_config

    if warmup < 1 or steps <= warmup:
        raise SystemExit(f"need 1 <= warmup < steps, got warmup={warmup}, steps={steps}")
    lengths = AnswerLengths(mu, sigma, max_tokens, seed)
    out: dict[str, list[float]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        manifest = synth_manifest(manifest, Path(tmp), limit, log)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            for rep in range(repeats):
                for mode, k in (("sync", 0), ("async", staleness)):
                    cfg = load_config(RLEPConfig, None, [
                        "model.path=keye-tiny", f"data.manifest={manifest}", f"data.limit={limit}",
                        f"data.prompts_per_step={prompts}", f"rollout.G={group}", f"rollout.max_new_tokens={max_tokens}",
                        "rollout.max_batch_size=64", "replay.enabled=false", "algorithm.micro_batch_size=16",
                        "train.lr=1e-5", f"train.steps={steps}", f"train.seed={seed}", "train.device=cpu",
                        f"checkpoint.out_dir={Path(tmp) / f'{mode}{rep}'}", "checkpoint.export=false",
                        "log.progress=false", "rl.engine=ray", "rl.mode=async", f"rl.max_staleness={k}",
                        "rl.ray.torch_threads=1", "rl.ray.reward_workers=0",
                        f"rl.update={'barrier' if k == 0 else async_update}",
                    ])
                    summary = train(cfg, answer_length=lengths)
                    ends = summary["step_end_times"]
                    rate = prompts * group * (steps - warmup) / (ends[-1] - ends[warmup - 1])
                    out[mode].append(rate)
                    hist = json.dumps(summary["staleness"])
                    log(f"  run {rep + 1} {mode:5s}: {rate:6.2f} samples/s (staleness histogram {hist}, "
                        f"{summary['partial']} answers continued across an update)")
        finally:
            ray.shutdown()
    return out


# --quick: the same three parts (costs, simulation, measured runs) at sizes that take seconds
QUICK = {"gpus": 8, "prompts": 16, "group": 4, "steps": 4, "warmup": 1, "mu": 4.0, "max_tokens": 256,
         "prompt_tokens": 64, "no_sweep": True, "cost_repeats": 1, "cost_decode_steps": 4, "a_steps": 2,
         "a_warmup": 1, "a_repeats": 1, "a_prompts": 2, "a_group": 2, "a_mu": 2.0, "a_sigma": 0.5,
         "a_max_tokens": 8, "a_limit": 4}


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``); the last printed line is
    ``rl throughput async vs sync: measured X.XXx, simulated N GPUs Y.YYx``."""
    from _quick import parse_args

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=128, help="prompts (groups) per update")
    parser.add_argument("--group", type=int, default=16, help="answers per prompt")
    parser.add_argument("--steps", type=int, default=10, help="simulated updates (the first --warmup not timed)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--mu", type=float, default=6.0, help="lognormal mu of answer lengths (median exp(mu))")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of answer lengths")
    parser.add_argument("--max-tokens", type=int, default=4096, help="answer length cap")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sweep", action="store_true", help="skip the sigma / staleness sweep")
    parser.add_argument("--no-measured", action="store_true", help="skip part (a), the measured keye-tiny runs")
    parser.add_argument("--cost-repeats", type=int, default=5, help="(b) timings per measured cost (the fastest)")
    parser.add_argument("--cost-decode-steps", type=int, default=24, help="(b) decode steps timed per batch size")
    parser.add_argument("--a-steps", type=int, default=12, help="(a) updates per run (the first --a-warmup not timed)")
    parser.add_argument("--a-warmup", type=int, default=3, help="(a) first updates not timed")
    parser.add_argument("--a-repeats", type=int, default=3, help="(a) runs per mode (median)")
    parser.add_argument("--a-prompts", type=int, default=4, help="(a) prompts per update")
    parser.add_argument("--a-group", type=int, default=4, help="(a) answers per prompt")
    parser.add_argument("--a-mu", type=float, default=3.5, help="(a) lognormal mu of the forced answer lengths")
    parser.add_argument("--a-sigma", type=float, default=1.0, help="(a) lognormal sigma of the answer lengths")
    parser.add_argument("--a-max-tokens", type=int, default=160, help="(a) answer length cap")
    parser.add_argument("--a-limit", type=int, default=64, help="(a) prompts read from the manifest")
    parser.add_argument("--a-update", choices=("streaming", "barrier"), default="streaming",
                        help="(a) the asynchronous runs' rl.update (the synchronous runs use the barrier update)")
    args = parse_args(parser, argv, QUICK)
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    costs = measure_costs(decode_steps=args.cost_decode_steps, repeats=args.cost_repeats)
    print(f"keye-tiny costs measured on this machine in {time.perf_counter() - t0:.0f} s (one thread, best of "
          f"{args.cost_repeats}):")
    print(f"  decode step: {costs['decode_step_s'] * 1e3:.2f} ms + {costs['decode_token_s'] * 1e3:.3f} ms per answer "
          f"in the batch; prefill {costs['prefill_token_s'] * 1e6:.1f} us/token")
    print(f"  training: {costs['train_token_s'] * 1e6:.1f} us/token (forward + backward), AdamW step "
          f"{costs['train_step_s'] * 1e3:.1f} ms; weight sync {costs['sync_s'] * 1e3:.1f} ms")

    per_gpu = max(1, args.prompts * args.group // args.gpus)
    cfg = ClusterConfig(
        n_gpus=args.gpus, batch_prompts=args.prompts, group_size=args.group, steps=args.steps,
        warmup_steps=args.warmup, length_mu=args.mu, length_sigma=args.sigma, max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens, max_concurrent=per_gpu, seed=args.seed, **costs,
    )
    lengths = cfg.lengths(args.steps * args.prompts)
    print(f"simulated cluster: {args.gpus} devices; {args.prompts} prompts x {args.group} answers per update; "
          f"lengths lognormal(mu={args.mu}, sigma={args.sigma}) capped at {args.max_tokens} "
          f"(median {int(sorted(lengths.ravel())[lengths.size // 2])}, mean {lengths.mean():.0f}, "
          f"{(lengths == args.max_tokens).mean() * 100:.1f}% at the cap); {per_gpu} answers decoded at once "
          f"per device; {args.steps} updates, first {args.warmup} not timed")
    # GPU-like decoding: one step costs the same for any number of answers (memory-bound decoding), priced at
    # the measured cost of a full per-device batch
    flat = replace(cfg, decode_step_s=cfg.decode_step_s + cfg.decode_token_s * per_gpu, decode_token_s=0.0)
    results, ceilings = {}, {}
    for name, c in (("measured CPU costs", cfg), ("GPU-like decoding (a step costs the same for any batch)", flat)):
        print(f"  {name}:")
        for update in ("barrier", "streaming"):
            sync, best = compare(c, args.staleness, update=update)
            key = (c is flat, update)
            results[key] = best.samples_per_s / sync.samples_per_s
            ceilings[key] = ceiling(c, args.staleness, sync, update)
            where = "colocated" if best.placement == "colocated" else f"tagged, {best.train_gpus} train-tagged devices"
            print(f"    {update:9s} update: async / sync {results[key]:.2f}x "
                  f"(ceiling {ceilings[key]:.2f}x; sync {sync.samples_per_s:.2f} samples/s, "
                  f"async {best.samples_per_s:.2f}; staleness {args.staleness}, {where}; largest staleness used "
                  f"{best.max_staleness_seen}; {best.partial} answers continued across a weight update, "
                  f"{best.preempted} preemptions, {best.reprefill_tokens} tokens prefilled again after weight loads)")
    ratio = results[(True, "streaming")]
    if not args.no_sweep:
        print("sweep (async / sync, best placement, barrier -> streaming update; the ceilings in brackets):")
        for name, base in (("measured costs", cfg), ("GPU-like decoding", flat)):
            for sigma in (0.5, 1.0, 1.5):
                row = []
                for k in (1, 2):
                    c = replace(base, length_sigma=sigma)
                    cells = []
                    for update in ("barrier", "streaming"):
                        s, a = compare(c, k, update=update)
                        cells.append(f"{a.samples_per_s / s.samples_per_s:.2f}x ({ceiling(c, k, s, update):.2f}x)")
                    row.append(f"staleness {k}: {' -> '.join(cells)}")
                print(f"  {name}, sigma {sigma}: " + ", ".join(row))
    print(f"simulated {args.gpus} GPUs, staleness {args.staleness}, streaming update, re-prefill charged: "
          f"{results[(False, 'streaming')]:.2f}x with the CPU-measured decode costs (ceiling "
          f"{ceilings[(False, 'streaming')]:.2f}x), {ratio:.2f}x with GPU-like decoding (ceiling "
          f"{ceilings[(True, 'streaming')]:.2f}x; not measured: a step priced at the measured full-batch cost)")
    if args.no_measured:
        print(f"rl throughput async vs sync: simulated {args.gpus} GPUs {ratio:.2f}x (streaming update, GPU-like "
              "decoding, re-prefill charged)")
        return
    print(f"measured on this machine: keye-tiny, {args.a_prompts} prompts x {args.a_group} answers per update, "
          f"forced lengths lognormal(mu={args.a_mu}, sigma={args.a_sigma}) capped at {args.a_max_tokens}; rollout "
          f"worker and learner (one rank) in Ray actors (one torch thread each); {args.a_steps} updates per run, "
          f"first {args.a_warmup} not timed; sync = staleness 0 (barrier update), async = staleness {args.staleness} "
          f"with the {args.a_update} update")
    runs = measure_async_vs_sync(steps=args.a_steps, warmup=args.a_warmup, repeats=args.a_repeats,
                                 prompts=args.a_prompts, group=args.a_group, mu=args.a_mu, sigma=args.a_sigma,
                                 max_tokens=args.a_max_tokens, staleness=args.staleness, limit=args.a_limit,
                                 seed=args.seed, async_update=args.a_update)
    med = {m: statistics.median(v) for m, v in runs.items()}
    print(f"  median of {args.a_repeats}: sync {med['sync']:.2f} samples/s, async {med['async']:.2f} samples/s")
    print(f"rl throughput async vs sync: measured {med['async'] / med['sync']:.2f}x, simulated {args.gpus} GPUs "
          f"{ratio:.2f}x")


if __name__ == "__main__":
    main()
