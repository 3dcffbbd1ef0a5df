"""The named components of one RL run and how they are built: the learner, the rollout engine, the whole-weight
models sampling and evaluation use, and (on Ray) a remote scorer; plus the weight sync from learner to engine.

The same :class:`Components` come from this process (``rl.engine: process``: :func:`build_components` builds a
:class:`keye.rl.learner.learner.Learner` and a local or vLLM engine) or from Ray actors (``rl.engine: ray``:
:func:`keye.rl.distributed.build.build_ray_components`, imported only then), and the recipe's loop drives either
through the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError
from keye.rl.config import RLEPConfig
from keye.rl.loop.state import step_seed
from keye.rl.rollout.engines import LocalRollout, VLLMRollout
from keye.train import dist as kdist


@dataclass
class Components:
    """What one RL run is made of: the learner, the rollout engine, and the whole-weight models sampling and
    evaluation run on (``rollout_model`` is the learner's own model when it is replicated, a synced inference
    copy under a sharded learner, None when the engine holds its own weights; ``eval_model`` the model the
    main rank evaluates with, None elsewhere)."""

    learner: Any
    engine: Any
    rollout_model: Any
    eval_model: Any
    scorer: Any = None  # what scores samples (None: a RewardScorer in this process)

    def sync(self, version: int, max_bytes: int) -> None:
        """Send the learner's weights (``version``) to an engine that holds its own copy, shard by shard of at
        most ``max_bytes`` (collective); a no-op when the engine samples with the learner's own model."""
        if hasattr(self.engine, "sync_from"):  # an engine that pulls them itself (keye.rl.distributed)
            self.engine.sync_from(self.learner, version)
        elif isinstance(self.engine, VLLMRollout):
            self.engine.sync_weights(self.learner.export_weights(max_bytes), version=version)
        elif self.rollout_model is not self.learner.model:
            self.engine.load_weights(self.learner.export_weights(max_bytes), version=version)


def build_components(cfg: RLEPConfig, info: kdist.DistInfo, model_path: Path, processor: Any) -> Components:
    """The learner and rollout engine of ``cfg`` (``rollout.engine`` local / vllm, ``train.strategy``); with
    ``rl.engine: ray`` the Ray actors of :mod:`keye.rl.distributed` (Ray is imported only then)."""
    if cfg.rl.engine == "ray":
        from keye.rl.distributed.build import build_ray_components

        return build_ray_components(cfg, info, model_path, processor)
    if cfg.rl.mode != "sync":
        raise KeyeConfigError(f"rl.mode={cfg.rl.mode} needs rl.engine=ray (the in-process loop is synchronous)")
    from keye.model.keye_vl import KeyeVL
    from keye.rl.learner.learner import Learner

    learner = Learner(cfg, info, model_path=model_path)

    def whole_copy() -> Any:
        m = KeyeVL.from_pretrained(model_path, torch_dtype=learner.dtype,
                                   attn_implementation=cfg.model.attn_implementation)
        return m.to(info.device).eval().requires_grad_(False)

    # the policy that samples: the learner's own replicated model, or (sharded learner, local engine) a whole
    # inference copy on every rank that receives the learner's weights after each update, as vLLM would
    r = cfg.rollout
    seed = step_seed(cfg.train.seed, 0, info.rank)
    if r.engine == "local":
        rollout_model = whole_copy() if learner.sharded else learner.model
        engine: Any = LocalRollout(rollout_model, processor, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                   top_p=r.top_p, top_k=r.top_k, max_batch_size=r.max_batch_size, seed=seed)
    else:
        rollout_model = None if learner.sharded else learner.model
        engine = VLLMRollout(model_path, processor, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                             top_p=r.top_p, top_k=r.top_k, seed=seed, colocate=r.colocate)
    # held-out evaluation generates on the main rank alone, so it needs whole weights: the rollout model, or
    # (sharded learner + vLLM) a main-rank copy refreshed from the exported shards before each evaluation
    eval_model = rollout_model
    if rollout_model is None:
        eval_model = whole_copy() if info.is_main and cfg.eval.manifest else None
    return Components(learner, engine, rollout_model, eval_model)
