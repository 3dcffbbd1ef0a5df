"""RLEP / GRPO-family reinforcement learning of Keye-VL (the recipe behind ``keye train rlep``).

Launch::

    keye rlep collect --policy runs/tiny/final --data data/synth/train.jsonl --n 8 --out runs/pool.jsonl
    keye train rlep --config training/configs/tiny_synth_rlep.yaml                 # one CPU, minutes
    torchrun --nproc_per_node 8 -m keye train rlep --config training/configs/keye_vl_8b_rlep.yaml

This module is the recipe: the config entry points and :func:`train`, ONE loop for every engine over named
components that live in their own modules under ``keye/rl/`` (docs/architecture.md, "Training layers"):

- config (:mod:`keye.rl.config`): the YAML sections, :class:`RLEPConfig`, :func:`validate`;
- components (:mod:`keye.rl.loop.components`): the learner, the rollout engine, the whole-weight models, the scorer,
  built in this process group or as Ray actors (:mod:`keye.rl.distributed.build`);
- the batch source: :class:`~keye.rl.loop.batcher.RolloutBatcher` (``rl.mode: sync``: prompts -> sampled, replayed,
  scored and filtered groups) or :class:`~keye.rl.loop.streaming.StreamingBatcher` (``rl.mode: async``: groups
  stream from rollout workers under the staleness rule while the learner trains);
- learner (:mod:`keye.rl.learner`): old / reference log-probs, advantages, PPO updates;
- state (:mod:`keye.rl.loop.state`, :class:`keye.train.checkpoint.Checkpoints`): prompt stream, replay pool,
  trainer state, checkpoints;
- evaluation (:mod:`keye.rl.loop.evaluate`) and metrics (:mod:`keye.rl.loop.metrics`, the floor's run log).

One synchronous step (``keye.rl.algorithms.update`` gives the core order):

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keye.hub import resolve_model_path
from keye.recipes import common
from keye.rl.config import RLEPConfig, policy_loss_kwargs, replay_m, streaming_update, tree_enabled, validate
from keye.rl.loop.batcher import BatchSource, RolloutBatcher, StreamingUpdate, prepare_update
from keye.rl.loop.components import Components, build_components
from keye.rl.loop.evaluate import Evaluator
from keye.rl.loop.metrics import format_summary, progress_figures, step_row
from keye.rl.loop.state import (
    PromptStream,
    load_pool,
    load_prompts,
    record_step,
    select_prompts,
    step_seed,
    trainer_state,
)
from keye.train import dist as kdist
from keye.train.checkpoint import Checkpoints
from keye.train.metrics import RunLog, truncate_jsonl
from keye.train.models import load_processor
from keye.train.run import start_run

log = logging.getLogger("keye.recipes.rlep")


@dataclass
class _Run:
    """Everything one invocation of :func:`train` holds (built by :func:`_setup`)."""

    cfg: RLEPConfig
    info: kdist.DistInfo
    out_dir: Path
    processor: Any
    parts: Components
    source: BatchSource
    pool: Any
    prompts: list[Any]
    state: dict[str, Any]
    ckpts: Checkpoints
    evaluator: Evaluator
    runlog: RunLog
    loss_kwargs: dict[str, Any]
    use_tree: bool
    pad_id: int
    streaming: bool  # the streaming update (rl.update; asynchronous mode only)
    t_start: float = 0.0  # when this invocation's training began (after the step-0 evaluation)
    restarts: int = 0  # learner group restarts of this invocation (rl.engine: ray)

    def save(self, step: int) -> None:
        """Checkpoint ``step`` (collective): the batch source's run state as the loader state."""
        rs = self.source.run_state
        if hasattr(rs, "snapshot"):
            rs.snapshot()
        self.ckpts.save(step, lambda path: self.parts.learner.save_checkpoint(path, rs, self.state, self.processor))


