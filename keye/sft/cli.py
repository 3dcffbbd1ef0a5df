"""``keye sft plan``: the per-GPU memory of an SFT step for a model and a setting (see :mod:`keye.sft.plan` and
docs/training.md "Planning memory"). Several values of ``--seq-len``, ``--strategy`` and ``--context-parallel``
(comma-separated) plan every combination and print one summary row each."""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

from keye.errors import KeyeConfigError

DEFAULT_MODEL = "Kwai-Keye/Keye-VL-1_5-8B"


def add_commands(subparsers: Any) -> None:
    """Register ``keye sft plan`` on the ``keye`` parser."""
    sft = subparsers.add_parser("sft", help="SFT tools (memory plan)")
    sub = sft.add_subparsers(dest="sft_command", metavar="COMMAND", required=True)
    p = sub.add_parser("plan", help="per-GPU memory of an SFT step, item by item, and whether it fits")
    p.add_argument("--config", help="SFT recipe YAML to take the settings from (e.g. training/configs/keye_vl_8b_sft.yaml)")
    p.add_argument("overrides", nargs="*", help="dot-list overrides of the recipe, e.g. data.batch_tokens=32768")
    p.add_argument("--model", help=f"checkpoint dir or hub id (default: the recipe's model.path, else {DEFAULT_MODEL})")
    p.add_argument("--model-config", help="config.json (or its directory) to plan for instead of --model")
    p.add_argument("--seq-len", help="tokens per packed row, comma-separated for several (default: data.batch_tokens)")
    p.add_argument("--micro-batch", type=int, default=1, help="packed rows per micro-batch on one data-parallel rank")
    p.add_argument("--strategy", help="ddp, fsdp2, zero2 or zero3, comma-separated for several (default: train.strategy)")
    p.add_argument("--context-parallel", help="ranks sharing one row (Ulysses), comma-separated for several (default: 1)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="activation checkpointing per layer (default: model.gradient_checkpointing, else on)")
    p.add_argument("--lora", action="store_true", default=None, help="LoRA adapters (default: lora.enabled)")
    p.add_argument("--lora-r", type=int, help="LoRA rank (default: lora.r, 16)")
    p.add_argument("--lora-targets", help="towers with adapters, comma-separated: llm, vision (default: lora.targets)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the job (data-parallel x context-parallel)")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="memory of one GPU in GiB")
    p.add_argument("--vision-fraction", type=float, default=0.5, help="share of each row that is visual tokens")
    p.add_argument("--vision-tokens", type=int, help="visual tokens per row (overrides --vision-fraction)")
    p.add_argument("--answer-tokens", type=int, help="target tokens per row (default: every text token)")
    p.add_argument("--loss-chunk-tokens", type=int, help="target rows per loss-head chunk, 0 for one chunk "
                   "(default: train.loss_chunk_tokens, 512)")
    p.add_argument("--dtype", help="model dtype (default: model.dtype; auto plans bfloat16)")
    p.add_argument("--overhead-gb", type=float, default=1.0, help="CUDA context / NCCL / allocator slack per GPU, GiB")
    p.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    p.set_defaults(func=_plan)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KeyeConfigError(f"{flag} must be integers separated by commas, got {text!r}") from None
    if not values:
        raise KeyeConfigError(f"{flag} is empty")
    return values


