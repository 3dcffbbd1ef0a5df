"""Building the RL components on Ray (``rl.engine: ray``): the config checks of the Ray section and
:func:`build_ray_components` (learner group, rollout workers, reward workers, the driver's evaluation copy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError
from keye.rl.distributed.learner_group import RemoteLearner
from keye.rl.distributed.ray_session import EventLog, RaySession
from keye.rl.distributed.reward_workers import RemoteScorer, RewardScorerFactory
from keye.rl.distributed.rollout_workers import RemoteEngine
from keye.rl.distributed.weight_sync import broadcast_backend


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
    if rs.reward_workers < 0:
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


def build_ray_components(cfg: Any, info: Any, model_path: Path, processor: Any) -> Any:
    """The recipe's components on Ray (see the module doc): :class:`RemoteLearner`, :class:`RemoteEngine`,
    no rollout model in the driver, the driver's evaluation copy (with ``eval.manifest``) and a
    :class:`RemoteScorer` (None with ``rl.ray.reward_workers: 0``: the driver scores).

    Raises:
        KeyeConfigError: an invalid ``rl`` section (:func:`check_ray_config`) or resources the cluster cannot
            place.
    """
    from keye.model.keye_vl import KeyeVL
    from keye.rl.loop.components import Components
    from keye.rl.loop.state import step_seed as _step_seed

    check_ray_config(cfg, info.world_size)
    rs = cfg.rl.ray
    events = EventLog(Path(cfg.checkpoint.out_dir) / "ray_events.jsonl")
    session = RaySession(rs, events)
    try:
        learner = RemoteLearner(session, cfg, model_path)
        engine = RemoteEngine(session, cfg, model_path, learner.dtype, _step_seed(cfg.train.seed, 0, 0),
                              broadcast=broadcast_backend(rs.weight_sync, learner.devices, session.rollout_gpus))
        scorer = None
        if rs.reward_workers:
            scorer = RemoteScorer(session, RewardScorerFactory(dict(cfg.reward.spec), cfg.reward.pass_value),
                                  rs.reward_workers, rs.reward_timeout_s, rs.max_restarts)
    except BaseException:
        session.close()
        raise
    eval_model = None
    if cfg.eval.manifest:
        # held-out evaluation runs in the driver on a copy refreshed from the learner's shards
        eval_model = KeyeVL.from_pretrained(model_path, torch_dtype=learner.dtype,
                                            attn_implementation=cfg.model.attn_implementation)
        eval_model = eval_model.to(info.device).eval().requires_grad_(False)
    return Components(learner, engine, None, eval_model, scorer)
