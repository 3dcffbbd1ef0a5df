"""Old import path of the RL recipe, which now lives in :mod:`keye.recipes.rlep` (its library in :mod:`keye.rl`).
Kept so that code written against ``keye.train.rlep`` keeps working; nothing inside keye imports this module
(tests/test_layers.py)."""

from keye.recipes.rlep import main, run_from_args, train
from keye.rl.config import RLEPConfig, tree_enabled, validate
from keye.rl.loop.evaluate import greedy_accuracy
from keye.rl.loop.state import PromptStream, RunState
from keye.train.config import to_dict

__all__ = ["PromptStream", "RLEPConfig", "RunState", "greedy_accuracy", "main", "run_from_args", "to_dict", "train",
           "tree_enabled", "validate"]
