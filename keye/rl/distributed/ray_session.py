"""The Ray session of an RL run: connecting to a cluster, the run's placement group and its actors
(:class:`RaySession`), the fault log (:class:`EventLog`) and replaceable worker pools (:class:`WorkerPool`).

``rl.ray.address`` None starts a local cluster (``ray.init`` with this machine's CPUs and GPUs); ``auto`` (or
``host:port``) joins one started with ``ray start --head`` / ``ray start --address ...``. An already initialised
Ray (a test, a notebook) is used as it is. All actors share one placement group (``rl.ray.placement``: PACK by
default); see docs/rl_ray.md.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError, KeyeError

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as _err:  # pragma: no cover - depends on the installation
    raise KeyeConfigError(f"rl.engine=ray needs the 'ray' package (pip install 'keye[ray]'): {_err}") from None

log = logging.getLogger("keye.rl.distributed")


class RayWorkerError(KeyeError, RuntimeError):
    """A Ray worker kept failing on the same request (more than ``rl.ray.max_restarts`` restarts)."""


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[lo, hi)`` ranges covering ``range(n)``, sizes differing by at most one (the
    first ``n % parts`` ranges one longer); empty ranges when ``n < parts``."""
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for k in range(parts):
        hi = lo + base + (k < extra)
        out.append((lo, hi))
        lo = hi
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def torch_threads(num_cpus: float, override: int | None) -> int:
    return override if override is not None else max(1, int(num_cpus))


class EventLog:
    """Fault events of the Ray workers: counted per ``component/event``, logged with the running counts and
    appended as JSON lines to ``path`` (when given)."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self.counts: Counter[str] = Counter()

    def record(self, component: str, worker: int, event: str, **detail: Any) -> None:
        """Count ``event`` (``died``, ``timeout``, ``restarted``, ``requeued``) of ``component`` worker
        ``worker``, log it and append it to the file."""
        self.counts[f"{component}/{event}"] += 1
        row = {"time": time.time(), "component": component, "worker": worker, "event": event, **detail,
               "counts": dict(self.counts)}
        log.warning("ray %s worker %d: %s %s; counts %s", component, worker, event,
                    " ".join(f"{k}={v}" for k, v in detail.items()), dict(self.counts))
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")


# --------------------------------------------------------------------------------------------- session
def connect(section: Any) -> bool:
    """Connect to Ray as ``rl.ray`` says; returns whether this call started it (an initialised Ray is kept)."""
    if ray.is_initialized():
        return False
    if section.address is None:
        # "local": always a new cluster of this process, never one a `ray start` left on this machine
        ray.init(address="local", num_cpus=section.num_cpus or os.cpu_count() or 1, include_dashboard=False)
    else:
        ray.init(address=section.address)
    return True


def _release(pg: Any, actors: list[Any]) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone, or Ray is shutting down
            pass
    actors.clear()
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - Ray is shutting down
            pass


class RaySession:
    """The run's placement group (one bundle per actor: learners, then rollout, then reward workers) and
    every actor started in it. :meth:`close` kills the actors and removes the group; it also runs when the
    session is garbage-collected (the proxies hold it), so a finished run releases its resources.

    Raises:
        KeyeConfigError: the placement group cannot be placed within ``rl.ray.placement_timeout_s``.
    """

    def __init__(self, section: Any, events: EventLog):
        import gc

        self.section, self.events = section, events
        self.started = connect(section)
        gc.collect()  # a finished run's session still awaiting collection releases its resources first
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.learner_gpus = section.learner_gpus if section.learner_gpus is not None else float(has_gpus)
        self.rollout_gpus = section.rollout_gpus if section.rollout_gpus is not None else float(has_gpus)
        kinds = ([("learner", section.learner_cpus, self.learner_gpus)] * section.learners
                 + [("rollout", section.rollout_cpus, self.rollout_gpus)] * section.rollout_workers
                 + [("reward", section.reward_cpus, 0.0)] * section.reward_workers)
        self.bundles = [{"CPU": float(c), **({"GPU": float(g)} if g else {})} for _, c, g in kinds]
        self.first = {"learner": 0, "rollout": section.learners,
                      "reward": section.learners + section.rollout_workers}
        self.resources = {k: (c, g) for k, c, g in kinds}
        self.pg = placement_group(self.bundles, strategy=section.placement)
        self.actors: list[Any] = []
        self._finalizer = weakref.finalize(self, _release, self.pg, self.actors)
        try:
            ray.get(self.pg.ready(), timeout=section.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise KeyeConfigError(
                f"rl.ray: the placement group {self.bundles} ({section.placement}) could not be placed within "
                f"{section.placement_timeout_s} s; the cluster offers {ray.cluster_resources()} (lower "
                "rl.ray.*_cpus / *_gpus or the worker counts, or add nodes)") from None

    def start(self, cls: type, kind: str, index: int, name: str, *args: Any) -> Any:
        """Start actor ``cls(*args)`` in bundle ``index`` of ``kind``'s bundles, named ``name`` (in this
        driver's namespace)."""
        cpus, gpus = self.resources[kind]
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.first[kind] + index)
        handle = ray.remote(cls).options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strategy, name=name,
                                         max_restarts=0).remote(*args)
        self.actors.append(handle)
        return handle

    def retire(self, handle: Any) -> None:
        """Kill ``handle`` (a dead or hung worker) and forget it."""
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        self.actors[:] = [a for a in self.actors if a is not handle]

    def close(self) -> None:
        """Kill every actor and remove the placement group (idempotent)."""
        self._finalizer()


