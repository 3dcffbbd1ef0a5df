"""The named components of one RL run and how they are built in this process group: the learner, the rollout
engine, the whole-weight models sampling and evaluation use, what scores and filters; plus the weight sync from
learner to engine.

The same :class:`Components` come from this process (``rl.engine: process``: :func:`build_components` builds a
:class:`keye.rl.learner.learner.Learner` and a local or vLLM engine) or from Ray actors (``rl.engine: ray``:
:mod:`keye.rl.distributed.build`, imported only then), and the one RL loop (:func:`keye.recipes.rlep.train`)
drives either through the same methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError
from keye.rl.loop.state import filter_by_accuracy, step_seed
from keye.rl.rollout.engines import LocalRollout, VLLMRollout
from keye.rl.rollout.samples import RLPrompt
from keye.rl.rollout.scoring import RewardScorer
from keye.rl.rollout.settings import SamplingSettings
from keye.train import dist as kdist
from keye.train.models import load_inference_model


@dataclass
class Components:
    """What one RL run is made of.

    ``learner``: the :class:`~keye.rl.learner.learner.Learner` (or a proxy with its interface); ``engine``: what
    samples (an engine with ``generate``, or the streaming worker pool of the asynchronous mode);
    ``rollout_model``: the learner's own model when it samples with it, a synced inference copy under a sharded
    learner, None when the engine holds its own weights; ``eval_model``: the model the main rank evaluates with
    (None elsewhere); ``scorer``: what scores samples; ``keep_informative``: the pre-run prompt filter
    (``data.filter_samples``; None: :func:`~keye.rl.loop.state.filter_by_accuracy` on ``engine``);
    ``on_close``: what :meth:`close` releases (Ray actors, a cluster this run started).
    """

    learner: Any
    engine: Any
    rollout_model: Any
    eval_model: Any
    scorer: Any
    keep_informative: Callable[[list[RLPrompt]], list[RLPrompt]] | None = None
    on_close: Callable[[], None] | None = None

    def sync(self, version: int, max_bytes: int) -> None:
        """Send the learner's weights (``version``) to an engine that holds its own copy, shard by shard of at
        most ``max_bytes`` (collective); a no-op when the engine samples with the learner's own model."""
        if hasattr(self.engine, "sync_from"):  # an engine that pulls them itself (keye.rl.distributed)
            self.engine.sync_from(self.learner, version)
        elif isinstance(self.engine, VLLMRollout):
            self.engine.sync_weights(self.learner.export_weights(max_bytes), version=version)
        elif self.rollout_model is not self.learner.model:
            self.engine.load_weights(self.learner.export_weights(max_bytes), version=version)

    def close(self) -> None:
        """Release what the components hold outside this process (idempotent)."""
        if self.on_close is not None:
            on_close, self.on_close = self.on_close, None
            on_close()


def build_components(cfg: Any, info: kdist.DistInfo, model_path: Path, processor: Any) -> Components:
    """The learner and rollout engine of an :class:`~keye.rl.config.RLEPConfig` in this process group
    (``rollout.engine`` local / vllm, ``train.strategy``), the evaluation model and the scorer (``reward``);
    ``processor`` is the run's :class:`~keye.processing.processor.KeyeProcessor`.

    Raises:
        KeyeConfigError: ``rl.mode: async`` (it needs ``rl.engine: ray``).
    """
    if cfg.rl.mode != "sync":
        raise KeyeConfigError(f"rl.mode={cfg.rl.mode} needs rl.engine=ray (the in-process loop is synchronous)")
    from keye.rl.learner.learner import Learner

    learner = Learner.from_config(cfg, info, model_path=model_path)
    sampling, r = SamplingSettings.from_config(cfg.rollout), cfg.rollout

    def whole_copy() -> Any:
        return load_inference_model(model_path, dtype=learner.dtype, attn_implementation=cfg.model.attn_implementation,
                                    device=info.device)

    # the policy that samples: the learner's own replicated model, or (sharded learner, local engine) a whole
    # inference copy on every rank that receives the learner's weights after each update, as vLLM would
    seed = step_seed(cfg.train.seed, 0, info.rank)
    if r.engine == "local":
        rollout_model = whole_copy() if learner.sharded else learner.model
        engine: Any = LocalRollout(rollout_model, processor, sampling, seed=seed)
    else:
        rollout_model = None if learner.sharded else learner.model
        engine = VLLMRollout(model_path, processor, sampling, seed=seed, colocate=r.colocate)
    # held-out evaluation generates on the main rank alone, so it needs whole weights: the rollout model, or
    # (sharded learner + vLLM) a main-rank copy refreshed from the exported shards before each evaluation
    eval_model = rollout_model
    if rollout_model is None:
        eval_model = whole_copy() if info.is_main and cfg.eval.manifest else None
    scorer = RewardScorer.from_config(cfg.reward)

    def keep_informative(prompts: list[RLPrompt]) -> list[RLPrompt]:
        return filter_by_accuracy(prompts, engine, scorer, cfg.data, info)

    return Components(learner, engine, rollout_model, eval_model, scorer, keep_informative)



__all__ = ["Components", "build_components"]
