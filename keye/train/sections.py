"""Config sections both recipes share, defined once (``keye train sft`` and ``keye train rlep`` YAML).

``model``, ``lora``, ``checkpoint`` and ``log`` have the same fields in both recipes; :class:`OptimSection` holds
the optimisation fields of both ``train`` sections (:class:`keye.sft.config.TrainSection`,
:class:`keye.rl.config.RLTrainSection` add what is their own: epochs or RL steps, strategies, trees). A recipe
that wants another default builds the section with it (``CheckpointSection(out_dir="runs/rlep")``), so the
fields themselves never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class ModelSection:
    """The checkpoint to start from and how to run it."""

    path: str = "keye-tiny"  # checkpoint dir, hub id, or "keye-tiny" (the embedded default)
    processor: str | None = None  # processor dir if not the model dir
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    # preprocessor_config.json fields to change for this run (e.g. a bigger max_pixels); video_defaults is
    # merged key by key. The exported checkpoint carries the result, so it is evaluated as it was trained.
    preprocessor: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoraSection:
    """LoRA adapters (peft) on the chosen towers; the export folds them into the base weights."""

    enabled: bool = False
    targets: list[str] = field(default_factory=lambda: ["llm"])  # "llm" and/or "vision"
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0


@dataclass
class OptimSection:
    """Freezing (stage presets), AdamW with per-tower learning rates, the LR schedule, clipping, the seed and
    the device: the fields every recipe's ``train`` section starts with (:mod:`keye.train.optim` reads them)."""

    stage: Literal["align", "full", "llm_only", "custom"] = "full"
    freeze: list[str] = field(default_factory=list)  # with stage=custom: subset of vision, projector, llm
    lr: float = 1e-4
    lr_vision: float | None = None  # per-tower learning rates (default: lr)
    lr_projector: float | None = None
    lr_llm: float | None = None
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8  # AdamW's epsilon (larger values damp the update of gradient elements near zero)
    warmup_steps: int = 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    deepspeed_config: str | None = None  # a DeepSpeed JSON for the ZeRO strategies (default: the recipe's)
    device: str = "auto"


@dataclass
class CheckpointSection:
    """Where checkpoints go, how often, how many are kept, and the final export."""

    out_dir: str = "runs/sft"
    save_every: int = 0  # optimizer steps between checkpoints (0: only at the end)
    keep_last: int = 2
    export: bool = True  # write <out_dir>/final in the official layout (+ processor files)


LOG_BACKENDS = ("tensorboard", "wandb", "mlflow")


@dataclass
class LogSection:
    """Metrics rows (every N steps), the progress bar, and the logging backends the rows also go to
    (:mod:`keye.train.metrics`; ``metrics.jsonl`` is always written).

    ``backends``: any of ``tensorboard``, ``wandb``, ``mlflow`` (a list, or one comma-separated string:
    ``log.backends=[wandb,mlflow]`` or ``log.backends=wandb``); each is an optional package, and selecting one
    that is not installed stops the run at its start with an error naming the package. Not set: the older
    switch ``tensorboard`` decides (TensorBoard when installed), so existing configs keep working.
    ``project``: the W&B project and the MLflow experiment; ``run_name``: the run's name there (default: the
    run directory's name). ``wandb_mode``: ``online`` (an account: ``wandb login``), ``offline`` (no account;
    the run is written under ``<run>/wandb`` and ``wandb sync`` uploads it later) or ``disabled``; default:
    ``WANDB_MODE``, else online. ``wandb_entity``: the W&B team or user (default: the account's).
    ``mlflow_tracking_uri``: default ``MLFLOW_TRACKING_URI`` when set, else a local file store
    ``<run>/mlruns`` (``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri <run>/mlruns`` shows it).
    """

    every: int = 1
    progress: bool = True
    tensorboard: bool = True  # the older switch, read only when backends is not set
    backends: list[str] | str | None = None
    project: str = "keye"
    run_name: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    wandb_entity: str | None = None
    mlflow_tracking_uri: str | None = None

    def __post_init__(self) -> None:
        from keye.errors import KeyeConfigError

        if isinstance(self.backends, str):
            self.backends = [b.strip() for b in self.backends.split(",") if b.strip()]
        if self.backends is not None:
            unknown = [b for b in self.backends if b not in LOG_BACKENDS]
            if unknown:
                raise KeyeConfigError(f"log.backends: {unknown[0]!r} is not one of {', '.join(LOG_BACKENDS)}")
            self.backends = list(dict.fromkeys(self.backends))  # each once, in the given order


__all__ = ["LOG_BACKENDS", "CheckpointSection", "LogSection", "LoraSection", "ModelSection", "OptimSection"]
