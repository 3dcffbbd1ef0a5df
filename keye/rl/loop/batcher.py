"""The training batch of one RL step: collected by :class:`RolloutBatcher`, made ready by :func:`prepare_update`.

:meth:`RolloutBatcher.collect` is the rollout side of a step (on every rank, for its own prompts):

1. draw this rank's prompts from the :class:`~keye.rl.loop.state.PromptStream`, give them thinking modes
   (``algorithm.mode_mix``) and sample ``rollout.G`` answers each with the rollout engine (``algorithm.autothink``:
   linked auto / forced-think / forced-direct groups, :mod:`keye.rl.algorithms.autothink`);
2. RLEP phase B: append ``replay.M`` replayed successes per group from the replay pool;
3. score fresh and replayed answers with the same scorer; with ``algorithm.dynamic_sampling`` drop groups whose
   signal is all equal and refill them (:func:`keye.rl.algorithms.sampling.dynamic_sample`);
4. number the kept groups and grow the pool with the new verified successes of every rank (``replay.online``).

:func:`prepare_update` is the learner side before the optimizer: old (and reference) log-probs of every kept
answer with the current policy, then the group-normalised advantages.

All randomness is drawn from the step seed, so a resumed run collects the same batches.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

from keye.rl.algorithms import autothink
from keye.rl.algorithms.replay import ReplayEntry, ReplayPool, add_replay
from keye.rl.algorithms.sampling import ModeMix, dynamic_sample, group_signal
from keye.rl.algorithms.update import assign_advantages, set_scores
from keye.rl.config import replay_m
from keye.rl.loop.metrics import dynsample_stats
from keye.rl.loop.state import PromptStream, RunState
from keye.rl.rollout.samples import RLPrompt, RolloutSample
from keye.train.dist import all_gather, reduce_sums


@dataclass
class StepBatch:
    """What one step trains on (this rank's part): ``samples`` with ``group`` numbered ``0 .. n_groups - 1``,
    seconds per stage (``timing``: the batch source's stages, then old_logprob, update and sync as they run), the
    dynamic-sampling and AutoThink metric rows (empty when off), the pool entries added this step and the batch
    source's own metrics (``extra``: the asynchronous source's staleness and event counts)."""

    samples: list[RolloutSample]
    n_groups: int
    timing: dict[str, float] = field(default_factory=dict)
    dynsample: dict[str, float] = field(default_factory=dict)
    autothink: dict[str, float] = field(default_factory=dict)
    pool_added: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class BatchSource(Protocol):
    """Where the one RL loop gets each step's batch (:func:`keye.recipes.rlep.train`): :class:`RolloutBatcher`
    (synchronous: every rank samples its prompts with the current policy) or
    :class:`keye.rl.loop.streaming.StreamingBatcher` (asynchronous: groups stream from rollout workers under the
    staleness rule). Every method is collective where the loop is (all ranks, same order).
    """

    run_state: Any
    """What a checkpoint stores as the loader state (``state_dict`` / ``load_state_dict``, ``snapshot()`` before
    each save)."""

    def start(self, step: int) -> None:
        """Begin after ``step`` (0, or the resumed checkpoint's): the engine serves that step's policy."""

    def collect(self, step: int, seed: int) -> StepBatch:
        """This rank's batch of ``step`` (scored, replayed, filtered, groups numbered)."""

    def push_weights(self, step: int, batch: StepBatch) -> None:
        """After the update of ``step``: the engine samples with the new weights from now on."""

    def eval_weights(self) -> Iterable[dict[str, Any]]:
        """The current policy's weight shards, for an evaluation copy (collective)."""

    def view(self, step: int) -> Any:
        """What an ``on_step`` callback receives after ``step`` (tests, benchmarks)."""

    def summary(self) -> dict[str, Any]:
        """The source's part of the run summary."""

    def close(self) -> None:
        """Release workers and files (idempotent)."""


def add_online(pool: ReplayPool, rows: list[tuple], step: int) -> int:
    """Add verified successes ``(question id, mode, text, token ids, reward)`` sampled at ``step`` to the pool;
    returns how many the pool accepted."""
    added = 0
    for qid, mode, text, ids, reward in rows:
        added += pool.add(ReplayEntry(qid, text, ids, reward, {"mode": mode, "source": "online", "step": step}))
    return added


class RolloutBatcher:
    """The synchronous batch source: prompts -> sampled, replayed, scored groups (see the module doc).

    Args:
        cfg: the :class:`keye.rl.config.RLEPConfig` (``data``, ``rollout``, ``replay``, ``algorithm`` are read).
        parts: the run's :class:`~keye.rl.loop.components.Components` (the engine that samples, the scorer, the
            weight sync).
        pool: the replay pool (read for phase B, grown online).
        stream: this rank's prompt stream.
        processor: the Keye processor (replayed texts are tokenised and decoded as the rollouts are).
        info: this process's :class:`keye.train.dist.DistInfo`.
        out_dir: the run directory (``autothink_groups.jsonl``).
    """

    def __init__(self, cfg: Any, parts: Any, pool: ReplayPool, stream: PromptStream, processor: Any, info: Any,
                 out_dir: Path):
        self.cfg, self.parts, self.engine, self.scorer = cfg, parts, parts.engine, parts.scorer
        self.pool, self.stream, self.processor, self.info, self.out_dir = pool, stream, processor, info, out_dir
        self.eos_id = int(parts.learner.config.eos_token_ids[0])
        self.run_state = RunState(stream, pool, parts.engine, info.rank)
        self.m_replay = replay_m(cfg)
        self.per_rank = cfg.data.prompts_per_step // info.world_size
        self.mix = ModeMix.from_config(cfg.algorithm.mode_mix)
        at = self.at = cfg.algorithm.autothink
        self.at_scale = at.length_scale if at.length_scale is not None else cfg.rollout.max_new_tokens
        self.at_log: Any = None

    def start(self, step: int) -> None:
        """Begin after ``step``: the AutoThink group log drops rows of later steps; an engine built from the start
        checkpoint is brought to the resumed policy (it is synced after every update from then on)."""
        at = self.at
        self.at_log = autothink.GroupLog(self.out_dir, step, enabled=at.enabled and at.record and self.info.is_main)
        if getattr(self.engine, "weight_version", step) != step:
            self.parts.sync(step, self.cfg.rollout.sync_bytes)

    def push_weights(self, step: int, batch: StepBatch) -> None:
        """The next rollouts sample the policy updated at ``step`` (a no-op for an engine sampling with the
        learner's own model)."""
        self.parts.sync(step, self.cfg.rollout.sync_bytes)

    def eval_weights(self) -> Iterable[dict[str, Any]]:
        """The learner's current weights, exported shard by shard (collective)."""
        return self.parts.learner.export_weights(self.cfg.rollout.sync_bytes)

    def view(self, step: int) -> Any:
        """``on_step``'s view: the components and the step."""
        return SimpleNamespace(parts=self.parts, learner=self.parts.learner, engine=self.engine,
                               out_dir=self.out_dir, version=step)

    def summary(self) -> dict[str, Any]:
        """Nothing beyond the loop's own summary."""
        return {}

    def close(self) -> None:
        """Nothing to release (the components are the recipe's)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of a replayed answer text (no special tokens)."""
        return list(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Text of response token ids, decoded as the rollouts decode their responses."""
        return self.processor.decode(ids, skip_special_tokens=True)

    def collect(self, step: int, seed: int) -> StepBatch:
        """This rank's batch of ``step`` (collective: the metrics, AutoThink records and pool growth are
        gathered over ranks); ``seed`` seeds the engine, the replay draws and the mode assignment."""
        a, at = self.cfg.algorithm, self.at
        if hasattr(self.engine, "reseed"):
            self.engine.reseed(seed)
        replay_rng, mode_rng = random.Random(seed), random.Random(seed + 1)
        timing = {"rollout": 0.0, "score": 0.0}

        def produce(prompts: Sequence[RLPrompt]) -> list[list[RolloutSample]]:
            return self._produce(prompts, mode_rng, replay_rng, timing)

        if a.dynamic_sampling:
            if at.enabled:
                def signal(g: Any) -> Any:
                    return autothink.group_signal(g, a.dynamic_sampling_metric, at.train_forced)
            else:
                def signal(g: Any) -> Any:
                    return group_signal(g, a.dynamic_sampling_metric)
            res = dynamic_sample(self.stream.draw, produce, self.per_rank, rewards_of=signal,
                                 max_rounds=a.max_rounds, oversample=a.oversample)
            groups, ds_stats = res.groups, dynsample_stats(res, self.info.device)
        else:
            groups, ds_stats = produce(self.stream.draw(self.per_rank)), {}
        at_row: dict[str, float] = {}
        if at.enabled:  # measure and record the linked questions, then train their (trained) groups
            at_row = autothink.finish_metrics(reduce_sums(autothink.metric_sums(groups), self.info.device))
            if at.record:
                self.at_log.write([q for rows in all_gather(autothink.question_records(groups, step)) for q in rows])
            samples, n_groups = autothink.flatten(groups, at.train_forced)
        else:
            samples, n_groups = [], len(groups)
            for gi, g in enumerate(groups):
                for s in g:
                    s.group = gi
                    samples.append(s)
        return StepBatch(samples, n_groups, timing, ds_stats, at_row, self._grow_pool(samples, step))

    def _produce(self, prompts: Sequence[RLPrompt], mode_rng: random.Random, replay_rng: random.Random,
                 timing: dict[str, float]) -> list[list[RolloutSample]]:
        """One round: modes, fresh answers, replayed ones, scores; one group (or AutoThink linked list) per prompt."""
        r, at = self.cfg.rollout, self.at
        ps = self.mix.assign(prompts, mode_rng) if self.mix is not None else list(prompts)
        t = time.time()
        fresh = autothink.generate(self.engine, ps, r.G, at) if at.enabled else self.engine.generate(ps, r.G)
        samples = add_replay(fresh, self.pool, self.m_replay, encode=self.encode, eos_id=self.eos_id,
                             max_response_len=r.max_new_tokens, rng=replay_rng, match_mode=self.cfg.replay.match_mode,
                             decode=self.decode) if self.m_replay else fresh
        timing["rollout"] += time.time() - t
        t = time.time()
        scores = self.scorer(samples)
        set_scores(samples, scores)
        for s, parts in zip(samples, scores.parts):
            s.metadata["reward_parts"] = parts
        timing["score"] += time.time() - t
        if at.enabled:  # one linked list (auto, think, direct groups) per prompt, auto replies re-rewarded
            return autothink.link_groups(samples, len(ps), at, self.at_scale)
        groups: dict[int, list[RolloutSample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        return [groups[i] for i in range(len(ps))]

    def _grow_pool(self, samples: Sequence[RolloutSample], step: int) -> int:
        """Online RLEP: every rank's verified fresh successes of this step, added on every rank (collective)."""
        if not (self.m_replay and self.cfg.replay.online):
            return 0
        mine = [(s.prompt.id, s.prompt.mode, s.text, [int(t) for t in s.response_ids], float(s.reward))
                for s in samples if s.source == "rollout" and s.passed]
        return sum(add_online(self.pool, rows, step) for rows in all_gather(mine))


def prepare_update(batch: StepBatch, learner: Any, algorithm: Any, *, pad_id: int, use_tree: bool) -> None:
    """Old (and, with a reference model, reference) log-probs of every sample with the current policy, then the
    group advantages (after the log-probs: the KL reward penalty uses them); times the log-probs as
    ``batch.timing["old_logprob"]``. Collective (the learner's forwards)."""
    a = algorithm
    t = time.time()
    learner.compute_logprobs(batch.samples, pad_id=pad_id, use_tree=use_tree)
    if learner.ref_model is not None:
        learner.compute_logprobs(batch.samples, target="ref_logp", pad_id=pad_id, use_tree=use_tree)
    batch.timing["old_logprob"] = time.time() - t
    if batch.samples:
        assign_advantages(batch.samples, std=a.std, eps=a.eps, difficulty=a.difficulty, kl_reward_coef=a.kl_reward_coef)


class StreamingUpdate:
    """The learner side of a streaming update (``rl.update: streaming``, asynchronous mode): the batch source hands
    each kept group over as soon as it is complete and scored (:meth:`add`); the groups waiting go to the learner
    as one part - old and reference log-probs with the weights about to be updated, group advantages, the part's
    gradient - while later groups are still being generated; :meth:`finish` steps once when the batch is whole.
    The result equals the barrier update (:func:`prepare_update` then ``learner.update`` with one epoch and one
    mini-batch) on the same groups, however the groups are split into parts.

    A part leaves when at least ``learner.ranks`` groups wait (one per rank) and the learner is free: a learner
    with ``busy()`` (the Ray learner group, whose parts run in its actors while the driver streams) gets every
    group that completed while it worked on the previous part in one call, so a learner slower than the groups
    arrive trains few large parts instead of queueing many small ones (each part pays a forward for the old
    log-probs and a backward, whose fixed costs dominate small parts). :meth:`poll` (called by the batch source
    between its polls of the rollout workers) sends the waiting groups as soon as the learner frees up.
    """

    def __init__(self, learner: Any, *, pad_id: int, use_tree: bool, loss_kwargs: dict[str, Any]):
        self.learner, self.pad_id, self.use_tree, self.loss_kwargs = learner, pad_id, use_tree, loss_kwargs
        self.per_part = max(1, int(getattr(learner, "ranks", 1)))
        self._busy = getattr(learner, "busy", None)
        self.pending: list[list[RolloutSample]] = []
        self.parts_sent = 0  # for the step's metrics
        self.seconds = 0.0  # driver time spent handing parts over (and in the learner, when it is in process)

    def add(self, group: list[RolloutSample]) -> None:
        """A kept group (its samples numbered with their batch group id)."""
        self.pending.append(group)
        self.poll()

    def poll(self) -> None:
        """Send the waiting groups as one part if there are at least ``learner.ranks`` of them and the learner is
        free (always, for a learner without ``busy()``)."""
        if len(self.pending) >= self.per_part and (self._busy is None or not self._busy()):
            self._send()

    def _send(self) -> None:
        t = time.time()
        samples = [s for g in self.pending for s in g]
        self.parts_sent += 1
        self.pending = []
        self.learner.stream_part(samples, pad_id=self.pad_id, use_tree=self.use_tree, loss_kwargs=self.loss_kwargs)
        self.seconds += time.time() - t

    def finish(self, batch: StepBatch) -> Any:
        """Send what is left, wait for the learner and step once; returns its
        :class:`~keye.rl.learner.learner.UpdateResult` and records the time spent in ``batch.timing``."""
        if self.pending:
            self._send()
        t = time.time()
        result = self.learner.finish_stream(loss_kwargs=self.loss_kwargs)
        batch.timing["update"] = time.time() - t
        batch.timing["stream_parts"] = self.seconds
        batch.extra["stream/parts"] = float(self.parts_sent)
        return result
