"""Trajectory bookkeeping for asynchronous RL: the *trajectory manager* of SeamlessFlow (training.md §5).

One :class:`TrajectoryManager` owns every sampled answer from the moment its prompt is admitted until the
trainer consumes it: which state it is in, the tokens generated so far, the policy version that produced
each token, the behaviour log-prob of each token (as sampled), its reward, how often a worker failure made
it start over on another worker, and the version under which its first token was sampled.

State machine of one trajectory (``Trajectory.state``)::

    queued --next_requests--> generating --on_finished--> finished --on_scored--> scored --consume--> consumed
                                 |   ^
              interrupt/requeue  v   | next_requests (continues the tokens kept so far)
                               partial

    any live state --stale (drop_stale) or group failed (requeue beyond max_retries)--> dropped

``partial`` is a trajectory that has tokens but no worker: a worker handed it back (preemption) or died
(:meth:`TrajectoryManager.requeue`). Its tokens and behaviour log-probs are kept, because they really were
sampled by the recorded policy version, so the importance weights computed from them stay exact; the next
worker continues after them (a *partial rollout*).

Staleness: a trajectory whose first token came from version ``s`` may train the update made at version
``v`` only if ``s >= v - max_staleness`` (:meth:`TrajectoryManager.ready_groups` drops the others and queues
a fresh sample for the same group slot). Synchronous on-policy RL is ``max_staleness = 0`` with no
generation while the trainer updates: every consumed token then comes from the version being trained.
:meth:`TrajectoryManager.admissible_groups` gives the admission bound that makes drops unnecessary when
groups are consumed in admission order.

Events carry the ``attempt`` number of the dispatch that produced them, so tokens from a worker that was
declared dead (and whose trajectory was since handed to another worker) are ignored instead of being
appended twice.

The manager is plain Python (it uses no torch, Ray or threads); :meth:`TrajectoryManager.state_dict` is
JSON-serialisable and restores the exact state, so a driver resumed from a checkpoint continues with the
same queue, the same partial outputs and the same counters.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keye.errors import KeyeConfigError, KeyeInputError

log = logging.getLogger(__name__)

STATES = ("queued", "generating", "partial", "finished", "scored", "consumed", "dropped")
FINISH_REASONS = ("stop", "length")
_STATE_FORMAT = 1

COUNTERS = (
    "groups_added",
    "added",  # trajectories created (first samples and fresh replacements)
    "dispatched",  # hand-outs by next_requests
    "partial_resumed",  # hand-outs that continue kept tokens
    "chunks",
    "generated",  # tokens appended
    "finished",
    "scored",
    "interrupted",
    "requeued",  # in-flight trajectories returned after a worker failure
    "retries",  # == requeued; kept separately from "reclaimed" (driver restarts do not count as retries)
    "reclaimed",  # in-flight trajectories returned after a driver restart
    "dropped_stale",
    "groups_failed",
    "dropped_failed",  # trajectories dropped with a failed group
    "consumed",
    "groups_consumed",
    "late_events",  # events for trajectories no longer in flight under that attempt (ignored)
)


@dataclass
class Trajectory:
    """One sampled answer and everything recorded about it.

    ``id``: unique, never reused (a fresh replacement gets a new id). ``group`` / ``sample``: its group and
    index in the group. ``prompt_id``: the question. ``tokens`` / ``logps`` / ``versions``: one entry per
    generated token (behaviour log-prob under the sampling distribution, policy version that sampled it).
    ``start_version``: version of the first token (None before any). ``attempt``: number of dispatches so far
    (events must carry the current one). ``retries``: worker failures survived. ``finish_reason``: ``"stop"``
    (EOS) or ``"length"`` (cut at the token budget).
    """

    id: int
    group: int
    sample: int
    prompt_id: str
    state: str = "queued"
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    start_version: int | None = None
    attempt: int = 0
    retries: int = 0
    finish_reason: str | None = None
    reward: float | None = None
    passed: bool | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.tokens)

    def version_spans(self) -> list[tuple[int, int, int]]:
        """``(version, start, end)`` for each run of tokens sampled by one policy version (``end`` exclusive),
        in order: the on/off-policy labelling of a partial rollout (training.md §8.16)."""
        spans: list[tuple[int, int, int]] = []
        for i, v in enumerate(self.versions):
            if spans and spans[-1][0] == v:
                spans[-1] = (v, spans[-1][1], i + 1)
            else:
                spans.append((v, i, i + 1))
        return spans

    def to_dict(self) -> dict[str, Any]:
        """JSON-able copy (see :meth:`from_dict`)."""
        return {
            "id": self.id, "group": self.group, "sample": self.sample, "prompt_id": self.prompt_id,
            "state": self.state, "tokens": list(self.tokens), "logps": list(self.logps),
            "versions": list(self.versions), "start_version": self.start_version, "attempt": self.attempt,
            "retries": self.retries, "finish_reason": self.finish_reason, "reward": self.reward,
            "passed": self.passed,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Trajectory:
        """Inverse of :meth:`to_dict`; raises :class:`KeyeInputError` for an unknown state or unequal
        per-token lists."""
        t = cls(**{k: d[k] for k in cls.__dataclass_fields__})
        t.tokens, t.logps, t.versions = list(t.tokens), [float(x) for x in t.logps], list(t.versions)
        if t.state not in STATES:
            raise KeyeInputError(f"trajectory {t.id}: unknown state {t.state!r}")
        if not len(t.tokens) == len(t.logps) == len(t.versions):
            raise KeyeInputError(f"trajectory {t.id}: {len(t.tokens)} tokens, {len(t.logps)} log-probs and "
                                 f"{len(t.versions)} versions")
        return t


@dataclass
class Group:
    """The ``G`` samples of one prompt: ``members[i]`` is the id of the live trajectory of slot ``i``.

    ``admitted_version``: policy version when the prompt was added. ``meta``: the JSON-able extras given to
    :meth:`TrajectoryManager.add_prompts` (e.g. ``prompt_tokens`` for load-based routing).
    """

    id: int
    prompt_id: str
    admitted_version: int
    members: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able copy."""
        return {"id": self.id, "prompt_id": self.prompt_id, "admitted_version": self.admitted_version,
                "members": list(self.members), "meta": dict(self.meta)}