# --------------------------------------------------------------------------------------------- workers
class WorkerPool:
    """Replaceable workers of one kind with the fault handling both pools share: a call whose worker died
    (``RayActorError``) - or, with ``timeout``, did not answer in time - gets a new worker (``make(index,
    generation)``, then ``prepare(index, handle)``) and is re-sent, at most ``max_restarts`` times."""

    def __init__(self, session: RaySession, component: str, count: int, make: Callable[[int, int], Any],
                 max_restarts: int, prepare: Callable[[int, Any], None] | None = None):
        self.session, self.component, self.make, self.prepare = session, component, make, prepare
        self.max_restarts = max_restarts
        self.events = session.events
        self.generation = [0] * count
        self.workers = [make(i, 0) for i in range(count)]
        # wait until every worker is built (model loaded): start-up errors surface here, and a call's
        # timeout never includes a worker's start-up
        ray.get([w.pid.remote() for w in self.workers])

    def restart(self, i: int, prepare: bool = True) -> None:
        """Replace worker ``i`` (killing the old one), wait until the new one is up and (``prepare``) prepare it."""
        self.session.retire(self.workers[i])
        self.generation[i] += 1
        self.workers[i] = self.make(i, self.generation[i])
        ray.get(self.workers[i].pid.remote())
        self.events.record(self.component, i, "restarted", generation=self.generation[i])
        if prepare and self.prepare is not None:
            self.prepare(i, self.workers[i])

    def dead(self) -> list[int]:
        """Indices of the workers that do not answer (their process died)."""
        out = []
        for i, w in enumerate(self.workers):
            try:
                ray.get(w.pid.remote())
            except ray.exceptions.RayActorError:
                out.append(i)
        return out

    def run(self, jobs: dict[int, Callable[[Any], Any]], what: str, timeout: float | None = None) -> dict[int, Any]:
        """Submit ``jobs[i](worker_i)`` on every listed worker at once; returns their results by index.

        Raises:
            RayWorkerError: a job failed more than ``max_restarts`` times.
        """
        start = time.monotonic()
        pending = {i: (job(self.workers[i]), start) for i, job in jobs.items()}
        out: dict[int, Any] = {}
        failures = dict.fromkeys(jobs, 0)
        for i in sorted(jobs):
            while i not in out:
                ref, t0 = pending[i]
                try:
                    wait = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
                    out[i] = ray.get(ref, timeout=wait)
                    continue
                except ray.exceptions.GetTimeoutError:
                    event = "timeout"
                    why = f"no answer within {timeout} s"
                except ray.exceptions.RayActorError as err:
                    event = "died"
                    why = type(err).__name__
                failures[i] += 1
                self.events.record(self.component, i, event, call=what, detail=why)
                if failures[i] > self.max_restarts:
                    raise RayWorkerError(f"ray {self.component} worker {i}: {what} failed {failures[i]} times "
                                         f"(last: {why}); rl.ray.max_restarts={self.max_restarts}")
                self._restart_until_up(i, what, failures)
                pending[i] = (jobs[i](self.workers[i]), time.monotonic())
                self.events.record(self.component, i, "requeued", call=what)
        return out

    def _restart_until_up(self, i: int, what: str, failures: dict[int, int]) -> None:
        while True:
            try:
                self.restart(i)
                return
            except ray.exceptions.RayActorError as err:
                failures[i] += 1
                self.events.record(self.component, i, "died", call=f"restart for {what}", detail=type(err).__name__)
                if failures[i] > self.max_restarts:
                    raise RayWorkerError(f"ray {self.component} worker {i} could not be restarted for {what}: "
                                         f"{err}") from None


__all__ = ["EventLog", "RaySession", "RayWorkerError", "WorkerPool", "connect", "split_even"]
