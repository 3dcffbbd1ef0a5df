"""The rollout manager of asynchronous RL (SeamlessFlow's rollout/inference manager, training.md §5).

:class:`RolloutManager` sits between a :class:`~keye.rl.rollout.trajectory.TrajectoryManager` and ``N`` rollout
workers. Each :meth:`RolloutManager.step` it

1. restarts workers that died (``alive()`` is False or any call raised) and returns their in-flight
   trajectories to the queue, keeping the tokens already received;
2. hands waiting trajectories to the workers with the fewest tokens in flight (prompt tokens plus tokens
   generated so far, i.e. the KV cache a request occupies), up to ``max_inflight`` requests per worker;
3. polls every worker and streams its token chunks and finish events into the trajectory manager.

:meth:`RolloutManager.update_weights` pauses every worker at a token boundary, applies what they produced
under the old weights, loads the new versioned weights and resumes them: unfinished answers continue under
the new version (partial rollouts), and since no chunk may mix versions the per-token version record stays
exact. A worker restarted later gets the latest weights before any work.

Workers are anything implementing :class:`RolloutWorker` (in-process engines, Ray actor handles wrapped in
a small adapter, test fakes); this module uses neither Ray nor torch itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from keye.errors import KeyeConfigError, KeyeError
from keye.rl.rollout.trajectory import Request, TrajectoryManager

log = logging.getLogger(__name__)


class WorkerProtocolError(KeyeError, RuntimeError):
    """A rollout worker broke the protocol (e.g. a chunk from a weight version it was not serving)."""


@dataclass(frozen=True)
class TokenChunk:
    """Tokens sampled for one request since the last poll, all under weight ``version``; ``logps`` are the
    behaviour log-probs of the sampled tokens."""

    traj_id: int
    attempt: int
    token_ids: tuple[int, ...]
    logps: tuple[float, ...]
    version: int


@dataclass(frozen=True)
class Finished:
    """A request ended: ``reason`` ``"stop"`` (EOS sampled, included in its last chunk) or ``"length"``."""

    traj_id: int
    attempt: int
    reason: str = "stop"


@runtime_checkable
class RolloutWorker(Protocol):
    """What the rollout manager needs from a worker.

    - ``submit(requests)``: start generating the :class:`~keye.rl.rollout.trajectory.Request` s (continuing their
      ``tokens``); returns at once.
    - ``poll()``: the :class:`TokenChunk` / :class:`Finished` events produced since the last poll, in order
      per request (a request's chunks come before its ``Finished``).
    - ``pause()``: stop sampling at a token boundary; after it returns, ``poll()`` yields only what was
      produced before, and nothing new until ``resume()``. Requests stay with the worker.
    - ``resume()``: continue the held requests (under the weights loaded meanwhile).
    - ``load_weights(shards, version)``: replace the weights (only called while paused); every later chunk
      carries ``version``.
    - ``alive()``: False once the worker has died (then the manager replaces it).
    """

    def submit(self, requests: Sequence[Request]) -> None:
        """Start the requests."""
        ...

    def poll(self) -> list[TokenChunk | Finished]:
        """Events since the last poll."""
        ...

    def pause(self) -> None:
        """Stop at a token boundary."""
        ...

    def resume(self) -> None:
        """Continue after :meth:`pause`."""
        ...

    def load_weights(self, shards: Any, version: int) -> None:
        """Serve weights ``version`` from now on."""
        ...

    def alive(self) -> bool:
        """Whether the worker still works."""
        ...


@dataclass
class _InFlight:
    attempt: int
    load: int  # prompt tokens + tokens generated so far


COUNTERS = ("submitted", "chunks", "tokens", "finished", "late_events", "worker_deaths", "restarts",
            "requeued", "weight_updates", "steps")


class RolloutManager:
    """Routes trajectory-manager requests to rollout workers and streams their output back.

    Args:
        trajectories: the :class:`~keye.rl.rollout.trajectory.TrajectoryManager` that owns the trajectories.
        factory: ``factory(index) -> RolloutWorker``, called for the initial workers and for each restart
            (a new worker serves the weights it was built with until the manager loads the latest ones).
        num_workers: how many workers.
        max_inflight: requests one worker holds at most.
        version: the weight version the freshly built workers serve.
        prompt_tokens_key: the group ``meta`` key with the prompt's token count, used in the load estimate
            (absent: 0).

    :meth:`counts` holds the event counters; restarts and weight updates are also logged (``INFO`` /
    ``WARNING``).
    """

    def __init__(self, trajectories: TrajectoryManager, factory: Callable[[int], RolloutWorker], num_workers: int,
                 *, max_inflight: int = 64, version: int = 0, prompt_tokens_key: str = "prompt_tokens"):
        if num_workers < 1:
            raise KeyeConfigError(f"num_workers must be >= 1, got {num_workers}")
        if max_inflight < 1:
            raise KeyeConfigError(f"max_inflight must be >= 1, got {max_inflight}")
        self.tm = trajectories
        self.factory = factory
        self.max_inflight = max_inflight
        self.version = int(version)
        self.prompt_tokens_key = prompt_tokens_key
        self.paused = False
        self._shards: Any = None  # latest weights given to update_weights (None: the factory's own)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self.workers: list[RolloutWorker] = [factory(i) for i in range(num_workers)]
        self.inflight: list[dict[int, _InFlight]] = [{} for _ in range(num_workers)]

    # ------------------------------------------------------------------------------------------ queries
    def counts(self) -> dict[str, int]:
        """Event counters: submitted requests, chunks, tokens, finished, late events, worker deaths,
        restarts, requeued trajectories, weight updates, steps."""
        return dict(self._counts)

    def loads(self) -> list[int]:
        """Tokens in flight per worker (prompt + generated tokens of its requests)."""
        return [sum(f.load for f in inf.values()) for inf in self.inflight]

    def num_inflight(self) -> int:
        """Requests held by all workers."""
        return sum(len(inf) for inf in self.inflight)

    # ------------------------------------------------------------------------------------------ control
    def step(self) -> list[int]:
        """One round: replace dead workers, dispatch waiting trajectories (unless paused), poll every
        worker. Returns the ids of the trajectories that finished in this round (ready for scoring)."""
        self._counts["steps"] += 1
        for i in range(len(self.workers)):
            try:
                ok = self.workers[i].alive()
            except Exception as err:  # noqa: BLE001 - any failure of a worker call means the worker is gone
                ok, why = False, f"alive() raised {err!r}"
            else:
                why = "alive() is False"
            if not ok:
                self._restart(i, why)
        if not self.paused:
            self._dispatch()
        finished: list[int] = []
        for i in range(len(self.workers)):
            finished.extend(self._poll(i))
        return finished

    def pause(self) -> None:
        """Pause every worker (no new tokens, no new requests) and apply what they produced before."""
        self._pause_all()

    def _pause_all(self) -> list[int]:
        """Pause every worker, then apply what they produced before; returns the trajectories that finished."""
        for i in range(len(self.workers)):
            try:
                self.workers[i].pause()
            except Exception as err:  # noqa: BLE001
                self._restart(i, f"pause() raised {err!r}")
        self.paused = True
        finished: list[int] = []
        for i in range(len(self.workers)):
            finished.extend(self._poll(i))
        return finished

    def resume(self) -> None:
        """Resume every worker after :meth:`pause`."""
        self.paused = False
        for i in range(len(self.workers)):
            try:
                self.workers[i].resume()
            except Exception as err:  # noqa: BLE001
                self._restart(i, f"resume() raised {err!r}")

    def update_weights(self, shards: Any, version: int) -> list[int]:
        """Serve weights ``version`` (> the current one): pause every worker, apply the events produced
        under the old weights, load ``shards`` everywhere, resume (unless the manager was already paused).
        Unfinished requests continue under the new weights. Returns the trajectories that finished while
        draining."""
        if version <= self.version:
            raise KeyeConfigError(f"weight version must increase: serving {self.version}, got {version}")
        was_paused = self.paused
        finished = self._pause_all()
        self.version, self._shards = int(version), shards
        for i in range(len(self.workers)):
            try:
                self.workers[i].load_weights(shards, self.version)
            except Exception as err:  # noqa: BLE001
                self._restart(i, f"load_weights() raised {err!r}")  # the restart loads the new weights
        self._counts["weight_updates"] += 1
        log.info("weights version %d loaded on %d workers (%s)", self.version, len(self.workers), self._summary())
        if not was_paused:
            self.resume()
        return finished

    # ------------------------------------------------------------------------------------------ internals
    def _summary(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self._counts.items())

    def _restart(self, i: int, why: str) -> None:
        """Replace worker ``i`` and return its in-flight trajectories to the queue (tokens kept)."""
        held = [(tid, f.attempt) for tid, f in self.inflight[i].items()]
        self.inflight[i] = {}
        n = self.tm.requeue(held)
        self._counts["worker_deaths"] += 1
        self._counts["requeued"] += n
        log.warning("rollout worker %d died (%s); requeued %d of its %d requests (%s)", i, why, n, len(held),
                    self._summary())
        # a factory that raises propagates: the manager cannot run without the worker slot
        worker = self.factory(i)
        if self._shards is not None:
            worker.load_weights(self._shards, self.version)
        if self.paused:
            worker.pause()
        self.workers[i] = worker
        self._counts["restarts"] += 1

    def _dispatch(self) -> None:
        free = sum(max(0, self.max_inflight - len(inf)) for inf in self.inflight)
        if not free:
            return
        requests = self.tm.next_requests(free)
        if not requests:
            return
        loads = self.loads()
        batches: list[list[Request]] = [[] for _ in self.workers]
        for req in requests:
            # least tokens in flight among workers with a free slot; ties go to the lower index
            i = min((j for j in range(len(self.workers)) if len(self.inflight[j]) < self.max_inflight),
                    key=lambda j: (loads[j], j))
            load = int(req.meta.get(self.prompt_tokens_key, 0)) + len(req.tokens) + 1
            self.inflight[i][req.traj_id] = _InFlight(req.attempt, load)
            loads[i] += load
            batches[i].append(req)
        for i, batch in enumerate(batches):
            if not batch:
                continue
            try:
                self.workers[i].submit(batch)
            except Exception as err:  # noqa: BLE001
                self._restart(i, f"submit() raised {err!r}")
                continue
            self._counts["submitted"] += len(batch)

    def _poll(self, i: int) -> list[int]:
        try:
            events = self.workers[i].poll()
        except Exception as err:  # noqa: BLE001
            self._restart(i, f"poll() raised {err!r}")
            return []
        finished = []
        inflight = self.inflight[i]
        for ev in events:
            held = inflight.get(ev.traj_id)
            if held is None or held.attempt != ev.attempt:
                self._counts["late_events"] += 1
                continue
            if isinstance(ev, TokenChunk):
                if ev.version != self.version:
                    raise WorkerProtocolError(
                        f"rollout worker {i} sent tokens of weight version {ev.version} for trajectory "
                        f"{ev.traj_id} while serving version {self.version}")
                if self.tm.on_tokens(ev.traj_id, ev.attempt, ev.token_ids, ev.logps, ev.version):
                    held.load += len(ev.token_ids)
                self._counts["chunks"] += 1
                self._counts["tokens"] += len(ev.token_ids)
            elif isinstance(ev, Finished):
                del inflight[ev.traj_id]
                if self.tm.on_finished(ev.traj_id, ev.attempt, ev.reason):
                    finished.append(ev.traj_id)
                self._counts["finished"] += 1
            else:
                raise WorkerProtocolError(f"rollout worker {i} returned an event of type {type(ev).__name__}")
        return finished
