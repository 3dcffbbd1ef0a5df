"""What an RL run carries from step to step and across restarts.

- the RL prompts (:func:`load_prompts`, the optional pre-run accuracy filter :func:`filter_by_accuracy`, and
  :func:`select_prompts`, which on resume keeps the filtered set the run started with) and this rank's
  :class:`PromptStream` over them;
- the replay pool (:func:`load_pool`);
- the trainer state (step, per-step losses / rewards / pass rates, eval curve, tokens: :func:`trainer_state`,
  :func:`record_step`) and :class:`RunState`, the rest of what a checkpoint holds;
- the per-step seed (:func:`step_seed`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from keye.errors import KeyeConfigError
from keye.rl.algorithms.replay import ReplayPool
from keye.rl.algorithms.sampling import filter_prompts
from keye.rl.rollout.prompts import load_rl_prompts
from keye.rl.rollout.samples import RLPrompt
from keye.rl.rollout.scoring import RewardScorer
from keye.train.dist import all_gather


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of everything random in RL step ``step`` on ``rank`` (sampling, replay draws, modes, order)."""
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**62)


class PromptStream:
    """An endless stream of this rank's prompts: per epoch a permutation seeded by ``(seed, epoch)``
    (identity without ``shuffle``), rank ``r`` of ``w`` reads positions ``r, r + w, ...``."""

    def __init__(self, prompts: Sequence[RLPrompt], seed: int, rank: int, world: int, shuffle: bool):
        if len(prompts) < world:
            raise KeyeConfigError(f"{len(prompts)} RL prompts cannot feed {world} ranks")
        self.prompts, self.seed, self.rank, self.world, self.shuffle = list(prompts), seed, rank, world, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        idx = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(idx)
        return idx[self.rank :: self.world]

    def draw(self, k: int) -> list[RLPrompt]:
        """The next ``k`` prompts (rolling into the next epoch)."""
        out = []
        while len(out) < k:
            if self.pos >= len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._epoch_order()
            out.append(self.prompts[self._order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """Cursor (epoch, position)."""
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`."""
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._epoch_order()


class RunState:
    """What a checkpoint holds besides model/optimizer/scheduler (passed as the SFT ``loader``):
    every rank's prompt cursor and rollout generator state, and the (rank-identical) replay pool.

    :meth:`snapshot` is collective (call it on every rank before saving); :meth:`state_dict` returns it.
    """

    def __init__(self, stream: PromptStream, pool: ReplayPool, engine: Any, rank: int):
        self.stream, self.pool, self.engine, self.rank = stream, pool, engine, rank
        self._snap: dict[str, Any] | None = None

    def snapshot(self) -> None:
        """Gather the per-rank pieces (collective)."""
        mine = {"stream": self.stream.state_dict(),
                "engine": self.engine.state_dict() if hasattr(self.engine, "state_dict") else None}
        ranks = all_gather(mine)
        self._snap = {"ranks": ranks, "pool": self.pool.state_dict()}

    def state_dict(self) -> dict[str, Any]:
        """The last :meth:`snapshot`."""
        if self._snap is None:
            raise KeyeConfigError("RunState.snapshot() must run on every rank before saving")
        return self._snap

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's cursor and generator and the pool."""
        ranks = state["ranks"]
        if len(ranks) != self.stream.world:
            raise KeyeConfigError(f"checkpoint was written by {len(ranks)} ranks; resume with the same world size "
                                  f"(now {self.stream.world})")
        self.stream.load_state_dict(ranks[self.rank]["stream"])
        if ranks[self.rank]["engine"] is not None and hasattr(self.engine, "load_state_dict"):
            self.engine.load_state_dict(ranks[self.rank]["engine"])
        self.pool.load_state_dict(state["pool"])


def load_prompts(data: Any) -> list[RLPrompt]:
    """The RL prompts of a ``data`` section (``manifest``, first ``limit``); raises :class:`KeyeConfigError` when
    there are none."""
    prompts = load_rl_prompts(data.manifest)
    if data.limit is not None:
        prompts = prompts[: data.limit]
    if not prompts:
        raise KeyeConfigError(f"{data.manifest}: no RL prompts")
    return prompts


def load_pool(replay: Any, seed: int) -> ReplayPool:
    """The replay pool of a ``replay`` section: ``pool`` loaded when replay is on and a pool file is set, else an
    empty pool (online growth only); seeded with ``seed`` either way."""
    if replay.enabled and replay.M > 0 and replay.pool:
        return ReplayPool.load_jsonl(replay.pool, max_per_question=replay.max_per_question, overflow=replay.overflow,
                                     seed=seed)
    return ReplayPool(replay.max_per_question, replay.overflow, seed=seed)


def filter_by_accuracy(prompts: list[RLPrompt], engine: Any, scorer: RewardScorer, data: Any,
                       info: Any) -> list[RLPrompt]:
    """Pre-run prompt filtering to sampling accuracy in (0, 1) over ``data.filter_samples`` answers; each rank
    tests its slice, ids are gathered (collective), and every rank returns the same kept prompts in their
    original order."""
    mine = prompts[info.rank :: info.world_size]
    res = filter_prompts(mine, engine, scorer, data.filter_samples, batch_prompts=max(1, data.prompts_per_step))
    keep = {pid for ids in all_gather([p.id for p in res.kept]) for pid in ids}
    return [p for p in prompts if p.id in keep]


def select_prompts(data: Any, prompts: list[RLPrompt], resumed: dict[str, Any] | None,
                   keep_informative: Callable[[list[RLPrompt]], list[RLPrompt]]) -> list[RLPrompt]:
    """The prompts this run trains on: on resume the ids the checkpoint recorded (a filtered run keeps the set it
    started with, no re-filtering), else with ``data.filter_samples > 0`` ``keep_informative(prompts)`` (the
    components' filter: :func:`filter_by_accuracy` or a Ray task), else all.

    ``resumed`` is the latest checkpoint's trainer state (None when starting fresh). Raises
    :class:`KeyeConfigError` when filtering keeps nothing."""
    if resumed is not None and resumed.get("prompt_ids") is not None:
        keep = set(resumed["prompt_ids"])
        return [p for p in prompts if p.id in keep]
    if data.filter_samples > 0:
        prompts = keep_informative(prompts)
        if not prompts:
            raise KeyeConfigError("prompt filtering kept no prompt (every accuracy was 0 or 1)")
    return prompts


def trainer_state(prompts: Sequence[RLPrompt], data: Any) -> dict[str, Any]:
    """The trainer state of a fresh run (what :func:`record_step` advances and a checkpoint stores as
    ``trainer``); ``prompt_ids`` is recorded only for a filtered prompt set (see :func:`select_prompts`)."""
    return {"step": 0, "losses": [], "rewards": [], "pass_rates": [], "eval_curve": [],
            "prompt_ids": [p.id for p in prompts] if data.filter_samples > 0 else None, "tokens": 0}


def record_step(state: dict[str, Any], step: int, row: dict[str, float], tokens: float) -> None:
    """Advance the trainer state past ``step`` with its metrics ``row`` and trained ``tokens`` (all ranks)."""
    state["step"] = step
    state["tokens"] += int(tokens)
    state["losses"].append(row["loss"])
    state["rewards"].append(row["reward/mean"])
    state["pass_rates"].append(row["pass_rate"])
