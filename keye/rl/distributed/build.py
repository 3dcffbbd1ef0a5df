"""Building the RL components on Ray (``rl.engine: ray``, both modes): the config checks of the Ray section and
:func:`build_ray_components` (learner group, rollout workers, reward workers, the driver's evaluation copy)."""

from __future__ import annotations

from keye.errors import KeyeConfigError

try:
    import ray
except ImportError as _err:  # pragma: no cover - depends on the installation
    raise KeyeConfigError(f"rl.engine=ray needs the 'ray' package (pip install 'keye[ray]'): {_err}") from None

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError
from keye.hub import resolve_model_path
from keye.rl.distributed.learner_group import RemoteLearner
from keye.rl.distributed.ray_session import EventLog, RaySession, connect
from keye.rl.distributed.reward_workers import RemoteScorer, RewardScorerFactory
from keye.rl.distributed.rollout_workers import RemoteEngine
from keye.rl.distributed.stream_workers import StreamWorkerPool
from keye.rl.distributed.weight_sync import broadcast_backend
from keye.rl.rollout.scoring import RewardScorer
from keye.train.models import load_inference_model


# --------------------------------------------------------------------------------------------- config
def check_ray_config(cfg: Any, world_size: int = 1) -> None:
    """Validate ``cfg.rl`` for the Ray engine; raises :class:`KeyeConfigError` naming the key.

    ``world_size`` is the driver's: the Ray driver is one process (the learner ranks are actors), so it must
    not be launched under torchrun.
    """
    rl, rs = cfg.rl, cfg.rl.ray
    if world_size != 1:
        raise KeyeConfigError(f"rl.engine=ray runs from one driver process (got a world of {world_size}): start it "
                              "with plain `keye train rlep`, not torchrun; rl.ray.learners sets the learner ranks")
    if rl.max_staleness < 0:
        raise KeyeConfigError(f"rl.max_staleness must be >= 0, got {rl.max_staleness}")
    for key in ("learners", "rollout_workers"):
        if getattr(rs, key) < 1:
            raise KeyeConfigError(f"rl.ray.{key} must be >= 1, got {getattr(rs, key)}")
    if rs.reward_workers is not None and rs.reward_workers < 0:
        raise KeyeConfigError(f"rl.ray.reward_workers must be >= 0 (0: score in the driver), got {rs.reward_workers}")
    if rs.max_restarts < 0:
        raise KeyeConfigError(f"rl.ray.max_restarts must be >= 0, got {rs.max_restarts}")
    for key in ("reward_timeout_s", "placement_timeout_s", "sync_timeout_s", "learner_cpus", "rollout_cpus",
                "reward_cpus"):
        if not getattr(rs, key) > 0:
            raise KeyeConfigError(f"rl.ray.{key} must be > 0, got {getattr(rs, key)}")
    for key in ("learner_gpus", "rollout_gpus"):
        v = getattr(rs, key)
        if v is not None and v < 0:
            raise KeyeConfigError(f"rl.ray.{key} must be >= 0 (or null: 1 when the cluster has GPUs), got {v}")
    if rs.torch_threads is not None and rs.torch_threads < 1:
        raise KeyeConfigError(f"rl.ray.torch_threads must be >= 1 (or null), got {rs.torch_threads}")
    if rs.num_cpus is not None and (rs.num_cpus < 1 or rs.address is not None):
        raise KeyeConfigError(f"rl.ray.num_cpus ({rs.num_cpus}) sizes a local cluster: it must be >= 1 and needs "
                              f"rl.ray.address: null (got {rs.address!r})")
    if cfg.rollout.engine == "vllm" and rs.rollout_gpus is not None and rs.rollout_gpus <= 0:
        raise KeyeConfigError("rollout.engine=vllm needs a GPU per rollout worker: set rl.ray.rollout_gpus > 0 "
                              "(or null)")
    if rl.mode == "async" and cfg.rollout.engine != "local":
        raise KeyeConfigError(f"rl.mode=async samples with keye's streaming engine: rollout.engine must be local, got "
                              f"{cfg.rollout.engine!r}")


