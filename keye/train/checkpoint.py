"""Resumable checkpoints of a training run, shared by both recipes.

Layout of ``<out_dir>/step_XXXXXXXX`` (written to ``.tmp`` and renamed, with a ``DONE`` marker last, so a crash
mid-save never leaves a checkpoint that looks complete): ``model/`` (the official layout + processor files),
``master.safetensors`` (float32 trainable weights of a bf16 run), ``adapter.safetensors`` (LoRA),
``deepspeed/`` (ZeRO engine state), ``trainer_state.pt`` (optimizer, scheduler, trainer counters, the run
state of the loader or RL loop) and per rank ``rng_rank{r}.pt`` / ``loader_rank{r}.pt``.
:class:`Checkpoints` is the run directory's view: the newest checkpoint to resume from, pruning, the final export.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keye.train import dist as kdist
from keye.train.lora import check_lora_base, lora_base_weights, merged_state_dict


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
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
    torch.save(rng_state(), tmp / f"rng_rank{info.rank}.pt")
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
        base = lora_base_weights(wrapped)
        full = {}
        for key in model.state_dict():
            if "lora_" in key:
                full[key] = adapters[key]
            elif key in base:
                full[key] = base[key]
            else:
                full[key] = official[key]
        check_lora_base(ckpt_dir, merged_state_dict(model, full), official, base)
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
        set_rng_state(torch.load(rng, weights_only=False))
    return blob["trainer"]


class Checkpoints:
    """The checkpoints of one run directory (``step_XXXXXXXX``), as both recipes use them.

    :attr:`latest` is the newest complete checkpoint present when the run started (None: a fresh run).
    """

    def __init__(self, out_dir: Path, keep_last: int, is_main: bool):
        self.out_dir, self.keep_last, self.is_main = Path(out_dir), keep_last, is_main
        found = list_checkpoints(self.out_dir)
        self.latest: Path | None = found[-1] if found else None

    def path(self, step: int) -> Path:
        """Where the checkpoint of optimizer / RL step ``step`` lives."""
        return self.out_dir / f"step_{step:08d}"

    def resumed_state(self) -> dict[str, Any] | None:
        """The trainer state stored in :attr:`latest` (None without a checkpoint); readable before the model is
        restored (the RL recipe chooses its prompt set from it first)."""
        if self.latest is None:
            return None
        return torch.load(self.latest / "trainer_state.pt", weights_only=False)["trainer"]

    def save(self, step: int, write: Any) -> None:
        """``write(path)`` the checkpoint of ``step`` (collective: every rank calls it, e.g.
        :func:`save_checkpoint`), then keep only the newest ``keep_last`` (main rank)."""
        write(self.path(step))
        if self.is_main:
            prune_checkpoints(self.out_dir, self.keep_last)

    def export_final(self, step: int) -> Path:
        """Copy the model of checkpoint ``step`` to ``final/`` (replacing an older export); main rank only."""
        final = self.out_dir / "final"
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(self.path(step) / "model", final)
        return final