def settings_of(args) -> tuple[Any, str, dict[str, Any], list[tuple[int, str, int]]]:
    """``(model config, model name, fixed plan_sft_memory kwargs, [(seq_len, strategy, cp), ...])`` of parsed
    ``keye sft plan`` arguments (the recipe's values where a flag is not given)."""
    from keye.sft.config import SFTConfig
    from keye.sft.plan import LoraPlan
    from keye.train.config import load_config
    from keye.train.optim import STAGE_FREEZE
    from keye.train.plan import resolve_model_config

    cfg = load_config(SFTConfig, args.config, args.overrides) if args.config else SFTConfig()
    if args.overrides and not args.config:
        raise KeyeConfigError(f"overrides {args.overrides} need --config (a recipe to override)")
    model_path = args.model or (cfg.model.path if args.config else DEFAULT_MODEL)
    model_config, name = resolve_model_config(model_path, args.model_config)
    seq_lens = _ints(args.seq_len, "--seq-len") if args.seq_len else [cfg.data.batch_tokens or 4096]
    strategies = (args.strategy or (cfg.train.strategy if args.config else "fsdp2")).split(",")
    strategies = ["ddp" if s in ("none", "") else s for s in strategies]
    cps = _ints(args.context_parallel, "--context-parallel") if args.context_parallel else [
        int(getattr(cfg.train, "context_parallel", 1) or 1)]
    ckpt = args.gradient_checkpointing
    if ckpt is None:
        ckpt = cfg.model.gradient_checkpointing if args.config else True
    lora_on = args.lora if args.lora is not None else cfg.lora.enabled
    lora = None
    if lora_on:
        targets = tuple(args.lora_targets.split(",")) if args.lora_targets else tuple(cfg.lora.targets)
        lora = LoraPlan(r=args.lora_r or cfg.lora.r, targets=targets)
    chunk = args.loss_chunk_tokens if args.loss_chunk_tokens is not None else cfg.train.loss_chunk_tokens
    dtype = args.dtype or (cfg.model.dtype if args.config else "bfloat16")
    frozen = list(cfg.train.freeze) if cfg.train.stage == "custom" else STAGE_FREEZE[cfg.train.stage]
    if not 0 <= args.vision_fraction < 1:
        raise KeyeConfigError(f"--vision-fraction must be in [0, 1), got {args.vision_fraction}")
    fixed = dict(gpus=args.gpus, dtype="bfloat16" if dtype == "auto" else dtype, micro_batch=args.micro_batch,
                 gradient_checkpointing=bool(ckpt), lora=lora, frozen=frozen,
                 loss_chunk_tokens=chunk or None, gpu_memory_gb=args.gpu_memory, overhead_gb=args.overhead_gb,
                 model_name=name)
    return model_config, name, fixed, list(itertools.product(seq_lens, strategies, cps))


def build_plans(args) -> list[Any]:
    """The :class:`~keye.sft.plan.SFTMemoryPlan` of every combination of parsed ``keye sft plan`` arguments."""
    from keye.sft.plan import plan_sft_memory
    from keye.train.plan import count_parameters

    model_config, _, fixed, combos = settings_of(args)
    fixed["param_counts"] = count_parameters(model_config, fixed["frozen"])
    merge2 = model_config.vision.spatial_merge_size ** 2
    plans = []
    for seq_len, strategy, cp in combos:
        vision = args.vision_tokens if args.vision_tokens is not None else int(seq_len * args.vision_fraction)
        vision -= vision % merge2 if vision > 0 else 0  # whole merged groups of a frame
        plans.append(plan_sft_memory(model_config, seq_len=seq_len, strategy=strategy, context_parallel=cp,
                                     vision_tokens=vision, answer_tokens=args.answer_tokens, **fixed))
    return plans


def summary_table(plans: list[Any]) -> str:
    """One markdown row per plan: the setting, the peak per GPU and the verdict (the largest item when it does
    not fit)."""
    head = "| sequence | strategy | context parallel | checkpointing | LoRA | peak GiB / GPU | fits |\n|---|---|---|---|---|---|---|"
    rows = [head]
    for p in plans:
        s = p.settings
        verdict = "yes" if p.fits else f"no ({p.largest})"
        rows.append(f"| {s['seq_len'] // 1024}K | {s['strategy']} | {s['context_parallel']} | "
                    f"{'on' if s['gradient_checkpointing'] else 'off'} | {'r=' + str(s['lora_r']) if s['lora_r'] else 'off'} | "
                    f"{p.peak_bytes / 1024**3:.1f} | {verdict} |")
    return "\n".join(rows)


def _plan(args) -> int:
    plans = build_plans(args)
    if args.json:
        out = [p.to_dict() for p in plans]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
        return 0
    if len(plans) == 1:
        print(plans[0].table())
        return 0
    print(summary_table(plans))
    return 0
