"""Streaming rollout workers on Ray (``rl.mode: async``): :class:`StreamWorkerActor` is a
:class:`~keye.rl.rollout.stream_worker.StreamWorker` in its own process (it loads the model itself) and
:class:`RayRolloutWorker` the driver-side adapter the :class:`~keye.rl.rollout.rollout_manager.RolloutManager`
drives: every protocol call is a ``ray.get`` on the actor; a dead actor (or any failed call) makes the adapter
report ``alive() == False`` and raise, and the manager replaces it through its factory."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from keye.rl.rollout.rollout_manager import Finished, TokenChunk
from keye.rl.rollout.settings import SamplingSettings
from keye.rl.rollout.stream_worker import RAY_CALL_TIMEOUT_S, StreamWorker, WorkerFailed
from keye.rl.rollout.trajectory import Request
from keye.train.models import load_inference_model

log = logging.getLogger("keye.rl.distributed.stream_workers")


class StreamWorkerActor:
    """A :class:`StreamWorker` in its own process (wrap with ``ray.remote``): loads the whole model from
    ``model_path`` (and the processor from ``processor_path``), decodes in a background thread.

    Args:
        sampling: the run's :class:`~keye.rl.rollout.settings.SamplingSettings`.
        settings: the other :class:`StreamWorker` keyword arguments (``background`` is forced on).
        dtype: model dtype (``"float32"``, ``"bfloat16"``, ...). device: ``"cpu"``, ``"cuda"`` or ``"auto"``
            (cuda when the actor was given a GPU). torch_threads: CPU threads for torch (None: unchanged).
        version: the weight version the checkpoint at ``model_path`` is.
    """

    def __init__(self, model_path: str, processor_path: str, sampling: SamplingSettings, settings: dict[str, Any], *,
                 dtype: str = "float32", device: str = "auto", torch_threads: int | None = None,
                 attn_implementation: str = "sdpa"):
        from keye.processing.processor import KeyeProcessor

        if torch_threads:
            torch.set_num_threads(int(torch_threads))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = load_inference_model(model_path, dtype=dtype, attn_implementation=attn_implementation, device=device)
        processor = KeyeProcessor.from_pretrained(processor_path)
        self.worker = StreamWorker(model, processor, sampling, **{**settings, "background": True})

    def submit(self, requests: Sequence[Request]) -> None:
        """:meth:`StreamWorker.submit`."""
        self.worker.submit(requests)

    def poll(self) -> list[TokenChunk | Finished]:
        """:meth:`StreamWorker.poll`."""
        return self.worker.poll()

    def pause(self) -> None:
        """:meth:`StreamWorker.pause`."""
        self.worker.pause()

    def resume(self) -> None:
        """:meth:`StreamWorker.resume`."""
        self.worker.resume()

    def load_weights(self, shard_refs: Sequence[Any], version: int) -> int:
        """:meth:`StreamWorker.load_weights` from Ray object references of the shards, fetched one at a
        time (the actor never holds more than one shard beyond its model)."""
        import ray

        return self.worker.load_weights((ray.get(ref) for ref in shard_refs), version)

    def alive(self) -> bool:
        """:meth:`StreamWorker.alive`."""
        return self.worker.alive()

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def counts(self) -> dict[str, int]:
        """The worker's counters (requests, chunks, tokens, prefills, re-prefilled rows, weight loads)."""
        return dict(self.worker.counts)


class RayRolloutWorker:
    """Driver-side :class:`~keye.rl.rollout.rollout_manager.RolloutWorker` over a :class:`StreamWorkerActor` handle.

    Each protocol call is ``ray.get(actor.method.remote(...), timeout=timeout_s)``. The first failure (the
    actor died: ``RayActorError``; a timeout; an error inside the actor) marks the adapter dead, kills the
    actor (so a hung one cannot come back) and re-raises; :meth:`alive` is False from then on and the
    rollout manager replaces the worker and requeues its requests. ``load_weights`` takes a list of Ray
    object references of the shards (put once by the driver, fetched by every actor).
    """

    def __init__(self, handle: Any, *, timeout_s: float = RAY_CALL_TIMEOUT_S):
        self.handle = handle
        self.timeout_s = timeout_s
        self.dead = False
        self._pid: int | None = None

    def _call(self, name: str, *args: Any) -> Any:
        import ray

        if self.dead:
            raise WorkerFailed(f"rollout actor is dead ({name} refused)")
        try:
            return ray.get(getattr(self.handle, name).remote(*args), timeout=self.timeout_s)
        except Exception:
            self.dead = True
            self.kill()
            raise

    def submit(self, requests: Sequence[Request]) -> None:
        """Hand the requests to the actor."""
        self._call("submit", list(requests))

    def poll(self) -> list[TokenChunk | Finished]:
        """The actor's events since the last poll."""
        return self._call("poll")

    def pause(self) -> None:
        """Pause the actor at a chunk boundary."""
        self._call("pause")

    def resume(self) -> None:
        """Resume the actor."""
        self._call("resume")

    def load_weights(self, shards: Sequence[Any], version: int) -> None:
        """Load the shards (a list of object references) as ``version``."""
        self._call("load_weights", list(shards), int(version))

    def alive(self) -> bool:
        """False after any failed call."""
        return not self.dead

    def pid(self) -> int:
        """The actor's process id (cached after the first call)."""
        if self._pid is None:
            self._pid = int(self._call("pid"))
        return self._pid

    def counts(self) -> dict[str, int]:
        """The actor's counters."""
        return self._call("counts")

    def kill(self) -> None:
        """Kill the actor (no Ray restart); errors are ignored (it may already be gone)."""
        import ray

        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - killing a dead actor may fail in several ways; it is gone either way
            pass