def train(cfg: RLEPConfig, *, stop_after: int | None = None, on_step: Callable[[int, Any], None] | None = None,
          answer_length: Callable[[str, int], int] | None = None) -> dict[str, Any]:
    """Run the RL recipe as configured - in this process group, on Ray synchronously, or on Ray asynchronously
    (``rl.engine`` / ``rl.mode``: the same loop, another batch source); returns the run summary (also written to
    ``summary.json``).

    The summary holds per-step ``losses`` (mean over the step's optimizer updates), ``rewards`` (mean fresh reward),
    ``pass_rates`` and the ``eval_curve``, plus the asynchronous source's staleness records
    (:meth:`keye.rl.loop.streaming.StreamingBatcher.summary`).

    Args:
        stop_after: stop after that many RL steps *of this invocation* without the final save (simulates a crash
            in resume tests).
        on_step: ``on_step(step, view)`` after every step's update and metrics (tests, benchmarks; ``view`` is the
            batch source's :meth:`~keye.rl.loop.batcher.BatchSource.view`).
        answer_length: forced answer lengths for the asynchronous mode's workers (benchmarks; see
            :class:`keye.rl.rollout.stream_worker.AnswerLengths`).
    On Ray, a learner rank that dies (its process killed, a crash) ends the attempt: every component is rebuilt and
    the run resumes from its newest checkpoint (from the start without one), at most ``rl.ray.max_restarts`` times,
    each restart logged with its count in ``ray_events.jsonl`` and the summary's ``learner_restarts``.

    Raises:
        KeyeConfigError: an invalid config (:func:`keye.rl.config.validate`, the Ray checks), a checkpoint of the
            other ``rl.mode``, or resources a Ray cluster cannot place.
        LearnerFailed: a learner rank died more than ``rl.ray.max_restarts`` times.
    """
    info = kdist.init_distributed(cfg.train.device)
    validate(cfg, info.world_size)
    out_dir = start_run(cfg, info)
    processor = load_processor(cfg.model)
    model_path = resolve_model_path(cfg.model.path)
    if cfg.rl.engine != "ray":
        return _attempt(cfg, info, out_dir, processor, build_components(cfg, info, model_path, processor),
                        stop_after, on_step)
    from keye.rl.distributed.build import build_ray_components
    from keye.rl.distributed.learner_group import LearnerFailed
    from keye.rl.distributed.ray_session import EventLog

    events, restarts = EventLog(out_dir / "ray_events.jsonl"), 0
    while True:
        parts = build_ray_components(cfg, info, model_path, processor, answer_length=answer_length)
        try:
            return _attempt(cfg, info, out_dir, processor, parts, stop_after, on_step, restarts=restarts)
        except LearnerFailed as err:
            # the learner group is gone with its rank: rebuild every component and resume from the last
            # checkpoint, as a new driver would (answers in flight go back to the queue, rows of lost steps go)
            restarts += 1
            events.record("learner", -1, "died", detail=str(err), restarts=restarts)
            if restarts > cfg.rl.ray.max_restarts:
                raise LearnerFailed(f"{err}; the learner group was restarted {restarts - 1} times "
                                    f"(rl.ray.max_restarts={cfg.rl.ray.max_restarts})") from None
            _rewind(out_dir)
            events.record("learner", -1, "restarted", restarts=restarts)


def _attempt(cfg: RLEPConfig, info: kdist.DistInfo, out_dir: Path, processor: Any, parts: Components,
             stop_after: int | None, on_step: Callable[[int, Any], None] | None, restarts: int = 0) -> dict[str, Any]:
    """Set up (resuming from the newest checkpoint), run the loop and finish; the components are closed after."""
    source = None
    try:
        run = _setup(cfg, info, out_dir, processor, parts)
        run.restarts, source = restarts, run.source
        _loop(run, stop_after, on_step)
        return _finish(run)
    finally:
        if source is not None:
            source.close()
        parts.close()


def _rewind(out_dir: Path) -> None:
    """Before a restart without a checkpoint to resume from: the rows the failed attempt wrote go (a resume from a
    checkpoint cuts them back itself)."""
    if Checkpoints(out_dir, keep_last=1, is_main=True).latest is None:
        for name in ("metrics.jsonl", "trajectories.jsonl"):
            truncate_jsonl(out_dir / name, -1)


def _setup(cfg: RLEPConfig, info: kdist.DistInfo, out_dir: Path, processor: Any, parts: Components) -> _Run:
    """Prompts (filtered, or the set a resumed run started with), pool, batch source, the resumed state, the
    evaluator and the run log."""
    pool = load_pool(cfg.replay, cfg.train.seed)
    ckpts = Checkpoints(out_dir, cfg.checkpoint.keep_last, info.is_main)
    prompts = select_prompts(cfg.data, load_prompts(cfg.data), ckpts.resumed_state(), parts.keep_informative)
    state = trainer_state(prompts, cfg.data)
    stream = PromptStream(prompts, cfg.train.seed, info.rank, info.world_size, cfg.data.shuffle)
    if cfg.rl.mode == "async":
        from keye.rl.loop.streaming import StreamingBatcher

        source: BatchSource = StreamingBatcher(cfg, parts, pool, stream, prompts, processor, out_dir)
    else:
        source = RolloutBatcher(cfg, parts, pool, stream, processor, info, out_dir)
    if ckpts.latest is not None:
        state = parts.learner.load_checkpoint(ckpts.latest, source.run_state)
        if info.is_main:
            log.info("resumed from %s at step %d", ckpts.latest, state["step"])
    source.start(state["step"])
    evaluator = Evaluator(cfg.eval, cfg.reward, parts, processor, info, out_dir, seed=cfg.train.seed,
                          weights=source.eval_weights)
    mode = ("async " if cfg.rl.mode == "async" else "") + ("rlep" if replay_m(cfg) else "grpo")
    runlog = RunLog(cfg.log, out_dir, info.is_main, total=cfg.train.steps, start_step=state["step"], desc=mode,
                    postfix=progress_figures)
    return _Run(cfg, info, out_dir, processor, parts, source, pool, prompts, state, ckpts, evaluator, runlog,
                policy_loss_kwargs(cfg), tree_enabled(cfg), int(processor.pad_token_id), streaming_update(cfg))


