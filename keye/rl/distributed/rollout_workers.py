"""Rollout workers on Ray for the synchronous loop: :class:`RolloutActor` s each holding a whole-weight engine
(:class:`~keye.rl.rollout.engines.LocalRollout` or :class:`~keye.rl.rollout.engines.VLLMRollout`), driven by
:class:`RemoteEngine`, which has the engine interface the RL loop uses plus :meth:`RemoteEngine.sync_from`.

Prompts are split by index; worker ``k`` samples from :func:`worker_seed` ``(step seed, k)`` (worker 0 from the
step seed itself, so one worker samples exactly what the in-process engine samples). Every call carries the random
state it starts from and the weight version it must serve, so a call is a pure function of (weights, state,
prompts) and can be re-sent to a replacement worker.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from keye.errors import KeyeConfigError
from keye.rl.distributed.learner_group import RemoteLearner
from keye.rl.distributed.ray_session import RaySession, RayWorkerError, WorkerPool, split_even, torch_threads
from keye.rl.distributed.weight_sync import open_sync_group, receive_shards
from keye.rl.rollout.rollout_manager import WorkerProtocolError
from keye.rl.rollout.samples import RolloutSample
from keye.rl.rollout.settings import SamplingSettings
from keye.train.models import load_inference_model, load_processor

try:
    import ray
except ImportError as _err:  # pragma: no cover - depends on the installation
    raise KeyeConfigError(f"rl.engine=ray needs the 'ray' package (pip install 'keye[ray]'): {_err}") from None

log = logging.getLogger("keye.rl.distributed.rollout_workers")


# --------------------------------------------------------------------------------------------- helpers
def worker_seed(seed: int, index: int) -> int:
    """The sampling seed of rollout worker ``index`` for a step seeded ``seed``: ``seed`` itself for worker 0
    (so one worker reproduces the in-process engine), a distinct deterministic value for the others."""
    if index == 0:
        return seed
    return (seed * 6_364_136_223_846_793_005 + index * 1_442_695_040_888_963_407) % (2**62)


class RolloutActor:
    """A rollout worker: a whole-weight rollout engine (``rollout.engine`` local or vllm) in its own process.

    Every :meth:`generate` names the random state it starts from (``{"seed": s}`` or ``{"state":
    engine.state_dict()}``) and the weight version it expects, and returns the state it ends in, so the
    driver can re-send a request to a replacement worker and get the same samples.
    """

    def __init__(self, cfg: Any, model_path: str, dtype: str, seed: int, threads: int):
        from keye.rl.rollout.engines import LocalRollout, VLLMRollout
        from keye.train import dist as kdist

        torch.set_num_threads(threads)
        self.sync: tuple[Any, Any] | None = None  # (store, group) of the weight broadcast
        info = kdist.init_distributed(cfg.train.device)  # no WORLD_SIZE here: picks the device (and CPU flags)
        processor = load_processor(cfg.model)
        sampling = SamplingSettings.from_config(cfg.rollout)
        self.kind = cfg.rollout.engine
        if self.kind == "local":
            model = load_inference_model(model_path, dtype=dtype, attn_implementation=cfg.model.attn_implementation,
                                         device=info.device)
            self.engine: Any = LocalRollout(model, processor, sampling, seed=seed)
        else:
            # the worker owns its GPU: vLLM never sleeps between rollouts here unless asked to
            self.engine = VLLMRollout(model_path, processor, sampling, seed=seed, colocate=cfg.rollout.colocate)

    def pid(self) -> int:
        """This actor's process id (for operators and fault tests)."""
        return os.getpid()

    def weight_version(self) -> int:
        """The weight version this worker serves."""
        return int(self.engine.weight_version)

    def generate(self, prompts: list[Any], n: int, start: dict[str, Any],
                 version: int) -> tuple[list[RolloutSample], dict[str, Any]]:
        """``n`` samples per prompt from random state ``start`` under weights ``version``; returns them (each
        with ``metadata["weight_version"]``) and the engine state afterwards.

        Raises:
            WorkerProtocolError: the worker does not serve ``version``.
        """
        if int(self.engine.weight_version) != int(version):
            raise WorkerProtocolError(f"rollout worker serves weights {self.engine.weight_version}, the request "
                                      f"expects {version}")
        if "seed" in start:
            self.engine.reseed(int(start["seed"]))
        else:
            self.engine.load_state_dict(start["state"])
        samples = self.engine.generate(prompts, n)
        for s in samples:
            s.metadata["weight_version"] = int(version)
        return samples, self.engine.state_dict()

    def load_weights(self, refs: list[Any], version: int) -> int:
        """Load the shards behind ``refs`` (object refs of ``{name: tensor}``, fetched one at a time) and serve
        ``version`` from now on; returns the number of tensors loaded."""
        return self._load((ray.get(ref) for ref in refs), version)

    def open_sync_group(self, addr: str, port: int, rank: int, world: int, backend: str, timeout_s: float) -> None:
        """Join (as ``rank``) a new weight-broadcast group with learner rank 0."""
        self.sync = None
        self.sync = open_sync_group(addr, port, rank, world, backend, timeout_s)
        self.sync_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def receive_weights(self, version: int) -> int:
        """Load the shards learner rank 0 broadcasts and serve ``version``; returns the number of tensors."""
        return self._load(receive_shards(self.sync[1], self.sync_device), version)

    def _load(self, shards: Iterator[dict[str, torch.Tensor]], version: int) -> int:
        if self.kind == "local":
            return self.engine.load_weights(shards, version=int(version))
        return self.engine.sync_weights(shards, version=int(version))


