"""The asynchronous batch source of the one RL loop (``rl.engine: ray``, ``rl.mode: async``): generation overlaps
training.

:class:`StreamingBatcher` holds a :class:`~keye.rl.rollout.trajectory.TrajectoryManager` and a
:class:`~keye.rl.rollout.rollout_manager.RolloutManager` over streaming rollout workers (each a
:class:`~keye.rl.rollout.stream_worker.StreamWorker` with whole weights that decodes in a background thread; on Ray
they are built by :class:`keye.rl.distributed.stream_workers.StreamWorkerPool`, the components' ``engine``). For each
step of the loop it:

1. **admits** prompts while the staleness rule allows (:meth:`TrajectoryManager.admissible_groups` with
   ``rl.max_staleness = k``, plus one more group for every group dropped by dynamic sampling or failed): group
   ``g`` trains update ``g // B`` at the latest, so every token it trains was sampled at most ``k`` versions
   earlier, without stale drops (``ready_groups`` still drops any that would exceed it);
2. **streams**: one :meth:`RolloutManager.step` (restart dead workers and requeue their answers, dispatch, poll),
   then **scores** every finished answer (``reward.spec``, in the driver);
3. **batches**: complete groups in admission order; each gets its RLEP replay rows (``replay.M``, scored with the
   same reward) and, with ``algorithm.dynamic_sampling``, a group whose members all score the same is dropped (and
   replaced by a new admission); ``data.prompts_per_step`` kept groups make the step's batch. Each trained answer
   gets a line in ``trajectories.jsonl`` (its per-version token spans).

With the streaming update (``rl.update``: ``streaming``, or ``auto`` when the update is one optimizer step) each
kept group goes to the learner as soon as it is complete (:class:`~keye.rl.loop.batcher.StreamingUpdate`: its
log-probs, advantages and gradient are computed while the long tail of the batch still decodes) and the optimizer
steps once the batch is whole; with ``barrier`` the loop computes log-probs and advantages and updates the learner
after the whole batch is in, exactly as in synchronous mode. Either way the loss is the decoupled PPO loss below,
every trained token comes from one version, and :meth:`StreamingBatcher.push_weights` then sends the new weights
as version ``v + 1`` (:meth:`RolloutManager.update_weights`: pause at a chunk boundary, load, resume; unfinished answers
continue under the new weights - partial rollouts).

**Off-policy correction (decoupled PPO).** An answer trained at version ``v`` was sampled by a behaviour policy
``mu`` (versions ``v - k .. v``, one per token, recorded with the token's log-prob). The loss of
:func:`keye.rl.algorithms.losses.policy_loss` uses the learner's log-probs at version ``v`` as the *proximal*
policy ``pi_old`` of the PPO ratio and clip, and multiplies each token's policy-gradient term by the behaviour
importance weight ``w = min(pi_old / mu, C)`` (no gradient), ``C = algorithm.tis_cap`` - the decoupled objective
of Hilton et al. (2022, "Batch size-invariance for policy optimization") with a truncated weight (as AReaL and
verl's TIS). Without ``algorithm.tis_cap`` async mode uses ``C =`` :data:`DEFAULT_ASYNC_TIS_CAP`
(:func:`keye.rl.config.policy_loss_kwargs`). Replayed answers have no behaviour log-probs: weight 1.

**Checkpoints** hold, as the loader state (:class:`AsyncRunState`), the prompt stream, the prompts drawn but not
admitted yet, the replay pool, the whole trajectory manager (queue, partial answers with their tokens, versions and
behaviour log-probs, scored answers waiting for their group) and the reward parts of those answers. A driver
killed at any moment resumes from the newest checkpoint: its answers that were in flight are returned to the queue
(:meth:`TrajectoryManager.reclaim`) and continue on new workers that first load the checkpoint's weights;
``trajectories.jsonl`` is cut back to the checkpoint's step.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keye.errors import KeyeConfigError
from keye.rl.algorithms.replay import add_replay
from keye.rl.algorithms.sampling import ModeMix, group_signal, is_informative
from keye.rl.algorithms.update import set_scores
from keye.rl.config import replay_m
from keye.rl.loop.batcher import StepBatch, add_online
from keye.rl.loop.state import step_seed
from keye.rl.rollout.rollout_manager import RolloutManager
from keye.rl.rollout.samples import PromptInputs, RLPrompt, RolloutSample, split_batch
from keye.rl.rollout.trajectory import ReadyGroup, Trajectory, TrajectoryManager
from keye.train.metrics import truncate_jsonl

log = logging.getLogger("keye.rl.loop.streaming")

MAX_RETRIES = 3
"""Worker failures one answer may survive before its group is dropped (a prompt that keeps killing workers
must not stall training)."""
POLL_INTERVAL_S = 0.02
"""Shortest time between two polls of the rollout workers. Each poll is a round of calls into every worker's
process, whose handler takes the interpreter lock from the decoding thread, and a busy driver takes CPU the workers
need. Polled in a spin (every 3 ms or faster, since token chunks arrive all the time), the driver used 16-20 % of
a core on the 2-core machine. A group waits at most this long to be noticed, against steps of seconds."""
TRAJECTORIES = "trajectories.jsonl"


@dataclass
class AsyncRun:
    """What the loop's ``on_step`` callback receives after each update in async mode: the managers, the learner
    group's proxy (:class:`keye.rl.distributed.learner_group.RemoteLearner`: ``run.learner.pids()`` are the ranks'
    processes), the output folder and the weight version (tests kill a worker by ``run.rollout.workers[i].pid()``)."""

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

    def snapshot(self) -> None:
        """Before a save: forget the reward parts of answers already trained or dropped (a small checkpoint)."""
        live = {str(t.id) for t in self.tm.trajectories()}
        self.extra["parts"] = {k: v for k, v in self.extra["parts"].items() if k in live}

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


class StreamingBatcher:
    """The asynchronous batch source (module doc); the :class:`~keye.rl.loop.batcher.BatchSource` of
    ``rl.mode: async``.

    Args:
        cfg: the :class:`keye.rl.config.RLEPConfig` (``data``, ``rollout``, ``replay``, ``algorithm``, ``rl``).
        parts: the run's components: ``learner`` (the learner group), ``scorer``, and ``engine``, a streaming
            worker pool with ``make(index)`` (a new worker, loaded with the boot weights when set), ``workers``
            (how many), ``boot(refs, version)``, ``export(learner, version)`` (the new weights' shard refs) and
            ``shards(learner, version)`` (the current weights for evaluation).
        pool: the replay pool; stream: the prompt stream (one rank); prompts: the run's prompts (by id);
        processor: the Keye processor; out_dir: the run directory.
    """

    def __init__(self, cfg: Any, parts: Any, pool: Any, stream: Any, prompts: Sequence[RLPrompt], processor: Any,
                 out_dir: Path):
        self.cfg, self.parts, self.workers, self.scorer = cfg, parts, parts.engine, parts.scorer
        self.pool, self.stream, self.processor, self.out_dir = pool, stream, processor, out_dir
        self.B, self.G, self.k = cfg.data.prompts_per_step, cfg.rollout.G, cfg.rl.max_staleness
        self.m_replay = replay_m(cfg)
        self.eos_id = int(parts.learner.config.eos_token_ids[0])
        self.mix = ModeMix.from_config(cfg.algorithm.mode_mix)
        self.by_id = {p.id: p for p in prompts}
        self.tm = TrajectoryManager(max_new_tokens=cfg.rollout.max_new_tokens, max_retries=MAX_RETRIES)
        # drawn: prompts drawn in batches of B (modes assigned per batch, as the sync loop does) and not yet
        # admitted; parts: reward parts of scored answers; discarded: groups dropped by dynamic sampling;
        # trained / staleness / partial: what the run's updates consumed so far
        self.extra: dict[str, Any] = {"drawn": [], "batches_drawn": 0, "parts": {}, "discarded": 0, "trained": 0,
                                      "staleness": {}, "partial": 0}
        self.run_state = AsyncRunState(stream, pool, self.tm, self.extra)
        self.inputs_cache: dict[int, PromptInputs] = {}
        self.version = 0
        self.rm: RolloutManager | None = None
        self.t_start = time.time()
        self.step_ends: list[float] = []

    # ----------------------------------------------------------------------------------- protocol
    def start(self, step: int) -> None:
        """Start the rollout workers after ``step``; after a resume, answers that were in flight go back to the
        queue, new workers first load the checkpoint's weights and ``trajectories.jsonl`` is cut back."""
        self.version = step
        if step:
            reclaimed = self.tm.reclaim()
            truncate_jsonl(self.out_dir / TRAJECTORIES, step)
            log.info("resumed at step %d (%d answers in flight returned to the queue)", step, reclaimed)
            self.workers.boot(self.workers.export(self.parts.learner, step), step)
        r = self.cfg.rollout
        self.rm = RolloutManager(self.tm, self.workers.make, self.workers.count, max_inflight=r.max_batch_size,
                                 version=self.version)

    def collect(self, step: int, seed: int,
                on_group: Callable[[list[RolloutSample]], None] | None = None,
                on_poll: Callable[[], None] | None = None) -> StepBatch:
        """The batch of ``step`` (module doc, 1-3): ``B`` kept groups (fewer when dynamic sampling examined
        ``algorithm.max_rounds * B`` groups first), numbered in admission order. ``on_group(samples)`` receives each
        kept group as soon as it is complete and scored (the streaming update, :class:`StreamingUpdate`);
        ``on_poll()`` is called once per poll of the rollout workers (:meth:`StreamingUpdate.poll`)."""
        a, B = self.cfg.algorithm, self.B
        replay_rng = random.Random(seed)
        t0 = time.time()
        timing = {"score": 0.0, "replay": 0.0}
        kept: list[tuple[ReadyGroup, list[RolloutSample]]] = []
        examined: set[int] = set()
        dropped = 0
        # dynamic sampling examines at most max_rounds batches' worth of groups per update, then trains what it
        # kept (as the synchronous loop does after algorithm.max_rounds rounds)
        cap = a.max_rounds * B if a.dynamic_sampling else None
        while not _batch_done(kept, examined, B, cap):
            t_round = time.time()
            self._admit()
            finished = self.rm.step()
            t = time.time()
            self._score(finished)
            timing["score"] += time.time() - t
            t = time.time()
            for group in self.tm.ready_groups(self.version, self.k):
                if _batch_done(kept, examined, B, cap):
                    break
                if group.id in examined:
                    continue
                examined.add(group.id)
                samples = self._with_replay(group, replay_rng)
                if a.dynamic_sampling and not is_informative(group_signal(samples, a.dynamic_sampling_metric)):
                    self.tm.consume([group.id])  # no learning signal: forget it, admit another prompt instead
                    self.inputs_cache.pop(group.id, None)
                    self.extra["discarded"] += 1
                    dropped += 1
                    continue
                for s in samples:
                    s.group = len(kept)
                kept.append((group, samples))
                if on_group is not None:
                    timing["replay"] += time.time() - t
                    on_group(samples)
                    t = time.time()
            timing["replay"] += time.time() - t
            if on_poll is not None:
                on_poll()
            rest = POLL_INTERVAL_S - (time.time() - t_round)
            if rest > 0 and not _batch_done(kept, examined, B, cap):
                time.sleep(rest)
        timing["wait"] = time.time() - t0 - timing["score"] - timing["replay"]
        return self._batch(step, kept, dropped, timing)

    def push_weights(self, step: int, batch: StepBatch) -> None:
        """Export the updated weights once (learner rank 0 into the object store) and load them into every worker
        as version ``step`` (answers that finish while the workers drain are scored); records the step's event
        counts and end time."""
        self.version += 1
        refs = self.workers.export(self.parts.learner, self.version)
        self._score(self.rm.update_weights(refs, self.version))
        self.workers.boot(None, self.version)  # from now on the rollout manager loads its latest weights
        batch.extra.update({f"events/trajectory/{key}": float(v) for key, v in self.tm.counts().items()})
        batch.extra.update({f"events/rollout/{key}": float(v) for key, v in self.rm.counts().items()})
        self.step_ends.append(time.time() - self.t_start)

    def eval_weights(self) -> Iterable[dict[str, torch.Tensor]]:
        """The weights the workers were last sent (exported again only when they are not the current ones)."""
        return self.workers.shards(self.parts.learner, self.version)

    def view(self, step: int) -> AsyncRun:
        """``on_step``'s view: the managers, the learner group, the run directory and the version."""
        return AsyncRun(self.rm, self.tm, self.parts.learner, self.out_dir, self.version)

    def summary(self) -> dict[str, Any]:
        """``trained_trajectories`` (answers consumed by updates, over the whole run), ``staleness`` (histogram of
        ``v - start_version`` over trained answers), ``partial`` (trained answers sampled by several versions),
        ``max_staleness``, the event counters of both managers (``trajectory_events`` over the whole run,
        ``rollout_events`` this invocation) and ``step_end_times`` (seconds since the start of this invocation)."""
        return {"max_staleness": self.k, "trained_trajectories": self.extra["trained"],
                "staleness": {int(key): v for key, v in self.extra["staleness"].items()},
                "partial": self.extra["partial"], "trajectory_events": self.tm.counts(),
                "rollout_events": self.rm.counts() if self.rm is not None else {}, "step_end_times": self.step_ends}

    def close(self) -> None:
        """Kill the rollout workers (idempotent)."""
        for w in self.rm.workers if self.rm is not None else []:
            w.kill()

    # ----------------------------------------------------------------------------------- internals
    def _admit(self) -> int:
        """Admit as many new groups as the staleness rule allows; returns how many."""
        allowed = self.tm.admissible_groups(self.version, self.k, self.B) + self.extra["discarded"] \
            + self.tm.counts()["groups_failed"]
        if allowed <= 0:
            return 0
        extra = self.extra
        while len(extra["drawn"]) < allowed:
            batch = self.stream.draw(self.B)
            if self.mix is not None:
                batch = self.mix.assign(batch, random.Random(step_seed(self.cfg.train.seed, extra["batches_drawn"], 1)))
            extra["batches_drawn"] += 1
            extra["drawn"] += [[p.id, p.mode] for p in batch]
        take, extra["drawn"] = extra["drawn"][:allowed], extra["drawn"][allowed:]
        inputs = [self._process(self.by_id[pid].messages, mode) for pid, mode in take]
        metas = [{"messages": self.by_id[pid].messages, "mode": mode, "prompt_tokens": x.length}
                 for (pid, mode), x in zip(take, inputs)]
        for gid, x in zip(self.tm.add_prompts([pid for pid, _ in take], self.G, self.version, metas), inputs):
            self.inputs_cache[gid] = x
        return len(take)

    def _process(self, messages: list[dict[str, Any]], mode: str | None) -> PromptInputs:
        """The processor outputs of one prompt in ``mode`` (what the rollout worker computes too)."""
        from keye.processing.chat import apply_mode

        p = self.processor
        batch = p([apply_mode(messages, mode)], return_tensors="pt")
        return split_batch(batch, p.image_token_id, p.video_token_id, p.image_processor.config.merge_size)[0]

    def _group_inputs(self, gid: int) -> PromptInputs:
        if gid not in self.inputs_cache:
            meta = self.tm.group(gid).meta
            self.inputs_cache[gid] = self._process(meta["messages"], meta["mode"])
        return self.inputs_cache[gid]

    def _sample(self, t: Trajectory) -> RolloutSample:
        """The training sample of a trajectory (its group's prompt in the group's mode)."""
        g = self.tm.group(t.group)
        base = self.by_id[g.prompt_id]
        prompt = RLPrompt(base.id, base.messages, base.reference, base.task, g.meta["mode"], dict(base.extra))
        return RolloutSample(prompt=prompt, group=t.group, inputs=self._group_inputs(t.group),
                             response_ids=torch.tensor(t.tokens, dtype=torch.long),
                             text=self.processor.decode(t.tokens, skip_special_tokens=True),
                             finished=t.finish_reason == "stop",
                             rollout_logp=torch.tensor(t.logps, dtype=torch.float32), reward=t.reward, passed=t.passed,
                             metadata={"mode": g.meta["mode"], "traj_id": t.id,
                                       "reward_parts": self.extra["parts"].get(str(t.id), {})})

    def _score(self, finished: Sequence[int]) -> None:
        trajs = [self.tm.get(tid) for tid in finished]
        if not trajs:
            return
        scores = self.scorer([self._sample(t) for t in trajs])
        for t, rew, ok, parts in zip(trajs, scores.rewards, scores.passed, scores.parts):
            if self.tm.on_scored(t.id, rew, ok):
                self.extra["parts"][str(t.id)] = dict(parts)

    def _with_replay(self, group: ReadyGroup, rng: random.Random) -> list[RolloutSample]:
        """A complete group's training rows: its fresh answers plus ``replay.M`` replayed ones, scored."""
        fresh = [self._sample(tr) for tr in group.trajectories]
        if not self.m_replay:
            return fresh
        samples = add_replay(fresh, self.pool, self.m_replay, encode=self._encode, eos_id=self.eos_id,
                             max_response_len=self.cfg.rollout.max_new_tokens, rng=rng,
                             match_mode=self.cfg.replay.match_mode, decode=self._decode)
        rows = [s for s in samples if s.source == "replay"]
        rs = self.scorer(rows)
        set_scores(rows, rs)
        for s, parts in zip(rows, rs.parts):
            s.metadata["reward_parts"] = parts
        return samples

    def _encode(self, text: str) -> list[int]:
        return list(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, ids: list[int]) -> str:
        return self.processor.decode(ids, skip_special_tokens=True)

    def _batch(self, step: int, kept: list[tuple[ReadyGroup, list[RolloutSample]]], dropped: int,
               timing: dict[str, float]) -> StepBatch:
        """Consume the kept groups: number them, grow the pool, record every trained answer's staleness and
        version spans (``trajectories.jsonl``)."""
        consumed = self.tm.consume([g.id for g, _ in kept])
        for g, _ in kept:
            self.inputs_cache.pop(g.id, None)
        samples = [s for _, rows in kept for s in rows]  # numbered 0 .. len(kept) - 1 as they were kept
        pool_added = 0
        if self.m_replay and self.cfg.replay.online:
            pool_added = add_online(self.pool, [(s.prompt.id, s.prompt.mode, s.text, [int(x) for x in s.response_ids],
                                                 float(s.reward)) for s in samples if s.source == "rollout" and s.passed],
                                    step)
        # staleness of every trained answer, from its recorded per-token versions
        stale = Counter(self.version - min(tr.versions) for tr in consumed)
        if stale and max(stale) > self.k:
            raise RuntimeError(f"internal error: an answer {max(stale)} versions old was trained with "
                               f"rl.max_staleness={self.k}")
        partial = sum(len(set(tr.versions)) > 1 for tr in consumed)
        with open(self.out_dir / TRAJECTORIES, "a") as f:
            for tr in consumed:
                f.write(json.dumps({"step": step, "version": self.version, "id": tr.id, "group": tr.group,
                                    "sample": tr.sample, "prompt_id": tr.prompt_id, "start_version": tr.start_version,
                                    "spans": tr.version_spans(), "tokens": tr.num_tokens, "retries": tr.retries,
                                    "reward": tr.reward, "finish": tr.finish_reason}) + "\n")
        self.extra["trained"] += len(consumed)
        self.extra["partial"] += partial
        for s, n in stale.items():
            self.extra["staleness"][str(s)] = self.extra["staleness"].get(str(s), 0) + n
        row = {"dynsample/dropped": float(dropped), "staleness/max": float(max(stale, default=0)),
               "staleness/mean": sum(s * n for s, n in stale.items()) / max(len(consumed), 1),
               "groups_trained": float(len(kept)), "partial_rollouts": float(partial),
               **{f"staleness/{s}": float(n) for s, n in sorted(stale.items())}}
        return StepBatch(samples, len(kept), timing, pool_added=pool_added, extra=row)


def _batch_done(kept: Sequence[Any], examined: set[int], target: int, cap: int | None) -> bool:
    """Whether an update's batch is complete: ``target`` groups kept, or (dynamic sampling) ``cap`` groups
    examined."""
    return len(kept) >= target or (cap is not None and len(examined) >= cap)


__all__ = ["AsyncRun", "AsyncRunState", "StreamingBatcher"]