def build_ray_components(cfg: Any, info: Any, model_path: Path, processor: Any, *,
                         answer_length: Callable[[str, int], int] | None = None) -> Any:
    """The RL components on Ray (``rl.engine: ray``); :func:`check_ray_config` first.

    ``rl.mode: sync``: a :class:`RemoteLearner`, a :class:`RemoteEngine` over the rollout workers, a
    :class:`RemoteScorer` (with ``rl.ray.reward_workers: 0`` the driver scores) in one placement group.
    ``rl.mode: async``: the :class:`RemoteLearner` and the reward workers in a placement group without rollout
    bundles, and a :class:`~keye.rl.distributed.stream_workers.StreamWorkerPool` as the engine (its workers are
    actors of their own, started and replaced by the rollout manager; ``answer_length`` forces their answer
    lengths); prompt filtering runs in a one-off Ray task (:func:`filter_on_worker`).
    Either way no rollout model lives in the driver, only its evaluation copy (with ``eval.manifest``), and
    closing the components releases the actors (and a cluster this run started).

    Raises:
        KeyeConfigError: an invalid ``rl`` section or resources the cluster cannot place.
    """
    from keye.rl.loop.components import Components
    from keye.rl.loop.state import filter_by_accuracy, step_seed

    check_ray_config(cfg, info.world_size)
    rs = replace(cfg.rl.ray, reward_workers=reward_worker_count(cfg))
    started = connect(rs)
    events = EventLog(Path(cfg.checkpoint.out_dir) / "ray_events.jsonl")
    session = None

    def close() -> None:
        if session is not None:
            session.close()
        if started:
            ray.shutdown()

    try:
        if cfg.rl.mode == "async":
            # no rollout bundles in the placement group: rollout workers are started (and replaced) by the rollout
            # manager as actors of their own
            session = RaySession(replace(rs, rollout_workers=0), events)
            learner = RemoteLearner(session, cfg, model_path)
            engine: Any = StreamWorkerPool(cfg, str(model_path), _processor_path(cfg), learner.dtype,
                                           Path(cfg.checkpoint.out_dir), answer_length)
            scorer: Any = _scorer(cfg, rs, session)
        else:
            session = RaySession(rs, events)
            learner = RemoteLearner(session, cfg, model_path)
            engine = RemoteEngine(session, cfg, model_path, learner.dtype, step_seed(cfg.train.seed, 0, 0),
                                  broadcast=broadcast_backend(rs.weight_sync, learner.devices, session.rollout_gpus))
            scorer = _scorer(cfg, rs, session)
    except BaseException:
        close()
        raise
    # held-out evaluation runs in the driver on a copy refreshed from the learner's shards
    eval_model = (load_inference_model(model_path, dtype=learner.dtype, attn_implementation=cfg.model.attn_implementation,
                                       device=info.device) if cfg.eval.manifest else None)
    if cfg.rl.mode == "async":
        def keep_informative(prompts: list[Any]) -> list[Any]:
            return _filter_on_ray(cfg, model_path, learner.dtype, engine, prompts)
    else:
        def keep_informative(prompts: list[Any]) -> list[Any]:
            return filter_by_accuracy(prompts, engine, scorer, cfg.data, info)
    return Components(learner, engine, None, eval_model, scorer, keep_informative, on_close=close)


def reward_worker_count(cfg: Any) -> int:
    """``rl.ray.reward_workers``, or its default: 2 in sync mode, 0 (the driver scores) in async mode."""
    n = cfg.rl.ray.reward_workers
    return n if n is not None else (2 if cfg.rl.mode == "sync" else 0)


def _scorer(cfg: Any, rs: Any, session: Any) -> Any:
    """``rs.reward_workers`` reward actors behind a :class:`RemoteScorer` (a share that dies or takes longer than
    ``rl.ray.reward_timeout_s`` is re-run on a new worker), or, with 0, the driver's own scorer."""
    if not rs.reward_workers:
        return RewardScorer.from_config(cfg.reward)
    return RemoteScorer(session, RewardScorerFactory(cfg.reward), rs.reward_workers, rs.reward_timeout_s,
                        rs.max_restarts)


def _processor_path(cfg: Any) -> str:
    return resolve_model_path(cfg.model.processor or cfg.model.path)


def _filter_on_ray(cfg: Any, model_path: Path, dtype: str, pool: Any, prompts: list[Any]) -> list[Any]:
    """``data.filter_samples`` in async mode: the start weights are model.path's, sampled by a one-off task with a
    rollout worker's resources (``max_calls=1``: its process exits afterwards, releasing the model's memory)."""
    rc = cfg.rl.ray
    task = ray.remote(max_calls=1, num_cpus=rc.rollout_cpus, num_gpus=pool.gpus)(filter_on_worker)
    keep = set(ray.get(task.remote(cfg, str(model_path), _processor_path(cfg), prompts, dtype, pool.threads)))
    return [p for p in prompts if p.id in keep]


def filter_on_worker(cfg: Any, model_path: str, processor_path: str, prompts: list[Any], dtype: str,
                     threads: int) -> list[str]:
    """The ids of the prompts ``data.filter_samples`` keeps (sampling accuracy in (0, 1)) under the weights at
    ``model_path``, sampled as the synchronous loop's filter does (a :class:`~keye.rl.rollout.engines.LocalRollout`
    seeded with ``train.seed``, scored by ``reward``). Meant to run as a Ray task with a rollout worker's
    resources, so the driver never loads the model; callable in any process with one torch rank."""
    import torch

    from keye.processing.processor import KeyeProcessor
    from keye.rl.loop.state import filter_by_accuracy
    from keye.rl.rollout.engines import LocalRollout
    from keye.rl.rollout.settings import SamplingSettings
    from keye.train import dist as kdist

    torch.set_num_threads(int(threads))
    info = kdist.init_distributed(cfg.train.device)  # no WORLD_SIZE here: one rank, picks the device
    model = load_inference_model(model_path, dtype=dtype, attn_implementation=cfg.model.attn_implementation,
                                 device=info.device)
    engine = LocalRollout(model, KeyeProcessor.from_pretrained(processor_path), SamplingSettings.from_config(cfg.rollout),
                          seed=cfg.train.seed)
    return [p.id for p in filter_by_accuracy(prompts, engine, RewardScorer.from_config(cfg.reward), cfg.data, info)]


__all__ = ["build_ray_components", "check_ray_config", "filter_on_worker"]