class StreamWorkerPool:
    """How the asynchronous mode makes its streaming rollout workers on Ray (the components' ``engine`` in
    ``rl.mode: async``, driven by :class:`keye.rl.loop.streaming.StreamingBatcher`): each a
    :class:`StreamWorkerActor` with ``rl.ray.rollout_cpus`` / ``rollout_gpus`` outside the learners' placement group,
    wrapped in a :class:`RayRolloutWorker`; and the weights they load, exported once per version by learner rank 0
    into the object store.

    Args:
        cfg: the :class:`keye.rl.config.RLEPConfig` (``rollout``, ``rl.ray``, ``model``, ``train.seed``).
        model_path, processor_path: where workers load the start checkpoint and the processor from.
        dtype: the policy's dtype.
        out_dir: the run directory (``rollout_workers.json``: the live workers' pids, for operators and tests).
        answer_length: forced answer lengths for every worker (:class:`keye.rl.rollout.stream_worker.AnswerLengths`;
            benchmarks and tests), None: the model decides.
    """

    CHUNK_TOKENS = 4
    """Tokens a rollout worker decodes between two points where it may pause or load weights."""

    def __init__(self, cfg: Any, model_path: str, processor_path: str, dtype: str, out_dir: Path,
                 answer_length: Callable[[str, int], int] | None = None):
        import ray

        rc = cfg.rl.ray
        self.cfg, self.model_path, self.processor_path, self.dtype = cfg, str(model_path), str(processor_path), dtype
        self.out_dir, self.answer_length = out_dir, answer_length
        self.sampling = SamplingSettings.from_config(cfg.rollout)
        self.count = rc.rollout_workers
        self.gpus = rc.rollout_gpus if rc.rollout_gpus is not None else (1.0 if ray.cluster_resources().get("GPU", 0)
                                                                          else 0.0)
        self.threads = rc.torch_threads or max(1, int(rc.rollout_cpus))
        self._actor = ray.remote(StreamWorkerActor)
        self._spawned = 0
        self._pids: dict[int, int] = {}
        self._boot: tuple[list[Any], int] | None = None  # weights for workers built before the first push
        self._latest: tuple[list[Any], int] | None = None  # the newest exported weights and their version

    def make(self, index: int) -> RayRolloutWorker:
        """A new worker ``index`` (waits until it has loaded its model; loads the boot weights when set)."""
        from keye.rl.loop.state import step_seed

        self._spawned += 1
        settings = dict(chunk_tokens=self.CHUNK_TOKENS, answer_length=self.answer_length,
                        seed=step_seed(self.cfg.train.seed, 1_000 + self._spawned, index))
        rc = self.cfg.rl.ray
        handle = self._actor.options(num_cpus=rc.rollout_cpus, num_gpus=self.gpus, max_restarts=0).remote(
            self.model_path, self.processor_path, self.sampling, settings, dtype=self.dtype,
            device="cuda" if self.gpus else "cpu", torch_threads=self.threads,
            attn_implementation=self.cfg.model.attn_implementation)
        worker = RayRolloutWorker(handle)
        self._pids[index] = worker.pid()
        if self._boot is not None:
            worker.load_weights(*self._boot)
        (self.out_dir / "rollout_workers.json").write_text(json.dumps({"pids": self._pids, "spawned": self._spawned}))
        log.info("rollout worker %d started (pid %d)", index, self._pids[index])
        return worker

    def boot(self, refs: list[Any] | None, version: int) -> None:
        """The weights new workers load before their first request (None: the start checkpoint's, or - after
        the first push - whatever the rollout manager sends them)."""
        self._boot = (refs, version) if refs is not None else None

    def export(self, learner: Any, version: int) -> list[Any]:
        """Learner rank 0 streams the current weights into the object store (owned by the driver, one put per
        shard) as ``version``; returns the refs."""
        refs = learner.export_refs(self.cfg.rollout.sync_bytes)
        self._latest = (refs, version)
        return refs

    def shards(self, learner: Any, version: int) -> Iterator[dict[str, torch.Tensor]]:
        """The weights of ``version`` shard by shard (the last export when it is that version's)."""
        import ray

        refs = self._latest[0] if self._latest is not None and self._latest[1] == version else \
            self.export(learner, version)
        return (ray.get(ref) for ref in refs)