class RemoteEngine:
    """The driver's rollout engine over ``rl.ray.rollout_workers`` :class:`RolloutActor` s, with the interface
    of :class:`~keye.rl.rollout.engines.LocalRollout` the recipe uses (``generate``, ``reseed``, ``state_dict`` /
    ``load_state_dict``, ``weight_version``) and :meth:`sync_from`.

    The per-worker random states live here (a worker is stateless between calls), so ``state_dict`` needs no
    remote call and a replacement worker continues exactly where the dead one would have.
    """

    def __init__(self, session: RaySession, cfg: Any, model_path: Path, dtype: str, seed: int,
                 broadcast: str | None = None):
        rs = cfg.rl.ray
        self.cfg, self.kind = cfg, cfg.rollout.engine
        self.sync_bytes = cfg.rollout.sync_bytes
        self.weight_version = 0
        self._refs: list[Any] = []  # the shards of weight_version (None of them for the start checkpoint)
        # broadcast weight sync: the backend (nccl / gloo) or None (object store); the learner last synced from
        self.broadcast, self.sync_timeout_s = broadcast, rs.sync_timeout_s
        self._learner: RemoteLearner | None = None
        self._group_ok = False
        n = rs.rollout_workers
        threads = torch_threads(rs.rollout_cpus, rs.torch_threads)
        # a vLLM engine seeds each call from its construction seed and call count: the count is its state
        self._start: list[dict[str, Any]] = ([{"seed": worker_seed(seed, i)} for i in range(n)] if self.kind == "local"
                                             else [{"state": {"calls": 0}} for _ in range(n)])

        def make(i: int, gen: int) -> Any:
            return session.start(RolloutActor, "rollout", i, f"keye-rollout-{i}-{gen}", cfg, str(model_path), dtype,
                                 worker_seed(seed, i), threads)

        me = weakref.proxy(self)  # no reference cycle: the engine (and its actors) go when the run drops it

        def prepare(i: int, handle: Any) -> None:
            if me.broadcast is not None:
                # a new member: the group is formed again and the current weights broadcast to every worker
                me._group_ok = False
                if me._learner is not None:
                    me._broadcast(me._learner, me.weight_version)
            elif me._refs:  # the start checkpoint is what a new worker holds already
                ray.get(handle.load_weights.remote(me._refs, me.weight_version))

        self.pool = WorkerPool(session, "rollout", n, make, rs.max_restarts, prepare)

    @property
    def num_workers(self) -> int:
        """How many rollout workers."""
        return len(self.pool.workers)

    def reseed(self, seed: int) -> None:
        """Start every worker's sampling stream from :func:`worker_seed` ``(seed, k)`` at its next call. A vLLM
        engine is not reseeded (as in one process: its seeds come from its call count)."""
        if self.kind == "local":
            self._start = [{"seed": worker_seed(seed, i)} for i in range(self.num_workers)]

    def state_dict(self) -> dict[str, Any]:
        """Every worker's random state (for exact resume)."""
        return {"ray_workers": [dict(s) for s in self._start], "engine": self.kind}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            KeyeConfigError: the state was not written by a Ray engine of the same kind and worker count.
        """
        if "ray_workers" not in state or state.get("engine") != self.kind:
            raise KeyeConfigError(f"the saved rollout state {sorted(state)} was not written by rl.engine=ray with "
                                  f"rollout.engine={self.kind}: resume with the engines the run was started with")
        if len(state["ray_workers"]) != self.num_workers:
            raise KeyeConfigError(f"the checkpoint holds {len(state['ray_workers'])} rollout workers' state; resume "
                                  f"with rl.ray.rollout_workers={len(state['ray_workers'])} (now {self.num_workers})")
        self._start = [dict(s) for s in state["ray_workers"]]

    def generate(self, prompts: Sequence[Any], n: int) -> list[RolloutSample]:
        """``n`` samples per prompt (prompt by prompt, ``group`` = index in ``prompts``); worker ``k`` samples
        the ``k``-th contiguous slice of the prompts."""
        if n < 1:
            raise KeyeConfigError(f"n (rollouts per prompt) must be >= 1, got {n}")
        prompts = list(prompts)
        spans = {k: span for k, span in enumerate(split_even(len(prompts), self.num_workers)) if span[1] > span[0]}
        version = self.weight_version
        jobs = {k: (lambda w, lo=lo, hi=hi, k=k: w.generate.remote(prompts[lo:hi], n, self._start[k], version))
                for k, (lo, hi) in spans.items()}
        results = self.pool.run(jobs, "generate")
        out: list[RolloutSample] = []
        for k in sorted(spans):
            samples, end = results[k]
            self._start[k] = {"state": end}
            for s in samples:
                s.group += spans[k][0]
            out += samples
        return out

    def sync_from(self, learner: RemoteLearner, version: int) -> None:
        """Serve the learner's current weights as ``version`` (between calls: never inside a generation).

        Object store: the shards are put once and every worker loads them; they are kept until the next sync
        (a replacement worker loads them). Broadcast: learner rank 0 broadcasts the shards to every worker in
        their own process group; a replacement worker gets the learner's weights broadcast again (in sync mode
        they are still ``version``'s)."""
        t0 = time.time()
        if self.broadcast is not None:
            self._broadcast(learner, int(version))
            self._learner, self.weight_version = learner, int(version)
        else:
            refs = learner.export_refs(self.sync_bytes)
            self.pool.run({k: (lambda w: w.load_weights.remote(refs, version)) for k in range(self.num_workers)},
                          f"load weights v{version}")
            self._refs, self.weight_version = refs, int(version)
        log.info("weights v%d synced to %d rollout worker(s) by %s in %.2f s", version, self.num_workers,
                 f"{self.broadcast} broadcast" if self.broadcast else "the object store", time.time() - t0)

    def _form_group(self, learner: RemoteLearner) -> None:
        addr, port = ray.get(learner.actors[0].endpoint.remote())
        world, backend, timeout = 1 + self.num_workers, self.broadcast, self.sync_timeout_s
        ray.get([learner.actors[0].open_sync_group.remote(addr, port, world, backend, timeout)]
                + [w.open_sync_group.remote(addr, port, k + 1, world, backend, timeout)
                   for k, w in enumerate(self.pool.workers)])

    def _broadcast(self, learner: RemoteLearner, version: int) -> None:
        """Broadcast the learner's weights to every worker as ``version``; a worker found dead (before, or by a
        failed broadcast) is replaced, the group formed again and the broadcast repeated."""
        failures = 0
        restarted: list[int] = []
        while True:
            for i in self.pool.dead():
                self.pool.events.record("rollout", i, "died", call=f"broadcast v{version}", detail="no answer")
                self.pool.restart(i, prepare=False)
                restarted.append(i)
                self._group_ok = False
            try:
                if not self._group_ok:
                    self._form_group(learner)
                    self._group_ok = True
                calls = learner.broadcast_refs(self.sync_bytes) + [w.receive_weights.remote(version)
                                                                   for w in self.pool.workers]
                ray.wait(calls, num_returns=len(calls))  # every member is out of the collective
                ray.get(calls)
            except ray.exceptions.RayError as err:
                failures += 1
                self._group_ok = False
                log.warning("weight broadcast v%d failed (%s); attempt %d", version, type(err).__name__, failures)
                if failures > self.pool.max_restarts:
                    raise RayWorkerError(f"the weight broadcast v{version} failed {failures} times (last: {err}); "
                                         f"rl.ray.max_restarts={self.pool.max_restarts}") from None
                continue
            for i in restarted:
                self.pool.events.record("rollout", i, "requeued", call=f"broadcast v{version}")
            return

    def pids(self) -> list[int]:
        """The workers' process ids."""
        return ray.get([w.pid.remote() for w in self.pool.workers])