@dataclass(frozen=True)
class Request:
    """A unit of generation work for a rollout worker.

    The worker samples continuation tokens for ``prompt_id`` after the already generated ``tokens`` (empty
    for a fresh start), at most ``max_new_tokens`` more (None: the worker's own limit), and reports every
    event with ``(traj_id, attempt)``. A continuation whose ``tokens`` already end with an EOS, or whose
    budget is 0 (its worker died between the last token and the finish event), is reported finished at
    once (``"stop"`` / ``"length"``) without sampling.
    """

    traj_id: int
    attempt: int
    group: int
    sample: int
    prompt_id: str
    tokens: tuple[int, ...]
    max_new_tokens: int | None
    meta: Mapping[str, Any]


@dataclass
class ReadyGroup:
    """A complete group returned by :meth:`TrajectoryManager.ready_groups`: its id, prompt id, admission
    version, meta and its trajectories in sample order (all ``scored``)."""

    id: int
    prompt_id: str
    admitted_version: int
    meta: dict[str, Any]
    trajectories: list[Trajectory]

    @property
    def rewards(self) -> list[float]:
        """The rewards of the group's samples, in sample order."""
        return [float(t.reward) for t in self.trajectories]  # type: ignore[arg-type]


def _prompt_key(p: Any) -> str:
    if isinstance(p, str):
        return p
    pid = getattr(p, "id", None)
    if not isinstance(pid, str):
        raise KeyeInputError(f"a prompt must be a string id or have a string .id, got {type(p).__name__}")
    return pid


