"""Metrics of the RL loop: the all-rank step row (``metrics.jsonl``), dynamic-sampling counts, the progress bar's
figures (the log itself is the floor's :class:`keye.train.metrics.RunLog`) and the run summary's one-line report.

The reductions here are collective: every rank calls them in the same order with its own samples.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from keye.rl.rollout.samples import RolloutSample
from keye.train.dist import all_gather, reduce_sums


def mean(xs: Sequence[float]) -> float:
    """The mean of ``xs`` as a float (0.0 for an empty sequence)."""
    return float(sum(xs) / len(xs)) if xs else 0.0


def dynsample_stats(res: Any, device: torch.device) -> dict[str, float]:
    """All-rank dynamic-sampling metrics (collective): groups generated and dropped summed over ranks, the
    kept fraction of those sums, and the rounds of the slowest rank."""
    g = reduce_sums({"generated": float(res.generated), "dropped": float(res.dropped)}, device)
    rounds = max(all_gather(int(res.rounds)))
    kept = (g["generated"] - g["dropped"]) / g["generated"] if g["generated"] else 0.0
    return {"dynsample/rounds": float(rounds), "dynsample/generated": g["generated"],
            "dynsample/dropped": g["dropped"], "dynsample/kept_frac": kept}


def step_metrics(samples: Sequence[RolloutSample], update_stats: list[dict[str, float]],
                  device: torch.device, tis: bool = False) -> dict[str, float]:
    """Global (all-rank) step metrics: reward mean and per part, pass rate, replay share, response
    length of the fresh rollouts, and update stats: per update the mean over every rank's loss tokens
    (each rank's stats weighted by its ``local_tokens``, so a rank without tokens adds nothing), then the
    mean over the step's updates (every rank holds the same updates in the same order). ``tis``: also the
    truncated importance-sampling statistics (``algorithm.tis_cap`` set)."""
    fresh = [s for s in samples if s.source == "rollout"]
    valid = [s for s in samples if s.valid]
    sums: dict[str, float] = {
        "n_fresh": float(len(fresh)), "n_valid": float(len(valid)),
        "reward": sum(float(s.reward) for s in fresh), "passed": float(sum(bool(s.passed) for s in fresh)),
        "replay": float(sum(s.source == "replay" for s in valid)),
        "length": float(sum(s.num_tokens for s in fresh)),
        "tokens": float(sum(s.num_tokens + s.inputs.length for s in valid)),
        "replay_reward": sum(float(s.reward) for s in valid if s.source == "replay"),
        "adv_abs": sum(abs(float(s.advantage or 0.0)) for s in valid),
    }
    part_names = ("format", "accuracy", "json", "code", "markdown", "steps", "length", "repetition", "overlong")
    for name in part_names:
        vals = [s.metadata.get("reward_parts", {}).get(name) for s in fresh]
        vals = [v for v in vals if v is not None]
        sums[f"part/{name}"] = float(sum(vals))
        sums[f"part_n/{name}"] = float(len(vals))
    stat_keys = ("clip_frac", "clip_frac_high", "clip_frac_low", "dual_clip_frac", "approx_kl", "entropy", "kl",
                 "ratio_mean")
    if tis:
        stat_keys += ("tis_weight_mean", "tis_clip_frac", "rollout_logp_abs_diff")
    n_upd = float(len(update_stats))
    for i, st in enumerate(update_stats):
        w = st["local_tokens"]
        sums[f"stat_w/{i}"] = w
        for k in stat_keys:
            sums[f"stat/{k}/{i}"] = st.get(k, 0.0) * w
    sums["stat/has_kl"] = float(any("kl" in st for st in update_stats))
    g = reduce_sums(sums, device)
    # every rank runs the same number of updates; the global loss of an update is the sum of the rank shares
    losses = [st.get("loss", 0.0) for st in update_stats]
    loss_sum = reduce_sums({"loss": sum(losses)}, device)["loss"]
    row = {
        "loss": loss_sum / max(n_upd, 1.0),
        "reward/mean": g["reward"] / max(g["n_fresh"], 1.0),
        "pass_rate": g["passed"] / max(g["n_fresh"], 1.0),
        "replay_share": g["replay"] / max(g["n_valid"], 1.0),
        "replay_reward": g["replay_reward"] / max(g["replay"], 1.0),
        "response_length": g["length"] / max(g["n_fresh"], 1.0),
        "adv_abs_mean": g["adv_abs"] / max(g["n_valid"], 1.0),
        "_tokens": g["tokens"],
        "_fresh": g["n_fresh"],
    }
    for name in part_names:
        if g[f"part_n/{name}"]:
            row[f"reward/{name}"] = g[f"part/{name}"] / g[f"part_n/{name}"]
    for k in stat_keys:
        if k == "kl" and not g["stat/has_kl"]:
            continue
        per_update = [g[f"stat/{k}/{i}"] / g[f"stat_w/{i}"] for i in range(len(update_stats)) if g[f"stat_w/{i}"]]
        row[k] = mean(per_update)
    return row


def step_row(batch: Any, update: Any, pool: Any, device: torch.device, *, tis: bool,
             t0: float) -> tuple[dict[str, float], float]:
    """The ``metrics.jsonl`` row of one step (collective) and the step's token count over all ranks.

    ``batch`` is the step's :class:`keye.rl.loop.batcher.StepBatch` (its samples, stage timings, dynamic-sampling and
    AutoThink rows, pool growth), ``update`` the learner's :class:`keye.rl.learner.learner.UpdateResult`, ``pool`` the
    replay pool (its size statistics), ``t0`` the step's start (for ``tokens_per_s``)."""
    row = step_metrics(batch.samples, update.stats, device, tis=tis)
    row.update({f"time/{k}": v for k, v in batch.timing.items()})
    row.update(batch.dynsample)
    row.update(batch.autothink)
    row.update(batch.extra)
    row.update(pool.stats())
    row["pool/added"] = float(batch.pool_added)
    row["grad_norm"] = mean(update.grad_norms)
    row["updates_skipped"] = float(update.skipped)
    row["lr"] = update.lr
    dt = time.time() - t0
    tokens = row.pop("_tokens")
    row["tokens_per_s"] = tokens / max(dt, 1e-9)
    row["samples_per_s"] = row.pop("_fresh") / max(dt, 1e-9)
    return row, tokens


