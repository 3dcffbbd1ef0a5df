"""Config schema of the SFT recipe (``keye train sft``): its own ``data`` and ``train`` sections and
:class:`SFTConfig`; ``model``, ``lora``, ``checkpoint`` and ``log`` are the shared sections of
:mod:`keye.train.sections`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from keye.errors import KeyeConfigError
from keye.train.loss import DEFAULT_LOSS_CHUNK_TOKENS
from keye.train.sections import CheckpointSection, LogSection, LoraSection, ModelSection, OptimSection


@dataclass
class DataSection:
    """The training manifest and how it is cut into load-balanced micro-batches."""

    manifest: str = "data/synth/train.jsonl"
    root: str | None = None
    batch_tokens: int | None = 4096  # token budget of one packed micro-batch row
    batch_size: int | None = None  # or: samples per micro-batch (padded batches)
    micro_batches: int = 1  # gradient accumulation steps per optimizer step
    packing: bool = True
    num_workers: int = 0
    max_bad_fraction: float = 0.05
    processor_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainSection(OptimSection):
    """The shared optimisation fields plus the SFT run length, the parallel strategy, the multi-answer layout and
    how the loss is computed (chunked over the vocabulary head, label smoothing)."""

    epochs: int = 1
    max_steps: int | None = None
    strategy: Literal["none", "ddp", "fsdp2", "zero2", "zero3"] = "none"
    # Shared-prefix batches for multi-answer rows (keye.sft.trees). YAML 1.1 reads a bare on/off as a boolean,
    # so true/false are accepted too and normalised to "on"/"off".
    tree: Literal["auto", "on", "off"] | bool = "auto"
    # The loss's target rows go through lm_head this many at a time inside the forward, recomputed in backward
    # (keye.train.loss): never the full [tokens, vocabulary] logits. null: the full-logits path (the reference).
    loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS
    label_smoothing: float = 0.0  # as F.cross_entropy's; 0 = off
    # Split each packed row over this many consecutive ranks (keye.train.context_parallel: Ulysses all-to-all over
    # the attention heads, vision items split and gathered); the world is world / N data-parallel replicas.
    context_parallel: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.tree, bool):
            self.tree = "on" if self.tree else "off"
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
            raise KeyeConfigError(f"train.loss_chunk_tokens must be >= 1 or null, got {self.loss_chunk_tokens}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise KeyeConfigError(f"train.label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.context_parallel < 1:
            raise KeyeConfigError(f"train.context_parallel must be >= 1, got {self.context_parallel}")
        if self.context_parallel > 1 and self.strategy not in ("ddp", "fsdp2"):
            raise KeyeConfigError(
                f"train.context_parallel={self.context_parallel} needs train.strategy ddp or fsdp2 (got "
                f"{self.strategy!r}): the ranks of a group must have their gradients averaged over the whole world; "
                "DeepSpeed ZeRO is not wired for it (fsdp2 shards like ZeRO-3)")
        if self.context_parallel > 1 and self.tree == "on":
            raise KeyeConfigError("train.context_parallel > 1 cannot run shared-prefix trees (train.tree: on); use "
                                  "train.tree: off")


@dataclass
class SFTConfig:
    """The whole ``keye train sft`` config (YAML sections of the same names)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    lora: LoraSection = field(default_factory=LoraSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)

    def __post_init__(self) -> None:
        if self.train.context_parallel > 1 and not (self.data.packing and self.data.batch_tokens):
            raise KeyeConfigError(f"train.context_parallel={self.train.context_parallel} splits packed rows: it needs "
                                  "data.packing: true with data.batch_tokens (not data.batch_size)")


__all__ = ["DataSection", "SFTConfig", "TrainSection"]
