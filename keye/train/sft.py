"""Supervised fine-tuning of Keye-VL (the recipe behind ``keye train sft`` and ``training/sft.py``).

Launch::

    keye train sft --config training/configs/tiny_synth_stage0.yaml               # one CPU (keye-tiny stage 0)
    torchrun --nproc_per_node 8 -m keye train sft --config training/configs/keye_vl_8b_sft.yaml \\
        model.path=Kwai-Keye/Keye-VL-1_5-8B data.manifest=/data/sft.jsonl

What one optimizer step does: each rank takes ``data.micro_batches`` load-balanced micro-batches
(packed rows by default), the number of target tokens of the whole global step is summed over
micro-batches and ranks, and every micro-batch's summed token loss is divided by that number. The
gradient is therefore the mean over all target tokens of the global batch, independent of how tokens
fall into micro-batches or ranks (not a mean of per-micro-batch means).

Precision: with ``model.dtype: bfloat16`` the forward runs in bf16 (autocast) while the trainable weights,
their gradients and AdamW stay in float32 (frozen towers stay bf16); checkpoints keep those float32 weights
(``master.safetensors``) for exact resume, and the official export is bf16. DeepSpeed does the same through
its own bf16 setting.

Multi-answer rows (a manifest row with an ``answers`` list, see :mod:`keye.data.manifest`) are trained
as if each answer were its own row: every answer's tokens count in the token-mean like any sample's.
``train.tree`` chooses how they are computed:
  ``auto`` (default) a micro-batch holding a multi-answer row runs as one shared-prefix forest
           (:mod:`keye.rl.tree`): each such row is its prompt once plus one branch per answer, every other
           row a one-branch tree, so the vision tower and every prompt run once; micro-batches without
           multi-answer rows take the ordinary packed (or padded) path unchanged;
  ``on``   every micro-batch runs as a forest;
  ``off``  multi-answer rows are expanded into one ordinary row per answer inside the micro-batch
           (prompt and media repeated) and take the packed path: the unshared reference.
On the same micro-batches all three give the same loss and gradients (in the tree, each distinct token's
loss is computed once and weighted by the number of answers whose target it is) with the same normaliser;
only the work differs. In ``data.batch_tokens`` mode micro-batches are planned with the token count of the
layout that runs (the tree's for ``auto``/``on``, the expanded rows' for ``off``), so ``off`` may put fewer
rows in a micro-batch; ``data.batch_size`` plans do not depend on it.

Stage presets (``train.stage``), from the Keye reports:
  ``align``    cross-modal alignment: projector only (vision tower and LLM frozen);
  ``full``     multi-task pre-training / SFT: everything trainable;
  ``llm_only`` LLM (and projector) trainable, vision tower frozen;
  ``custom``   use ``train.freeze`` as given.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from keye.errors import KeyeConfigError, KeyeInputError
from keye.tiny import resolve_model_path
from keye.train import dist as kdist
from keye.train.config import dump_config, load_config, to_dict

log = logging.getLogger("keye.train")

MODEL_INPUT_KEYS = (
    "input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw", "pixel_values_videos",
    "video_grid_thw", "second_per_grid_ts", "seq_lens", "position_ids",
)
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------- config
@dataclass
class ModelSection:
    path: str = "keye-tiny"  # checkpoint dir, hub id, or "keye-tiny" (the embedded default)
    processor: str | None = None  # processor dir if not the model dir
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    # preprocessor_config.json fields to change for this run (e.g. a bigger max_pixels); video_defaults is
    # merged key by key. The exported checkpoint carries the result, so it is evaluated as it was trained.
    preprocessor: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataSection:
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
class LoraSection:
    enabled: bool = False
    targets: list[str] = field(default_factory=lambda: ["llm"])  # "llm" and/or "vision"
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0


@dataclass
class TrainSection:
    stage: Literal["align", "full", "llm_only", "custom"] = "full"
    freeze: list[str] = field(default_factory=list)  # with stage=custom: subset of vision, projector, llm
    lr: float = 1e-4
    lr_vision: float | None = None  # per-tower learning rates (default: lr)
    lr_projector: float | None = None
    lr_llm: float | None = None
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    epochs: int = 1
    max_steps: int | None = None
    grad_clip: float = 1.0
    seed: int = 0
    strategy: Literal["none", "ddp", "fsdp2", "zero2", "zero3"] = "none"
    deepspeed_config: str | None = None
    device: str = "auto"
    # Shared-prefix batches for multi-answer rows (see the module docstring). YAML 1.1 reads a bare on/off
    # as a boolean, so true/false are accepted too and normalised to "on"/"off".
    tree: Literal["auto", "on", "off"] | bool = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.tree, bool):
            self.tree = "on" if self.tree else "off"


@dataclass
class CheckpointSection:
    out_dir: str = "runs/sft"
    save_every: int = 0  # optimizer steps between checkpoints (0: only at the end)
    keep_last: int = 2
    export: bool = True  # write <out_dir>/final in the official layout (+ processor files)


@dataclass
class LogSection:
    every: int = 1
    progress: bool = True
    tensorboard: bool = True


@dataclass
class SFTConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    lora: LoraSection = field(default_factory=LoraSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)


# ------------------------------------------------------------------------------------ model setup
TOWERS = {"vision": ("visual.",), "projector": ("mlp_AR.",), "llm": ("model.", "lm_head.")}
STAGE_FREEZE = {"align": ["vision", "llm"], "full": [], "llm_only": ["vision"]}


def tower_of(name: str) -> str:
    """Which tower a parameter belongs to (``vision``, ``projector`` or ``llm``); PEFT prefixes ignored."""
    for prefix in ("base_model.model.",):
        name = name.removeprefix(prefix)
    for tower, prefixes in TOWERS.items():
        if name.startswith(prefixes):
            return tower
    raise KeyeConfigError(f"parameter {name!r} belongs to no known tower")


def apply_freezing(model: torch.nn.Module, cfg: TrainSection) -> list[str]:
    """Set ``requires_grad`` per the stage preset; returns the frozen tower names."""
    frozen = list(cfg.freeze) if cfg.stage == "custom" else STAGE_FREEZE[cfg.stage]
    bad = sorted(set(frozen) - set(TOWERS))
    if bad:
        raise KeyeConfigError(f"train.freeze has unknown tower(s) {bad}; use vision, projector, llm")
    for name, p in model.named_parameters():
        p.requires_grad_(tower_of(name) not in frozen)
    return frozen


LORA_TARGETS = {
    "llm": r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
    "vision": r"visual\.vision_model\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])",
}


def apply_lora(model: torch.nn.Module, cfg: LoraSection) -> torch.nn.Module:
    """Inject LoRA adapters (peft) into the chosen towers; base weights of those towers are frozen,
    other trainable parts (e.g. the projector) stay trainable."""
    from peft import LoraConfig, inject_adapter_in_model

    bad = sorted(set(cfg.targets) - set(LORA_TARGETS))
    if bad:
        raise KeyeConfigError(f"lora.targets has unknown entries {bad}; use llm and/or vision")
    pattern = "|".join(f"(?:{LORA_TARGETS[t]})" for t in cfg.targets)
    lcfg = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=f"^(?:{pattern})$")
    trainable_before = {n for n, p in model.named_parameters() if p.requires_grad}
    model = inject_adapter_in_model(lcfg, model)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
        elif tower_of(name) in cfg.targets:
            p.requires_grad_(False)
        else:
            p.requires_grad_(name in trainable_before)
    return model


def _lora_scaling(model: torch.nn.Module) -> dict[str, float]:
    """alpha / r of every LoRA-wrapped module, by module name."""
    return {n: float(m.scaling.get("default", 1.0)) for n, m in model.named_modules()
            if isinstance(getattr(m, "scaling", None), dict)}


def merged_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The official-layout state dict: LoRA deltas folded into their base weights, adapter tensors dropped."""
    state = state if state is not None else {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    scaling = _lora_scaling(model)
    for key, val in state.items():
        if "lora_" in key:
            continue
        if key.endswith(".base_layer.weight") or key.endswith(".base_layer.bias"):
            mod = key.rsplit(".base_layer.", 1)[0]
            kind = key.rsplit(".", 1)[1]
            new_key = f"{mod}.{kind}"
            if kind == "weight" and f"{mod}.lora_A.default.weight" in state:
                a = state[f"{mod}.lora_A.default.weight"].float()
                b = state[f"{mod}.lora_B.default.weight"].float()
                val = (val.float() + scaling.get(mod, 1.0) * (b @ a)).to(val.dtype)
            out[new_key] = val
        else:
            out[key] = val
    return out


def param_groups(model: torch.nn.Module, cfg: TrainSection) -> list[dict[str, Any]]:
    """AdamW parameter groups: one per tower (own lr), no weight decay on norms and biases."""
    lrs = {"vision": cfg.lr_vision, "projector": cfg.lr_projector, "llm": cfg.lr_llm}
    groups: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim < 2 or "norm" in name
        groups.setdefault((tower_of(name), no_decay), []).append(p)
    out = []
    for (tower, no_decay), params in sorted(groups.items()):
        lr = lrs[tower] if lrs[tower] is not None else cfg.lr
        out.append({"params": params, "lr": lr, "initial_lr": lr, "weight_decay": 0.0 if no_decay else cfg.weight_decay,
                    "name": f"{tower}{'_no_decay' if no_decay else ''}"})
    if not out:
        raise KeyeConfigError("no trainable parameters: check train.stage / train.freeze / lora")
    return out


def lr_lambda(cfg: TrainSection, total_steps: int):
    """Warmup then cosine / linear decay to ``min_lr_ratio`` (or constant)."""

    def fn(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant" or total_steps <= cfg.warmup_steps:
            return 1.0
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        if cfg.schedule == "linear":
            decay = 1.0 - frac
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * frac))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return fn


