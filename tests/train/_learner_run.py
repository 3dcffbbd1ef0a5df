"""A fixed RL batch trained by :class:`keye.rl.learner.learner.Learner` for a few steps (used by test_rl_sharded.py).
from keye.rl.rollout.settings import SamplingSettings

``run(...)`` works in one process and under torchrun: every rank builds the same samples (seeded rollouts of
the same checkpoint, replayed answers included), keeps its share of the groups (rank 0 most of them, so the
ranks run different numbers of micro-batches), and runs ``steps`` x (old log-probs, reference log-probs,
advantages, update). The weights are exported shard by shard at the end; rank 0 writes them, the update
statistics and the shard sizes to ``out_dir/<name>.*``.

Command line (torchrun): OUT_DIR CKPT MANIFEST POOL NAME=key=value,key=value [NAME=...]; test_rl_sharded.py runs
it as ``learner`` jobs of ``_dist_rlep.py`` instead (one launch with the loop runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

GROUPS_OF_RANK = {1: [[0, 1, 2, 3]], 2: [[0, 1, 2], [3]]}
BASE = ["data.prompts_per_step=4", "rollout.G=2", "rollout.max_new_tokens=5", "replay.M=1", "train.lr=1e-3",
        "algorithm.micro_batch_size=2", "algorithm.ppo_epochs=2", "algorithm.mini_batches=1",
        "algorithm.reference=true", "algorithm.kl_coef=0.05", "algorithm.kl_estimator=k3",
        "tree.groups_per_micro_batch=1", "log.progress=false", "train.device=cpu", "train.grad_clip=1.0"]


def build_samples(ckpt: Path, manifest: Path, pool_path: Path):
    """The same scored samples in every process: 4 prompts x (2 fresh + 1 replayed) responses."""
    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor
    from keye.rl import LocalRollout, ReplayPool, SamplingSettings, add_replay, load_rl_prompts

    model = KeyeVL.from_pretrained(ckpt, torch_dtype="float32")
    proc = KeyeProcessor.from_pretrained(ckpt)
    prompts = load_rl_prompts(manifest)[:4]
    fresh = LocalRollout(model, proc, SamplingSettings(max_new_tokens=5), seed=3).generate(prompts, 2)
    pool = ReplayPool.load_jsonl(pool_path)
    eos = int(model.config.eos_token_ids[0])
    samples = add_replay(fresh, pool, 1, encode=lambda t: list(proc.tokenizer(t, add_special_tokens=False)["input_ids"]),
                         eos_id=eos, max_response_len=5, rng=__import__("random").Random(0),
                         decode=lambda ids: proc.decode(ids, skip_special_tokens=True))
    for i, s in enumerate(samples):  # rewards with both signs inside every group
        s.reward, s.passed = float((i * 5) % 3), bool(i % 2)
    return samples, int(proc.pad_token_id)


def run(out_dir: Path, ckpt: Path, manifest: Path, pool: Path, name: str, overrides: list[str], *, steps: int = 3) -> None:
    """Train the fixed batch with ``overrides`` on top of :data:`BASE`; see the module docstring."""
    from keye.rl import assign_advantages
    from keye.rl.config import RLEPConfig, policy_loss_kwargs
    from keye.rl.learner.learner import Learner
    from keye.train import dist as kdist
    from keye.train.config import load_config

    info = kdist.init_distributed("cpu")
    torch.manual_seed(0)
    # drop_group=K: group K was filtered out (dynamic sampling): it is in neither the batch nor its counts
    drop = {int(o.split("=", 1)[1]) for o in overrides if o.startswith("drop_group=")}
    overrides = [o for o in overrides if not o.startswith("drop_group=")]
    cfg = load_config(RLEPConfig, None, [f"model.path={ckpt}", f"checkpoint.out_dir={out_dir}", *BASE, *overrides])
    use_tree = bool(cfg.tree.enabled)
    learner = Learner.from_config(cfg, info, model_path=ckpt)
    samples, pad_id = build_samples(ckpt, manifest, pool)
    mine = [g for g in GROUPS_OF_RANK[info.world_size][info.rank] if g not in drop]
    local = [s for s in samples if s.group in mine]
    stats = []
    for step in range(steps):
        for s in local:
            s.old_logp = s.ref_logp = s.advantage = None
        if cfg.rl.update == "streaming":
            res = _streaming_step(learner, local, pad_id, use_tree, policy_loss_kwargs(cfg))
        else:
            learner.compute_logprobs(local, pad_id=pad_id, use_tree=use_tree)
            learner.compute_logprobs(local, target="ref_logp", pad_id=pad_id, use_tree=use_tree)
            assign_advantages(local)
            res = learner.update(local, n_groups=len(mine), seed=100 + step, pad_id=pad_id, use_tree=use_tree,
                                 loss_kwargs=policy_loss_kwargs(cfg))
        stats.append({"loss": kdist.all_reduce_sum(sum(st["loss"] for st in res.stats), info.device),
                      "tokens": [st["tokens"] for st in res.stats], "skipped": res.skipped})
    # the rollout side's view: a LocalRollout over a fresh copy of the start checkpoint receives the shards
    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor
    from keye.rl import LocalRollout

    receiver = LocalRollout(KeyeVL.from_pretrained(ckpt, torch_dtype="float32"), KeyeProcessor.from_pretrained(ckpt))
    sizes: list[int] = []
    shapes: list[int] = []

    def shards():
        for shard in learner.export_weights(max_bytes=64 * 1024):
            sizes.append(sum(t.numel() * t.element_size() for t in shard.values()))
            shapes.append(len(shard))
            yield shard

    receiver.load_weights(shards(), version=steps)
    weights = {k: v.detach().clone() for k, v in receiver.model.state_dict().items()}
    full = learner.full_state_dict()  # the learner's own gathered state (rank 0)
    if info.is_main:
        exact = set(full) == set(weights) and all(torch.equal(full[k], weights[k]) for k in full)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / f"{name}.safetensors"))
        (out_dir / f"{name}.json").write_text(json.dumps({"stats": stats, "shard_bytes": sizes, "shard_tensors": shapes,
                                                          "export_exact": exact, "version": receiver.weight_version,
                                                          "strategy": learner.strategy,
                                                          "ref_placement": learner.ref_placement}))
    kdist.barrier()


def _streaming_step(learner, local, pad_id: int, use_tree: bool, loss_kwargs: dict):
    """The streaming update of the same samples: each group in turn gets its log-probs, advantages and gradient
    (as it would when it completes), one optimizer step at the end. Every rank takes part in every part
    (collectives), one group of its own per part while it has any."""
    from keye.rl import assign_advantages
    from keye.train import dist as kdist

    groups: dict[int, list] = {}
    for s in local:
        groups.setdefault(s.group, []).append(s)
    own = list(groups.values())
    rounds = int(kdist.all_max(len(own), learner.device))
    parts = []
    for i in range(rounds):
        part = own[i] if i < len(own) else []
        learner.compute_logprobs(part, pad_id=pad_id, use_tree=use_tree)
        learner.compute_logprobs(part, target="ref_logp", pad_id=pad_id, use_tree=use_tree)
        assign_advantages(part)
        parts.append(learner.accumulate_part(part, pad_id=pad_id, use_tree=use_tree, loss_kwargs=loss_kwargs))
    return learner.finish_update(parts, loss_kwargs=loss_kwargs)


if __name__ == "__main__":
    from keye.train import dist as kdist

    out, ckpt, manifest, pool, *jobs = sys.argv[1:]
    try:
        for job in jobs:
            name, _, rest = job.partition("=")
            run(Path(out), Path(ckpt), Path(manifest), Path(pool), name, [x for x in rest.split(",") if x])
    finally:
        kdist.cleanup()
