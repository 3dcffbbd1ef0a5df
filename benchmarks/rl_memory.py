"""Peak memory per rank of one RL learner step, FSDP2 (sharded) vs replicated (``ddp``), on 2 ranks.
from keye.rl.rollout.settings import SamplingSettings

A random Keye-VL 1.5 (by default a 12-layer 512-wide decoder, 38.5 M parameters, vocabulary 520, the tiny
vision tower) in float32 on CPU, sized so that parameters + gradients + AdamW moments dominate the step, as
they do for the 8B recipe. One fixed RL batch is sampled once from that model with
:class:`keye.rl.LocalRollout` (prompts with and without an image, G responses each, rewards of both signs in
every group) and saved; every run loads the same batch and each rank keeps the groups ``g % 2 == rank``.
An RL step is what ``keye train rlep`` runs on the learner: old log-probs (:meth:`Learner.compute_logprobs`),
advantages, :meth:`Learner.update` (forward/backward of every micro-batch, gradient averaging or
reduce-scatter, clipping, the AdamW step). The recipe's settings: gradient checkpointing, no reference
model, ``kl_coef 0``; padded micro-batches unless ``--tree``.

What is measured, per rank: the resident set size (``/proc/self/statm``, sampled every 0.5 ms by a thread,
``benchmarks/_memory.py``) at its highest during the *second* step - the first step creates the AdamW
moments, so the second holds everything a long run holds - minus the RSS after the imports, the process group
and the batch, just before the learner builds its model. That difference is what the learner's state and the
step cost the process: parameters, gradients, optimizer moments, FSDP2's gathered units and unsharded
gradients, activations and temporaries. It is the CPU analogue of ``torch.cuda.max_memory_allocated`` (CPU
tensors have no allocator counter; a dispatch-mode tensor counter would miss the parameters, which exist
before any operator runs). The workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc serves every
tensor above 64 KiB from its own mapping and unmaps it on free: RSS then follows the live tensors instead of
keeping freed all-gather buffers in the heap (with glibc's adaptive threshold, freed blocks of up to 32 MiB
may stay resident, which would measure allocator history rather than what a layout holds). Both layouts also
carry a few tens of MiB that appear in the first step and stay (lazily initialised runtime state).

Each layout runs as ``python -m torch.distributed.run --nproc_per_node 2 --standalone`` of this file with
``--worker`` (gloo, ``OMP_NUM_THREADS=1``), both layouts in every repeat; a rank's figure is its own peak, a
run's figure the larger of its two ranks, the reported figure the median over repeats. Both layouts must
train the same model: the sum of the whole batch's old log-probs at each step (the second step's come from the
updated policy) and the gradient norm of each update agree to rtol 1e-4 (the loss cannot show it: at ratio 1
it depends on the advantages only). ``keye.rl.learner.plan.plan_memory``'s learner-phase prediction for the same model
and micro-batch (padded, float32, no overhead line) is printed next to the measurement. The last line is the
ratio of the medians, replicated over sharded. Last line:
``rl step peak memory per rank replicated vs sharded: X.XXx less``

Usage: python benchmarks/rl_memory.py [--repeats 3] [--hidden 512] [--layers 12] [--micro 4] [--tree] [--quick]
       (``--quick``: one repeat of a 2-layer 128-wide decoder, 2 x 2 answers of 4 tokens; still both 2-rank
       torchrun jobs, so about 20 s)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _memory import PeakRSS, current_rss_mib

LAYOUTS = ("ddp", "fsdp2")
NAMES = {"ddp": "replicated", "fsdp2": "fsdp2"}
WORLD = 2
# the recipe's settings (training/configs/keye_vl_8b_rlep.yaml): gradient checkpointing, no reference model,
# one epoch; one optimizer update per RL step here, so that a step is short
BASE = ["model.gradient_checkpointing=true", "algorithm.reference=false", "algorithm.kl_coef=0.0",
        "algorithm.ppo_epochs=1", "algorithm.mini_batches=1", "train.lr=1e-4", "train.grad_clip=1.0",
        "train.device=cpu", "log.progress=false", "tree.groups_per_micro_batch=1"]
AGREE_RTOL = 1e-4


# ------------------------------------------------------------------------------------------- fixtures
def build_checkpoint(directory: Path, *, hidden: int, layers: int, intermediate: int | None = None) -> Path:
    """Write a random Keye-VL 1.5 checkpoint and its tiny processor to ``directory``; returns it.

    The decoder has ``layers`` layers of width ``hidden`` (``hidden / 64`` query heads of 64, half as many KV
    heads, MLP width ``intermediate``, default ``3 * hidden``); vocabulary and vision tower are
    :func:`keye.config.tiny_config`'s, so the decoder layers hold nearly all parameters.
    Raises ValueError when ``hidden`` is not a positive multiple of 128.
    """
    from keye.config import TextConfig, tiny_config
    from keye.testing.model import save_tiny_checkpoint
    from keye.testing.processor import make_tiny_processor_dir

    if hidden < 128 or hidden % 128:
        raise ValueError(f"hidden must be a positive multiple of 128 (heads of 64, 2 query heads per KV "
                         f"head), got {hidden}")
    heads = hidden // 64
    vocab = tiny_config("1.5").text.vocab_size
    text = TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                      head_dim=64, mrope_section=(8, 12, 12), max_position_embeddings=40960)
    save_tiny_checkpoint(directory, "1.5", seed=0, text=text)
    make_tiny_processor_dir(directory, variant="1.5", vocab_size=vocab)
    return directory


def make_prompts(n: int) -> list:
    """``n`` arithmetic questions (:class:`keye.rl.RLPrompt`), every other one with a small random image."""
    from keye.rl import RLPrompt

    rng = np.random.default_rng(0)
    prompts = []
    for i in range(n):
        a, b = int(rng.integers(1, 50)), int(rng.integers(1, 50))
        content = [{"type": "text", "text": f"what is {a} plus {b}?"}]
        if i % 2 == 0:
            content.insert(0, {"type": "image", "image": rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)})
        prompts.append(RLPrompt(f"q{i}", [{"role": "user", "content": content}], reference=str(a + b),
                                task="numeric", mode="no_think"))
    return prompts


def build_samples(ckpt: Path, out: Path, *, prompts: int, group: int, new_tokens: int) -> Path:
    """Sample ``group`` responses to each of ``prompts`` prompts from the checkpoint, give every group rewards
    of both signs, and save ``{"samples", "pad_id"}`` to ``out`` (``torch.save``); returns ``out``."""
    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor
    from keye.rl import LocalRollout, SamplingSettings

    model = KeyeVL.from_pretrained(ckpt, torch_dtype="float32")
    proc = KeyeProcessor.from_pretrained(ckpt)
    engine = LocalRollout(model, proc, SamplingSettings(max_new_tokens=new_tokens), seed=3)
    samples = engine.generate(make_prompts(prompts), group)
    for i, s in enumerate(samples):
        s.reward, s.passed = float((i * 5) % 3), bool(i % 2)
    torch.save({"samples": samples, "pad_id": int(proc.pad_token_id)}, out)
    return out


def config_overrides(ckpt: Path, out_dir: Path, *, micro: int, new_tokens: int, tree: bool,
                     strategy: str) -> list[str]:
    """The ``RLEPConfig`` overrides of one layout (on top of :data:`BASE`)."""
    return [f"model.path={ckpt}", f"checkpoint.out_dir={out_dir}", f"train.strategy={strategy}",
            f"algorithm.micro_batch_size={micro}", f"rollout.max_new_tokens={new_tokens}",
            f"tree.enabled={'true' if tree else 'false'}", *BASE]


# --------------------------------------------------------------------------------------------- worker
def worker(out_dir: Path, ckpt: Path, samples_path: Path, overrides: list[str], *, steps: int = 2) -> dict:
    """Run ``steps`` RL learner steps in this process (one torchrun rank, or a lone process) and return, and
    write to ``out_dir/rank<r>.json``, this rank's record: ``peak_mib`` (highest RSS during the last step
    minus the RSS before the learner was built), ``built_mib`` (after building the learner), ``resident_mib``
    (after the last step), ``logp_sums`` (per step, the old log-probs of the whole batch summed over every
    rank), ``grad_norms`` (of every update), ``seconds`` (per step), rank, world size and the learner's
    strategy.

    Raises ValueError when ``steps < 2`` (the first step creates the optimizer state; the last is measured).
    """
    # what the learner imports lazily is imported before the baseline: transformers' modelling code alone is
    # ~200 MiB of RSS, which would otherwise count as learner state
    import torch.distributed.fsdp  # noqa: F401

    import keye.model.keye_vl  # noqa: F401
    import keye.train.checkpoint  # noqa: F401
    import keye.train.optim  # noqa: F401
    import keye.train.tree  # noqa: F401
    from keye.rl import assign_advantages
    from keye.rl.config import RLEPConfig, policy_loss_kwargs
    from keye.rl.learner.learner import Learner
    from keye.train import dist as kdist
    from keye.train.config import load_config

    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first creates the AdamW state), got {steps}")
    info = kdist.init_distributed("cpu")
    torch.manual_seed(0)
    cfg = load_config(RLEPConfig, None, overrides)
    use_tree = bool(cfg.tree.enabled)
    payload = torch.load(samples_path, weights_only=False)
    pad_id = int(payload["pad_id"])
    local = [s for s in payload["samples"] if s.group % info.world_size == info.rank]
    n_groups = len({s.group for s in local})
    del payload
    gc.collect()
    base = current_rss_mib()
    learner = Learner.from_config(cfg, info, model_path=ckpt)
    built = current_rss_mib() - base
    logp_sums, grad_norms, seconds, peak = [], [], [], 0.0
    for step in range(steps):
        for s in local:
            s.old_logp = s.ref_logp = s.advantage = None
        t0 = time.perf_counter()
        with PeakRSS() as mem:
            learner.compute_logprobs(local, pad_id=pad_id, use_tree=use_tree)
            assign_advantages(local)
            res = learner.update(local, n_groups=n_groups, seed=100 + step, pad_id=pad_id, use_tree=use_tree,
                                 loss_kwargs=policy_loss_kwargs(cfg))
        seconds.append(time.perf_counter() - t0)
        peak = mem.peak - base
        logp = sum(float(s.old_logp.double().sum()) for s in local)
        logp_sums.append(kdist.all_reduce_sum(logp, info.device))
        grad_norms += res.grad_norms
    record = {"rank": info.rank, "world_size": info.world_size, "strategy": learner.strategy,
              "peak_mib": peak, "built_mib": built, "resident_mib": current_rss_mib() - base,
              "logp_sums": logp_sums, "grad_norms": grad_norms, "seconds": seconds,
              "local_samples": len(local)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(record))
    kdist.barrier()
    return record


def _agree(a: dict, b: dict, rtol: float) -> bool:
    return all(len(a[k]) == len(b[k]) and np.allclose(a[k], b[k], rtol=rtol, atol=0)
               for k in ("logp_sums", "grad_norms"))


def aggregate(records: list[dict]) -> dict:
    """One run of one layout from its ranks' records: the largest ``peak_mib`` / ``built_mib`` /
    ``resident_mib`` over ranks, the rank holding the peak, the log-prob sums and gradient norms (global
    figures, the same on every rank: rank 0's) and the slowest rank's seconds per step.

    Raises ValueError on no records, a missing or repeated rank, or ranks that disagree on the strategy, the
    log-prob sums or the gradient norms (rtol 1e-6)."""
    if not records:
        raise ValueError("no worker records")
    world = records[0]["world_size"]
    if sorted(r["rank"] for r in records) != list(range(world)):
        raise ValueError(f"expected one record per rank 0..{world - 1}, "
                         f"got ranks {[r['rank'] for r in records]}")
    first = min(records, key=lambda r: r["rank"])
    for r in records:
        if r["strategy"] != first["strategy"] or not _agree(r, first, 1e-6):
            raise ValueError(f"rank {r['rank']} disagrees with rank 0: {r['strategy']} {r['logp_sums']} "
                             f"{r['grad_norms']} vs {first['strategy']} {first['logp_sums']} "
                             f"{first['grad_norms']}")
    top = max(records, key=lambda r: r["peak_mib"])
    return {"strategy": first["strategy"], "world_size": world, "peak_mib": top["peak_mib"],
            "peak_rank": top["rank"], "built_mib": max(r["built_mib"] for r in records),
            "resident_mib": max(r["resident_mib"] for r in records),
            "logp_sums": first["logp_sums"], "grad_norms": first["grad_norms"],
            "seconds": [max(s) for s in zip(*(r["seconds"] for r in records))]}


# ---------------------------------------------------------------------------------------------- parent
def plan_mib(ckpt: Path, samples_path: Path, overrides: list[str]) -> float:
    """``keye.rl.learner.plan.plan_memory``'s learner-phase bytes (MiB) on 2 ranks for the layout of ``overrides``
    (``train.strategy``, micro-batch size, ``rollout.max_new_tokens``, gradient checkpointing): this
    checkpoint, one padded micro-batch of rows of the batch's longest prompt + ``max_new_tokens``, the largest
    image per row, float32, no reference, no overhead line."""
    from keye.config import KeyeVLConfig
    from keye.rl.config import RLEPConfig
    from keye.rl.learner.plan import plan_memory
    from keye.train.config import load_config
    from keye.train.logprobs import DEFAULT_CHUNK_TOKENS

    cfg = load_config(RLEPConfig, None, overrides)
    micro, new = cfg.algorithm.micro_batch_size, cfg.rollout.max_new_tokens
    samples = torch.load(samples_path, weights_only=False)["samples"]
    prompt = max(int(s.inputs.input_ids.numel()) for s in samples)
    patches = max(0 if s.inputs.pixel_values is None else int(s.inputs.pixel_values.shape[0])
                  for s in samples)
    plan = plan_memory(KeyeVLConfig.from_json_file(ckpt), world_size=WORLD, strategy=cfg.train.strategy,
                       dtype="float32", micro_batch_tokens=micro * (prompt + new),
                       micro_batch_sequences=micro,
                       vision_patches=micro * patches, response_tokens=micro * new, padded=True,
                       gradient_checkpointing=cfg.model.gradient_checkpointing,
                       logprob_chunk=DEFAULT_CHUNK_TOKENS, ref="none", overhead_gb=0.0,
                       rollout={"engine": "keye", "max_batch_size": 1, "max_model_len": prompt + new})
    return plan.learner_bytes / 2**20


def run_layout(strategy: str, out_dir: Path, ckpt: Path, samples_path: Path,
               args: argparse.Namespace) -> dict:
    """Launch the 2-rank torchrun job of one layout and aggregate its records (RuntimeError with the workers'
    stderr when the job fails)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KEYE_LOG_LEVEL": "WARNING",
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--standalone",
           str(Path(__file__).resolve()), "--worker", "--out", str(out_dir), "--ckpt", str(ckpt),
           "--samples", str(samples_path), "--strategy", strategy, "--micro", str(args.micro),
           "--new-tokens", str(args.new_tokens), "--steps", str(args.steps)]
    cmd += ["--tree"] if args.tree else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy} workers failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return aggregate([json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))])