def progress_figures(row: dict[str, Any]) -> dict[str, str]:
    """The progress bar's figures of an RL step row (:class:`keye.train.metrics.RunLog` ``postfix``)."""
    out = {"reward": f"{row['reward/mean']:.3f}", "pass_": f"{row['pass_rate']:.2f}",
           "replay": f"{row['replay_share']:.2f}", "clip": f"{row['clip_frac']:.3f}",
           "kl": f"{row.get('kl', row['approx_kl']):.4f}", "ent": f"{row['entropy']:.2f}",
           "len": f"{row['response_length']:.1f}", "tok_s": f"{row['tokens_per_s']:.0f}"}
    if "staleness/mean" in row:  # the asynchronous batch source
        out.update(stale=f"{row['staleness/mean']:.2f}", partial=str(int(row["partial_rollouts"])))
    return out


def format_summary(s: dict[str, Any], out_dir: Path) -> str:
    """A human-readable end-of-run report."""
    curve = s["eval_curve"]
    ev = "" if not curve else f", held-out accuracy {curve[0]['accuracy']:.3f} -> {curve[-1]['accuracy']:.3f}"
    rew = "n/a" if not s["rewards"] else f"{s['rewards'][0]:.3f} -> {s['rewards'][-1]:.3f}"
    return (f"{'RLEP' if s['replay_M'] else 'GRPO'} {'finished' if s['finished'] else 'stopped'}: {s['steps']} steps, "
            f"reward {rew}{ev}, tree={s['tree']}, {s['seconds']:.1f}s on {s['world_size']} process(es); "
            f"outputs in {out_dir}")
