"""RLEP / GRPO-family reinforcement learning of Keye-VL (the recipe behind ``keye train rlep``).

Launch::

    keye rlep collect --policy runs/tiny/final --data data/synth/train.jsonl --n 8 --out runs/pool.jsonl
    keye train rlep --config training/configs/tiny_synth_rlep.yaml                 # one CPU, minutes
    torchrun --nproc_per_node 8 -m keye train rlep --config training/configs/keye_vl_8b_rlep.yaml

This module is the recipe: the config entry points and :func:`train`, a short loop over named components that
live in their own modules under ``keye/rl/`` (docs/rl_learner.md, "Module layout"):

- config (:mod:`keye.rl.config`): the YAML sections, :class:`RLEPConfig`, :func:`validate`;
- components (:mod:`keye.rl.loop.components`): the learner, the rollout engine, the whole-weight models, the weight
  sync, built in this process group or as Ray actors (:mod:`keye.rl.distributed`);
- rollout (:mod:`keye.rl.loop.batcher`): prompts -> sampled, replayed, scored and filtered groups, online pool growth;
- learner (:mod:`keye.rl.learner`): old / reference log-probs, advantages, PPO updates;
- state (:mod:`keye.rl.loop.state`): prompt stream, replay pool, trainer state, checkpoints;
- evaluation (:mod:`keye.rl.loop.evaluate`) and metrics (:mod:`keye.rl.loop.metrics`).

One step (``keye.rl.algorithms.update`` gives the core order):

1. draw ``data.prompts_per_step / world`` prompts on each rank (its own slice of a seeded per-epoch
   permutation), give them thinking modes (``algorithm.mode_mix``), sample ``rollout.G`` responses each
   (``algorithm.autothink``: each prompt becomes linked auto / forced-think / forced-direct groups and the auto
   replies get the mode-selection reward, :mod:`keye.rl.algorithms.autothink`);
2. RLEP phase B: append ``replay.M`` replayed successes per group (missing ones as masked rows), score
   fresh and replayed responses with the same reward; with ``algorithm.dynamic_sampling`` groups whose
   accuracy (or total reward: ``dynamic_sampling_metric``) is all equal are dropped and refilled (at most
   ``max_rounds`` rounds);
3. online pool growth with new verified successes (gathered from every rank);
4. old (and reference) log-probs with the current policy - replayed responses included - through the
   shared-prefix tree (``tree.enabled``) or padded batches, then group-normalised advantages over the
   enlarged groups (+ optional difficulty reshaping by the fresh pass rate; with
   ``algorithm.kl_reward_coef`` the reward minus the k1 KL to the reference, summed over the response);
5. ``ppo_epochs`` x ``mini_batches`` optimizer updates on whole groups; every micro-batch loss is
   normalised by the token count of the whole mini-batch over all ranks, gradients are summed over
   ranks (data parallelism by explicit all-reduce: ranks may hold different numbers of live samples);
   a mini-batch without a loss token on any rank is skipped on every rank (no empty AdamW step).

All randomness of a step (sampling, replay draws, mode assignment, mini-batch order) is seeded from
``(train.seed, step, rank)``; a checkpoint stores the model, optimizer, scheduler, the prompt stream
cursors, the replay pool (entries + RNG) and the rollout generator states (a vLLM engine's seed
counter), so a resumed run reproduces the uninterrupted one exactly (on CPU). A vLLM engine holds its own
copy of the weights: it is synced after every update and, after a resume, before the first rollout.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keye.rl.config import RLEPConfig, policy_loss_kwargs, replay_m, tree_enabled, validate
from keye.rl.loop.batcher import RolloutBatcher, StepBatch, prepare_update
from keye.rl.loop.components import build_components
from keye.rl.loop.evaluate import Evaluator, greedy_accuracy
from keye.rl.loop.metrics import RunLog, format_summary, step_row
from keye.rl.loop.state import (
    Checkpoints,
    PromptStream,
    RunState,
    load_pool,
    load_prompts,
    record_step,
    select_prompts,
    step_seed,
    trainer_state,
)
from keye.rl.rollout.scoring import RewardScorer
from keye.tiny import resolve_model_path
from keye.train import dist as kdist
from keye.train.config import dump_config, load_config, to_dict

log = logging.getLogger("keye.recipes.rlep")


def train(cfg: RLEPConfig, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run the RL recipe as configured; returns the run summary (also written to ``summary.json``).

    ``stop_after`` stops after that many RL steps *of this invocation* without the final save (simulates a
    crash in resume tests). The summary holds per-step ``losses`` (mean over the step's optimizer updates),
    ``rewards`` (mean fresh reward), ``pass_rates`` and the ``eval_curve``. With ``rl.engine=ray
    rl.mode=async`` the asynchronous loop runs instead (:func:`keye.rl.distributed.streaming.train_async`).
    """
    if cfg.rl.engine == "ray" and cfg.rl.mode == "async":
        from keye.rl.distributed.streaming import train_async

        return train_async(cfg, stop_after=stop_after)
    from keye.processing.processor import KeyeProcessor
    from keye.rewards import RewardSpec

    info = kdist.init_distributed(cfg.train.device)
    validate(cfg, info.world_size)
    out_dir = Path(cfg.checkpoint.out_dir)
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out_dir / "config.yaml")
    kdist.barrier()
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)

    # the components: learner + rollout engine (in this process group or on Ray), scorer, pool, prompts, eval
    model_path = resolve_model_path(cfg.model.path)
    processor = KeyeProcessor.from_pretrained(resolve_model_path(cfg.model.processor or cfg.model.path))
    parts = build_components(cfg, info, model_path, processor)
    learner, engine, frozen = parts.learner, parts.engine, parts.learner.frozen
    scorer = parts.scorer if parts.scorer is not None else RewardScorer(RewardSpec.from_dict(cfg.reward.spec),
                                                                        pass_value=cfg.reward.pass_value)
    pool = load_pool(cfg)
    prompts = load_prompts(cfg)
    evaluator = Evaluator(cfg, parts, processor, info, out_dir)
    ckpts = Checkpoints(out_dir, cfg.checkpoint.keep_last, info.is_main)
    prompts = select_prompts(cfg, prompts, ckpts.resumed_state(), engine, scorer, info)
    state = trainer_state(prompts, cfg)
    run_state = RunState(PromptStream(prompts, cfg.train.seed, info.rank, info.world_size, cfg.data.shuffle),
                         pool, engine, info.rank)
    if ckpts.latest is not None:
        state = learner.load_checkpoint(ckpts.latest, run_state)
        if info.is_main:
            log.info("resumed from %s at step %d", ckpts.latest, state["step"])
    if getattr(engine, "weight_version", state["step"]) != state["step"]:
        # the engine was built from the start checkpoint: after a resume it must serve the resumed policy
        # before the first rollout (it is synced after every update from then on)
        parts.sync(state["step"], cfg.rollout.sync_bytes)
    runlog = RunLog(cfg, out_dir, info.is_main, state["step"], replay=bool(replay_m(cfg)))
    rollout = RolloutBatcher(cfg, engine, scorer, pool, run_state.stream, processor,
                             int(learner.config.eos_token_ids[0]), info, out_dir, state["step"])
    use_tree, loss_kwargs, pad_id = tree_enabled(cfg), policy_loss_kwargs(cfg), int(processor.pad_token_id)

    def due(every: int, step: int) -> bool:  # periodic work; the last step has its own evaluation and save
        return bool(every) and step % every == 0 and step < cfg.train.steps

    if state["step"] == 0 and not state["eval_curve"]:
        evaluator.run(0, state, runlog)
    t_start, steps_this_run = time.time(), 0
    while state["step"] < cfg.train.steps:
        step = state["step"] + 1
        seed = step_seed(cfg.train.seed, step, info.rank)
        t0 = time.time()
        batch: StepBatch = rollout.collect(step, seed)  # sampled + replayed, scored, filtered groups
        prepare_update(batch, learner, cfg.algorithm, pad_id=pad_id, use_tree=use_tree)  # log-probs, advantages
        t = time.time()
        update = learner.update(batch.samples, n_groups=batch.n_groups, seed=seed, pad_id=pad_id, use_tree=use_tree,
                                loss_kwargs=loss_kwargs)
        parts.sync(step, cfg.rollout.sync_bytes)  # the next rollouts sample the updated policy
        batch.timing["update"] = time.time() - t
        row, tokens = step_row(batch, update, pool, info.device, tis=cfg.algorithm.tis_cap is not None, t0=t0)
        record_step(state, step, row, tokens)
        runlog.step(step, row)
        steps_this_run += 1
        if due(cfg.eval.every, step):
            evaluator.run(step, state, runlog)
        if due(cfg.checkpoint.save_every, step):
            ckpts.save(step, learner, run_state, state, processor)
        if stop_after is not None and steps_this_run >= stop_after and step < cfg.train.steps:
            break
    runlog.close_progress()

    finished = state["step"] >= cfg.train.steps
    if finished:
        evaluator.run(state["step"], state, runlog)
        ckpts.save(state["step"], learner, run_state, state, processor)
        if info.is_main:
            if cfg.checkpoint.export:
                ckpts.export_final(state["step"])
            if replay_m(cfg):
                pool.save_jsonl(out_dir / "pool.jsonl")
    summary = {
        "finished": finished,
        "steps": state["step"],
        "losses": state["losses"],
        "rewards": state["rewards"],
        "pass_rates": state["pass_rates"],
        "eval_curve": state["eval_curve"],
        "tokens": state["tokens"],
        "seconds": time.time() - t_start,
        "tree": use_tree,
        "replay_M": replay_m(cfg),
        "pool": pool.stats(),
        "frozen_towers": frozen,
        "world_size": info.world_size,
        "strategy": learner.strategy,
        "prompts": len(prompts),
        # identical on every rank when the replicas stayed in sync (data-parallel sanity check)
        "param_checksum": learner.checksum(),
    }
    if info.is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        runlog.close()
        if cfg.log.progress:
            print(format_summary(summary, out_dir))
    kdist.barrier()
    return summary


def main(argv: list[str] | None = None) -> int:
    """``keye train rlep --config CFG.yaml [key=value ...]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="keye train rlep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML recipe config")
    ap.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. replay.M=0 train.steps=20")
    args = ap.parse_args(argv)
    return run_from_args(args.config, args.overrides)


def run_from_args(config: str | None, overrides: list[str]) -> int:
    """Load the config (YAML + overrides), run, tear the process group down."""
    logging.basicConfig(level=os.environ.get("KEYE_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(RLEPConfig, config, overrides)
    try:
        train(cfg)
    finally:
        kdist.cleanup()
    return 0



__all__ = ["RLEPConfig", "PromptStream", "RunState", "greedy_accuracy", "main", "to_dict", "train", "tree_enabled",
           "validate"]