QUICK = {"repeats": 1, "hidden": 128, "layers": 2, "prompts": 2, "group": 2, "new_tokens": 4, "micro": 2}


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (or, with ``--worker``, one rank of a layout) with the command line ``argv`` (``None``:
    ``sys.argv[1:]``); the last line is the memory ratio."""
    from _quick import parse_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3 x hidden)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts (groups) in the batch, split over ranks")
    ap.add_argument("--group", type=int, default=4, help="G responses per prompt")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4, help="algorithm.micro_batch_size")
    ap.add_argument("--steps", type=int, default=2, help="RL steps per run; the last one is measured")
    ap.add_argument("--tree", action="store_true", help="shared-prefix tree micro-batches, not padded rows")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--strategy", choices=LAYOUTS, help=argparse.SUPPRESS)
    args = parse_args(ap, argv, QUICK)

    if args.worker:
        from keye.train import dist as kdist

        try:
            overrides = config_overrides(args.ckpt, args.out, micro=args.micro, new_tokens=args.new_tokens,
                                         tree=args.tree, strategy=args.strategy)
            worker(args.out, args.ckpt, args.samples, overrides, steps=args.steps)
        finally:
            kdist.cleanup()
        return

    if args.repeats < 1 or args.prompts < WORLD or args.steps < 2:
        ap.error(f"need --repeats >= 1, --prompts >= {WORLD} (a group per rank) and --steps >= 2")
    with tempfile.TemporaryDirectory(prefix="keye_rl_memory_") as tmp:
        tmp = Path(tmp)
        ckpt = build_checkpoint(tmp / "ckpt", hidden=args.hidden, layers=args.layers,
                                intermediate=args.intermediate)
        samples_path = build_samples(ckpt, tmp / "samples.pt", prompts=args.prompts, group=args.group,
                                     new_tokens=args.new_tokens)
        from keye.config import KeyeVLConfig
        from keye.rl.learner.plan import count_parameters

        n_params = count_parameters(KeyeVLConfig.from_json_file(ckpt)).total
        plans = {s: plan_mib(ckpt, samples_path, config_overrides(ckpt, tmp, micro=args.micro, tree=args.tree,
                                                                  new_tokens=args.new_tokens, strategy=s))
                 for s in LAYOUTS}
        print(f"model: {n_params / 1e6:.1f} M parameters (float32: {4 * n_params / 2**20:.0f} MiB), decoder "
              f"{args.layers} x {args.hidden}; batch {args.prompts} prompts x {args.group} responses of <= "
              f"{args.new_tokens} tokens, micro-batch {args.micro}, {'tree' if args.tree else 'padded'}, "
              f"gradient checkpointing; {WORLD} ranks", flush=True)
        runs: dict[str, list[dict]] = {s: [] for s in LAYOUTS}
        equal = True
        for i in range(args.repeats):
            for s in LAYOUTS:
                runs[s].append(run_layout(s, tmp / f"run{i}_{s}", ckpt, samples_path, args))
            a, b = runs["ddp"][-1], runs["fsdp2"][-1]
            same = _agree(a, b, AGREE_RTOL)
            equal &= same
            print(f"run {i + 1}: " + ", ".join(
                f"{NAMES[r['strategy']]} peak {r['peak_mib']:.0f} MiB (rank {r['peak_rank']}; after build "
                f"{r['built_mib']:.0f}, after the step {r['resident_mib']:.0f}; "
                f"step {r['seconds'][-1]:.1f} s)"
                for r in (a, b)) + f"; same training: {same}", flush=True)
        med = {s: statistics.median(r["peak_mib"] for r in runs[s]) for s in LAYOUTS}
        print(f"{'layout':<12}{'measured peak MiB/rank':>24}{'plan MiB/rank':>16}")
        for s in LAYOUTS:
            print(f"{NAMES[s]:<12}{med[s]:>24.0f}{plans[s]:>16.0f}")
        print(f"plan ratio {plans['ddp'] / plans['fsdp2']:.2f}x (padded micro-batches); both layouts trained "
              f"the same model (log-probs and gradient norms, rtol {AGREE_RTOL}): {'yes' if equal else 'no'}")
        ratio = med["ddp"] / max(med["fsdp2"], 1e-3)
        print(f"rl step peak memory per rank replicated vs sharded: {ratio:.2f}x less")


if __name__ == "__main__":
    main()