# -------------------------------------------------------------------------------------- checkpoints
def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints (``step_XXXXXXXX`` with a ``DONE`` marker), oldest first."""
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.glob("step_*") if (p / "DONE").is_file())


def save_checkpoint(
    ckpt_dir: Path,
    wrapped: kdist.Wrapped,
    optimizer,
    scheduler,
    loader,
    trainer_state: dict[str, Any],
    processor,
    info: kdist.DistInfo,
    lora: bool,
    export_dtype: torch.dtype | None = None,
) -> None:
    """Model in the official layout (+ adapter weights with LoRA), optimizer, scheduler, RNG and loader
    state (per rank) and trainer counters. Written to a temp dir and renamed, with a DONE marker,
    so a crash mid-save never leaves a checkpoint that looks complete.

    With ``export_dtype`` (bf16 training with float32 master weights), the official export holds every
    weight in that dtype and ``master.safetensors`` the exact float32 trainable weights (LoRA adapters:
    ``adapter.safetensors``), which resume restores."""
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    kdist.barrier()
    state = kdist.full_state_dict(wrapped)
    if wrapped.strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optim_state = get_optimizer_state_dict(wrapped.model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif wrapped.is_deepspeed:
        wrapped.engine.save_checkpoint(str(tmp / "deepspeed"), tag="state")
        optim_state = None
    else:
        optim_state = optimizer.state_dict()
    if info.is_main:
        model = wrapped.model
        masters = {k: v for k, v in state.items() if export_dtype is not None and v.is_floating_point()
                   and v.dtype != export_dtype and "lora_" not in k}
        export = {k: v.to(export_dtype) if k in masters else v for k, v in state.items()}
        official = merged_state_dict(model, export) if lora else export
        from keye.model.weights import save_state_dict

        save_state_dict(official, tmp / "model")
        model.config.torch_dtype = str(next(iter(official.values())).dtype).removeprefix("torch.")
        model.config.to_json_file(tmp / "model" / "config.json")
        if processor is not None:
            processor.save_pretrained(tmp / "model")
        from safetensors.torch import save_file

        if lora:
            save_file({k: v.contiguous() for k, v in state.items() if "lora_" in k}, str(tmp / "adapter.safetensors"))
        if masters:
            save_file({k: v.contiguous() for k, v in masters.items()}, str(tmp / "master.safetensors"))
        torch.save({"optimizer": optim_state, "scheduler": scheduler.state_dict(), "trainer": trainer_state,
                    "loader": loader.state_dict()}, tmp / "trainer_state.pt")
    kdist.barrier()  # the main rank has written tmp/ by now
    torch.save(_rng_state(), tmp / f"rng_rank{info.rank}.pt")
    # The position is common to all ranks, but the counters (samples loaded, bad samples: the bad-fraction
    # check) are each rank's own.
    torch.save(loader.state_dict(), tmp / f"loader_rank{info.rank}.pt")
    kdist.barrier()
    if info.is_main:
        (tmp / "DONE").write_text(json.dumps({"step": trainer_state["step"], "time": time.time()}))
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        tmp.rename(ckpt_dir)
    kdist.barrier()


def prune_checkpoints(out_dir: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints."""
    if keep_last <= 0:
        return
    for old in list_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _lora_base_weights(wrapped: kdist.Wrapped) -> dict[str, torch.Tensor]:
    """The current base weights (and biases) of the LoRA-wrapped modules, full and on CPU on every rank."""
    model = wrapped.model
    out = {}
    for name, p in model.named_parameters():
        if ".base_layer." not in name:
            continue
        if wrapped.strategy == "zero3" and hasattr(p, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                out[name] = p.detach().cpu().clone()
        elif hasattr(p, "full_tensor"):  # FSDP2 shard
            out[name] = p.detach().full_tensor().cpu()
        else:
            out[name] = p.detach().cpu().clone()
    return out


def _check_lora_base(ckpt_dir: Path, remerged: dict[str, torch.Tensor], official: dict[str, torch.Tensor],
                     base: dict[str, torch.Tensor]) -> None:
    """Raise unless folding the checkpoint's adapters into ``base`` reproduces the checkpoint's export (up to
    the model dtype's rounding, which another machine's matmul may flip): the base model is the one it was
    trained from."""
    for key in base:
        merged_key = key.replace(".base_layer.", ".")
        got, want = remerged[merged_key].float(), official[merged_key].float()
        eps = torch.finfo(official[merged_key].dtype).eps
        if not torch.allclose(got, want, rtol=2 * eps, atol=1e-3 * eps):
            raise KeyeConfigError(
                f"{ckpt_dir}: the LoRA checkpoint was not trained from this model.path ({merged_key} differs "
                f"by up to {float((got - want).abs().max()):.3g}); resume with the base model it was trained "
                f"from")


def load_checkpoint(ckpt_dir: Path, wrapped, optimizer, scheduler, loader, info, lora: bool) -> dict[str, Any]:
    """Restore everything :func:`save_checkpoint` wrote; returns the trainer counters."""
    from keye.model.weights import iter_tensors

    model = wrapped.model
    # Under DeepSpeed the engine's own checkpoint restores the weights (below); the export is then read only
    # to check a LoRA base, not loaded on every rank for nothing.
    need_export = lora or not wrapped.is_deepspeed
    official = ({name: handle.get_tensor(name) for name, _, handle in iter_tensors(ckpt_dir / "model")}
                if need_export else {})
    if need_export and (ckpt_dir / "master.safetensors").is_file():
        from safetensors.torch import load_file

        official.update(load_file(str(ckpt_dir / "master.safetensors")))  # exact float32 trainable weights
    if lora:
        from safetensors.torch import load_file

        adapters = load_file(str(ckpt_dir / "adapter.safetensors"))
        # The export folds each adapter into its base weight in the model dtype, a rounding that
        # merged - delta cannot undo (in bf16 the rebuilt base is off by up to an ulp, and training no
        # longer resumes exactly). The base weights of LoRA-wrapped modules are frozen for the whole run,
        # so the model as just built from model.path holds them exactly: keep them, once checked to be the
        # weights the checkpoint was trained on (folding the saved adapters into them gives the export).
        base = _lora_base_weights(wrapped)
        full = {}
        for key in model.state_dict():
            if "lora_" in key:
                full[key] = adapters[key]
            elif key in base:
                full[key] = base[key]
            else:
                full[key] = official[key]
        _check_lora_base(ckpt_dir, merged_state_dict(model, full), official, base)
        official = full
    blob = torch.load(ckpt_dir / "trainer_state.pt", weights_only=False)
    if wrapped.is_deepspeed:
        # DeepSpeed's own checkpoint restores the weights from its (fp32 master) state; under ZeRO-3 the
        # module's parameters are partitioned, so a full-tensor copy would not even fit.
        wrapped.engine.load_checkpoint(str(ckpt_dir / "deepspeed"), tag="state")
    elif wrapped.strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(model, official, options=StateDictOptions(full_state_dict=True))
        set_optimizer_state_dict(model, optimizer, blob["optimizer"], options=StateDictOptions(full_state_dict=True))
    else:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(official[k])
        optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    own_loader = ckpt_dir / f"loader_rank{info.rank}.pt"
    # Checkpoints from before per-rank loader files hold rank 0's state only.
    loader_state = torch.load(own_loader, weights_only=False) if own_loader.is_file() else blob["loader"]
    loader.load_state_dict(loader_state)
    rng = ckpt_dir / f"rng_rank{info.rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    return blob["trainer"]


# --------------------------------------------------------------------------------------- metrics
class MetricsWriter:
    """JSONL metrics (always) and TensorBoard scalars (when installed and enabled); rank 0 only."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.file = None
        self.tb = None
        if not enabled:
            return
        self.file = open(out_dir / "metrics.jsonl", "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except Exception:  # noqa: BLE001 - tensorboard is optional
                self.tb = None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


# ------------------------------------------------------------------------ multi-answer rows as trees
@contextmanager
def _media_once(processor: Any):
    """While active, ``processor`` decodes each image / video item once and reuses it.

    Every answer of a multi-answer row is rendered by the processor as an ordinary conversation, so its
    tokens are exactly those of the expanded row; the conversations share the prompt's media items, in the
    same order, and decoding is deterministic, so the per-item results are memoised by (item number, item)
    for the duration of one row. A processor without these per-item steps simply decodes once per answer:
    slower, equally correct.
    """
    names = ("_process_image", "_process_video")
    own = getattr(processor, "__dict__", None)
    if own is None or any(n in own for n in names) or not all(callable(getattr(processor, n, None)) for n in names):
        yield
        return
    for name in names:
        method, cache = getattr(processor, name), {}

        def memo(content, row, index, _method=method, _cache=cache):
            key = (index, repr(sorted(content.items())))
            if key not in _cache:
                _cache[key] = _method(content, row, index)
            return _cache[key]

        setattr(processor, name, memo)  # instance attribute shadows the method; removed below
    try:
        yield
    finally:
        for name in names:
            delattr(processor, name)


class TreeSampleProcessor:
    """The processor the SFT loader uses when a manifest has multi-answer rows (or ``train.tree=on``).

    Called like :class:`~keye.processing.processor.KeyeProcessor` with one conversation per call (as the
    loader does). Every row becomes one sample carrying its prefix tree under ``"tree"`` (a one-item
    list, so the collate functions join them into a per-sample list):

    * an ordinary row: the processor's output unchanged plus its one-branch tree (so the micro-batch can
      still take the packed path as is);
    * a multi-answer row: each answer is processed as its own conversation (media decoded once), and the
      B token sequences with their label masks go to :func:`keye.rl.tree.build_tree`: ``input_ids`` is
      the serialised tree [1, N] (prompt once), ``labels`` are all -100 (the targets live in the tree, and
      only :func:`tree_loss` / :func:`unshared_batch` read them), the pixel tensors are the prompt's, once.

    Tree vision inputs hold the grids (and preview ``second_per_grid_ts``) but no pixels: the pixels stay in
    the sample's top-level tensors, which the collate functions concatenate in sample order.

    Args:
        processor: the wrapped :class:`~keye.processing.processor.KeyeProcessor` (other attributes, e.g.
            ``tokenizer``, are delegated to it).
        config: the model's :class:`~keye.KeyeVLConfig` (token ids, merge size, variant: tree positions).
    """

    def __init__(self, processor: Any, config: Any):
        self.processor = processor
        self.config = config

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("processor", "config"):  # unpickling: no recursion
            raise AttributeError(name)
        return getattr(self.processor, name)

    def __call__(self, messages: list, return_tensors: str | None = "pt", for_training: bool = True,
                 **kwargs: Any) -> dict[str, Any]:
        """One sample dict for the collate functions (see the class docstring); ``kwargs`` go to the processor."""
        from keye.data.manifest import expand_answers
        from keye.rl.tree import VisionInputs, build_tree

        convs = messages if messages and isinstance(messages[0], list) else [messages]
        if len(convs) != 1:
            raise KeyeInputError(f"TreeSampleProcessor takes one conversation per call, got {len(convs)}")
        branches = expand_answers(convs[0])
        with _media_once(self.processor):
            outs = [dict(self.processor([c], return_tensors=return_tensors, for_training=for_training, **kwargs))
                    for c in branches]
        first = outs[0]
        for b, o in enumerate(outs[1:], start=1):
            for key in ("image_grid_thw", "video_grid_thw"):
                if (first.get(key) is None) != (o.get(key) is None) or (
                        first.get(key) is not None and not torch.equal(first[key], o[key])):
                    raise KeyeInputError(f"answer {b} got other {key} than answer 0 for the same prompt")
        grids = VisionInputs(image_grid_thw=first.get("image_grid_thw"), video_grid_thw=first.get("video_grid_thw"),
                             second_per_grid_ts=first.get("second_per_grid_ts"))
        tree = build_tree(self.config, [o["input_ids"][0] for o in outs],
                          [o["labels"][0] != IGNORE_INDEX for o in outs], grids)
        out = {k: v for k, v in first.items() if k in VISION_KEYS}
        if len(outs) == 1:
            out.update(input_ids=first["input_ids"], labels=first["labels"])
        else:
            out.update(input_ids=tree.input_ids, labels=torch.full_like(tree.input_ids, IGNORE_INDEX))
        out["attention_mask"] = torch.ones_like(out["input_ids"])
        out["tree"] = [tree]
        return out


class TreeCostModel:
    """Cost model for the SFT loader with multi-answer rows: :func:`keye.data.manifest.estimate_cost` over
    ``base`` (a :class:`~keye.data.cost.CostModel`), the tree's cost (``shared=True``) or the expanded rows'."""

    def __init__(self, base: Any, shared: bool):
        self.base, self.shared = base, shared

    def estimate(self, sample: Any) -> Any:
        from keye.data.manifest import estimate_cost

        return estimate_cost(self.base, sample, shared=self.shared)


def _trees(mb: dict[str, Any]) -> list[Any] | None:
    """The per-sample trees of a micro-batch, or None (plain loader, or every sample failed to load)."""
    trees = mb.get("tree")
    return trees if trees and int(mb.get("num_samples", 0)) > 0 else None


def has_multi_answer(mb: dict[str, Any]) -> bool:
    """Whether the micro-batch holds a row with two or more answers."""
    return any(t.num_branches > 1 for t in _trees(mb) or [])


def use_tree_path(mb: dict[str, Any], mode: str) -> bool:
    """Whether ``mb`` runs as a shared-prefix forest under ``train.tree = mode``."""
    if _trees(mb) is None or mode == "off":
        return False
    return mode == "on" or has_multi_answer(mb)


def target_tokens(mb: dict[str, Any]) -> int:
    """Loss tokens of a micro-batch counted as in the unshared computation (every answer's own tokens)."""
    trees = _trees(mb)
    if trees is None:
        return int(mb["num_label_tokens"])
    return sum(int(t.loss_mask.sum()) for t in trees)


def _split_vision(mb: dict[str, Any], trees: list[Any]) -> list[dict[str, torch.Tensor]]:
    """Each sample's own slice of the micro-batch's vision tensors (samples own consecutive grid rows; a
    grid row [t, h, w] owns t*h*w pixel rows; preview videos have one ``second_per_grid_ts`` per row)."""
    at = dict.fromkeys(VISION_KEYS, 0)
    out = []
    for t in trees:
        own: dict[str, torch.Tensor] = {}
        for grid_key, pix_key in (("image_grid_thw", "pixel_values"), ("video_grid_thw", "pixel_values_videos")):
            grid = getattr(t.vision, grid_key)
            if grid is None or grid.shape[0] == 0:
                continue
            rows, pix = grid.shape[0], int(grid.prod(-1).sum())
            own[grid_key] = mb[grid_key][at[grid_key] : at[grid_key] + rows]
            own[pix_key] = mb[pix_key][at[pix_key] : at[pix_key] + pix]
            at[grid_key] += rows
            at[pix_key] += pix
            if grid_key == "video_grid_thw" and mb.get("second_per_grid_ts") is not None:
                own["second_per_grid_ts"] = mb["second_per_grid_ts"][at["second_per_grid_ts"] : at["second_per_grid_ts"] + rows]
                at["second_per_grid_ts"] += rows
        out.append(own)
    return out


def unshared_batch(mb: dict[str, Any], pad_token_id: int) -> dict[str, Any]:
    """The micro-batch with every multi-answer row expanded into one ordinary row per answer.

    Each answer's row is its tree path (prompt + answer tokens) with labels on its own loss tokens and its
    own copy of the prompt's pixels, joined by the collate function the loader used (packed row or padded
    batch): exactly what the processor and collate produce for a manifest with one row per answer. A
    micro-batch without multi-answer rows is returned as is.
    """
    from keye.data.collate import collate_packed, collate_padded

    if not has_multi_answer(mb):
        return mb
    trees = _trees(mb)
    outs = []
    for tree, vision in zip(trees, _split_vision(mb, trees)):
        ids = tree.input_ids[0]
        for b, path in enumerate(tree.paths):
            seq = ids[path]
            is_target = torch.isin(path, tree.target_index[b][tree.loss_mask[b]])
            outs.append({"input_ids": seq[None], "labels": torch.where(is_target, seq, IGNORE_INDEX)[None], **vision})
    batch = collate_packed(outs) if "cu_seqlens" in mb else collate_padded(outs, pad_token_id)
    batch["num_samples"] = mb["num_samples"]  # rows of the manifest, as in the shared layout
    return batch


def tree_loss(module: Any, mb: dict[str, Any], device: torch.device) -> torch.Tensor:
    """Summed next-token cross-entropy of every branch's target tokens, from ONE forest forward.

    The micro-batch's per-sample trees are joined by :func:`keye.rl.tree.concat_trees` (no attention
    across trees) and run with :class:`keye.rl.tree_attention.TreeAttention` and per-path positions, so
    each distinct tree token's logits equal those of its unshared sequence. Each distinct target token's
    loss is computed once and weighted by the number of branches (answers) whose target it is, so the sum
    (and its gradient) equals the unshared batch's summed token loss; divide by :func:`target_tokens`
    summed over the global batch for the token mean (docs/training.md §4: weight n_t / Σ_b N_b).

    Args:
        module: what to call for the forward (the model, or its DDP / FSDP / DeepSpeed wrapper).
        mb: a loader micro-batch with ``tree`` entries (see :class:`TreeSampleProcessor`).
    Returns:
        A float32 scalar with gradient.
    """
    from keye.rl.tree import VisionInputs, concat_trees
    from keye.rl.tree_attention import TreeAttention

    forest = concat_trees(_trees(mb))
    forest.vision = VisionInputs(**{k: mb.get(k) for k in VISION_KEYS})  # pixels, in the same sample order
    forest = forest.to(device)
    # Full logits (logits_to_keep=0) as the packed path computes them: the LM head stays inside the
    # wrapped forward, which sharded and data-parallel wrappers require.
    out = module(forest.input_ids, position_ids=forest.position_ids, attention_override=TreeAttention(forest),
                 **forest.vision.as_kwargs())
    targets, weight = torch.unique(forest.target_index[forest.loss_mask], return_counts=True)
    logits = out.logits[0].index_select(0, forest.parent[targets]).float()
    token_loss = F.cross_entropy(logits, forest.input_ids[0, targets], reduction="none")
    return (token_loss * weight.to(token_loss.dtype)).sum()


# ------------------------------------------------------------------------------------------ main
def model_inputs(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The tensors of a loader micro-batch that the model's forward takes, moved to ``device``."""
    out = {}
    for k in MODEL_INPUT_KEYS:
        v = batch.get(k)
        if v is None:
            continue
        if k == "seq_lens" and not batch.get("packed", "cu_seqlens" in batch):
            continue
        out[k] = v.to(device, non_blocking=True) if torch.is_tensor(v) else v
    if "seq_lens" in out and out["input_ids"].shape[0] != 1:
        del out["seq_lens"]
    return out


def _infinite(loader):
    while True:
        yield from loader


def deepspeed_config(cfg: SFTConfig, world_size: int, device_type: str,
                     model_dtype: torch.dtype) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO run: ``train.deepspeed_config`` (default
    ``training/deepspeed/<strategy>.json``) with batch sizes, accumulation (``data.micro_batches``) and
    clipping (``train.grad_clip``) from the recipe.

    ``"enabled": "auto"`` in the ``bf16`` / ``fp16`` sections (the HF-Trainer convention the shipped configs
    use) is resolved from ``model_dtype``: DeepSpeed itself reads the string as *disabled*, which for a bf16
    model means no bf16 engine and no float32 master weights. On CPU the ``bf16`` section is dropped.

    Raises:
        KeyeConfigError: the file is missing or not JSON (the message names it).
    """
    ds_path = cfg.train.deepspeed_config or f"training/deepspeed/{cfg.train.strategy}.json"
    try:
        ds_cfg = json.loads(Path(ds_path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise KeyeConfigError(f"{ds_path}: cannot read the DeepSpeed config ({err})") from None
    ds_cfg["train_micro_batch_size_per_gpu"] = 1
    ds_cfg["gradient_accumulation_steps"] = cfg.data.micro_batches
    ds_cfg["train_batch_size"] = cfg.data.micro_batches * world_size
    ds_cfg["gradient_clipping"] = cfg.train.grad_clip
    for section, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if isinstance(ds_cfg.get(section), dict) and ds_cfg[section].get("enabled") == "auto":
            ds_cfg[section]["enabled"] = model_dtype == dtype
    if device_type != "cuda":
        ds_cfg.pop("bf16", None)
    return ds_cfg


def train(cfg: SFTConfig, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run SFT as configured; returns the run summary (also written to ``summary.json``).

    ``stop_after`` stops after that many optimizer steps *of this invocation* without the final
    save (used to simulate a crash in resume tests).
    """
    from keye.data.cost import CostModel
    from keye.data.loader import build_dataloader
    from keye.data.manifest import read_manifest
    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor

    info = kdist.init_distributed(cfg.train.device)
    out_dir = Path(cfg.checkpoint.out_dir)
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out_dir / "config.yaml")
    kdist.barrier()
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)

    model_path = resolve_model_path(cfg.model.path)
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if info.device.type == "cuda" else "float32"
    model = KeyeVL.from_pretrained(model_path, torch_dtype=dtype, attn_implementation=cfg.model.attn_implementation)
    processor = KeyeProcessor.from_pretrained(resolve_model_path(cfg.model.processor or cfg.model.path))
    processor.override_preprocessor(cfg.model.preprocessor, where="model.preprocessor")
    model.train()
    # Data-parallel/sharded ranks must run identical modules even when a micro-batch has no pixels.
    model.always_run_vision = info.distributed
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    frozen = apply_freezing(model, cfg.train)
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora)
    # bf16 training: compute in bf16 (autocast) but keep the trainable weights in float32. AdamW's step is
    # ~lr per element, far below bf16's resolution of a weight at SFT learning rates (1e-5 vs ~1e-4 for a
    # weight of 0.02), so pure bf16 weights would silently drop most updates. Frozen weights stay in bf16;
    # DeepSpeed keeps its own float32 master weights (its bf16 setting).
    export_dtype = next(model.parameters()).dtype
    amp = export_dtype == torch.bfloat16 and cfg.train.strategy not in ("zero2", "zero3")
    if amp:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    else:
        export_dtype = None

    manifest = read_manifest(cfg.data.manifest, cfg.data.root)
    tree_mode = cfg.train.tree
    loader_processor, cost_model = processor, None
    if tree_mode == "on" or any(s.answers is not None for s in manifest.samples):
        # Rows carry their prefix trees; micro-batches are planned with the cost of the layout that runs.
        loader_processor = TreeSampleProcessor(processor, model.config)
        cost_model = TreeCostModel(CostModel.from_processor(processor, mode=cfg.data.processor_kwargs.get("mode")),
                                   shared=tree_mode != "off")
    loader = build_dataloader(
        manifest, loader_processor, batch_tokens=cfg.data.batch_tokens,
        batch_size=cfg.data.batch_size, micro_batches=cfg.data.micro_batches, world_size=info.world_size,
        rank=info.rank, seed=cfg.train.seed, num_workers=cfg.data.num_workers, packing=cfg.data.packing,
        max_bad_fraction=cfg.data.max_bad_fraction, processor_kwargs=cfg.data.processor_kwargs,
        bad_log=(out_dir / "bad_samples.jsonl") if info.is_main else None, cost_model=cost_model,
    )
    steps_per_epoch = max(1, len(loader) // cfg.data.micro_batches)
    total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch

    def make_optimizer():
        return torch.optim.AdamW(param_groups(model, cfg.train), lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                 weight_decay=cfg.train.weight_decay)

    ds_cfg = None
    if cfg.train.strategy in ("zero2", "zero3"):
        ds_cfg = deepspeed_config(cfg, info.world_size, info.device.type, next(model.parameters()).dtype)
    if cfg.train.strategy == "fsdp2":
        wrapped = kdist.wrap_model(model, cfg.train.strategy, info)
        optimizer = make_optimizer()
    else:
        model.to(info.device)
        optimizer = make_optimizer()
        wrapped = kdist.wrap_model(model, cfg.train.strategy, info, optimizer=optimizer, deepspeed_config=ds_cfg)
    # The LR schedule drives the torch optimizer's param groups (DeepSpeed's ZeRO optimizer shares them).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train, total_steps))

    state = {"step": 0, "samples": 0, "tokens": 0, "losses": []}
    ckpts = list_checkpoints(out_dir)
    if ckpts:
        state = load_checkpoint(ckpts[-1], wrapped, optimizer, scheduler, loader, info, cfg.lora.enabled)
        if info.is_main:
            log.info("resumed from %s at step %d", ckpts[-1], state["step"])

    metrics = MetricsWriter(out_dir, info.is_main, cfg.log.tensorboard)
    bar = None
    if info.is_main and cfg.log.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=state["step"], desc="sft", dynamic_ncols=True)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    t_start = time.time()
    batches = _infinite(loader)
    steps_this_run = 0
    tree_micro_batches = 0
    use_ds = wrapped.is_deepspeed
    while state["step"] < total_steps:
        t0 = time.time()
        mbs = [next(batches) for _ in range(cfg.data.micro_batches)]
        # Every answer of a multi-answer row counts its own tokens, whichever layout computes them.
        local_targets = sum(target_tokens(mb) for mb in mbs)
        global_targets = kdist.all_reduce_sum(local_targets, info.device)
        # DDP, FSDP and ZeRO average gradients over ranks; undo that so the result is
        # sum(token losses) / global target tokens (Wrapped.backward keeps DeepSpeed from also dividing by
        # its accumulation steps).
        scale = info.world_size / max(global_targets, 1.0)
        loss_sum = 0.0
        local_tokens = 0
        ds_steps_before = wrapped.engine.global_steps if use_ds else 0
        for i, mb in enumerate(mbs):
            last = i == len(mbs) - 1
            with wrapped.no_sync(last):
                with torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=amp):
                    if use_tree_path(mb, tree_mode):
                        mb_loss = tree_loss(wrapped.module, mb, info.device)
                        tree_micro_batches += 1
                        local_tokens += int(mb["num_tokens"])
                    else:
                        batch = unshared_batch(mb, loader.pad_token_id) if _trees(mb) else mb
                        inputs = model_inputs(batch, info.device)
                        mb_loss = wrapped.module(**inputs, loss_reduction="sum").loss
                        local_tokens += int(batch["num_tokens"])
                wrapped.backward(mb_loss * scale)
                if use_ds:
                    # DeepSpeed counts micro-batches itself (gradient_accumulation_steps = micro_batches): its
                    # step() must run after every backward, and applies the update (reduction, clipping,
                    # optimizer) only at its own accumulation boundary, the last micro-batch.
                    wrapped.engine.step()
            loss_sum += float(mb_loss.detach())
        if use_ds:
            if wrapped.engine.global_steps != ds_steps_before + 1:
                taken = wrapped.engine.global_steps - ds_steps_before
                raise RuntimeError(f"DeepSpeed took {taken} optimizer steps in training step "
                                   f"{state['step'] + 1}, expected 1: its accumulation boundary is out of "
                                   f"step with data.micro_batches={cfg.data.micro_batches}")
            grad_norm = float(wrapped.engine.get_global_grad_norm() or 0.0)
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], cfg.train.grad_clip))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss = kdist.all_reduce_sum(loss_sum, info.device) / max(global_targets, 1.0)
        tokens = kdist.all_reduce_sum(local_tokens, info.device)  # tokens the LLM ran (a tree's once)
        samples = kdist.all_reduce_sum(sum(int(mb["num_samples"]) for mb in mbs), info.device)
        state["step"] += 1
        state["samples"] += int(samples)
        state["tokens"] += int(tokens)
        state["losses"].append(loss)
        steps_this_run += 1
        dt = time.time() - t0
        row = {"loss": loss, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm, "tokens_per_s": tokens / dt,
               "target_tokens": global_targets, "samples": state["samples"], "epoch": mbs[-1].get("epoch", 0)}
        if state["step"] % cfg.log.every == 0:
            metrics.write(state["step"], row)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens / dt:.0f}")
            bar.update(1)
        if stop_after is not None and steps_this_run >= stop_after and state["step"] < total_steps:
            if cfg.checkpoint.save_every and state["step"] % cfg.checkpoint.save_every == 0:
                save_checkpoint(out_dir / f"step_{state['step']:08d}", wrapped, optimizer, scheduler, loader, state,
                                processor, info, cfg.lora.enabled, export_dtype)
            break
        if cfg.checkpoint.save_every and state["step"] % cfg.checkpoint.save_every == 0 and state["step"] < total_steps:
            save_checkpoint(out_dir / f"step_{state['step']:08d}", wrapped, optimizer, scheduler, loader, state,
                            processor, info, cfg.lora.enabled, export_dtype)
            if info.is_main:
                prune_checkpoints(out_dir, cfg.checkpoint.keep_last)
    if bar is not None:
        bar.close()
    finished = state["step"] >= total_steps
    if finished:
        save_checkpoint(out_dir / f"step_{state['step']:08d}", wrapped, optimizer, scheduler, loader, state,
                        processor, info, cfg.lora.enabled, export_dtype)
        if info.is_main:
            prune_checkpoints(out_dir, cfg.checkpoint.keep_last)
            if cfg.checkpoint.export:
                final = out_dir / "final"
                shutil.rmtree(final, ignore_errors=True)
                shutil.copytree(out_dir / f"step_{state['step']:08d}" / "model", final)
    data_summary = loader.summary()
    tree_micro_batches = int(kdist.all_reduce_sum(tree_micro_batches, info.device))  # all ranks
    summary = {
        "finished": finished,
        "steps": state["step"],
        "samples": state["samples"],
        "tokens": state["tokens"],
        "skipped_samples": data_summary.get("samples_bad", 0),
        "final_loss": state["losses"][-1] if state["losses"] else None,
        "first_loss": state["losses"][0] if state["losses"] else None,
        "losses": state["losses"],
        "seconds": time.time() - t_start,
        "trainable_parameters": n_trainable,
        "frozen_towers": frozen,
        "world_size": info.world_size,
        "strategy": wrapped.strategy,
        "tree": {"mode": tree_mode, "tree_micro_batches": tree_micro_batches},
        "data": data_summary,
    }
    if info.is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        metrics.close()
        if cfg.log.progress:
            print(format_summary(summary, out_dir))
    kdist.barrier()
    return summary