def _loop(run: _Run, stop_after: int | None, on_step: Callable[[int, Any], None] | None) -> None:
    """The steps: a batch from the source, log-probs and advantages, the learner's update, the weight push,
    metrics, evaluation and checkpoints when due."""
    cfg, state, learner, source = run.cfg, run.state, run.parts.learner, run.source

    def due(every: int, step: int) -> bool:  # periodic work; the last step has its own evaluation and save
        return bool(every) and step % every == 0 and step < cfg.train.steps

    if state["step"] == 0 and not state["eval_curve"]:
        run.evaluator.run(0, state, run.runlog)
    run.t_start, steps_this_run = time.time(), 0
    while state["step"] < cfg.train.steps:
        step = state["step"] + 1
        seed = step_seed(cfg.train.seed, step, run.info.rank)
        t0 = time.time()
        if run.streaming:  # each group's gradient as soon as it is complete; one step when the batch is whole
            stream = StreamingUpdate(learner, pad_id=run.pad_id, use_tree=run.use_tree, loss_kwargs=run.loss_kwargs)
            batch = source.collect(step, seed, on_group=stream.add, on_poll=stream.poll)
            update = stream.finish(batch)
        else:
            batch = source.collect(step, seed)  # sampled (or streamed) + replayed, scored, filtered groups
            prepare_update(batch, learner, cfg.algorithm, pad_id=run.pad_id, use_tree=run.use_tree)
            t = time.time()
            update = learner.update(batch.samples, n_groups=batch.n_groups, seed=seed, pad_id=run.pad_id,
                                    use_tree=run.use_tree, loss_kwargs=run.loss_kwargs)
            batch.timing["update"] = time.time() - t
        t = time.time()
        source.push_weights(step, batch)  # the next rollouts sample the updated policy
        batch.timing["sync"] = time.time() - t
        row, tokens = step_row(batch, update, run.pool, run.info.device, tis="tis_cap" in run.loss_kwargs, t0=t0)
        record_step(state, step, row, tokens)
        run.runlog.step(step, row)
        steps_this_run += 1
        if on_step is not None:
            on_step(step, source.view(step))
        if due(cfg.eval.every, step):
            run.evaluator.run(step, state, run.runlog)
        if due(cfg.checkpoint.save_every, step):
            run.save(step)
        if stop_after is not None and steps_this_run >= stop_after and step < cfg.train.steps:
            break
    run.runlog.close_progress()


def _finish(run: _Run) -> dict[str, Any]:
    """The final evaluation, checkpoint, export and pool, and the summary (``summary.json``)."""
    cfg, info, state, learner = run.cfg, run.info, run.state, run.parts.learner
    finished = state["step"] >= cfg.train.steps
    if finished:
        run.evaluator.run(state["step"], state, run.runlog)
        run.save(state["step"])
        if info.is_main:
            if cfg.checkpoint.export:
                run.ckpts.export_final(state["step"])
            if replay_m(cfg):
                run.pool.save_jsonl(run.out_dir / "pool.jsonl")
    summary = {
        "finished": finished, "mode": cfg.rl.mode, "steps": state["step"], "losses": state["losses"],
        "rewards": state["rewards"], "pass_rates": state["pass_rates"], "eval_curve": state["eval_curve"],
        "tokens": state["tokens"], "seconds": time.time() - run.t_start, "tree": run.use_tree,
        "replay_M": replay_m(cfg), "pool": run.pool.stats(), "frozen_towers": learner.frozen,
        "world_size": info.world_size, "strategy": learner.strategy, "prompts": len(run.prompts),
        "update": "streaming" if run.streaming else "barrier",
        # identical on every rank when the replicas stayed in sync (data-parallel sanity check)
        "param_checksum": learner.checksum(),
    }
    if hasattr(learner, "actors"):  # a Ray learner group
        summary.update(learner_ranks=len(learner.actors), learner_devices=list(learner.devices),
                       learner_restarts=run.restarts)
    summary.update(run.source.summary())
    if info.is_main:
        (run.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        run.runlog.close()
        if cfg.log.progress:
            print(format_summary(summary, run.out_dir))
    kdist.barrier()
    return summary


def main(argv: list[str] | None = None) -> int:
    """``keye train rlep --config CFG.yaml [key=value ...]``."""
    return common.main(argv, prog="keye train rlep", doc=__doc__, example="replay.M=0 train.steps=20",
                       config_cls=RLEPConfig, train=train)


def run_from_args(config: str | None, overrides: list[str]) -> int:
    """Load the config (YAML + overrides), run, tear the process group down."""
    return common.run_from_args(RLEPConfig, train, config, overrides)


__all__ = ["RLEPConfig", "main", "run_from_args", "train"]