class TrajectoryManager:
    """Owns every trajectory from prompt admission to the training batch.

    Args:
        max_new_tokens: token budget of one answer (None: the workers' own limit). A partial trajectory is
            continued with the remaining budget; a chunk that would exceed it is refused.
        max_retries: worker failures one trajectory may survive; one more fails (drops) its whole group,
            so a prompt that keeps killing workers cannot stall training.

    Every mutating call updates :meth:`counts`; drops, requeues and failures are also logged (``INFO``),
    per-token events at ``DEBUG``.
    """

    def __init__(self, max_new_tokens: int | None = None, max_retries: int = 3):
        if max_new_tokens is not None and max_new_tokens < 1:
            raise KeyeConfigError(f"max_new_tokens must be >= 1 or None, got {max_new_tokens}")
        if max_retries < 0:
            raise KeyeConfigError(f"max_retries must be >= 0, got {max_retries}")
        self.max_new_tokens = max_new_tokens
        self.max_retries = max_retries
        self._trajs: dict[int, Trajectory] = {}
        self._groups: dict[int, Group] = {}
        self._queue: list[tuple[int, int, int]] = []  # heap of (group, sample, traj id); lazily cleaned
        self._next_traj = 0
        self._next_group = 0
        self._counts = dict.fromkeys(COUNTERS, 0)

    # ------------------------------------------------------------------------------------------ queries
    def get(self, traj_id: int) -> Trajectory:
        """The live trajectory ``traj_id`` (consumed and dropped ones are forgotten); KeyError otherwise."""
        return self._trajs[traj_id]

    def group(self, group_id: int) -> Group:
        """The live group ``group_id`` (consumed and failed ones are forgotten); KeyError otherwise."""
        return self._groups[group_id]

    def trajectories(self) -> list[Trajectory]:
        """Every live trajectory, by id."""
        return [self._trajs[i] for i in sorted(self._trajs)]

    def in_flight(self) -> list[int]:
        """Ids of the trajectories a worker is generating, ascending."""
        return sorted(i for i, t in self._trajs.items() if t.state == "generating")

    def pending(self) -> int:
        """Trajectories waiting for a worker (queued or partial)."""
        return sum(t.state in ("queued", "partial") for t in self._trajs.values())

    def state_counts(self) -> dict[str, int]:
        """Number of live trajectories in each state (consumed / dropped ones are not kept: see
        :meth:`counts`)."""
        out = dict.fromkeys(STATES, 0)
        for t in self._trajs.values():
            out[t.state] += 1
        return out

    def counts(self) -> dict[str, int]:
        """Event counters since the manager was created (restored by :meth:`load_state_dict`)."""
        return dict(self._counts)

    @property
    def groups_added(self) -> int:
        """Groups ever admitted (the next group id)."""
        return self._next_group

    def admissible_groups(self, current_version: int, max_staleness: int, batch_groups: int) -> int:
        """How many more groups may be admitted now so that, when groups are consumed in admission order
        ``batch_groups`` per update, no trajectory can exceed ``max_staleness``.

        Group ``g`` trains the update made at version ``g // batch_groups``; admitting it only once
        ``g < (current_version + max_staleness + 1) * batch_groups`` means its first token comes from a
        version ``>= g // batch_groups - max_staleness``. With ``max_staleness = 0`` this admits exactly
        the current version's batch (synchronous RL).
        """
        if max_staleness < 0 or batch_groups < 1:
            raise KeyeConfigError(f"need max_staleness >= 0 and batch_groups >= 1, got {max_staleness}, "
                                  f"{batch_groups}")
        return max(0, (current_version + max_staleness + 1) * batch_groups - self._next_group)

    # ----------------------------------------------------------------------------------------- admission
    def add_prompts(self, prompts: Sequence[Any], group_size: int, version: int,
                    meta: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Admit ``prompts`` (string ids, or objects with a string ``.id``), ``group_size`` queued
        trajectories each; returns the new group ids (consecutive, in order).

        ``version``: the current policy version (recorded as the group's admission version). ``meta``: one
        JSON-able mapping per prompt, copied into :class:`Group` and every :class:`Request` of the group.
        """
        if group_size < 1:
            raise KeyeConfigError(f"group_size must be >= 1, got {group_size}")
        if version < 0:
            raise KeyeConfigError(f"version must be >= 0, got {version}")
        if meta is not None and len(meta) != len(prompts):
            raise KeyeInputError(f"{len(meta)} meta entries for {len(prompts)} prompts")
        ids = []
        for i, p in enumerate(prompts):
            gid = self._next_group
            self._next_group += 1
            group = Group(gid, _prompt_key(p), int(version), [], dict(meta[i]) if meta is not None else {})
            self._groups[gid] = group
            for s in range(group_size):
                group.members.append(self._new_trajectory(group, s).id)
            ids.append(gid)
        self._counts["groups_added"] += len(ids)
        return ids

    def _new_trajectory(self, group: Group, sample: int) -> Trajectory:
        t = Trajectory(self._next_traj, group.id, sample, group.prompt_id)
        self._next_traj += 1
        self._trajs[t.id] = t
        heapq.heappush(self._queue, (t.group, t.sample, t.id))
        self._counts["added"] += 1
        return t

    # ---------------------------------------------------------------------------------------- dispatching
    def next_requests(self, k: int) -> list[Request]:
        """Hand out up to ``k`` waiting trajectories (oldest group first, then sample order), which become
        ``generating`` with a new attempt number. A partial one is continued: its request carries the tokens
        kept so far and the remaining budget."""
        out: list[Request] = []
        while len(out) < k and self._queue:
            _, _, tid = heapq.heappop(self._queue)
            t = self._trajs.get(tid)
            if t is None or t.state not in ("queued", "partial"):
                continue  # lazily removed entry (dropped, or already handed out)
            if t.state == "partial":
                self._counts["partial_resumed"] += 1
            t.state = "generating"
            t.attempt += 1
            self._counts["dispatched"] += 1
            budget = None if self.max_new_tokens is None else self.max_new_tokens - len(t.tokens)
            out.append(Request(t.id, t.attempt, t.group, t.sample, t.prompt_id, tuple(t.tokens), budget,
                               self._groups[t.group].meta))
        return out

    def _live(self, traj_id: int, attempt: int, event: str) -> Trajectory | None:
        """The trajectory if ``(traj_id, attempt)`` is the current dispatch of a generating trajectory;
        None (counted as a late event) if it was dropped, consumed or handed to another attempt."""
        t = self._trajs.get(traj_id)
        if t is None and not 0 <= traj_id < self._next_traj:
            raise KeyeInputError(f"{event} for trajectory {traj_id}, which was never created")
        if t is None or t.state != "generating" or t.attempt != attempt:
            self._counts["late_events"] += 1
            log.debug("ignored late %s for trajectory %s attempt %s", event, traj_id, attempt)
            return None
        return t

    # -------------------------------------------------------------------------------------------- events
    def on_tokens(self, traj_id: int, attempt: int, token_ids: Sequence[int], logps: Sequence[float],
                  version: int) -> bool:
        """Append a chunk of sampled tokens, all sampled by policy ``version`` (a worker never mixes
        versions within a chunk). Returns False if the event was late (ignored).

        Raises:
            KeyeInputError: unequal token / log-prob counts, an empty chunk, a version older than the
                trajectory's last token (weights only move forward), or more tokens than the budget.
        """
        t = self._live(traj_id, attempt, "tokens")
        if t is None:
            return False
        if len(token_ids) != len(logps) or not token_ids:
            raise KeyeInputError(f"trajectory {traj_id}: a chunk needs as many log-probs as tokens (>= 1), got "
                                 f"{len(token_ids)} tokens and {len(logps)} log-probs")
        if t.versions and version < t.versions[-1]:
            raise KeyeInputError(f"trajectory {traj_id}: chunk from version {version} after tokens of version "
                                 f"{t.versions[-1]}")
        if self.max_new_tokens is not None and len(t.tokens) + len(token_ids) > self.max_new_tokens:
            raise KeyeInputError(f"trajectory {traj_id}: {len(t.tokens)} + {len(token_ids)} tokens exceed "
                                 f"max_new_tokens={self.max_new_tokens}")
        if t.start_version is None:
            t.start_version = int(version)
        t.tokens.extend(int(x) for x in token_ids)
        t.logps.extend(float(x) for x in logps)
        t.versions.extend([int(version)] * len(token_ids))
        self._counts["chunks"] += 1
        self._counts["generated"] += len(token_ids)
        return True

    def on_finished(self, traj_id: int, attempt: int, reason: str = "stop") -> bool:
        """The worker finished the trajectory (``reason``: ``"stop"`` = EOS, ``"length"`` = budget).
        Returns False if late. Raises :class:`KeyeInputError` for an unknown reason or a trajectory with no
        tokens (every answer has at least its EOS)."""
        if reason not in FINISH_REASONS:
            raise KeyeInputError(f"trajectory {traj_id}: finish reason must be one of {FINISH_REASONS}, got "
                                 f"{reason!r}")
        t = self._live(traj_id, attempt, "finish")
        if t is None:
            return False
        if not t.tokens:
            raise KeyeInputError(f"trajectory {traj_id}: finished without any token")
        t.state = "finished"
        t.finish_reason = reason
        self._counts["finished"] += 1
        return True

    def on_scored(self, traj_id: int, reward: float, passed: bool | None = None) -> bool:
        """Record the reward of a finished trajectory. Returns False if it was dropped meanwhile (its group
        failed or it went stale). Raises :class:`KeyeInputError` if it is not ``finished`` or the reward is
        not finite."""
        t = self._trajs.get(traj_id)
        if t is None:
            if not 0 <= traj_id < self._next_traj:
                raise KeyeInputError(f"score for trajectory {traj_id}, which was never created")
            self._counts["late_events"] += 1
            return False
        if t.state != "finished":
            raise KeyeInputError(f"trajectory {traj_id} is {t.state}, only a finished trajectory can be scored")
        if not math.isfinite(float(reward)):
            raise KeyeInputError(f"trajectory {traj_id}: reward {reward} is not finite")
        t.reward, t.passed, t.state = float(reward), None if passed is None else bool(passed), "scored"
        self._counts["scored"] += 1
        return True

    def interrupt(self, traj_id: int, attempt: int) -> bool:
        """A worker hands an unfinished trajectory back (preemption): it becomes ``partial`` (``queued`` if it
        has no token yet) and keeps its tokens; not a retry. Returns False if late."""
        t = self._live(traj_id, attempt, "interrupt")
        if t is None:
            return False
        self._return_to_queue(t)
        self._counts["interrupted"] += 1
        return True

    def _return_to_queue(self, t: Trajectory) -> None:
        t.state = "partial" if t.tokens else "queued"
        heapq.heappush(self._queue, (t.group, t.sample, t.id))

    def requeue(self, items: Iterable[int | tuple[int, int]]) -> int:
        """Return the in-flight trajectories of a failed worker to the queue; returns how many were requeued.

        ``items``: trajectory ids or ``(traj_id, attempt)`` pairs (a pair is requeued only if that attempt is
        still the current one, so a trajectory already finished or handed to another worker is left alone:
        nothing is lost or counted twice). Tokens already received are kept (they were sampled by the recorded
        versions); each requeue counts one retry, and a trajectory beyond ``max_retries`` fails its group.
        """
        n = 0
        for item in items:
            tid, attempt = (item, None) if isinstance(item, int) else (int(item[0]), int(item[1]))
            t = self._trajs.get(tid)
            if t is None or t.state != "generating" or (attempt is not None and t.attempt != attempt):
                continue
            t.retries += 1
            self._counts["retries"] += 1
            self._counts["requeued"] += 1
            n += 1
            if t.retries > self.max_retries:
                self._fail_group(t.group, f"trajectory {tid} failed {t.retries} times")
            else:
                self._return_to_queue(t)
        if n:
            log.info("requeued %d in-flight trajectories (%s)", n, self._summary())
        return n

    def reclaim(self) -> int:
        """Return every ``generating`` trajectory to the queue without counting a retry (after a driver
        restart, when the workers that held them are gone); returns how many."""
        ids = self.in_flight()
        for tid in ids:
            self._return_to_queue(self._trajs[tid])
        self._counts["reclaimed"] += len(ids)
        if ids:
            log.info("reclaimed %d in-flight trajectories after a restart (%s)", len(ids), self._summary())
        return len(ids)

    def _fail_group(self, gid: int, why: str) -> None:
        group = self._groups.pop(gid)
        for tid in group.members:
            t = self._trajs.pop(tid)
            t.state = "dropped"
        self._counts["groups_failed"] += 1
        self._counts["dropped_failed"] += len(group.members)
        log.warning("group %d (prompt %s) dropped: %s (%s)", gid, group.prompt_id, why, self._summary())

    # ---------------------------------------------------------------------------------------- batching
    def drop_stale(self, current_version: int, max_staleness: int) -> int:
        """Drop every live trajectory whose first token is older than ``current_version - max_staleness``
        and queue a fresh sample for its group slot; returns how many were dropped.

        Such a trajectory can never train an update made at ``current_version`` or later. One being
        generated is dropped too: its worker's later events are ignored as late.
        """
        if max_staleness < 0:
            raise KeyeConfigError(f"max_staleness must be >= 0, got {max_staleness}")
        oldest = current_version - max_staleness
        stale = [t for t in self._trajs.values() if t.start_version is not None and t.start_version < oldest]
        for t in sorted(stale, key=lambda x: x.id):
            del self._trajs[t.id]
            t.state = "dropped"
            group = self._groups[t.group]
            group.members[t.sample] = self._new_trajectory(group, t.sample).id
        self._counts["dropped_stale"] += len(stale)
        if stale:
            log.info("dropped %d stale trajectories at version %d (max staleness %d) (%s)", len(stale),
                     current_version, max_staleness, self._summary())
        return len(stale)

    def ready_groups(self, current_version: int, max_staleness: int, *, in_order: bool = True,
                     limit: int | None = None) -> list[ReadyGroup]:
        """Complete groups that may train the update made at ``current_version``, oldest first.

        First applies :meth:`drop_stale`, so every returned trajectory started at a version
        ``>= current_version - max_staleness``. A group is complete when all its samples are ``scored``.
        ``in_order``: stop at the first incomplete group (consumption in admission order, which keeps the
        bound of :meth:`admissible_groups` without drops). ``limit``: at most that many groups. The groups
        stay live until :meth:`consume`.
        """
        self.drop_stale(current_version, max_staleness)
        out: list[ReadyGroup] = []
        for gid in sorted(self._groups):
            if limit is not None and len(out) >= limit:
                break
            group = self._groups[gid]
            trajs = [self._trajs[i] for i in group.members]
            if all(t.state == "scored" for t in trajs):
                out.append(ReadyGroup(gid, group.prompt_id, group.admitted_version, dict(group.meta), trajs))
            elif in_order:
                break
        return out

    def consume(self, group_ids: Iterable[int]) -> list[Trajectory]:
        """Mark complete groups as used by the trainer and forget them; returns their trajectories (state
        ``consumed``), group by group in sample order. Raises :class:`KeyeInputError` (and changes nothing)
        if a group is unknown or not complete."""
        gids = list(group_ids)
        for gid in gids:
            group = self._groups.get(gid)
            if group is None:
                raise KeyeInputError(f"group {gid} is not live (never added, already consumed or failed)")
            bad = [i for i in group.members if self._trajs[i].state != "scored"]
            if bad:
                raise KeyeInputError(f"group {gid} is not complete: trajectories {bad[:5]} are not scored")
        if len(set(gids)) != len(gids):
            raise KeyeInputError(f"group ids repeat in {gids}")
        out = []
        for gid in gids:
            group = self._groups.pop(gid)
            for tid in group.members:
                t = self._trajs.pop(tid)
                t.state = "consumed"
                out.append(t)
        self._counts["consumed"] += len(out)
        self._counts["groups_consumed"] += len(gids)
        log.debug("consumed %d groups (%s)", len(gids), self._summary())
        return out

    def _summary(self) -> str:
        c = self._counts
        return ", ".join(f"{k}={c[k]}" for k in ("added", "consumed", "requeued", "dropped_stale",
                                                 "groups_failed", "late_events"))

    # -------------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """The complete state as JSON-able data (lists, dicts, numbers, strings, None): trajectories, groups,
        id counters, event counters and settings. The queue order is derived from it (oldest group, then
        sample), so nothing else is needed."""
        return {
            "format": _STATE_FORMAT,
            "max_new_tokens": self.max_new_tokens,
            "max_retries": self.max_retries,
            "next_traj": self._next_traj,
            "next_group": self._next_group,
            "counts": dict(self._counts),
            "groups": [self._groups[g].to_dict() for g in sorted(self._groups)],
            "trajectories": [self._trajs[t].to_dict() for t in sorted(self._trajs)],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this manager's state by :meth:`state_dict`'s (also after a JSON round trip).

        In-flight trajectories stay ``generating``: a driver that restarts without its workers calls
        :meth:`reclaim` next. Raises :class:`KeyeInputError` for another format or an inconsistent state.
        """
        if state.get("format") != _STATE_FORMAT:
            raise KeyeInputError(f"trajectory manager state has format {state.get('format')!r}, expected "
                                 f"{_STATE_FORMAT}")
        trajs = {int(d["id"]): Trajectory.from_dict(d) for d in state["trajectories"]}
        groups = {}
        for d in state["groups"]:
            g = Group(int(d["id"]), d["prompt_id"], int(d["admitted_version"]), [int(i) for i in d["members"]],
                      dict(d["meta"]))
            missing = [i for i in g.members if i not in trajs]
            if missing:
                raise KeyeInputError(f"trajectory manager state: group {g.id} names unknown trajectories "
                                     f"{missing[:5]}")
            groups[g.id] = g
        orphans = [t.id for t in trajs.values() if t.group not in groups]
        if orphans:
            raise KeyeInputError(f"trajectory manager state: trajectories {orphans[:5]} belong to no live group")
        unknown = set(state["counts"]) - set(COUNTERS)
        if unknown:
            raise KeyeInputError(f"trajectory manager state: unknown counters {sorted(unknown)}")
        self.max_new_tokens = state["max_new_tokens"]
        self.max_retries = int(state["max_retries"])
        self._trajs, self._groups = trajs, groups
        self._next_traj, self._next_group = int(state["next_traj"]), int(state["next_group"])
        self._counts = dict.fromkeys(COUNTERS, 0) | {k: int(v) for k, v in state["counts"].items()}
        self._queue = [(t.group, t.sample, t.id) for t in trajs.values() if t.state in ("queued", "partial")]
        heapq.heapify(self._queue)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> TrajectoryManager:
        """A new manager holding ``state`` (see :meth:`load_state_dict`)."""
        tm = cls()
        tm.load_state_dict(state)
        return tm
