"""Old import path of the SFT recipe, which now lives in :mod:`keye.recipes.sft` (its library pieces in
:mod:`keye.sft` and the training floor :mod:`keye.train`). Kept so that code written against
``keye.train.sft`` keeps working; nothing inside keye imports this module (tests/test_layers.py)."""

from keye.recipes.sft import format_summary, main, run_from_args, train
from keye.sft.config import DataSection, SFTConfig, TrainSection
from keye.sft.inputs import IGNORE_INDEX, MODEL_INPUT_KEYS, VISION_KEYS, model_inputs
from keye.sft.step import deepspeed_config
from keye.sft.trees import (
    TreeCostModel,
    TreeSampleProcessor,
    has_multi_answer,
    target_tokens,
    tree_loss,
    unshared_batch,
    use_tree_path,
)
from keye.train.checkpoint import list_checkpoints, load_checkpoint, prune_checkpoints, save_checkpoint
from keye.train.config import to_dict
from keye.train.lora import LORA_TARGETS, apply_lora, merged_state_dict
from keye.train.metrics import MetricsWriter
from keye.train.optim import STAGE_FREEZE, TOWERS, apply_freezing, lr_lambda, param_groups, tower_of
from keye.train.sections import CheckpointSection, LogSection, LoraSection, ModelSection

__all__ = ["IGNORE_INDEX", "LORA_TARGETS", "MODEL_INPUT_KEYS", "STAGE_FREEZE", "TOWERS", "VISION_KEYS", "CheckpointSection",
           "DataSection", "LogSection", "LoraSection", "MetricsWriter", "ModelSection", "SFTConfig", "TrainSection",
           "TreeCostModel", "TreeSampleProcessor", "apply_freezing", "apply_lora", "deepspeed_config", "format_summary",
           "has_multi_answer", "list_checkpoints", "load_checkpoint", "lr_lambda", "main", "merged_state_dict",
           "model_inputs", "param_groups", "prune_checkpoints", "run_from_args", "save_checkpoint", "target_tokens",
           "to_dict", "tower_of", "train", "tree_loss", "unshared_batch", "use_tree_path"]
