"""The policy side of RL: :class:`~keye.rl.learner.learner.Learner` (policy and reference models, optimizer,
log-probs and PPO updates, replicated or sharded) and the per-GPU memory planner (plan.py, ``keye rl plan``)."""

from keye.rl.learner.learner import Learner, UpdateResult

__all__ = ["Learner", "UpdateResult"]
