"""Asynchronous RL on Ray (``keye train rlep ... rl.engine=ray rl.mode=async``): generation overlaps training.

The learner is the learner group of the synchronous Ray engine
(:class:`keye.rl.distributed.learner_group.RemoteLearner`): ``rl.ray.learners`` :class:`~keye.rl.distributed.learner_group.LearnerActor` s,
the ranks of one torch process group (``train.strategy`` none / ddp / fsdp2 / zero3 across them), each with
``rl.ray.learner_cpus`` / ``rl.ray.learner_gpus`` in a placement group of their own. The driver holds no
policy weights: it holds a :class:`~keye.rl.distributed.trajectory.TrajectoryManager`, a
:class:`~keye.rl.distributed.rollout_manager.RolloutManager` over ``rl.ray.rollout_workers`` Ray actors (each a
:class:`~keye.rl.distributed.stream_worker.StreamWorker` with whole weights that decodes in a background thread, with
``rl.ray.rollout_cpus`` / ``rl.ray.rollout_gpus``, outside the learners' placement group) and the proxy of
the learner group. One loop:

1. **admit** prompts while the staleness rule allows (:meth:`TrajectoryManager.admissible_groups` with
   ``rl.max_staleness = k``, plus one more group for every group dropped by dynamic sampling or failed):
   group ``g`` trains update ``g // B`` at the latest, so every token it trains was sampled at most ``k``
   versions earlier, without stale drops (``ready_groups`` still drops any that would exceed it);
2. **stream**: one :meth:`RolloutManager.step` (restart dead workers and requeue their answers, dispatch,
   poll), then **score** every finished answer (``reward.spec``, in the driver);
3. **batch**: complete groups in admission order; each gets its RLEP replay rows (``replay.M``, scored
   with the same reward) and, with ``algorithm.dynamic_sampling``, a group whose members all score the same
   is dropped (and replaced by a new admission); ``data.prompts_per_step`` kept groups make an update;
4. **update**: the learner group's log-probs (``old_logp``: the proximal policy = the weights about to be
   updated) and reference log-probs, advantages, ``learner.update`` (the groups split over the ranks and the
   mini-batches planned by the driver, exactly as in sync mode: N ranks compute the one-rank update); the
   loss is the decoupled PPO loss (below); then learner rank 0 puts the exported shards into the object store
   once and every worker loads them as version ``v + 1`` (:meth:`RolloutManager.update_weights`: pause at a
   chunk boundary, load, resume; unfinished answers continue under the new weights - partial rollouts);
5. metrics (staleness histogram, partial rollouts, event counters of both managers), one line per
   trained answer in ``trajectories.jsonl`` (its per-version token spans), checkpoints.

**Off-policy correction (decoupled PPO).** An answer trained at version ``v`` was sampled by a behaviour
policy ``mu`` (versions ``v - k .. v``, one per token, recorded with the token's log-prob). The loss of
:func:`keye.rl.algorithms.losses.policy_loss` uses the learner's log-probs at version ``v`` as the *proximal* policy
``pi_old`` of the PPO ratio and clip, and multiplies each token's policy-gradient term by the behaviour
importance weight ``w = min(pi_old / mu, C)`` (no gradient), ``C = algorithm.tis_cap`` - the decoupled
objective of Hilton et al. (2022, "Batch size-invariance for policy optimization") with a truncated weight
(as AReaL and verl's TIS). Without ``algorithm.tis_cap`` async mode uses ``C =``
:data:`DEFAULT_ASYNC_TIS_CAP`. Replayed answers have no behaviour log-probs: weight 1.

**Evaluation and prompt filtering** need whole weights outside the learner group. Held-out evaluation
(``eval.manifest``; nothing is built without it) runs in the driver on a whole-weight copy on the driver's
device, refreshed from the shards the workers were last sent (as the sync Ray engine's ``eval_model``).
Prompt filtering (``data.filter_samples``, a fresh run only) runs before the rollout workers start, in a
one-off Ray task with a rollout worker's resources over the start weights (:func:`filter_on_worker`).

**Checkpoints** (``checkpoint.save_every``) hold the learner (model, optimizer, scheduler), the prompt
stream, the prompts drawn but not yet admitted, the replay pool, the whole trajectory manager (queue, partial
answers with their tokens, versions and behaviour log-probs, scored answers waiting for their group) and the
reward parts of those answers; every learner rank writes its part, the driver's run state travels to them
with the call. A driver killed at any moment (SIGKILL) takes its actors with it and resumes from the newest
checkpoint: its answers that were in flight are returned to the queue (:meth:`TrajectoryManager.reclaim`)
and continue on new workers that first load the checkpoint's weights; ``trajectories.jsonl`` and
``metrics.jsonl`` are cut back to the checkpoint's step.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keye.errors import KeyeConfigError
from keye.rl.distributed.rollout_manager import RolloutManager
from keye.rl.distributed.trajectory import ReadyGroup, Trajectory, TrajectoryManager
from keye.rl.rollout.samples import RLPrompt, RolloutSample, split_batch

log = logging.getLogger("keye.rl.distributed.streaming")

DEFAULT_ASYNC_TIS_CAP = 2.0
"""Truncation of the behaviour importance weight when ``algorithm.tis_cap`` is unset in async mode."""
CHUNK_TOKENS = 4
"""Tokens a rollout worker decodes between two points where it may pause or load weights."""
MAX_RETRIES = 3
"""Worker failures one answer may survive before its group is dropped (a prompt that keeps killing workers
must not stall training)."""
IDLE_SLEEP_S = 0.003
"""Driver sleep when a loop round brought nothing new (polling the workers costs CPU the workers need)."""


@dataclass
class AsyncRun:
    """What :func:`train_async` hands to its ``on_step`` callback after each update: the managers, the
    learner group's proxy (:class:`keye.rl.distributed.learner_group.RemoteLearner`: ``run.learner.pids()`` are the ranks'
    processes) and the output folder (tests use it to kill a worker by ``run.rollout.workers[i].pid()``)."""

    rollout: RolloutManager
    trajectories: TrajectoryManager
    learner: Any
    out_dir: Path
    version: int


class AsyncRunState:
    """The driver's resumable state (the checkpoint's ``loader`` entry): prompt stream, prompts drawn but not
    admitted yet, replay pool, the trajectory manager, the reward parts of scored answers, counters."""

    def __init__(self, stream: Any, pool: Any, tm: TrajectoryManager, extra: dict[str, Any]):
        self.stream, self.pool, self.tm, self.extra = stream, pool, tm, extra

    def state_dict(self) -> dict[str, Any]:
        """JSON-able except the pool's own state (as the sync loop stores it)."""
        return {"format": 1, "stream": self.stream.state_dict(), "pool": self.pool.state_dict(),
                "trajectories": self.tm.state_dict(), **json.loads(json.dumps(self.extra))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises :class:`KeyeConfigError` for a checkpoint of the synchronous
        loop (resume with the mode the run was started with)."""
        if state.get("format") != 1 or "trajectories" not in state:
            raise KeyeConfigError("the checkpoint was not written by the asynchronous loop (rl.mode=async); resume "
                                  "with the rl.mode the run was started with")
        self.stream.load_state_dict(state["stream"])
        self.pool.load_state_dict(state["pool"])
        self.tm.load_state_dict(state["trajectories"])
        for key in self.extra:
            if key in state:
                self.extra[key] = state[key]


def _check(cfg: Any, world_size: int) -> None:
    """Validate ``cfg.rl`` for this mode (the Ray section's checks are those of the sync Ray engine)."""
    from keye.rl.distributed.build import check_ray_config

    rl = cfg.rl
    if rl.engine != "ray" or rl.mode != "async":
        raise KeyeConfigError(f"train_async runs rl.engine=ray rl.mode=async, got rl.engine={rl.engine} "
                              f"rl.mode={rl.mode}")
    check_ray_config(cfg, world_size)  # the same rl.ray checks as the synchronous Ray engine
    if cfg.rollout.engine != "local":
        raise KeyeConfigError(f"rl.mode=async samples with keye's streaming engine: rollout.engine must be local, got "
                              f"{cfg.rollout.engine!r}")


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only the rows of ``path`` with ``step <= last_step`` (after a resume: rows written after the
    checkpoint belong to updates that were lost)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


def train_async(cfg: Any, stop_after: int | None = None, *, on_step: Callable[[int, AsyncRun], None] | None = None,
                answer_length: Callable[[str, int], int] | None = None) -> dict[str, Any]:
    """Run ``cfg`` (a :class:`keye.rl.config.RLEPConfig` with ``rl.engine=ray``, ``rl.mode=async``)
    asynchronously (module doc); returns the run summary (also ``summary.json``).

    ``stop_after``: stop after that many updates of this invocation without the final save (a crash in
    tests). ``on_step(step, run)``: called after every update (tests). ``answer_length``: forced answer
    lengths for every worker (:class:`keye.rl.distributed.stream_worker.AnswerLengths`; benchmarks).

    The summary holds what the synchronous loop's does (losses, rewards, pass rates, eval curve, tokens) plus
    ``trained_trajectories`` (answers consumed by updates, over the whole run), ``staleness`` (histogram of
    ``v - start_version`` over trained answers), ``partial`` (trained answers sampled by several versions),
    ``max_staleness``, the event counters of both managers (``trajectory_events`` over the whole run,
    ``rollout_events`` this invocation) and ``step_end_times`` (seconds since the start of this invocation).

    The learner is the Ray learner group (``rl.ray.learners`` ranks, ``train.strategy``; module doc); the
    summary's ``strategy`` and ``learner_ranks`` say how it ran, ``world_size`` is the driver's (1).

    Raises:
        KeyeConfigError: a config this mode cannot run (rollout.engine other than local, several torch
            processes, rl.max_staleness < 0, resources the cluster cannot place) or a checkpoint of the
            synchronous loop.
    """
    import ray

    from keye.rl.config import validate
    from keye.rl.distributed.learner_group import RemoteLearner
    from keye.rl.distributed.ray_session import EventLog, RaySession, connect
    from keye.tiny import resolve_model_path
    from keye.train import dist as kdist

    info = kdist.init_distributed(cfg.train.device)
    _check(cfg, info.world_size)
    validate(cfg, 1)
    out_dir = Path(cfg.checkpoint.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rc = cfg.rl.ray
    started_ray = connect(rc)
    session = None
    try:
        # the learners' placement group only: rollout workers are started (and replaced) by the rollout
        # manager as actors of their own, and the reward runs in the driver
        session = RaySession(replace(rc, rollout_workers=0, reward_workers=0), EventLog(out_dir / "ray_events.jsonl"))
        learner = RemoteLearner(session, cfg, resolve_model_path(cfg.model.path))
        return _run(cfg, info, learner, stop_after=stop_after, on_step=on_step, answer_length=answer_length)
    finally:
        if session is not None:
            session.close()
        if started_ray:
            ray.shutdown()


def _run(cfg: Any, info: Any, learner: Any, *, stop_after: int | None,
         on_step: Callable[[int, AsyncRun], None] | None,
         answer_length: Callable[[str, int], int] | None) -> dict[str, Any]:
    """The body of :func:`train_async` once Ray is connected and the learner group (``learner``) is up."""
    import ray

    from keye.processing.processor import KeyeProcessor
    from keye.rewards import RewardSpec
    from keye.rl import (
        ModeMix,
        ReplayPool,
        RewardScorer,
        add_replay,
        assign_advantages,
        load_rl_prompts,
        set_scores,
    )
    from keye.rl.algorithms.sampling import group_signal, is_informative
    from keye.rl.config import policy_loss_kwargs, tree_enabled
    from keye.rl.config import reward_options as _reward_options
    from keye.rl.distributed.stream_worker import RayRolloutWorker, StreamWorkerActor
    from keye.rl.loop.batcher import add_online as _add_online
    from keye.rl.loop.evaluate import greedy_accuracy
    from keye.rl.loop.metrics import format_summary
    from keye.rl.loop.metrics import mean as _mean
    from keye.rl.loop.metrics import step_metrics as _step_metrics
    from keye.rl.loop.state import PromptStream
    from keye.rl.loop.state import step_seed as _step_seed
    from keye.rl.rollout.engines import load_weight_shards
    from keye.tiny import resolve_model_path
    from keye.train.checkpoint import list_checkpoints, prune_checkpoints
    from keye.train.config import dump_config
    from keye.train.metrics import MetricsWriter

    out_dir = Path(cfg.checkpoint.out_dir)
    dump_config(cfg, out_dir / "config.yaml")
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)

    r, a, rc = cfg.rollout, cfg.algorithm, cfg.rl.ray
    B, G, k = cfg.data.prompts_per_step, r.G, cfg.rl.max_staleness
    model_path = resolve_model_path(cfg.model.path)
    processor_path = resolve_model_path(cfg.model.processor or cfg.model.path)
    processor = KeyeProcessor.from_pretrained(processor_path)
    scorer = RewardScorer(RewardSpec.from_dict(cfg.reward.spec), pass_value=cfg.reward.pass_value)
    eval_scorer = RewardScorer(RewardSpec.from_dict({"rewards": ["accuracy"], "options": _reward_options(cfg.reward.spec)}),
                               pass_value=cfg.reward.pass_value)
    eos_id = int(learner.config.eos_token_ids[0])
    pad_id = int(processor.pad_token_id)

    def encode(text: str) -> list[int]:
        return list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(ids: list[int]) -> str:
        return processor.decode(ids, skip_special_tokens=True)

    replay_on = cfg.replay.enabled and cfg.replay.M > 0
    m_replay = cfg.replay.M if replay_on else 0
    if replay_on and cfg.replay.pool:
        pool = ReplayPool.load_jsonl(cfg.replay.pool, max_per_question=cfg.replay.max_per_question,
                                     overflow=cfg.replay.overflow, seed=cfg.train.seed)
    else:
        pool = ReplayPool(cfg.replay.max_per_question, cfg.replay.overflow, seed=cfg.train.seed)

    prompts = load_rl_prompts(cfg.data.manifest)
    if cfg.data.limit is not None:
        prompts = prompts[: cfg.data.limit]
    if not prompts:
        raise KeyeConfigError(f"{cfg.data.manifest}: no RL prompts")
    eval_prompts: list[RLPrompt] = load_rl_prompts(cfg.eval.manifest)[: cfg.eval.limit] if cfg.eval.manifest else []
    gpus = rc.rollout_gpus if rc.rollout_gpus is not None else (1.0 if ray.cluster_resources().get("GPU", 0) else 0.0)
    threads = rc.torch_threads or max(1, int(rc.rollout_cpus))
    eval_model = None
    if eval_prompts:
        from keye.model.keye_vl import KeyeVL

        # the driver's whole-weight evaluation copy (the only weights it holds), refreshed before evaluating
        eval_model = KeyeVL.from_pretrained(model_path, torch_dtype=learner.dtype,
                                            attn_implementation=cfg.model.attn_implementation)
        eval_model = eval_model.to(info.device).eval().requires_grad_(False)

    state: dict[str, Any] = {"step": 0, "losses": [], "rewards": [], "pass_rates": [], "eval_curve": [],
                             "prompt_ids": None, "tokens": 0, "trained": 0, "staleness": {}, "partial": 0}
    ckpts = list_checkpoints(out_dir)
    resume_blob = torch.load(ckpts[-1] / "trainer_state.pt", weights_only=False)["trainer"] if ckpts else None
    if resume_blob is not None and resume_blob.get("prompt_ids") is not None:
        keep = set(resume_blob["prompt_ids"])
        prompts = [p for p in prompts if p.id in keep]
    elif cfg.data.filter_samples > 0:
        # the start weights are model.path's: a one-off task with a rollout worker's resources samples them
        # max_calls=1: the task's process exits afterwards, releasing the model's memory
        task = ray.remote(max_calls=1, num_cpus=rc.rollout_cpus, num_gpus=gpus)(filter_on_worker)
        keep = set(ray.get(task.remote(cfg, str(model_path), str(processor_path), prompts, learner.dtype, threads)))
        prompts = [p for p in prompts if p.id in keep]
        if not prompts:
            raise KeyeConfigError("prompt filtering kept no prompt (every accuracy was 0 or 1)")
    state["prompt_ids"] = [p.id for p in prompts] if cfg.data.filter_samples > 0 else None
    by_id = {p.id: p for p in prompts}
    stream = PromptStream(prompts, cfg.train.seed, 0, 1, cfg.data.shuffle)
    tm = TrajectoryManager(max_new_tokens=r.max_new_tokens, max_retries=MAX_RETRIES)
    # drawn: prompts drawn in batches of B (modes assigned per batch, as the sync loop does) and not yet
    # admitted; parts: reward parts of scored answers; discarded: groups dropped by dynamic sampling
    extra: dict[str, Any] = {"drawn": [], "batches_drawn": 0, "parts": {}, "discarded": 0}
    run_state = AsyncRunState(stream, pool, tm, extra)
    if ckpts:
        state = learner.load_checkpoint(ckpts[-1], run_state)
        reclaimed = tm.reclaim()
        _truncate_jsonl(out_dir / "trajectories.jsonl", state["step"])
        _truncate_jsonl(out_dir / "metrics.jsonl", state["step"])
        log.info("resumed from %s at step %d (%d answers in flight returned to the queue)", ckpts[-1], state["step"],
                 reclaimed)
    version = state["step"]

    mix = ModeMix.from_config(a.mode_mix)
    use_tree = tree_enabled(cfg)
    loss_kwargs = policy_loss_kwargs(cfg)
    if a.tis_cap is None:
        loss_kwargs["tis_cap"] = DEFAULT_ASYNC_TIS_CAP
        log.info("async: behaviour importance weights truncated at %.1f (algorithm.tis_cap unset)",
                 DEFAULT_ASYNC_TIS_CAP)

    # ------------------------------------------------------------------------------- workers
    actor_cls = ray.remote(StreamWorkerActor)
    boot: dict[str, Any] = {"refs": None, "version": version}  # weights for workers built before the first push
    spawned = [0]
    pids: dict[int, int] = {}

    # the object refs of the newest exported weights and their version (None: model.path's, version 0)
    latest: dict[str, Any] = {"refs": None, "version": 0}

    def export_refs() -> list[Any]:
        # learner rank 0 streams the shards into the object store (owned by the driver), one put each
        latest["refs"], latest["version"] = learner.export_refs(r.sync_bytes), version
        return latest["refs"]

    def factory(i: int) -> RayRolloutWorker:
        spawned[0] += 1
        settings = dict(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                        chunk_tokens=CHUNK_TOKENS, max_batch=r.max_batch_size, answer_length=answer_length,
                        seed=_step_seed(cfg.train.seed, 1_000 + spawned[0], i))
        handle = actor_cls.options(num_cpus=rc.rollout_cpus, num_gpus=gpus, max_restarts=0).remote(
            model_path, processor_path, settings, dtype=learner.dtype, device="cuda" if gpus else "cpu",
            torch_threads=threads, attn_implementation=cfg.model.attn_implementation)
        worker = RayRolloutWorker(handle)
        pids[i] = worker.pid()  # waits until the actor has loaded its model
        if boot["refs"] is not None:
            worker.load_weights(boot["refs"], boot["version"])
        (out_dir / "rollout_workers.json").write_text(json.dumps({"pids": pids, "spawned": spawned[0]}))
        log.info("rollout worker %d started (pid %d)", i, pids[i])
        return worker

    inputs_cache: dict[int, Any] = {}

    def group_inputs(gid: int) -> Any:
        if gid not in inputs_cache:
            meta = tm.group(gid).meta
            inputs_cache[gid] = _process(processor, meta["messages"], meta["mode"])
        return inputs_cache[gid]

    def group_prompt(gid: int) -> RLPrompt:
        g = tm.group(gid)
        base = by_id[g.prompt_id]
        return RLPrompt(base.id, base.messages, base.reference, base.task, g.meta["mode"], dict(base.extra))

    def as_sample(t: Trajectory) -> RolloutSample:
        ids = torch.tensor(t.tokens, dtype=torch.long)
        return RolloutSample(prompt=group_prompt(t.group), group=t.group, inputs=group_inputs(t.group), response_ids=ids,
                             text=decode(t.tokens), finished=t.finish_reason == "stop",
                             rollout_logp=torch.tensor(t.logps, dtype=torch.float32),
                             reward=t.reward, passed=t.passed,
                             metadata={"mode": tm.group(t.group).meta["mode"], "traj_id": t.id,
                                       "reward_parts": extra["parts"].get(str(t.id), {})})

    def admit() -> int:
        allowed = tm.admissible_groups(version, k, B) + extra["discarded"] + tm.counts()["groups_failed"]
        if allowed <= 0:
            return 0
        while len(extra["drawn"]) < allowed:
            batch = stream.draw(B)
            if mix is not None:
                batch = mix.assign(batch, random.Random(_step_seed(cfg.train.seed, extra["batches_drawn"], 1)))
            extra["batches_drawn"] += 1
            extra["drawn"] += [[p.id, p.mode] for p in batch]
        take, extra["drawn"] = extra["drawn"][:allowed], extra["drawn"][allowed:]
        inputs = [_process(processor, by_id[pid].messages, mode) for pid, mode in take]
        metas = [{"messages": by_id[pid].messages, "mode": mode, "prompt_tokens": x.length}
                 for (pid, mode), x in zip(take, inputs)]
        for gid, x in zip(tm.add_prompts([pid for pid, _ in take], G, version, metas), inputs):
            inputs_cache[gid] = x
        return len(take)

    def score(finished: Sequence[int]) -> None:
        trajs = [tm.get(tid) for tid in finished]
        if not trajs:
            return
        samples = [as_sample(t) for t in trajs]
        scores = scorer(samples)
        for t, rew, ok, parts in zip(trajs, scores.rewards, scores.passed, scores.parts):
            if tm.on_scored(t.id, rew, ok):
                extra["parts"][str(t.id)] = dict(parts)

    metrics = MetricsWriter(out_dir, True, cfg.log.tensorboard)
    bar = None
    if cfg.log.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.train.steps, initial=state["step"], desc="async rlep" if m_replay else "async grpo",
                   dynamic_ncols=True)

    eval_version = [0]  # the weight version the evaluation copy holds (model.path's: 0)

    def evaluate(step: int) -> None:
        if eval_model is None:
            return
        if eval_version[0] != version:
            refs = latest["refs"] if latest["version"] == version and latest["refs"] is not None else export_refs()
            load_weight_shards(eval_model, (ray.get(ref) for ref in refs))
            eval_version[0] = version
        res = greedy_accuracy(eval_model, processor, eval_prompts, eval_scorer, max_new_tokens=cfg.eval.max_new_tokens,
                              batch_size=cfg.eval.batch_size, samples=cfg.eval.samples,
                              temperature=cfg.eval.temperature, seed=cfg.train.seed)
        state["eval_curve"].append({"step": step, **res})
        metrics.write(step, {f"eval/{key}": v for key, v in res.items()})
        (out_dir / "eval_curve.json").write_text(json.dumps(state["eval_curve"], indent=2))

    def save(step: int) -> None:
        # scored answers of dropped / consumed groups need no parts: keep the checkpoint small
        live = {str(t.id) for t in tm.trajectories()}
        extra["parts"] = {key: v for key, v in extra["parts"].items() if key in live}
        learner.save_checkpoint(out_dir / f"step_{step:08d}", run_state, state, processor)
        prune_checkpoints(out_dir, cfg.checkpoint.keep_last)

    t_start = time.time()
    step_ends: list[float] = []
    steps_this_run = 0
    rm: RolloutManager | None = None
    try:
        if version > 0:  # resumed: new workers must serve the checkpoint's weights, not model.path's
            boot["refs"] = export_refs()
        rm = RolloutManager(tm, factory, rc.rollout_workers, max_inflight=r.max_batch_size, version=version)
        if state["step"] == 0 and not state["eval_curve"]:
            evaluate(0)
        while state["step"] < cfg.train.steps:
            step = state["step"] + 1
            seed = _step_seed(cfg.train.seed, step, 0)
            replay_rng = random.Random(seed)
            t0 = time.time()
            timing = {"score": 0.0, "replay": 0.0}
            kept: list[tuple[ReadyGroup, list[RolloutSample]]] = []
            examined: set[int] = set()
            ds_dropped = 0
            # dynamic sampling examines at most max_rounds batches' worth of groups per update, then trains
            # what it kept (as the synchronous loop does after algorithm.max_rounds rounds)
            cap = a.max_rounds * B if a.dynamic_sampling else None
            while not _batch_done(kept, examined, B, cap):
                admitted = admit()
                before = tm.counts()["chunks"] + tm.counts()["finished"]
                finished = rm.step()
                t = time.time()
                score(finished)
                timing["score"] += time.time() - t
                t = time.time()
                for group in tm.ready_groups(version, k):
                    if _batch_done(kept, examined, B, cap):
                        break
                    if group.id in examined:
                        continue
                    examined.add(group.id)
                    fresh = [as_sample(tr) for tr in group.trajectories]
                    samples = fresh
                    if m_replay:
                        samples = add_replay(fresh, pool, m_replay, encode=encode, eos_id=eos_id,
                                             max_response_len=r.max_new_tokens, rng=replay_rng,
                                             match_mode=cfg.replay.match_mode, decode=decode)
                        rows = [s for s in samples if s.source == "replay"]
                        rs = scorer(rows)
                        set_scores(rows, rs)
                        for s, parts in zip(rows, rs.parts):
                            s.metadata["reward_parts"] = parts
                    if a.dynamic_sampling and not is_informative(group_signal(samples, a.dynamic_sampling_metric)):
                        tm.consume([group.id])  # no learning signal: forget it, admit another prompt instead
                        inputs_cache.pop(group.id, None)
                        extra["discarded"] += 1
                        ds_dropped += 1
                        continue
                    kept.append((group, samples))
                timing["replay"] += time.time() - t
                if not finished and not admitted and tm.counts()["chunks"] + tm.counts()["finished"] == before:
                    time.sleep(IDLE_SLEEP_S)
            timing["wait"] = time.time() - t0 - timing["score"] - timing["replay"]

            consumed = tm.consume([g.id for g, _ in kept])
            for g, _ in kept:
                inputs_cache.pop(g.id, None)
            samples = []
            for gi, (_, rows) in enumerate(kept):
                for s in rows:
                    s.group = gi
                    samples.append(s)
            fresh = [s for s in samples if s.source == "rollout"]
            pool_added = 0
            if replay_on and cfg.replay.online:
                pool_added = _add_online(pool, [(s.prompt.id, s.prompt.mode, s.text, [int(x) for x in s.response_ids],
                                                 float(s.reward)) for s in fresh if s.passed], step)

            t = time.time()
            learner.compute_logprobs(samples, pad_id=pad_id, use_tree=use_tree)
            if learner.ref_model is not None:
                learner.compute_logprobs(samples, target="ref_logp", pad_id=pad_id, use_tree=use_tree)
            timing["old_logprob"] = time.time() - t
            assign_advantages(samples, std=a.std, eps=a.eps, difficulty=a.difficulty, kl_reward_coef=a.kl_reward_coef)
            t = time.time()
            res = learner.update(samples, n_groups=len(kept), seed=seed, pad_id=pad_id, use_tree=use_tree,
                                 loss_kwargs=loss_kwargs)
            timing["update"] = time.time() - t

            # staleness of every trained answer, from its recorded per-token versions
            stale = Counter(version - min(tr.versions) for tr in consumed)
            if stale and max(stale) > k:
                raise RuntimeError(f"internal error: an answer {max(stale)} versions old was trained with "
                                   f"rl.max_staleness={k}")
            partial = sum(len(set(tr.versions)) > 1 for tr in consumed)
            with open(out_dir / "trajectories.jsonl", "a") as f:
                for tr in consumed:
                    f.write(json.dumps({"step": step, "version": version, "id": tr.id, "group": tr.group,
                                        "sample": tr.sample, "prompt_id": tr.prompt_id,
                                        "start_version": tr.start_version, "spans": tr.version_spans(),
                                        "tokens": tr.num_tokens, "retries": tr.retries, "reward": tr.reward,
                                        "finish": tr.finish_reason}) + "\n")

            t = time.time()
            version += 1
            refs = export_refs()
            score(rm.update_weights(refs, version))  # answers that finished while the workers drained
            boot["refs"] = None  # from now on the rollout manager loads its latest weights into new workers
            timing["sync"] = time.time() - t

            row = _step_metrics(samples, res.stats, info.device, tis=True)
            row.update({f"time/{key}": v for key, v in timing.items()})
            row.update(pool.stats())
            row["pool/added"] = float(pool_added)
            row["grad_norm"] = _mean(res.grad_norms)
            row["updates_skipped"] = float(res.skipped)
            row["lr"] = res.lr
            row["dynsample/dropped"] = float(ds_dropped)
            row["staleness/max"] = float(max(stale, default=0))
            row["staleness/mean"] = sum(s * n for s, n in stale.items()) / max(len(consumed), 1)
            row["groups_trained"] = float(len(kept))
            for s_, n in sorted(stale.items()):
                row[f"staleness/{s_}"] = float(n)
            row["partial_rollouts"] = float(partial)
            row.update({f"events/trajectory/{key}": float(v) for key, v in tm.counts().items()})
            row.update({f"events/rollout/{key}": float(v) for key, v in rm.counts().items()})
            dt = time.time() - t0
            step_tokens = row.pop("_tokens")
            row["tokens_per_s"] = step_tokens / max(dt, 1e-9)
            row["samples_per_s"] = len(consumed) / max(dt, 1e-9)
            state["step"] = step
            state["tokens"] += int(step_tokens)
            state["trained"] += len(consumed)
            state["partial"] += partial
            for s_, n in stale.items():
                state["staleness"][str(s_)] = state["staleness"].get(str(s_), 0) + n
            state["losses"].append(row["loss"])
            state["rewards"].append(row["reward/mean"])
            state["pass_rates"].append(row["pass_rate"])
            steps_this_run += 1
            step_ends.append(time.time() - t_start)
            if step % cfg.log.every == 0:
                metrics.write(step, row)
            if bar is not None:
                bar.set_postfix(reward=f"{row['reward/mean']:.3f}", stale=f"{row['staleness/mean']:.2f}",
                                partial=int(partial), len=f"{row['response_length']:.1f}",
                                smp_s=f"{row['samples_per_s']:.1f}")
                bar.update(1)
            if on_step is not None:
                on_step(step, AsyncRun(rm, tm, learner, out_dir, version))
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                evaluate(step)
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < cfg.train.steps:
                save(step)
            if stop_after is not None and steps_this_run >= stop_after and step < cfg.train.steps:
                break
        finished_run = state["step"] >= cfg.train.steps
        if finished_run:
            evaluate(state["step"])
            save(state["step"])
            if cfg.checkpoint.export:
                final = out_dir / "final"
                shutil.rmtree(final, ignore_errors=True)
                shutil.copytree(out_dir / f"step_{state['step']:08d}" / "model", final)
            if replay_on:
                pool.save_jsonl(out_dir / "pool.jsonl")
        rollout_events = rm.counts()
    finally:
        if bar is not None:
            bar.close()
        metrics.close()
        for w in rm.workers if rm is not None else []:
            w.kill()

    summary = {
        "finished": finished_run,
        "mode": "async",
        "steps": state["step"],
        "losses": state["losses"],
        "rewards": state["rewards"],
        "pass_rates": state["pass_rates"],
        "eval_curve": state["eval_curve"],
        "tokens": state["tokens"],
        "seconds": time.time() - t_start,
        "tree": use_tree,
        "replay_M": m_replay,
        "pool": pool.stats(),
        "frozen_towers": learner.frozen,
        "world_size": 1,
        "strategy": learner.strategy,
        "learner_ranks": len(learner.actors),
        "learner_devices": list(learner.devices),
        "prompts": len(prompts),
        "param_checksum": learner.checksum(),
        "max_staleness": k,
        "trained_trajectories": state["trained"],
        "staleness": {int(key): v for key, v in state["staleness"].items()},
        "partial": state["partial"],
        "trajectory_events": tm.counts(),
        "rollout_events": rollout_events,
        "step_end_times": step_ends,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if cfg.log.progress:
        print(format_summary(summary, out_dir))
    return summary


def filter_on_worker(cfg: Any, model_path: str, processor_path: str, prompts: list[RLPrompt], dtype: str,
                     threads: int) -> list[str]:
    """The ids of the prompts ``data.filter_samples`` keeps (sampling accuracy in (0, 1)) under the weights at
    ``model_path``, sampled as the synchronous loop's filter does (a :class:`~keye.rl.rollout.engines.LocalRollout`
    seeded with ``train.seed``, scored by ``reward.spec``). Meant to run as a Ray task with a rollout
    worker's resources, so the driver never loads the model; callable in any process with one torch rank."""
    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor
    from keye.rewards import RewardSpec
    from keye.rl import LocalRollout, RewardScorer
    from keye.rl.loop.state import filter_by_accuracy as _filter
    from keye.train import dist as kdist

    torch.set_num_threads(int(threads))
    info = kdist.init_distributed(cfg.train.device)  # no WORLD_SIZE here: one rank, picks the device
    r = cfg.rollout
    model = KeyeVL.from_pretrained(model_path, torch_dtype=dtype, attn_implementation=cfg.model.attn_implementation)
    model = model.to(info.device).eval().requires_grad_(False)
    engine = LocalRollout(model, KeyeProcessor.from_pretrained(processor_path), max_new_tokens=r.max_new_tokens,
                          temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_batch_size=r.max_batch_size,
                          seed=cfg.train.seed)
    scorer = RewardScorer(RewardSpec.from_dict(cfg.reward.spec), pass_value=cfg.reward.pass_value)
    return [p.id for p in _filter(prompts, engine, scorer, cfg, info)]


def _batch_done(kept: Sequence[Any], examined: set[int], target: int, cap: int | None) -> bool:
    """Whether an update's batch is complete: ``target`` groups kept, or (dynamic sampling) ``cap`` groups
    examined."""
    return len(kept) >= target or (cap is not None and len(examined) >= cap)


def _process(processor: Any, messages: list[dict[str, Any]], mode: str | None) -> Any:
    """The processor outputs of one prompt in ``mode`` (what the rollout worker computes too)."""
    from keye.processing.chat import apply_mode

    batch = processor([apply_mode(messages, mode)], return_tensors="pt")
    return split_batch(batch, processor.image_token_id, processor.video_token_id,
                       processor.image_processor.config.merge_size)[0]


__all__ = ["AsyncRun", "AsyncRunState", "DEFAULT_ASYNC_TIS_CAP", "filter_on_worker", "train_async"]