def format_summary(s: dict[str, Any], out_dir: Path) -> str:
    """A human-readable end-of-run report."""
    loss = "n/a" if s["final_loss"] is None else f"{s['final_loss']:.4f} (first {s['first_loss']:.4f})"
    return (
        f"SFT {'finished' if s['finished'] else 'stopped'}: {s['steps']} steps, {s['samples']} samples, "
        f"{s['tokens']} tokens, {s['skipped_samples']} skipped samples, final loss {loss}, "
        f"{s['seconds']:.1f}s on {s['world_size']} process(es) [{s['strategy']}]; outputs in {out_dir}"
    )


def main(argv: list[str] | None = None) -> int:
    """``keye train sft --config CFG.yaml [key=value ...]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="keye train sft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML recipe config")
    ap.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. train.lr=1e-4")
    args = ap.parse_args(argv)
    return run_from_args(args.config, args.overrides)


def run_from_args(config: str | None, overrides: list[str]) -> int:
    logging.basicConfig(level=os.environ.get("KEYE_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(SFTConfig, config, overrides)
    try:
        train(cfg)
    finally:
        kdist.cleanup()
    return 0


__all__ = ["SFTConfig", "TreeCostModel", "TreeSampleProcessor", "deepspeed_config", "main", "target_tokens",
           "to_dict", "train", "tree_loss", "unshared_batch", "use_tree_path"]
